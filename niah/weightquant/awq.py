"""AWQ (Lin et al., 2024): activation-aware per-input-channel weight scaling, found by a small grid search.

For the linears that read one input ``x`` (q/k/v, or gate/up, or down alone), AWQ multiplies each weight
column by ``s = s_x ** alpha`` before quantizing and divides the input by ``s`` (folded into the previous
operation), so ``y = Q(W diag(s)) (diag(s)^-1 x)``.  ``s_x`` is the mean |x| per input channel on
calibration text and ``alpha`` is chosen from ``{0, 1/grid, ..., (grid-1)/grid}`` to minimize the squared
error of the layers' outputs against full precision on calibration tokens.  ``alpha = 0`` is plain
round-to-nearest, so the search can only improve the calibration error.  As in AutoAWQ, ``s`` is
normalized by ``sqrt(max(s) * min(s))`` (which leaves the result unchanged up to rounding), and a group is
scaled only where ``1/s`` can be folded into the previous operation: for Llama, o_proj is skipped when
grouped-query attention makes v_proj narrower than o_proj's input.  Weight clipping search (AutoAWQ's
``apply_clip``) is not done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class AWQResult:
    scale: torch.Tensor  # (in,) the chosen s
    alpha: float
    losses: torch.Tensor  # (grid,) calibration output error at each alpha


def scales_for(x_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = s_x ** alpha``, clamped at 1e-4 and normalized by ``sqrt(max * min)``: ``(in,)``."""
    s = x_mean_abs.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def output_error(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    s: torch.Tensor,
    quant: Callable[[torch.Tensor], torch.Tensor],
    refs: list[torch.Tensor] | None = None,
) -> float:
    """Sum over ``weights`` ``(out_i, in)`` of the mean squared error of ``Q(W s) (x / s)`` against ``W x``
    (``refs``, if already computed), ``x: (tokens, in)``."""
    xs = x / s
    refs = refs or [x @ w.T for w in weights]
    return sum(float((xs @ quant(w * s).T - r).pow(2).mean()) for w, r in zip(weights, refs))


@torch.no_grad()
def search_scale(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    x_mean_abs: torch.Tensor,
    quant: Callable[[torch.Tensor], torch.Tensor],
    grid: int = 20,
) -> AWQResult:
    """AWQ's scale for the linears ``weights`` that share the input ``x: (tokens, in)`` (mean |x| = ``x_mean_abs``)."""
    weights = [w.detach().float() for w in weights]
    refs = [x @ w.T for w in weights]
    losses = torch.tensor(
        [output_error(weights, x, scales_for(x_mean_abs, i / grid), quant, refs) for i in range(grid)]
    )
    best = int(losses.argmin())
    return AWQResult(scales_for(x_mean_abs, best / grid), best / grid, losses)


def foldable(name: str, linears: dict[str, torch.nn.Linear]) -> bool:
    """Whether ``1/s`` of this input group folds into the previous operation (AutoAWQ's rule for Llama)."""
    if not name.endswith("o_proj"):
        return True  # q/k/v <- input_layernorm, gate/up <- post_attention_layernorm, down <- up_proj
    v = linears[name[: -len("o_proj")] + "v_proj"]
    return v.out_features == linears[name].in_features
