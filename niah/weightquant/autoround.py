"""AutoRound (Intel's ``auto-round`` package) on the CPU: calibrate int weights, and check what it offers.

:func:`calibrate` runs AutoRound's signed-gradient rounding on a copy of the model with the repo's own
calibration windows (never a hub dataset) and returns the result as :class:`PackedLinear` codes: AutoRound
leaves each tuned layer with its fp16 ``scale`` and a quantize-dequantized weight, from which the integer
codes are recovered exactly (checked).  :func:`w4a8_offer` is the small cached check of claim S3-10: does the
installed version have a W4A8 scheme, does it accept ``act_bits=8``, and in which format can it save one.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from .. import tokenizer as bytetok
from ..experiments.telemetry import MemorySampler
from .pack import PackedLinear
from .quant import QWeight, grouped, quantize_weight
from .salience import decoder_linears


class UnsupportedScheme(ValueError):
    """The installed quantization library cannot do what a config asked; the message says what it offers."""


def version() -> str:
    """The installed auto-round version; a clear error when it is missing."""
    try:
        return importlib.metadata.version("auto-round")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedScheme(
            "auto-round is not installed: `pip install auto-round` (a dependency of this repo since notebook 01)"
        ) from None


def presets() -> dict[str, dict]:
    """auto-round's preset schemes: ``{name: {bits, group_size, sym, act_bits, ...}}``."""
    version()
    from auto_round.schemes import PRESET_SCHEMES  # heavy: auto_round loads transformers, when it runs only

    return {name: {k: v for k, v in s.to_dict().items() if v is not None} for name, s in PRESET_SCHEMES.items()}


def w4a8_presets(table: dict[str, dict]) -> list[str]:
    """Names of the presets in ``table`` with 4-bit weights and 8-bit activations."""
    return [n for n, s in table.items() if s.get("bits") == 4 and s.get("act_bits") == 8]


def scheme(bits: int, group: int, sym: bool, act_bits: int = 16, preset: str | None = None):
    """An auto-round ``QuantizationScheme``: the named ``preset`` (an error listing the real ones if it is absent),
    or integer weights with dynamic per-token integer activations when ``act_bits < 16``."""
    table = presets()
    from auto_round.schemes import QuantizationScheme, preset_name_to_scheme  # heavy: as in presets()

    if preset is not None:
        if preset.upper() not in table:
            raise UnsupportedScheme(
                f"auto-round {version()} has no scheme {preset!r}. Its presets: {', '.join(sorted(table))}; "
                f"those with 4-bit weights and 8-bit activations: {', '.join(w4a8_presets(table)) or 'none'}. "
                "A custom scheme is scheme(bits, group, sym, act_bits=...); "
                "w4a8_offer() shows what the library can save of one."
            )
        return preset_name_to_scheme(preset)
    act = (
        {"act_bits": act_bits, "act_data_type": "int", "act_dynamic": True, "act_sym": True, "act_group_size": -1}
        if act_bits < 16
        else {"act_bits": 16}
    )
    return QuantizationScheme(bits=bits, group_size=group, sym=sym, data_type="int", **act)


def _has_linear_attention(model) -> bool:
    """Whether ``model`` has linear-attention layers (Qwen3.5).  auto-round 0.16 caches the first block's inputs,
    an explicit 2D padding mask among them, and feeds them to every block; a full-attention block then hands that
    mask to SDPA, which refuses it.  Such models get their windows with ``attention_mask: None`` (no padding
    here): every block then builds its own causal mask, or none."""
    return "linear_attention" in (getattr(model.config, "layer_types", None) or [])


def _autoround(model, tokenizer, windows: torch.Tensor, sch, iters: int, batch_size: int, amp: bool, seed: int):
    from auto_round import AutoRound  # heavy: auto_round loads transformers, when it runs only

    if windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(
            f"AutoRound needs calibration windows (samples, seqlen) with seqlen >= 2; got {tuple(windows.shape)}"
        )
    return AutoRound(
        model,
        tokenizer=tokenizer,
        scheme=sch,
        iters=iters,
        nsamples=len(windows),
        seqlen=windows.shape[1],
        batch_size=min(batch_size, len(windows)),
        dataset=[
            {"input_ids": w[None], "attention_mask": None} if _has_linear_attention(model) else w[None] for w in windows
        ],
        device_map="cpu",
        amp=amp,
        seed=seed,
    )


