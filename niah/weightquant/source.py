"""The storage format of each tensor in a GGUF file, read from the file itself.

The "fp32 baseline" is a GGUF dequantized to fp32, so its weights carry the rounding of the format they were
shipped in.  :func:`source_formats` returns one row per (tensor role, ggml type): the role is the tensor name
without its ``blk.<i>.`` prefix and ``.weight`` suffix, ``layers`` lists the blocks that store that role in
that type, and ``values_per_block`` / ``bits_per_weight`` come from ``gguf.GGML_QUANT_SIZES``.  Every value
is read from the file (names, types, shapes); nothing is typed by hand.  :func:`decoder_bits` is the
element-weighted mean bits per weight of the decoder linears, from such a table.

llama.cpp's Q4_K_M rule (src/llama-quant.cpp, ``llama_tensor_get_type`` and ``use_more_bits``) gives attn_v
and ffn_down of about half the layers more bits (Q6_K instead of Q4_K).  Rows whose length is not a multiple
of 256, the k-quant super-block, fall back to a 32-value format (Q4_K -> Q5_0, Q6_K -> Q8_0), which is why a
small model's "Q4_K_M" file is mostly Q5_0.
"""

from __future__ import annotations

import re
from os import PathLike

import gguf
import pandas as pd

from ..models import verified_gguf

SOURCE_FORMATS = "source_formats.csv"  # notebook 01 writes the model's table into its run folder, for the summary
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _read(path: str | PathLike[str]) -> gguf.GGUFReader:
    """Open ``path`` with ``gguf.GGUFReader``; a file it cannot parse raises a one-line ``ValueError``."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as err:  # bad magic or dtype view; truncated (IndexError)
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from None


def _bits(tensor_type: gguf.GGMLQuantizationType) -> tuple[int, float]:
    """Values per block and bits per weight of ``tensor_type``, from ``gguf.GGML_QUANT_SIZES``."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    return block_size, 8 * type_size / block_size


def _ranges(layers: list[int]) -> str:
    """Compact sorted list of block indices: ``[0, 1, 4, 15, 16, 17]`` -> ``"0-1, 4, 15-17"``."""
    runs: list[list[int]] = []
    for i in sorted(set(layers)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def source_formats(path: str | PathLike[str], include_vectors: bool = False) -> pd.DataFrame:
    """One row per (role, ggml type) of the GGUF at ``path``, roles in the order they first appear in the file.

    Columns: ``role``, ``format``, ``layers`` (blocks holding the role in that format, empty for non-block
    tensors), ``tensors``, ``weights`` (their elements), ``values_per_block``, ``bits_per_weight``, ``shape``
    (GGUF's order, ne0 first; distinct shapes joined by ``"; "``).  1-D tensors (norms) are skipped unless
    ``include_vectors``.
    """
    groups: dict[tuple[str, str], dict] = {}
    for t in _read(path).tensors:
        if len(t.shape) < 2 and not include_vectors:
            continue
        match = _BLOCK.match(t.name)
        name = match.group(2) if match else t.name
        role = name.removesuffix(".weight")
        shape = " x ".join(str(int(n)) for n in t.shape)
        g = groups.setdefault(
            (role, t.tensor_type.name), {"type": t.tensor_type, "layers": [], "n": 0, "weights": 0, "shapes": []}
        )
        g["n"] += 1
        g["weights"] += int(t.n_elements)
        if match:
            g["layers"].append(int(match.group(1)))
        if shape not in g["shapes"]:
            g["shapes"].append(shape)
    first = {role: i for i, (role, _) in reversed(list(enumerate(groups)))}
    rows = []
    for (role, fmt), g in sorted(groups.items(), key=lambda item: first[item[0][0]]):
        block_size, bits = _bits(g["type"])
        rows.append(
            {
                "role": role,
                "format": fmt,
                "layers": _ranges(g["layers"]),
                "tensors": g["n"],
                "weights": g["weights"],
                "values_per_block": block_size,
                "bits_per_weight": bits,
                "shape": "; ".join(g["shapes"]),
            }
        )
    columns = ["role", "format", "layers", "tensors", "weights", "values_per_block", "bits_per_weight", "shape"]
    return pd.DataFrame(rows, columns=columns)


def decoder_bits(table: pd.DataFrame) -> float:
    """Mean bits per weight of the block tensors of a :func:`source_formats` table (the decoder linears: rows with
    ``layers``), weighted by their ``weights``."""
    block = table[table["layers"] != ""]
    if not len(block):
        raise ValueError("the table holds no blk.* tensors")
    return float((block["bits_per_weight"] * block["weights"]).sum() / block["weights"].sum())


def shipped_formats(spec: dict) -> tuple[str, pd.DataFrame] | None:
    """For a ``package`` or ``assembled`` model spec (a GGUF dequantized to fp32): a sentence naming the file and its
    decoder linears' bits per weight, and :func:`source_formats` of it; None for any other source, whose weights
    are as published (hub) or made (random)."""
    if spec["source"] not in ("package", "assembled"):
        return None
    path = verified_gguf(spec)
    table = source_formats(path)
    return f"{path.name}: the decoder linears hold {decoder_bits(table):.2f} bits per weight as shipped", table
