"""Results rows as readable tables; a scheme with simulated activations says ``[simulated]`` in its name."""

from __future__ import annotations

import pandas as pd

OFFER = "auto-round W4A8 check"  # the scheme name of claim S3-10's row


def view(rows: pd.DataFrame) -> pd.DataFrame:
    """The results rows as a readable table."""
    df = rows[rows["scheme"] != OFFER].copy()
    out = pd.DataFrame(
        {
            "scheme": [s + (" [simulated]" if sim else "") for s, sim in zip(df["scheme"], df["simulated"])],
            "W bits": df["w_bits"].astype("Int64"),
            "A bits": df["a_bits"].astype("Int64"),
            "bits/weight (stored)": df["bits_per_weight"].round(2) if "bits_per_weight" in df else None,
            "perplexity": df["ppl"].round(3),
            "Δ ppl": df["ppl_delta"].round(3),
            "KL vs fp32": df["kl_vs_fp32"].map(lambda v: f"{v:.2e}"),
            "top-1 vs fp32": df["top1_vs_fp32"].round(4),
            "disk MB": (df["disk_bytes"] / 1e6).round(1),
            "linears MB": (df["linear_bytes"] / 1e6).round(1),
            "memory MB (eval)": (df["memory_bytes"] / 1e6).round(1),
        }
    )
    if "needle_n" in df and df["needle_n"].notna().any():
        out["needle acc [95% CI] (n)"] = [
            f"{a:.2f} [{lo:.2f}, {hi:.2f}] ({int(n)})" if n == n and n else ""  # n == n: not NaN (needles not run)
            for a, lo, hi, n in zip(df["needle_accuracy"], df["needle_ci_low"], df["needle_ci_high"], df["needle_n"])
        ]
    return out.reset_index(drop=True)


def offer_sentence(offer: dict) -> str:
    """Claim S3-10 in one plain sentence, written from the library check's fields."""
    presets = ", ".join(offer["presets_w4a8"]) or "no preset"
    formats = ", ".join(f"{k}: {v}" for k, v in offer["formats_written"].items())
    real = (
        "at least one format holds integer W4A8 weights"
        if offer["real_w4a8_export"]
        else "none of them holds integer weights, so there is no deployable W4A8 checkpoint"
    )
    accepted = "accepts" if offer["custom_w4a8_accepted"] else "rejects"
    return (
        f"auto-round {offer['auto_round_version']} has {presets} for 4-bit weights with 8-bit activations; "
        f"it {accepted} a custom scheme "
        f"(bits=4, act_bits=8, dynamic per-token int) as an experimental feature, and saving it gave {formats}: {real}."
    )
