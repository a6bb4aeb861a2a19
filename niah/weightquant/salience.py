"""Which input channels matter: activation statistics on calibration text, channel choices, masks, kurtosis.

Every ``nn.Linear`` inside the decoder layers counts (attention q/k/v/o, MLP gate/up/down); the embedding
and the LM head stay in full precision throughout this subpackage.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm


def decoder_linears(model) -> dict[str, torch.nn.Linear]:
    """``{qualified name: module}`` of the linear layers inside the decoder layers, in model order."""
    layers = model.base_model.layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return {f"{prefix}.{n}": m for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}


def uncoded_weights(model) -> dict[str, int]:
    """``{parameter name: elements}`` of decoder-layer weights that are not in a ``torch.nn.Linear`` and so stay at
    full precision under every weight scheme here: the fused expert tensors of a mixture of experts (Qwen3.5-MoE's
    ``mlp.experts.gate_up_proj``) and its router.  Norms, biases, 1-D parameters and convolutions are not counted."""
    layers = model.base_model.layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    in_linear = {id(m.weight) for m in layers.modules() if isinstance(m, torch.nn.Linear)}
    return {
        f"{prefix}.{n}": p.numel()
        for n, p in layers.named_parameters()
        if p.dim() >= 2 and id(p) not in in_linear and "conv" not in n
    }


def layer_type(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``q_proj``."""
    return name.rsplit(".", 1)[-1]


@dataclass
class InputStats:
    """Calibration statistics of one linear layer's input: ``mean_abs`` ``(in,)`` = mean |x| per input channel
    over every calibration token (the activation salience), ``sample`` ``(tokens, in)`` = the inputs at a
    seeded random subset of the tokens (for AWQ's search)."""

    mean_abs: torch.Tensor
    sample: torch.Tensor


@torch.no_grad()
def shared_inputs(model) -> dict[str, str]:
    """``{linear: the first linear that reads the same input tensor}`` (q/k/v -> q_proj, gate/up -> gate_proj).

    Found from one short forward pass that holds every input, so no tensor address is reused meanwhile.
    """
    linears = decoder_linears(model)
    inputs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0])) for n, m in linears.items()
    ]
    try:
        model.base_model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    first: dict[int, str] = {}
    return {n: first.setdefault(id(inputs[n]), n) for n in linears}


@torch.no_grad()
def collect_inputs(
    model, windows: torch.Tensor, sample_tokens: int, seed: int, batch: int = 4
) -> dict[str, InputStats]:
    """Run the calibration ``windows: (n, length)`` through ``model`` and record every decoder linear's input.

    Linears that read the same tensor (q/k/v; gate/up) share one :class:`InputStats`.
    """
    owner = shared_inputs(model)
    linears = decoder_linears(model)
    total = windows.numel()
    pick = torch.zeros(total, dtype=torch.bool)
    pick[torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: min(sample_tokens, total)]] = True
    sums: dict[str, torch.Tensor] = {}
    samples: dict[str, list[torch.Tensor]] = {}
    offset = 0

    def record(name):
        def hook(module, args):
            flat = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + flat.abs().sum(0, dtype=torch.float64)
            samples.setdefault(name, []).append(flat[pick[offset : offset + flat.shape[0]]].clone())

        return hook

    handles = [linears[n].register_forward_pre_hook(record(n)) for n in set(owner.values())]
    try:
        for i in tqdm(range(0, len(windows), batch), desc="calibration activations", unit="batch"):
            model.base_model(input_ids=windows[i : i + batch])
            offset += windows[i : i + batch].numel()
    finally:
        for h in handles:
            h.remove()
    stats = {n: InputStats((sums[n] / total).float(), torch.cat(samples[n])) for n in sums}
    return {n: stats[owner[n]] for n in linears}


def select_channels(score: torch.Tensor, share: float, by: str, seed: int = 0) -> torch.Tensor:
    """Indices of ``round(share * in)`` (at least one) input channels: the largest ``score`` ``(in,)``, or random
    with ``by='random'``."""
    k = max(1, round(share * score.numel()))
    if by == "random":
        return torch.randperm(score.numel(), generator=torch.Generator().manual_seed(seed))[:k].sort().values
    return score.topk(k).indices.sort().values


