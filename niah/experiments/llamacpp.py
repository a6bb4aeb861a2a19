"""llama.cpp side by side: the needle battery's questions run through llama.cpp itself (the ``[llamacpp]`` extra).

The same GGUF file that this repo dequantizes for transformers runs on the same token ids with llama.cpp's cache
types f16, q8_0 and q4_0.  llama.cpp rotates a quantized cache (a Hadamard transform of Q, K and V, PR #21038), so
each quantized type runs with the rotation (``method`` ``lcpp_<type>``) and without it (``lcpp_<type>_norot``,
``LLAMA_ATTN_ROT_DISABLE=1``).  Per question and cache type a row holds the greedy answer and its score, the
teacher-forced answer log-prob, the KL and top-1 agreement against llama.cpp's own f16 cache (as
:func:`~niah.experiments.protocol.compare_logits` scores this repo's methods), and the prefill and decode speed.
Flash attention is on for every type (a quantized V cache needs it), so the f16 reference runs the same kernel.
See docs/design-notes.md#niah.experiments.llamacpp.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..config import Config
from ..models import ModelUnavailable, verified_gguf
from ..schema import LlamaCpp
from .base import Experiment, check_answer_room, too_long_reason
from .battery import question_prompts
from .grid import Cell, cell_keys
from .protocol import Answer, greedy_from, scored_fields, teacher_forced

ROTATION_OFF = "LLAMA_ATTN_ROT_DISABLE"
DECODE_STEPS = 8  # timed greedy steps per question, at the context's length
INSTALL = "pip install -e '.[llamacpp]' (or `make setup-llamacpp`; it compiles llama.cpp from source)"


def installed() -> bool:
    try:
        import llama_cpp  # noqa: F401  # optional extra: llamacpp
    except ImportError:
        return False
    return True


def variants(s: dict) -> list[tuple[str, str, bool]]:
    """(method name, cache type, rotation) per run, the f16 reference first (f16 is never rotated)."""
    out = [("lcpp_f16", "f16", False)]
    for kv in s.kv:
        if kv != "f16":
            out += [(f"lcpp_{kv}" + ("" if rot else "_norot"), kv, rot) for rot in s.rotation]
    return out


def open_llama(gguf: Path, n_ctx: int, kv: str, rotation: bool, threads: int):
    """A llama.cpp context on ``gguf`` with cache type ``kv`` for K and V, flash attention, ``rotation`` on or off."""
    try:
        import llama_cpp  # optional extra: llamacpp
    except ImportError:
        raise ModelUnavailable(f"llama-cpp-python is not installed: {INSTALL}") from None
    if rotation:
        os.environ.pop(ROTATION_OFF, None)
    else:
        os.environ[ROTATION_OFF] = "1"
    try:
        return llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=LlamaCpp.KV_TYPES[kv],
            type_v=LlamaCpp.KV_TYPES[kv],
            flash_attn=True,
            logits_all=False,
            verbose=False,
        )
    finally:
        os.environ.pop(ROTATION_OFF, None)


def _last_logits(llm) -> torch.Tensor:
    import llama_cpp  # optional extra: llamacpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy())


def ask_llama(
    llm, ids: list[int], question_ids: list[int], answer_ids: list[int], max_new_tokens: int, eos: int, decode
) -> tuple:
    """Context and question through ``llm``, the expected answer teacher-forced one token at a time, then greedy
    decoding from the first token where the argmax leaves the answer (as :func:`niah.experiments.protocol.ask` does,
    so the answer texts compare).  Returns ``(answer, prefill_s)``; ``answer.question_s`` is the prefill of context
    and question together."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(list(ids) + list(question_ids))
    prefill_s = time.perf_counter() - t0
    base, rows = llm.n_tokens, [_last_logits(llm)]
    for tok in answer_ids[:-1]:
        llm.eval([tok])
        rows.append(_last_logits(llm))
    logsm = torch.log_softmax(torch.stack(rows).float(), dim=-1)
    answer_logprob, j = teacher_forced(logsm, answer_ids)
    if j == len(answer_ids):
        return Answer(decode(answer_ids), answer_logprob, logsm, float("nan"), prefill_s), prefill_s
    llm.n_tokens = base + j  # the next eval drops the cache from here

    def step(token: int) -> int:
        llm.eval([token])
        return int(_last_logits(llm).argmax())

    generated = list(answer_ids[:j]) + [int(logsm[j].argmax())]
    decode_s = greedy_from(generated, step, max_new_tokens, eos, decode)
    return Answer(decode(generated), answer_logprob, logsm, decode_s, prefill_s), prefill_s


