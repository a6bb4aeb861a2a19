"""Quality of a weight scheme on held-out text: perplexity, KL and top-1 agreement against fp32, repetition.

Perplexity is measured on fixed non-overlapping windows ``(n, length)`` of the evaluation split, each
scored from its own first token (no context carried over): ``n * (length - 1)`` predicted tokens.  KL
divergence ``KL(p_fp32 || p_scheme)`` and top-1 agreement are averaged over the same positions.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .schemes import QuantizedModel


class Evaluator:
    """Scores schemes on ``windows: (n, length)`` token ids; the fp32 distributions are computed once and kept."""

    def __init__(self, model, windows: torch.Tensor, batch: int = 2):
        self.model, self.windows, self.batch = model, windows, batch
        self._ref: list[torch.Tensor] | None = None
        self.ref_ppl: float | None = None

    @torch.no_grad()
    def _logprobs(self, desc: str):
        """Per batch: log-softmax ``(b, length - 1, vocab)`` of the next-token predictions, and the targets
        ``(b, length - 1)``."""
        for i in tqdm(range(0, len(self.windows), self.batch), desc=desc, unit="batch", leave=False):
            ids = self.windows[i : i + self.batch]
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            yield torch.log_softmax(logits, dim=-1), ids[:, 1:]

    @staticmethod
    def _nll(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -lp.gather(-1, targets[..., None]).squeeze(-1)

    def reference(self) -> list[torch.Tensor]:
        """fp32 log-probabilities (computed with the model as loaded)."""
        if self._ref is None:
            ref, nll = [], []
            for lp, t in self._logprobs("fp32 reference"):
                ref.append(lp)
                nll.append(self._nll(lp, t))
            self._ref, self.ref_ppl = ref, math.exp(float(torch.cat([x.reshape(-1) for x in nll]).mean()))
        return self._ref

    def measure(self, qm: QuantizedModel) -> dict:
        """``ppl``, ``ppl_fp32``, ``kl_vs_fp32``, ``top1_vs_fp32`` and the window geometry for ``qm``."""
        ref = self.reference()
        nll, kl, top1 = [], [], []
        with qm.applied(self.model):
            for r, (lp, t) in zip(ref, self._logprobs(qm.name)):
                nll.append(self._nll(lp, t).reshape(-1))
                kl.append((r.exp() * (r - lp)).sum(-1).reshape(-1))
                top1.append((r.argmax(-1) == lp.argmax(-1)).reshape(-1).float())
        n, length = self.windows.shape
        return {
            "ppl": math.exp(float(torch.cat(nll).mean())),
            "ppl_fp32": self.ref_ppl,
            "kl_vs_fp32": max(float(torch.cat(kl).mean()), 0.0),  # rounding can put an identical model's KL below 0
            "top1_vs_fp32": float(torch.cat(top1).mean()),
            "eval_windows": n,
            "eval_length": length,
            "eval_tokens": n * (length - 1),
        }


@torch.no_grad()
def generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of exactly ``new_tokens`` tokens (end-of-text suppressed)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def repeat_flags(ids: list[int], n: int = 4) -> list[bool]:
    """For each n-gram start position: does this n-gram occur earlier in ``ids``?"""
    seen, flags = set(), []
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        flags.append(gram in seen)
        seen.add(gram)
    return flags


def repetition(ids: list[int], n: int = 4, edges: tuple[int, ...] = (128, 256)) -> dict:
    """Share of repeated ``n``-grams overall and per segment of start positions split at ``edges``."""
    flags = repeat_flags(ids, n)
    bounds = [0, *[e for e in edges if e < len(flags)], len(flags)]
    segments = {f"{a}-{b}": sum(flags[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:]) if b > a}
    return {"repeat_share": sum(flags) / max(len(flags), 1), "repeat_by_segment": segments, "ngram": n}
