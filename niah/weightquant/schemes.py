"""Weight schemes: what a configuration does to the decoder linears, and the model with it applied.

A :class:`Scheme` names the weight quantization (bits, group, symmetry, rounding: round-to-nearest,
AutoRound or AWQ), the dynamic per-token activation quantization, the share of input channels kept in
higher precision, and the share of weights set to zero.  :class:`QuantizedModel` holds the stored form of
every changed layer and swaps the dequantized weights into the model (and activation quantize-dequantize
hooks onto every decoder linear input) only inside ``with qm.applied(model):``, so one fp32 model serves
every scheme.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .pack import PackedLinear
from .quant import fake_quant_tokens, quantize_weight
from .salience import (
    InputStats,
    channel_scores,
    decoder_linears,
    layer_type,
    magnitude_prune,
    select_channels,
    zero_channels,
)

FP32 = "fp32"  # the reference weights of the weights x KV cells
REF_METHOD = "fp16"  # the reference KV method of the weights x KV cells (asked first)


@dataclass(frozen=True)
class Scheme:
    name: str
    w_bits: int = 16  # 16: weights untouched
    group: int = 64  # input channels per scale; -1: one scale per output channel
    sym: bool = True
    rounding: str = "rtn"  # rtn | autoround | awq
    a_bits: int = 16  # dynamic per-token activation bits on every decoder linear input; 16: none
    a_sym: bool = True
    keep: float = 0.0  # share of input channels whose weight columns are kept at keep_bits
    keep_by: str = "activation"  # activation | weight | random
    keep_bits: int = 16  # 16: fp16 columns; 8: int8 per output channel
    zero: float = 0.0  # share of weights set to zero
    # activation: the input channels of lowest activation salience; magnitude: smallest |w| (unstructured)
    zero_by: str = ""
    # bits of attn_v and ffn_down in the layers llama.cpp's Q4_K_M rule picks (:func:`more_bits_layer`); 0: none
    more_bits: int = 0
    iters: int = 0  # AutoRound iterations; 0: the config's weightquant.autoround.iters

    def __post_init__(self):
        # AutoRound tunes every linear at one width (niah.weightquant.autoround.calibrate); only the RTN codes
        # (rtn_layers, which AWQ's scaled weights also take) read layer_bits
        if self.more_bits and self.rounding == "autoround":
            raise ValueError(f"{self.name}: more_bits needs rounding 'rtn' or 'awq'; AutoRound codes one width")

    @property
    def simulated(self) -> bool:
        """Activation quantization has no integer kernel here: it is quantize-dequantize at each layer input."""
        return self.a_bits < 16

    @property
    def label(self) -> str:
        return self.name + (" [simulated]" if self.simulated else "")

    def fields(self) -> dict:
        return {
            "scheme": self.name,
            "w_bits": self.w_bits,
            "group": self.group if self.w_bits < 16 else None,
            "w_sym": self.sym,
            "rounding": self.rounding if self.w_bits < 16 else "none",
            "a_bits": self.a_bits,
            "a_sym": self.a_sym,
            "keep_share": self.keep,
            "keep_by": self.keep_by if self.keep else "",
            "keep_bits": self.keep_bits if self.keep else None,
            "zero_share": self.zero,
            "zero_by": self.zero_by,
            "more_bits": self.more_bits or None,
            "iters": self.iters or None,
            "simulated": self.simulated,
        }


@dataclass
class QuantizedModel:
    """``layers``: the stored form of each changed decoder linear (a :class:`PackedLinear`, or a dense fp32
    tensor for masks and pruning, which have no sparse format here)."""

    scheme: Scheme
    layers: dict[str, PackedLinear | torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.dense = {n: (p.dense() if isinstance(p, PackedLinear) else p.float()) for n, p in self.layers.items()}

    @property
    def name(self) -> str:
        return self.scheme.name

    def linear_bytes(self, model) -> int:
        """Bytes of all decoder linear weights as stored: packed layers, dense fp32 for the unchanged or masked ones."""
        total = 0
        for n, m in decoder_linears(model).items():
            p = self.layers.get(n)
            total += p.nbytes() if isinstance(p, PackedLinear) else m.weight.numel() * 4
        return total

    @contextmanager
    def applied(self, model):
        """Inside the block ``model`` computes with this scheme; its own weights come back afterwards."""
        linears = decoder_linears(model)
        saved = {n: linears[n].weight for n in self.dense}
        handles = []
        try:
            for n, w in self.dense.items():
                linears[n].weight = torch.nn.Parameter(w.to(saved[n].dtype), requires_grad=False)
            if self.scheme.a_bits < 16:
                bits, sym = self.scheme.a_bits, self.scheme.a_sym
                handles = [
                    m.register_forward_pre_hook(lambda mod, args: (fake_quant_tokens(args[0], bits, sym), *args[1:]))
                    for m in linears.values()
                ]
            yield model
        finally:
            for h in handles:
                h.remove()
            for n, w in saved.items():
                linears[n].weight = w


MORE_BITS_ROLES = ("v_proj", "down_proj")  # llama.cpp's attn_v and ffn_down


def more_bits_layer(index: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (src/llama-quant.cpp, the Q4_K_M rule of ``llama_tensor_get_type``): the first
    and last eighth of the ``layers`` and every third layer between them, about half of them."""
    eighth = layers // 8
    return index < eighth or index >= 7 * layers // 8 or (index - eighth) % 3 == 2