def _codes(layer: torch.nn.Linear, bits: int, group: int, sym: bool) -> QWeight:
    """Integer codes of an AutoRound-tuned layer from its ``scale`` (fp16, ``(out, groups)``), ``zp`` and
    quantize-dequantized weight; raises if the weight is not on that grid."""
    scale = layer.scale.detach().float().reshape(layer.out_features, -1)
    x = grouped(layer.weight.detach().float(), group) / scale[..., None]
    if sym:
        lo, hi, zero = torch.full_like(scale, -(2 ** (bits - 1))), torch.full_like(scale, 2 ** (bits - 1) - 1), None
    else:
        zero = torch.as_tensor(layer.zp).float().reshape(scale.shape)
        lo, hi = -zero, 2**bits - 1 - zero
    q = torch.maximum(torch.minimum(torch.round(x), hi[..., None]), lo[..., None])
    off_grid = float((x - q).abs().max())
    if off_grid > 0.1:  # rounding noise is far below a tenth of a step; more means another grid, not noise
        raise RuntimeError(
            f"auto-round's weight is {off_grid:.3f} steps off its int grid: its result layout has changed"
        )
    codes = (q - lo[..., None]).to(torch.uint8)
    zero = zero.to(torch.uint8) if zero is not None else None
    return QWeight(codes, layer.scale.detach().half().reshape(scale.shape), zero, bits)


def first_blocks(model, blocks: int):
    """A copy of ``model`` with only its first ``blocks`` decoder layers (the layer-type pattern cut to match).
    AutoRound tunes a block on the outputs of the blocks before it, so the copy's blocks tune as they would in the
    whole model."""
    base = model.base_model
    layers = base.layers
    if not 1 <= blocks <= len(layers):
        raise ValueError(f"the AutoRound check needs 1 to {len(layers)} blocks of this model; got {blocks}")
    base.layers = torch.nn.ModuleList(layers[:blocks])
    try:
        work = copy.deepcopy(model)
    finally:
        base.layers = layers
    work.config.num_hidden_layers = blocks
    if getattr(work.config, "layer_types", None):
        work.config.layer_types = work.config.layer_types[:blocks]
    return work