def state_size(llm) -> int:
    """Bytes of llama.cpp's session state now (its KV cache at the tokens evaluated, plus the last logits): at the same
    tokens, the difference between two cache types is the difference of their caches."""
    import llama_cpp  # optional extra: llamacpp

    return int(llama_cpp.llama_state_get_size(llm.ctx))


def time_decode(llm, first_token: int, steps: int) -> float:
    """Seconds per greedy decode step over ``steps`` steps from where ``llm`` stands (its cache at the context's
    length)."""
    token, t0 = first_token, time.perf_counter()
    for _ in range(steps):
        llm.eval([token])
        token = int(_last_logits(llm).argmax())
    return (time.perf_counter() - t0) / steps


def run_llamacpp(cfg: Config, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Every missing (question, cache type) row of the config's llama.cpp cross-check; return the table's path.

    ``lm`` is the transformers model of the same GGUF (its tokenizer builds the prompts)."""
    s = cfg.llamacpp
    if not cfg.battery.present:
        raise ValueError(
            f"llamacpp: it asks the battery's questions, and config {cfg.name} has no battery: section; add one"
        )
    gguf = verified_gguf(cfg.model)
    exp = Experiment(cfg, "llamacpp", lm.name, out_path, progress)
    style, max_new = cfg.niah.prompt_styles[0], cfg.niah.max_new_tokens
    prompts = [(ids, q) for ids, q in question_prompts(cfg, lm) if q.length in s.lengths and q.context < s.contexts]
    runs = variants(s)

    def row(q, method):
        return exp.row(
            **cell_keys(cfg, Cell(style, q.length, round(q.depth, 4), q.trial)), context=q.context, method=method
        )

    todo = [(name, kv, rot) for name, kv, rot in runs if any(not exp.done(row(q, name)) for _, q in prompts)]
    if not todo:
        return exp.path
    sizes = [(len(ids) + len(q.question_ids), len(q.answer_ids)) for ids, q in prompts]
    check_answer_room(cfg, lm, sizes)
    prompt, answer = max(sizes, key=lambda p: p[0] + max(p[1], max_new))
    n_ctx = prompt + max(answer, max_new) + 8
    reason = too_long_reason(cfg, lm, prompt, answer)
    if reason:
        raise ValueError(f"llamacpp: {reason}")
    exp.start(len(prompts) * len(todo), "llama.cpp")
    ref = {}
    decode = lambda t: lm.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    for name, kv, rot in [runs[0], *(r for r in todo if r != runs[0])]:
        llm = open_llama(gguf, n_ctx, kv, rot, cfg.threads)
        try:
            for ids, q in prompts:
                wanted = not exp.done(row(q, name))
                if name != runs[0][0] and not wanted:
                    exp.bar.update(1)
                    continue
                ans, prefill_s = ask_llama(
                    llm, ids, q.question_ids, q.answer_ids, max_new, lm.tokenizer.eos_token_id, decode
                )
                state_bytes = state_size(llm)
                decode_s = time_decode(llm, q.answer_ids[0], DECODE_STEPS)
                if name == runs[0][0]:
                    ref[q] = ans.answer_logsoftmax
                if wanted:
                    exp.write(
                        [
                            {
                                **row(q, name),
                                "status": "ok",
                                "reason": "",
                                "kv_type": kv,
                                "rotation": rot,
                                "context_tokens": q.length,
                                **scored_fields(ans, [q.value], ref[q]),
                                "prefill_s": prefill_s,
                                "prefill_tokens_per_s": (len(ids) + len(q.question_ids)) / prefill_s,
                                "decode_s_per_token": decode_s,
                                "state_bytes": state_bytes,
                            }
                        ]
                    )
        finally:
            llm.close()
    return exp.close()


def cross_check(cfg: Config, lm, run) -> pd.DataFrame | None:
    """Notebook 03's llama.cpp section: run (or resume) the cross-check and return its rows (their tables:
    :func:`niah.report.tables.agreement_table`, :func:`~niah.report.tables.speed_table`), or say why it cannot run."""
    if not installed():
        print(
            "llama.cpp cross-check skipped: llama-cpp-python is not installed. "
            f"To run it: {INSTALL}, then run the chain again."
        )
        return None
    if cfg.model["source"] not in ("package", "assembled"):
        print(
            "llama.cpp cross-check skipped: it needs the model as a GGUF file (source package or assembled), "
            f"not {cfg.model['source']}."
        )
        return None
    if not cfg.battery.present:
        print(
            "llama.cpp cross-check skipped: it asks the battery's questions, "
            f"and config {cfg.name} has no battery: section."
        )
        return None
    run_llamacpp(cfg, lm, run.file("llamacpp"))
    return run.rows("llamacpp")