def layer_bits(model, scheme: Scheme) -> dict[str, int]:
    """``{decoder linear name: weight bits}``: ``scheme.w_bits``, or ``scheme.more_bits`` for the attn_v and ffn_down
    linears of the layers :func:`more_bits_layer` picks.  The index is the decoder layer's; llama.cpp counts attn_v
    among the attention layers only, which differs on hybrid models with linear-attention layers."""
    layers = model.base_model.layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    out = {}
    for n in decoder_linears(model):
        index = int(n[len(prefix) + 1 :].split(".")[0])  # decoder_linears names are <prefix>.<index>.<path>
        more = scheme.more_bits and layer_type(n) in MORE_BITS_ROLES and more_bits_layer(index, len(layers))
        out[n] = scheme.more_bits if more else scheme.w_bits
    return out


def rtn_layers(model, scheme: Scheme, channel_scale: dict[str, torch.Tensor] | None = None) -> dict[str, PackedLinear]:
    """Round-to-nearest codes of every decoder linear, at its :func:`layer_bits` (of ``W * s`` where AWQ's
    ``channel_scale[name] = s`` is given)."""
    out = {}
    bits = layer_bits(model, scheme)
    for n, m in decoder_linears(model).items():
        s = (channel_scale or {}).get(n)
        w = m.weight.detach().float() * (s[None, :] if s is not None else 1.0)
        out[n] = PackedLinear.from_qweight(
            quantize_weight(w, bits[n], scheme.group, scheme.sym), tuple(w.shape), scheme.group, channel_scale=s
        )
    return out


def with_kept_channels(
    model, layers: dict[str, PackedLinear], scheme: Scheme, stats: dict[str, InputStats], seed: int
) -> dict[str, PackedLinear]:
    """``layers`` plus, per layer, the original weight columns of ``scheme.keep`` of its input channels
    (chosen by ``scheme.keep_by``), stored as fp16 or as int8 per output channel."""
    out = {}
    for i, (n, m) in enumerate(decoder_linears(model).items()):
        w = m.weight.detach().float()
        idx = select_channels(channel_scores(w, stats.get(n), scheme.keep_by), scheme.keep, scheme.keep_by, seed + i)
        p = layers[n]
        cols = w[:, idx]
        if scheme.keep_bits == 16:
            keep, keep_scale = cols.half(), None
        else:
            q = quantize_weight(cols, scheme.keep_bits, group=-1, sym=True)
            signed = q.codes.reshape(cols.shape).to(torch.int16) - 2 ** (scheme.keep_bits - 1)  # codes are offset
            keep, keep_scale = signed.to(torch.int8), q.scale.reshape(-1)
        out[n] = PackedLinear(
            p.shape,
            p.bits,
            p.group,
            p.codes,
            p.scale,
            p.zero,
            idx.to(torch.int32),
            keep,
            keep_scale,
            p.channel_scale,
            p.extra,
        )
    return out


def zeroed_layers(model, scheme: Scheme, stats: dict[str, InputStats]) -> dict[str, torch.Tensor]:
    """Dense weights with ``scheme.zero`` of each layer set to zero: lowest-salience input channels, or smallest
    magnitudes."""
    linears = decoder_linears(model)
    if scheme.zero_by == "activation":
        return {n: zero_channels(m.weight, stats[n].mean_abs, scheme.zero) for n, m in linears.items()}
    if scheme.zero_by == "magnitude":
        return {n: magnitude_prune(m.weight, scheme.zero) for n, m in linears.items()}
    raise ValueError(f"unknown zeroing {scheme.zero_by!r}: use activation or magnitude")