def channel_scores(weight: torch.Tensor, stats: InputStats, by: str) -> torch.Tensor:
    """Salience per input channel ``(in,)``: ``activation`` = mean |x|, ``weight`` = mean |W| over output rows,
    ``random`` = zeros."""
    if by == "activation":
        return stats.mean_abs
    if by == "weight":
        return weight.detach().abs().float().mean(0)
    if by == "random":  # no salience: select_channels draws the channels at random itself
        return torch.zeros(weight.shape[1])
    raise ValueError(f"unknown channel choice {by!r}: use activation, weight or random")


def zero_channels(weight: torch.Tensor, salience: torch.Tensor, share: float) -> torch.Tensor:
    """A copy of ``weight: (out, in)`` with the ``round(share * in)`` input channels of lowest ``salience`` set to
    zero."""
    k = round(share * weight.shape[1])
    out = weight.detach().float().clone()
    out[:, salience.topk(k, largest=False).indices] = 0.0
    return out


def magnitude_prune(weight: torch.Tensor, share: float) -> torch.Tensor:
    """A copy of ``weight`` with its ``round(share * numel)`` smallest-magnitude entries set to zero (unstructured)."""
    out = weight.detach().float().clone()
    k = round(share * out.numel())
    flat = out.view(-1)
    flat[flat.abs().topk(k, largest=False).indices] = 0.0
    return out


def kurtosis(*tensors: torch.Tensor) -> float:
    """Pearson kurtosis ``E[(x - mean)^4] / var^2`` of all entries of ``tensors`` pooled (3 for a normal
    distribution)."""
    n, s1, s2, s3, s4 = 0, 0.0, 0.0, 0.0, 0.0
    for t in tensors:
        v = t.detach().double().reshape(-1)
        n += v.numel()
        s1, s2, s3, s4 = (
            s1 + float(v.sum()),
            s2 + float((v**2).sum()),
            s3 + float((v**3).sum()),
            s4 + float((v**4).sum()),
        )
    mu = s1 / n
    var = s2 / n - mu**2
    m4 = s4 / n - 4 * mu * s3 / n + 6 * mu**2 * s2 / n - 3 * mu**4
    return m4 / var**2


def salience_summary(model, stats: dict[str, InputStats], top: float = 0.01) -> pd.DataFrame:
    """One row per distinct linear input: its readers, layer, channels, max/median salience, and the share of the
    summed salience held by the top ``top`` channels (0.01 for a flat distribution)."""
    owner = shared_inputs(model)
    rows = []
    for first in dict.fromkeys(owner.values()):
        s = stats[first].mean_abs
        k = max(1, round(top * s.numel()))
        readers = "/".join(layer_type(n) for n in owner if owner[n] == first)
        rows.append(
            {
                "input_of": readers,
                "layer": int(first.split(".layers.")[1].split(".")[0]),
                "channels": s.numel(),
                "max_over_median": float(s.max() / s.median()),
                f"top{top:.0%}_share": float(s.topk(k).values.sum() / s.sum()),
            }
        )
    return pd.DataFrame(rows)


@torch.no_grad()
def layer_errors(model, stats: dict[str, InputStats], quant) -> pd.DataFrame:
    """Per decoder linear: Pearson kurtosis of its weight and the relative output error
    ``|x (Q(W) - W)^T|^2 / |x W^T|^2`` of ``quant`` (a function of the weight) on the calibration sample."""
    rows = []
    for n, m in decoder_linears(model).items():
        w, x = m.weight.float(), stats[n].sample
        ref = x @ w.T
        rows.append(
            {
                "linear": n,
                "layer": int(n.split(".layers.")[1].split(".")[0]),
                "type": layer_type(n),
                "kurtosis": kurtosis(w),
                "rel_output_error": float((x @ quant(w).T - ref).pow(2).sum() / ref.pow(2).sum()),
            }
        )
    return pd.DataFrame(rows)
