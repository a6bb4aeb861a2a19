"""The stored form of a quantized linear layer: bit-packed codes, fp16 scales, kept channels; safetensors I/O.

A :class:`PackedLinear` is what a deployment would keep for one ``nn.Linear`` weight ``(out, in)``:

* ``codes``: the n-bit codes packed into bytes (``bits`` bits each, little-endian bit order),
* ``scale``: fp16 ``(out, groups)``, and ``zero``: bit-packed zero points (asymmetric only),
* ``keep_index`` ``(k,)`` int32 and ``keep``: the weight columns of ``k`` kept input channels, as fp16
  ``(out, k)`` or as int8 codes ``(out, k)`` with fp16 ``keep_scale`` ``(out,)``,
* ``channel_scale`` ``(in,)`` fp32: AWQ's per-input-channel scale ``s`` (the stored codes are of ``W * s``;
  a deployment folds ``1/s`` into the previous operation, here it divides the dequantized weight).

Its bytes are those of these tensors, so the weight storage of a scheme is measured, not declared.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..kv import packing as kv_packing
from .quant import QWeight


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (any shape, values < 2**bits) -> uint8 bytes: the flattened codes as one little-endian bit
    stream, the layout of :func:`niah.kv.packing.pack_bits` (``n * bits / 8`` bytes when ``n`` is a multiple of 8)."""
    return kv_packing.pack_bits(codes.reshape(-1), bits)


def unpack_bits(packed: torch.Tensor, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 codes of ``shape``."""
    return kv_packing.unpack_bits(packed, bits, math.prod(shape)).reshape(shape)


@dataclass
class PackedLinear:
    shape: tuple[int, int]
    bits: int
    group: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    keep_index: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    keep_scale: torch.Tensor | None = None
    channel_scale: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_qweight(cls, q: QWeight, shape: tuple[int, int], group: int, **kw) -> "PackedLinear":
        zero = pack_bits(q.zero, q.bits) if q.zero is not None else None
        return cls(tuple(shape), q.bits, group, pack_bits(q.codes, q.bits), q.scale, zero, **kw)

    def qweight(self) -> QWeight:
        out, inp = self.shape
        groups = self.scale.shape[1]
        codes = unpack_bits(self.codes, self.bits, (out, groups, inp // groups))
        zero = unpack_bits(self.zero, self.bits, (out, groups)) if self.zero is not None else None
        return QWeight(codes, self.scale, zero, self.bits)

    def dense(self) -> torch.Tensor:
        """The fp32 weight ``(out, in)`` this storage represents."""
        w = self.qweight().dequantize()
        if self.channel_scale is not None:
            w = w / self.channel_scale[None, :]
        if self.keep_index is not None:
            cols = (
                self.keep.float() * self.keep_scale.float()[:, None]
                if self.keep_scale is not None
                else self.keep.float()
            )
            w[:, self.keep_index.long()] = cols
        return w

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("codes", "scale", "zero", "keep_index", "keep", "keep_scale", "channel_scale")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def save_packed(path: Path, layers: dict[str, PackedLinear], meta: dict) -> None:
    """Write ``layers`` and ``meta`` (JSON-able) to one safetensors file, atomically."""
    flat = {
        f"{name}.{k}": t.contiguous().clone() for name, p in layers.items() for k, t in p.tensors().items()
    }  # no shared storage
    shapes = {
        name: {"shape": list(p.shape), "bits": p.bits, "group": p.group, "extra": p.extra} for name, p in layers.items()
    }
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")  # its own: two processes may build the same cache entry
    save_file(flat, str(tmp), metadata={"layers": json.dumps(shapes), "meta": json.dumps(meta, default=str)})
    tmp.replace(path)


def load_packed(path: Path) -> tuple[dict[str, PackedLinear], dict]:
    """Inverse of :func:`save_packed`: ``(layers, meta)``."""
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
    flat = load_file(str(path))
    layers = {}
    for name, info in json.loads(header["layers"]).items():
        parts = {k[len(name) + 1 :]: t for k, t in flat.items() if k.rsplit(".", 1)[0] == name}
        layers[name] = PackedLinear(tuple(info["shape"]), info["bits"], info["group"], extra=info["extra"], **parts)
    return layers, json.loads(header["meta"])