def calibrate(
    model,
    tokenizer,
    windows: torch.Tensor,
    bits: int,
    group: int,
    sym: bool,
    iters: int,
    batch_size: int,
    amp: bool,
    seed: int,
    blocks: int | None = None,
) -> tuple[dict[str, PackedLinear], dict]:
    """AutoRound ``bits``-bit weights (activations untouched) for every decoder linear of ``model`` (the ones
    auto-round will not tune get round-to-nearest codes, named in the record's ``rtn_layers``).

    ``windows: (samples, seqlen)`` token ids of the calibration split, passed as tensors (auto-round tokenizes
    nothing and downloads nothing).  ``amp=False`` tunes in fp32; auto-round's CPU default (``amp=True``) casts the
    model to bf16, which this kind of CPU only emulates.  Returns the packed layers and a record of the run:
    iterations, samples, sequence length, wall seconds, this process's resident memory at the start and its peak,
    version.
    ``blocks``: tune only the first ``blocks`` decoder layers (:func:`first_blocks`); the others are not returned.
    """
    sch = scheme(bits, group, sym)
    work = copy.deepcopy(model) if blocks is None else first_blocks(model, blocks)
    ours = set(decoder_linears(work))  # before auto-round unfuses a mixture's experts into linears of its own
    torch.manual_seed(seed)
    ar = _autoround(work, tokenizer, windows, sch, iters, batch_size, amp, seed)
    t0 = time.perf_counter()
    with MemorySampler(hz=20) as mem:
        ar.quantize()
    wall = time.perf_counter() - t0
    linears = {n: m for n, m in decoder_linears(work).items() if n in ours}  # not the expert linears auto-round unfused
    if set(linears) != ours:
        raise RuntimeError(f"auto-round replaced decoder linears with other modules: {sorted(ours - set(linears))[:3]}")
    # auto-round leaves some (Qwen3.5's gates) alone
    skipped = sorted(n for n, m in linears.items() if not hasattr(m, "scale"))
    layers = {
        n: PackedLinear.from_qweight(
            _codes(m, bits, group, sym)
            if n not in skipped
            else quantize_weight(m.weight.detach().float(), bits, group, sym),
            (m.out_features, m.in_features),
            group,
        )
        for n, m in linears.items()
    }
    record = {
        "library": "auto-round",
        "version": version(),
        "iters": iters,
        "samples": len(windows),
        "seqlen": windows.shape[1],
        "batch_size": min(batch_size, len(windows)),
        "amp": amp,
        "wall_s": round(wall, 1),
        "rss_start_bytes": mem.values[0] if mem.values else 0,
        "peak_rss_bytes": max(mem.values, default=0),
        "tuned_in": str(next(work.parameters()).dtype),
        "blocks": blocks,
        # decoder linears auto-round did not tune: round-to-nearest codes, so that every one is 4-bit
        "rtn_layers": skipped,
    }
    return layers, record


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def w4a8_offer(formats: tuple[str, ...] = ("auto_round", "auto_gptq", "llm_compressor", "fake")) -> dict:
    """What the installed auto-round does with W4A8 (claim S3-10), tried on a tiny random Llama in a few seconds.

    Records the presets that pair 4-bit weights with 8-bit activations, whether a custom scheme
    ``bits=4, act_bits=8`` (dynamic per-token int8) is accepted and tuned, the warnings it prints, and for
    each requested export format what was written: ``packed`` (integer weight tensors) or ``fake``
    (full-precision quantize-dequantized weights).
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: transformers, for this check only

    table = presets()
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=258,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    windows = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    capture = _Capture()
    log = logging.getLogger("autoround")
    log.addHandler(capture)
    written, error = {}, ""
    try:
        ar = _autoround(
            tiny,
            bytetok.ByteTokenizer(),
            windows,
            scheme(4, 64, True, act_bits=8),
            iters=1,
            batch_size=2,
            amp=True,
            seed=0,
        )
        ar.quantize()
        for fmt in formats:
            written[fmt] = _save_as(ar, fmt)
    except Exception as err:  # the library refusing the scheme is the finding, not a crash
        error = f"{type(err).__name__}: {err}"
    finally:
        log.removeHandler(capture)
    return {
        "auto_round_version": version(),
        "presets_w4a8": w4a8_presets(table),
        "presets_with_int8_activations": [
            n for n, s in table.items() if s.get("act_bits") == 8 and s.get("data_type") == "int"
        ],
        "custom_w4a8_accepted": not error,
        "custom_w4a8_error": error,
        "formats_written": written,
        "real_w4a8_export": any(v == "packed" for v in written.values()),
        "warnings": sorted(set(capture.messages)),
    }


def _save_as(ar, fmt: str) -> str:
    """Save ``ar``'s model in format ``fmt`` and say what was written (or the error)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            ar.save_quantized(d, format=fmt)
        except Exception as err:  # a refused format is a recorded answer
            return f"refused ({type(err).__name__}: {err})"
        return _written_format(Path(d))


def _written_format(folder: Path) -> str:
    """``packed`` if a saved checkpoint holds integer weight tensors (``qweight``), else ``fake``."""
    names = [k for f in folder.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()]
    config = (
        json.loads((folder / "config.json").read_text()).get("quantization_config", {})
        if (folder / "config.json").exists()
        else {}
    )
    return (
        "packed"
        if any(n.endswith("qweight") for n in names)
        else f"fake ({config.get('packing_format', 'dense weights')})"
    )
