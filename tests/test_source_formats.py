"""The source-format table and decoder bits, on a tiny GGUF written here with ``gguf.GGUFWriter``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

from niah.weightquant.source import decoder_bits, source_formats


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """Three decoder linears (Q8_0, Q4_0, F16), a norm, and a Q8_0 embedding, in a non-sorted file order."""
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, arch="llama")
    writer.add_tensor(
        "token_embd.weight", quantize(rng.standard_normal((16, 64), dtype=np.float32), T.Q8_0), raw_dtype=T.Q8_0
    )
    writer.add_tensor(
        "blk.0.attn_v.weight", quantize(rng.standard_normal((8, 64), dtype=np.float32), T.Q8_0), raw_dtype=T.Q8_0
    )
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((64, 32)).astype(np.float16))
    writer.add_tensor(
        "blk.1.attn_v.weight", quantize(rng.standard_normal((8, 64), dtype=np.float32), T.Q4_0), raw_dtype=T.Q4_0
    )
    writer.add_tensor(
        "blk.2.attn_v.weight", quantize(rng.standard_normal((8, 64), dtype=np.float32), T.Q8_0), raw_dtype=T.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_rows_layers_and_bits(tiny_gguf: Path) -> None:
    table = source_formats(tiny_gguf)
    assert table[["role", "format", "layers", "tensors"]].values.tolist() == [
        ["token_embd", "Q8_0", "", 1],
        ["attn_v", "Q8_0", "0, 2", 2],
        ["attn_v", "Q4_0", "1", 1],
        ["ffn_down", "F16", "0", 1],
    ]
    assert table["bits_per_weight"].tolist() == [8.5, 8.5, 4.5, 16.0]
    assert table["values_per_block"].tolist() == [32, 32, 32, 1]
    assert table["shape"].tolist() == ["64 x 16", "64 x 8", "64 x 8", "32 x 64"]


def test_vectors_only_on_request(tiny_gguf: Path) -> None:
    table = source_formats(tiny_gguf, include_vectors=True)
    norm = table[table["role"] == "attn_norm"]
    assert norm[["format", "layers", "bits_per_weight", "shape"]].values.tolist() == [["F32", "0", 32.0, "64"]]
    assert table["role"].tolist() == ["token_embd", "attn_v", "attn_v", "attn_norm", "ffn_down"]


def test_decoder_bits_by_hand(tiny_gguf: Path) -> None:
    # attn_v: 2 x 512 values at 8.5 bits, 1 x 512 at 4.5; ffn_down: 2048 at 16; the embedding is not a decoder linear.
    expected = (2 * 512 * 8.5 + 512 * 4.5 + 2048 * 16) / (3 * 512 + 2048)
    assert decoder_bits(source_formats(tiny_gguf)) == pytest.approx(expected)


TRUNCATED = b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little")


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\xff", TRUNCATED])
def test_not_a_gguf_is_a_one_line_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for read in (source_formats, lambda p: decoder_bits(source_formats(p))):
        with pytest.raises(ValueError) as info:
            read(path)
        message = str(info.value)
        assert str(path) in message and "\n" not in message
        assert info.value.__suppress_context__


@pytest.mark.slow
def test_gemmas_gguf_favours_the_layers_of_llama_cpps_rule_and_other_sources_have_no_file(tmp_path) -> None:
    """The shipped Q4_K_M file itself: its attn_v and ffn_down are wider exactly in the layers
    :func:`~niah.weightquant.schemes.more_bits_layer` picks, the rule the mixed 4-bit scheme follows; notebook 01's
    table of it reaches the run's summary."""
    from niah.config import load_config
    from niah.notebook import source_formats as notebook_formats
    from niah.report.summary import _weights_parts
    from niah.rundir import RunDir
    from niah.weightquant.schemes import more_bits_layer
    from niah.weightquant.source import shipped_formats

    cfg = load_config("cpu")
    line, table = shipped_formats(cfg.weights)
    assert line.startswith("gemma-3-270m-q4_k_m.gguf: the decoder linears hold")
    run = RunDir(cfg, tmp_path)
    notebook_formats(cfg.weights, run)
    text = "\n".join(_weights_parts(cfg, run))
    assert f"decoder linears {decoder_bits(table):.2f} bits per weight" in text and "| attn_v" in text
    rule = ", ".join(str(i) for i in range(18) if more_bits_layer(i, 18))
    for role, wide in (("attn_v", "Q8_0"), ("ffn_down", "Q6_K")):
        row = table[(table["role"] == role) & (table["format"] == wide)].iloc[0]
        picked = [int(i) for part in row["layers"].split(", ") for i in _expand(part)]
        assert ", ".join(map(str, picked)) == rule
    assert shipped_formats(load_config("smoke").weights) is None  # random weights: no file behind them
    assert "not a GGUF's" in notebook_formats(load_config("smoke").weights, RunDir(load_config("smoke"), tmp_path))


def _expand(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)
