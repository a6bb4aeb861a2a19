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
            f"{a:.2f} [{lo:.2f}, {hi:.2f}] ({int(n)})" if n == n and n else ""
            for a, lo, hi, n in zip(df["needle_accuracy"], df["needle_ci_low"], df["needle_ci_high"], df["needle_n"])
        ]
    return out.reset_index(drop=True)


def repetition_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Greedy generations: share of repeated 4-grams overall and per segment of the continuation, and its start."""
    g = rows[rows.get("repeat_share", pd.Series(index=rows.index, dtype=float)).notna()].reset_index(drop=True)
    segments = pd.DataFrame(list(g["repeat_by_segment"])).add_prefix("repeated, n-grams starting at ")
    head = pd.DataFrame(
        {
            "scheme": [s + (" [simulated]" if sim else "") for s, sim in zip(g["scheme"], g["simulated"])],
            "tokens": g["generated_tokens"].astype(int),
            "repeated 4-grams": g["repeat_share"].round(3),
        }
    )
    return pd.concat([head, segments.round(3), g["generated_text"].str.slice(0, 160).rename("text (first 160 characters)")], axis=1)


def salient_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Perplexity of the AWQ paper's experiment: round-to-nearest, +kept channels by each choice, and AWQ scales; one
    column per bit width."""
    df = rows[(rows["w_bits"] < 16) & (rows["zero_share"] == 0) & (rows["a_bits"] == 16)].copy()
    df["variant"] = [
        "AWQ scales" if r == "awq" else (f"+{k:.0%} fp16 by {by}" if k else "round-to-nearest")
        for r, k, by in zip(df["rounding"], df["keep_share"], df["keep_by"])
    ]
    out = df.pivot_table(index="variant", columns="w_bits", values="ppl").rename(columns=lambda b: f"W{int(b)} perplexity")
    return out.assign(fp32=rows["ppl_fp32"].iloc[0]).round(3)


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
        f"auto-round {offer['auto_round_version']} has {presets} for 4-bit weights with 8-bit activations; it {accepted} a custom scheme "
        f"(bits=4, act_bits=8, dynamic per-token int) as an experimental feature, and saving it gave {formats}: {real}."
    )
