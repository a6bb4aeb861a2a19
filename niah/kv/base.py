"""The extension point for KV-cache methods.

A KV quantizer turns a block of keys or values, ``x: (batch, kv_heads, tokens, head_dim)``,
into a :class:`Packed` object that holds *only* the tensors a cache would really keep
(packed integer codes, scales, zero points, norms, sign bits), and back.

Storage is measured, not declared: :meth:`Packed.nbytes` sums the stored tensors, and
``bits_per_value`` divides that by the number of values.  ``analytical_bits`` is the
formula figure that the measured one is checked against.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .kernels import rowkernels


@dataclass
class Packed:
    """The stored form of one block of keys or values.

    ``tensors``: everything the cache keeps for this block (e.g. ``codes: uint8``, ``scales: fp16``).
    ``shape``: the original ``(batch, kv_heads, tokens, head_dim)``.
    ``dtype``: the dtype that ``dequantize`` returns.
    ``meta``: small python values needed to decode (no tensors, not counted as storage).
    """

    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class KVQuantizer(ABC):
    """One way of storing keys or values.

    Subclasses are small dataclasses.  Class attributes that the cache reads:

    ``residual``: the newest tokens kept in full precision (KIVI keeps 128); 0 means every token is
    quantized as soon as it is stored, as llama.cpp does.
    ``token_group``: tokens that must be quantized together (KIVI's per-channel keys need 32).
    ``tokenwise``: each token of a block stored by :meth:`quantize_after` is coded on its own, and every stored
    tensor is ``(B, H, T, ...)`` except those named in ``meta["shared"]`` (per-head parameters that the block
    took from the block before it), so two such blocks concatenate along dim 2 (:func:`concat_tokens`); the
    cache then merges the one-token chunks of decode steps instead of letting them pile up.
    """

    name: str = "base"
    residual: int = 0
    token_group: int = 1
    tokenwise: bool = False

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> Packed:
        """``x: (batch, kv_heads, tokens, head_dim)`` -> stored form."""

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        """``x`` stored right after ``prev``, the same layer's newest stored block.

        A format whose block carries a parameter chosen from its own tokens (fp8's scale, the outlier channels of
        the split TurboQuant variants) reuses ``prev``'s here and names it in ``meta["shared"]``, so a decode
        step's token is coded like the prefill's and merges into the block before it.  Others code ``x`` on its own.
        """
        return self.quantize(x)

    @abstractmethod
    def dequantize(self, p: Packed) -> torch.Tensor:
        """Stored form -> ``(batch, kv_heads, tokens, head_dim)`` in ``p.dtype``."""

    @abstractmethod
    def analytical_bits(self, head_dim: int) -> float:
        """Bits per value from the format's definition (codes plus per-block metadata)."""

    def for_layer(self, layer_idx: int) -> "KVQuantizer":
        """The quantizer used in decoder layer ``layer_idx`` (TurboQuant seeds a rotation per layer)."""
        return self

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` naming the problem if this method cannot take ``head_dim``."""

    # A numba row decoder (see :mod:`niah.kv.kernels.rowkernels`) for reading this format on the CPU without a
    # dequantized copy; ``row_args`` gives the arrays it reads.  None: every read dequantizes with torch.
    decode_row = None

    def decoder(self, p: Packed):
        """The row decoder that reads ``p``: :attr:`decode_row`, unless the format compiles one per shape."""
        return self.decode_row

    def row_args(self, p: Packed) -> tuple:
        """The arrays (and constants) that :meth:`decoder` reads, rows first."""
        raise NotImplementedError(f"{self.name} has no row decoder")

    def reads_rows(self, p: Packed) -> bool:
        """Whether reads of ``p`` go through the row kernels: the format has a decoder and ``p`` is on the CPU
        (:func:`rowkernels.usable`)."""
        return self.decoder(p) is not None and rowkernels.usable(next(iter(p.tensors.values())))

    def scores(self, p: Packed, q: torch.Tensor) -> torch.Tensor:
        """``q . k`` for every stored key: ``q: (B, H, G, D)`` float32 (``G`` query heads per KV head) ->
        ``(B, H, G, T)`` float32, read row by row from the codes where :meth:`reads_rows`."""
        if self.reads_rows(p):
            return rowkernels.scores(self.decoder(p), self.row_args(p), q, p.shape[-2])
        return q @ self.dequantize(p).float().transpose(-1, -2)

    def weighted_sum(self, p: Packed, w: torch.Tensor) -> torch.Tensor:
        """``sum_t w_t v_t`` over the stored values: ``w: (B, H, G, T)`` float32 -> ``(B, H, G, D)`` float32."""
        if self.reads_rows(p):
            return rowkernels.weighted_sum(self.decoder(p), self.row_args(p), w, p.shape[-1])
        return w @ self.dequantize(p).float()

    @staticmethod
    def bits_per_value(p: Packed) -> float:
        """Measured bits per value: 8 * stored bytes / number of values."""
        return 8.0 * p.nbytes() / p.numel


class RowDecoded(KVQuantizer):
    """A format with a numba row decoder: subclasses give ``decode_row``, :meth:`row_args` and
    :meth:`torch_dequantize` (the path for other devices, and the reference the tests compare with);
    :meth:`dequantize` picks between them."""

    def dequantize(self, p: Packed) -> torch.Tensor:
        if self.reads_rows(p):
            return rowkernels.dequantize(self.decoder(p), self.row_args(p), p.shape).to(p.dtype)
        return self.torch_dequantize(p)

    @abstractmethod
    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        """:meth:`dequantize` with torch ops, on any device."""


def concat_tokens(a: Packed, b: Packed) -> Packed:
    """``a`` then ``b`` as one block, for ``tokenwise`` formats: tensors ``(B, H, T, ...)`` are joined along dim 2,
    and the ``meta["shared"]`` ones, which ``b`` took from ``a`` (:meth:`KVQuantizer.quantize_after`), kept once."""
    shared = a.meta.get("shared", ())
    for k in shared:
        if not torch.equal(a.tensors[k], b.tensors[k]):
            raise ValueError(
                f"cannot join blocks with different {k!r}: the second was not stored by quantize_after(x, first)"
            )
    tensors = {k: a.tensors[k] if k in shared else torch.cat([a.tensors[k], b.tensors[k]], dim=2) for k in a.tensors}
    shape = (*a.shape[:2], a.shape[2] + b.shape[2], *a.shape[3:])
    return Packed(tensors, shape, a.dtype, dict(a.meta))


def check_kv_shape(x: torch.Tensor) -> None:
    """Raise a clear error unless ``x`` is ``(batch, kv_heads, tokens, head_dim)`` floating point."""
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(
            "KV quantizers take a floating tensor of shape (batch, kv_heads, tokens, head_dim); "
            f"got {tuple(x.shape)} {x.dtype}"
        )
