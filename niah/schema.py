"""Every config setting, declared once: its default, its checks, the result tables whose rows depend on it, and how
a dry run shrinks it.

A section is a frozen dataclass whose fields are made by :func:`setting`; :func:`niah.config.load_config` fills it
from the YAML (:func:`niah.config.filled`), checks each setting against its default's kind, then calls the
section's ``resolved`` (the checks and derived values that need more than one setting) and hands it out as
``cfg.<section>``.  Adding a setting is one :func:`setting` line here (and the YAMLs that set it): the table hashes
(:func:`niah.rundir.hashed_settings`) and the dry run (:func:`niah.dryrun.dry_config`) read its declaration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ClassVar

from .data.needles import KEY_WORDS
from .kv.registry import get_method, with_modifier


class ConfigError(ValueError):
    """A config file is missing, malformed or asks for something impossible; the message says which and how to fix
    it."""


# The result tables (niah.rundir.TABLES).  A table's settings hash covers the settings its rows depend on.
NEEDLES, SWEEP, KVPPL, WEIGHTS, WEIGHT_NEEDLES, LLAMACPP = (
    "needles", "sweep", "kv_perplexity", "weightquant", "weightquant_needles", "llamacpp"
)  # fmt: skip
TABLES = (NEEDLES, SWEEP, KVPPL, WEIGHTS, WEIGHT_NEEDLES, LLAMACPP)
QUESTIONS = (NEEDLES, WEIGHT_NEEDLES, LLAMACPP)  # the tables of needle questions

SCALE = 16  # a dry run divides lengths by it: 32768 -> 2048, 4096 -> 256


def shorter(n: int) -> int:
    """Dry run: a length divided by :data:`SCALE` (at least 1 token); an unset one (None) stays unset."""
    return None if n is None else max(1, int(n) // SCALE)


def shorter_all(lengths: list[int]) -> list[int]:
    """Dry run: each length of a list divided by :data:`SCALE`."""
    return [shorter(n) for n in lengths]


FITS_A_NEEDLE = 256  # a dry run's shortest needle context: the byte tokenizer's intro, needle and question fit in it


def fitting_lengths(lengths: list[int]) -> list[int]:
    """Dry run: needle-context lengths divided by :data:`SCALE`, none below :data:`FITS_A_NEEDLE`; lengths that meet
    at that floor are kept once (the smoke config's 512 and 1024 both become 256)."""
    out = [max(FITS_A_NEEDLE, shorter(n)) for n in lengths]
    return [n for i, n in enumerate(out) if n not in out[:i]]


def sweep_lengths(lengths: list[int]) -> list[int]:
    """Dry run: the sweep's steps divided by :data:`SCALE`, the longest at least :data:`FITS_A_NEEDLE` (its context
    holds the probe's needle; the shorter steps are prefixes of it)."""
    out = shorter_all(lengths)
    out[out.index(max(out))] = max(FITS_A_NEEDLE, max(out))
    return [n for i, n in enumerate(out) if n not in out[:i]]


def at_most(limit: int) -> Callable:
    """Dry run: an integer cut to ``limit``; an unset one (None) set to it."""
    return lambda v: limit if v is None else min(v, limit) if isinstance(v, int) and not isinstance(v, bool) else v


def ends_and_middle(depths: list[float]) -> list[float]:
    """Dry run: both ends and the middle of a list of depths."""
    d = sorted(depths)
    return sorted({d[0], d[len(d) // 2], d[-1]})


def each(rules: dict[str, Callable]) -> Callable:
    """Dry run: ``rules`` applied to the keys of a mapping setting that it holds."""
    return lambda v: v if not isinstance(v, dict) else {k: rules[k](x) if k in rules else x for k, x in v.items()}


def setting(
    default: Any, *, rows=(), hashed_by=(), hashed_when=None, dry: Callable | None = None, lowest: int = 1
) -> Any:
    """A config setting's dataclass field.

    ``default``: its value when the YAML leaves it out (copied for each config; a ``None`` default takes any kind,
    otherwise the value must be of the default's kind: :func:`check_types`).  ``rows``: the tables in whose settings
    hash it is left out because it only chooses which rows exist (adding a method runs only that method).
    ``hashed_by``: tables that hash it on its own, besides those that hash its whole section (``Section.HASHED_BY``).
    ``hashed_when``: {table: when}, tables that hash it only for configs where ``when(cfg)`` holds.
    ``dry``: how a dry run shrinks it (a function of its value).  ``lowest``: an integer setting's least value.
    """
    meta = {"default": default, "rows": tuple(rows), "hashed_by": tuple(hashed_by), "dry": dry, "lowest": lowest}
    meta["hashed_when"] = hashed_when or {}
    return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)


def derived(default: Any) -> Any:
    """A field that the section computes in ``resolved`` from its settings; a YAML cannot set it."""
    return field(default_factory=lambda: copy.deepcopy(default), metadata={"derived": True})


@dataclass(frozen=True)
class Section:
    """A config section: its settings over their defaults, checked.  ``present``: the YAML has the section (a
    section left out still has its defaults; the notebooks skip the experiments of absent sections)."""

    NAME: ClassVar[str] = ""
    HASHED_BY: ClassVar[tuple[str, ...]] = ()  # tables whose rows depend on the whole section
    present: bool = field(default=False, metadata={"derived": True})

    @classmethod
    def settings(cls) -> dict[str, Any]:
        """Setting name -> its field's metadata (:func:`setting`), in declaration order."""
        return {f.name: f.metadata for f in fields(cls) if "default" in f.metadata}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: copy.deepcopy(m["default"]) for k, m in cls.settings().items()}


@dataclass(frozen=True)
class Top(Section):
    """The settings outside every section (``model`` and ``weight_model``: :func:`niah.config.check_model`)."""

    name: str = setting(None)  # names papermill_runs/<name>/: one folder name
    description: str = setting("")
    model: dict = setting(None, hashed_by=TABLES)  # the model spec (niah.models)
    weight_model: dict = setting(None, hashed_by=(WEIGHTS, WEIGHT_NEEDLES))  # notebooks 01, 02; None: model
    device: str = setting("cpu", hashed_by=TABLES)  # or cuda
    threads: int = setting(2, hashed_by=(SWEEP, LLAMACPP))  # torch threads on the CPU
    seed: int = setting(1234, hashed_by=TABLES, lowest=0)  # every needle, value and sampled window derives from it
    # pydoc (CPython's pydoc_data.topics), noise (RULER's filler) or folder
    haystack: str = setting("pydoc", hashed_by=TABLES)
    haystack_folder: str = setting("data/haystack", hashed_by=TABLES)  # the .txt files of haystack: folder
    # configs (names in configs/ or paths) whose battery and KV perplexity notebook 03 also asks, each in its own run
    # folder beside this one's: a second architecture in the same chain (niah.notebook.companions)
    companions: list[str] = setting([])


def engine_sweep(cfg) -> bool:
    """Whether the sweep asks a method read in vLLM's engine mode (its rows then depend on ``niah.engine_chunk``)."""
    return any(m.endswith("@engine") for m in cfg.sweep.methods)


def static_needles(cfg) -> bool:
    """Whether the needle questions ask a ``+static`` method (its rows then depend on the calibration split)."""
    return any("+static" in m for m in [*cfg.niah.methods, *(cfg.battery.methods or [])])


def static_sweep(cfg) -> bool:
    """Whether the sweep asks a ``+static`` method."""
    return any("+static" in m for m in cfg.sweep.methods)


@dataclass(frozen=True)
class Niah(Section):
    """The needle grid, and what the battery, sweep and llama.cpp runs share with it."""

    NAME = "niah"
    HASHED_BY = QUESTIONS
    lengths: list[int] = setting([1024, 2048], rows=QUESTIONS, dry=fitting_lengths)  # context lengths in tokens
    # needle depth in the context: 0 = start, 1 = end
    depths: list[float] = setting([0.0, 0.25, 0.5, 0.75, 1.0], rows=QUESTIONS, dry=ends_and_middle)
    trials: int = setting(1, rows=QUESTIONS, dry=at_most(1))  # seeded trials per (length, depth)
    # niah.data.needles.NeedleSpec
    needle: dict = setting({"kind": "number", "variant": "single", "count": 4}, hashed_by=(SWEEP,))
    prompt_styles: list[str] = setting(["completion"], rows=(NEEDLES, WEIGHT_NEEDLES))  # niah.data.prompts.STYLES
    methods: list[str] = setting(["fp16"], rows=QUESTIONS)  # KV methods (niah.kv.registry); the reference first
    reference: str = setting("fp16", hashed_by=(SWEEP, KVPPL))  # the method every other is paired against
    max_new_tokens: int = setting(12)  # greedy answer tokens at most
    prefill_chunk: int = setting(1024, hashed_by=(SWEEP, KVPPL), dry=shorter)  # tokens per prefill forward pass
    # the prompt chunk of methods read in vLLM's engine mode (name@engine): vLLM 0.34.0's default
    # max_num_batched_tokens on a >= 70 GiB GPU (H100, H200) with the LLM class (engine/arg_utils.py,
    # get_batch_defaults); `vllm serve` uses 8192
    engine_chunk: int = setting(16384, hashed_by=(KVPPL,), hashed_when={SWEEP: engine_sweep}, dry=shorter)


@dataclass(frozen=True)
class Battery(Section):
    """Notebook 03's needle questions (niah.experiments.battery)."""

    NAME = "battery"
    HASHED_BY = QUESTIONS
    MODES: ClassVar[tuple[str, ...]] = ("single", "multi_key")
    DEPTHS: ClassVar[tuple[str, ...]] = ("spread", "centred")
    lengths: list[int] = setting([4096, 8192, 16384], dry=fitting_lengths)  # sorted
    contexts: int = setting(5, dry=at_most(2))  # stretches of haystack, each asked at every length
    needles: int = setting(10, dry=at_most(2))  # questions per length and context
    # single mode: "spread" (0, 1/(n-1), ..., 1) or "centred" ((k + 1/2)/n: no needle at either end)
    depths: str = setting("spread")
    mode: str = setting("single")  # one needle per prompt; "multi_key": every needle of a context in one prompt
    # multi_key: one context serves every length (False: separate contexts per length, fewer distractors)
    nested: bool = setting(True)
    methods: list[str] = setting(None, rows=QUESTIONS)  # None: niah.methods; resolved: the reference first
    # {method: [lengths]}: methods asked only at those lengths (an ablation at the longest); the others at every length
    method_lengths: dict = setting({}, rows=QUESTIONS, dry=lambda m: {k: fitting_lengths(v) for k, v in m.items()})
    sliding_layers: str = setting("quantize")  # or "fp16": sliding-window layers kept at fp16 (PackedCache)

    def resolved(self, niah: Niah) -> Battery:
        if self.mode not in self.MODES:
            raise ConfigError(f"unknown battery mode {self.mode!r}: choose single (one needle per prompt) or multi_key")
        if self.depths not in self.DEPTHS:
            raise ConfigError(f"unknown battery depths {self.depths!r}: choose one of {sorted(self.DEPTHS)}")
        if self.needles * len(self.lengths) > len(KEY_WORDS):
            raise ConfigError(
                f"battery: {self.needles} needles x {len(self.lengths)} lengths need more distinct keys than the "
                f"{len(KEY_WORDS)} there are"
            )
        methods = _reference_first(niah.reference, self.methods or niah.methods)
        for m, lengths in self.method_lengths.items():
            # the reference answers every question: each method's rows are paired with it
            if m not in methods[1:] or not isinstance(lengths, list) or not set(lengths) <= set(self.lengths):
                raise ConfigError(
                    f"battery.method_lengths: {m}: {lengths!r} must name one of the battery's methods other than the "
                    f"reference ({methods[1:]}) and a list of its lengths ({sorted(self.lengths)})"
                )
        return replace(self, lengths=sorted(self.lengths), methods=methods)


@dataclass(frozen=True)
class Sweep(Section):
    """Notebook 04's stepped pressure sweep (niah.experiments.sweep)."""

    NAME = "sweep"
    HASHED_BY = (SWEEP,)
    # context lengths, prefilled in order, one cache grown through them
    lengths: list[int] = setting([1, 256, 512, 1024, 2048], rows=(SWEEP,), dry=sweep_lengths)
    methods: list[str] = setting(["fp16"], rows=(SWEEP,))  # resolved: the reference first
    decode_steps: int = setting(32, dry=at_most(4))  # paired greedy decode steps per length (TPOT)
    hz: int = setting(50)  # memory sampling rate
    memory_budget_gib: float = setting(None)  # lengths whose fp32 context exceeds it get oom rows instead of a run
    # e.g. {"target": 16384, "warmup": 4096, "repeats": 3}: TTFT at target, cold and after a warm-up
    cold_warm: dict = setting(None, dry=each({"target": shorter, "warmup": shorter, "repeats": at_most(2)}))

    def resolved(self, niah: Niah) -> Sweep:
        methods = self.methods if niah.reference in self.methods else [niah.reference, *self.methods]
        return replace(self, methods=methods)


@dataclass(frozen=True)
class KVPerplexity(Section):
    """Held-out text read through each stored cache (niah.experiments.kvppl)."""

    NAME = "kv_perplexity"
    HASHED_BY = (KVPPL,)
    BREAKDOWN: ClassVar[tuple[str, ...]] = ("keys", "values", "full", "sliding")  # KV method modifiers
    methods: list[str] = setting(["fp16"], rows=(KVPPL,))  # resolved: the reference, the listed, the breakdown rows
    windows: int = setting(4, dry=at_most(2))  # held-out windows
    context: int = setting(2048, dry=shorter)  # tokens stored by each method
    continuation: int = setting(256, dry=shorter, lowest=2)  # tokens scored over the stored context
    # per method, rows with only these parts quantized: keys, values, full (layers), sliding (layers)
    breakdown: list[str] = setting([], rows=(KVPPL,))
    breakdown_methods: list[str] = setting(None, rows=(KVPPL,))  # the listed methods that get breakdown rows; None: all
    parts: dict = derived({})  # each breakdown row's method name -> (the listed method, the part)

    def resolved(self, niah: Niah) -> KVPerplexity:
        """The reference first, then the listed methods, then the breakdown rows of ``breakdown_methods``.  A listed
        method that already names a part of the same kind (a ``+keys`` method gets no ``+values`` row) gets no row for
        it, and a method that codes one attention layer type only gets no layer-type rows."""
        bad = [p for p in self.breakdown if p not in self.BREAKDOWN]
        if bad:
            raise ConfigError(
                f"unknown kv_perplexity.breakdown part(s) {bad}; choose among {', '.join(self.BREAKDOWN)}"
            )
        listed = [m for m in self.methods if m != niah.reference]
        of = listed if self.breakdown_methods is None else self.breakdown_methods
        if not set(of) <= set(listed):
            raise ConfigError(
                f"kv_perplexity.breakdown_methods {sorted(set(of) - set(listed))} are not in kv_perplexity.methods; "
                "list them there too"
            )
        parts = {}
        for m in of:
            layers = get_method(m).layers
            for part in self.breakdown:
                if part in ("full", "sliding") and not (layers.full and layers.sliding):
                    # it codes one layer type only (vLLM's presets): +full is the method, +sliding codes nothing
                    continue
                variant = with_modifier(m, part)
                if variant and variant not in listed:
                    parts[variant] = (m, part)
        return replace(self, methods=[niah.reference, *listed, *parts], parts=parts)


@dataclass(frozen=True)
class LlamaCpp(Section):
    """llama.cpp side by side on the battery's questions (niah.experiments.llamacpp)."""

    NAME = "llamacpp"
    HASHED_BY = (LLAMACPP,)
    KV_TYPES: ClassVar[dict[str, int]] = {"f16": 1, "q8_0": 8, "q4_0": 2}  # GGML type ids, as type_k / type_v take them
    lengths: list[int] = setting(None)  # battery lengths to ask at; None: the battery's shortest
    contexts: int = setting(1)  # the battery's first contexts
    kv: list[str] = setting(["f16", "q8_0", "q4_0"], rows=(LLAMACPP,))  # llama.cpp cache types (f16: the reference)
    # quantized types with the Hadamard rotation and not
    rotation: list[bool] = setting([True, False], rows=(LLAMACPP,))

    def resolved(self, battery: Battery) -> LlamaCpp:
        lengths = self.lengths or battery.lengths[:1]
        if not set(lengths) <= set(battery.lengths):
            raise ConfigError(
                f"llamacpp.lengths {lengths} must be lengths of the battery ({battery.lengths}): it asks the battery's "
                "questions"
            )
        bad = [k for k in self.kv if k not in self.KV_TYPES]
        if bad:
            raise ConfigError(f"unknown llama.cpp cache type(s) {bad}; choose from {', '.join(self.KV_TYPES)}")
        if "f16" not in self.kv:
            raise ConfigError(
                "llamacpp.kv must include f16: it is the reference the other cache types are compared with"
            )
        return replace(self, lengths=lengths)


@dataclass(frozen=True)
class WeightQuant(Section):
    """Notebooks 01 and 02 (niah.weightquant); the sizes are the knobs of the CPU budget."""

    NAME = "weightquant"
    HASHED_BY = (WEIGHTS, WEIGHT_NEEDLES)
    # share of pydoc topic keys used for calibration (see weightquant.data.split_keys)
    calibration_share: float = setting(
        0.25, hashed_by=(KVPPL,), hashed_when={NEEDLES: static_needles, SWEEP: static_sweep}
    )  # also +static key statistics (niah.experiments.keystats)
    # sample_tokens: kept per layer input for AWQ
    calibration: dict = setting(
        {"samples": 16, "seqlen": 256, "sample_tokens": 1024},
        dry=each({"samples": at_most(4), "seqlen": at_most(64), "sample_tokens": at_most(128)}),
    )
    evaluation: dict = setting(
        {"windows": 8, "length": 512, "batch": 2},
        dry=each({"windows": at_most(2), "length": at_most(128), "batch": at_most(2)}),
    )
    group: int = setting(64, dry=at_most(64))  # weights per scale
    # the 4-bit schemes at the source GGUF's own block: Q5_0, Q8_0 and Q4_K's sub-blocks hold 32 weights each
    # (both are in the schemes' names, so they choose rows: a new value adds schemes, it redoes none)
    block_group: int = setting(32, dry=at_most(32), rows=(WEIGHTS, WEIGHT_NEEDLES))
    # the mixed scheme's attn_v and ffn_down bits, where llama.cpp's Q4_K_M rule has Q6_K
    more_bits: int = setting(6, rows=(WEIGHTS, WEIGHT_NEEDLES))
    # the first calibration windows, cut to seqlen
    autoround: dict = setting(
        {"iters": 10, "samples": 8, "seqlen": 128, "batch_size": 8, "amp": False},
        dry=each({"iters": at_most(2), "samples": at_most(4), "seqlen": at_most(64), "batch_size": at_most(4)}),
    )
    # W4A16 on the first `blocks` decoder layers: RTN, AutoRound at `autoround.iters` and at `iters`
    # (auto-round's default)
    autoround_check: dict = setting({"blocks": 2, "iters": 200}, dry=each({"blocks": at_most(1), "iters": at_most(4)}))
    outlier_share: float = setting(0.01)  # W4A8: input channels kept in int8 weights (S3-2)
    salient_share: float = setting(0.01)  # AWQ's experiment: input channels kept in fp16 (S3-5)
    salient_bits: list[int] = setting([3, 4])
    zero_share: float = setting(0.3)  # channel mask and magnitude pruning (S3-4)
    awq_grid: int = setting(20, dry=at_most(5))  # scale exponents searched per layer
    # the weights x KV cells: the battery's questions at these lengths (niah.weightquant.needle)
    needle_lengths: list[int] = setting([4096], rows=(WEIGHT_NEEDLES,), dry=fitting_lengths)
    # contexts / needles None: the battery's (a different number asks other questions than notebook 03's)
    needle: dict = setting(
        {"contexts": None, "needles": None}, dry=each({"contexts": at_most(1), "needles": at_most(2)})
    )
    # keys of schemes_01 with needle cells
    needle_schemes: list[str] = setting(
        ["fp32", "w8a8_sym", "w4a16_rtn_block", "w4a16_ar_block", "w4a16_mixed"], rows=(WEIGHT_NEEDLES,)
    )
    kv_methods: list[str] = setting(
        ["fp16", "q8_0", "q4_0", "turboquant_k8v4@engine", "turboquant_3bit_nc+centred+scaled"],
        rows=(WEIGHTS, WEIGHT_NEEDLES),
    )
    generate_tokens: int = setting(300, dry=at_most(32))  # greedy tokens per scheme for the repetition check
    prompt_tokens: int = setting(32)

    def resolved(self) -> WeightQuant:
        if self.more_bits not in (6, 8):  # wider than the mix's 4 bits, and a width that bit packing stores
            raise ConfigError(f"weightquant.more_bits must be 6 or 8 (the widths stored packed); got {self.more_bits}")
        for k in ("contexts", "needles"):
            v = self.needle[k]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(
                    f"weightquant.needle.{k} must be a whole number of at least 1 (or null: the battery's); got {v!r}"
                )
        return self


@dataclass(frozen=True)
class Cluster(Section):
    """Scale-out on Ray (niah.cluster): the section's presence, or --cluster ADDRESS, turns it on."""

    NAME = "cluster"
    ENGINES: ClassVar[tuple[str, ...]] = ("ray",)
    engine: str = setting("ray")
    # None: a local cluster started by the run; "auto": the running one; "ray://host:10001"
    address: str = setting(None)
    workers: int = setting(2)  # Ray actors, each with one copy of the model
    gpus_per_worker: int = setting(0, lowest=0)  # GPUs per actor (1: one model per GPU; more: spread with device_map)
    cpus_per_worker: int = setting(1)  # CPUs per actor, and its torch threads

    def resolved(self, device: str, address: str) -> Cluster:
        """``address``: the one ``--cluster`` gave (:data:`niah.config.CLUSTER_ENV`), over the YAML's; ``local`` is a
        cluster started on this machine.  A cluster asked for by ``address`` alone is ``present``."""
        out = replace(self, present=self.present or bool(address), address=address or self.address)
        if out.address in ("", "local"):
            out = replace(out, address=None)
        if out.engine not in self.ENGINES:
            raise ConfigError(f"cluster.engine {out.engine!r} is unknown: the only engine is ray")
        if out.gpus_per_worker > 1 and not str(device).startswith("cuda"):
            raise ConfigError(
                f"cluster.gpus_per_worker {out.gpus_per_worker} spreads one model over several GPUs, which needs "
                f"device: cuda (this config has device: {device}); set gpus_per_worker to 0 or 1"
            )
        return out


SECTIONS = {s.NAME: s for s in (Niah, Battery, Sweep, KVPerplexity, LlamaCpp, WeightQuant, Cluster)}


def _reference_first(ref: str, methods: list[str]) -> list[str]:
    return [ref, *(m for m in methods if m != ref)]