def schemes_01(s: dict) -> dict[str, Scheme]:
    """Notebook 01: fp32, W8A8 (two activation variants), W4A16 RTN and AutoRound, W4A8 with and without int8
    outliers, W4A4; then the 4-bit schemes at the source's block size (``block_group``): RTN, AutoRound, W4A8 and
    llama.cpp's Q4_K_M rule (:func:`more_bits_layer`) with ``more_bits`` for the tensors it favours."""
    g, pct, b, more = s.group, f"{s.outlier_share:.0%}", s.block_group, s.more_bits
    ar = dict(w_bits=4, group=g, rounding="autoround")
    block = dict(w_bits=4, group=b)
    return {
        "fp32": Scheme(FP32),
        "w8a8_sym": Scheme("W8A8 sym per-token", w_bits=8, group=-1, a_bits=8),
        "w8a8_asym": Scheme("W8A8 asym per-token", w_bits=8, group=-1, a_bits=8, a_sym=False),
        "w4a16_rtn": Scheme(f"W4A16 RTN g{g}", w_bits=4, group=g),
        "w4a16_ar": Scheme(f"W4A16 AutoRound g{g}", **ar),
        "w4a8": Scheme(f"W4A8 AutoRound g{g}", **ar, a_bits=8),
        "w4a8_outliers": Scheme(
            f"W4A8 AutoRound g{g} +{pct} int8 channels", **ar, a_bits=8, keep=s.outlier_share, keep_bits=8
        ),
        "w4a4": Scheme(f"W4A4 AutoRound g{g}", **ar, a_bits=4),
        # "(source blocks)": their own names, apart from the seed's group (the ledger matches names with any group)
        "w4a16_rtn_block": Scheme(f"W4A16 RTN g{b} (source blocks)", **block),
        "w4a16_ar_block": Scheme(f"W4A16 AutoRound g{b} (source blocks)", **block, rounding="autoround"),
        "w4a8_block": Scheme(f"W4A8 AutoRound g{b} (source blocks)", **block, rounding="autoround", a_bits=8),
        "w4a16_mixed": Scheme(f"W4A16 RTN g{b} + W{more} attn_v/ffn_down (Q4_K_M rule)", **block, more_bits=more),
    }


AUTOROUND_DEFAULT_ITERS = 200  # auto-round's own default iterations (``AutoRound(iters=200)``)


def autoround_default(s: dict) -> Scheme:
    """``make autoround-200``: W4A16 AutoRound at the source's blocks (``block_group``) with auto-round's default
    iterations on every block, measured once outside the chain (about 15 minutes of calibration here)."""
    b = s.block_group
    name = f"W4A16 AutoRound g{b} (source blocks), {AUTOROUND_DEFAULT_ITERS} iters"
    return Scheme(name, w_bits=4, group=b, rounding="autoround", iters=AUTOROUND_DEFAULT_ITERS)


def schemes_02(s: dict) -> dict[str, Scheme]:
    """Notebook 02: RTN asym g64 at each salient bit width, with 1% fp16 channels by activation, weight or random,
    AWQ scales, and the 30% activation-aware channel mask vs 30% magnitude pruning."""
    g, pct, out = s.group, f"{s.salient_share:.0%}", {"fp32": Scheme(FP32)}
    for b in s.salient_bits:
        rtn = dict(w_bits=b, group=g, sym=False)
        out[f"rtn{b}"] = Scheme(f"W{b}A16 RTN g{g} asym", **rtn)
        for by in ("activation", "weight", "random"):
            out[f"rtn{b}_{by}"] = Scheme(
                f"W{b}A16 RTN g{g} asym +{pct} fp16 by {by}", **rtn, keep=s.salient_share, keep_by=by
            )
        out[f"awq{b}"] = Scheme(f"W{b}A16 AWQ g{g} asym", **rtn, rounding="awq")
    z = f"{s.zero_share:.0%}"
    out["mask"] = Scheme(f"{z} channel mask (activation salience)", zero=s.zero_share, zero_by="activation")
    out["prune"] = Scheme(f"{z} magnitude pruning", zero=s.zero_share, zero_by="magnitude")
    return out
