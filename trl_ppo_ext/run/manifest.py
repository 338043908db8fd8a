"""The run manifest: ``<output_dir>/run_manifest.json``, what a run was made of.

The design note's system contract: fix and record the policy, reference, reward model and
value init (name, revision, precision, quantization, adapters, shared parameters), the
tokenizer and chat template, the datasets, the generation settings, the hyperparameters,
the seed and the distributed topology. This module builds that record as plain JSON:

* identity functions: :func:`model_identity`, :func:`tokenizer_identity`,
  :func:`dataset_identity`, :func:`package_versions`, :func:`environment_identity`;
* :func:`build_manifest` puts them together with ``status="running"``;
* :func:`write_manifest` writes it atomically; :func:`finish_manifest` records the stop.

Everything returned is JSON-serialisable (:func:`to_jsonable` converts dtypes, enums,
paths, sets, tensors and config objects; NaN/inf become strings, so the file is strict JSON).

Example:

>>> import torch
>>> from trl_ppo_ext.run.manifest import to_jsonable
>>> to_jsonable({"kl": torch.tensor(0.5), "steps": (1, 2)})
{'kl': 0.5, 'steps': [1, 2]}
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import math
import os
import platform
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

from .._utils import load_json, save_json
from ..models.sharding import is_fsdp2_param

MANIFEST_FILENAME = "run_manifest.json"
FORMAT_VERSION = 1
FINAL_STATUSES = ("completed", "halted", "failed", "interrupted", "preempted")  # preempted: SIGTERM, checkpointed
# Models whose parameters take at most this many bytes are hashed in full; larger ones by
# a strided sample (hashing every byte of a 7B model would take tens of seconds).
FULL_HASH_MAX_BYTES = 256 * 2**20
SAMPLES_PER_TENSOR = 4096
PACKAGES = ("trl", "transformers", "peft", "accelerate", "bitsandbytes", "torch", "datasets")


# ---------------------------------------------------------------------- JSON conversion
def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data (dict/list/str/int/float/bool/None).

    dtypes and devices -> ``str``; enums -> their value; paths -> ``str``; sets -> sorted
    lists; tuples -> lists; tensors/arrays -> a number (one element), a list (<= 64
    elements) or ``{"shape", "dtype"}``; dataclasses and objects with ``to_dict()`` -> dicts;
    NaN/inf -> ``"nan"``/``"inf"``/``"-inf"``; anything else -> ``repr``.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, (os.PathLike, torch.dtype, torch.device)):
        return os.fspath(obj) if isinstance(obj, os.PathLike) else str(obj)
    if isinstance(obj, Mapping):
        return {str(key): to_jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, torch.Size)):
        return [to_jsonable(item) for item in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_jsonable(item) for item in obj), key=lambda x: json.dumps(x, sort_keys=True))
    if isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy":
        return _array_to_jsonable(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if callable(getattr(obj, "to_dict", None)) and not isinstance(obj, type):
        return to_jsonable(obj.to_dict())
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


def _array_to_jsonable(array) -> Any:
    """A torch tensor or NumPy array/scalar: number, short list, or a shape/dtype summary."""
    if hasattr(array, "item") and getattr(array, "size", None) in (1, ()) and not isinstance(array, torch.Tensor):
        return to_jsonable(array.item())  # NumPy scalar or one-element array
    if isinstance(array, torch.Tensor) and array.numel() == 1:
        return to_jsonable(array.item())
    shape = list(array.shape) if hasattr(array, "shape") else None
    numel = math.prod(shape) if shape is not None else None
    if numel is not None and numel <= 64:
        return to_jsonable(array.tolist())
    return {"shape": shape, "dtype": str(getattr(array, "dtype", type(array).__name__))}


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------- models
def content_hash(
    model: nn.Module, *, full_hash_max_bytes: int = FULL_HASH_MAX_BYTES, samples_per_tensor: int = SAMPLES_PER_TENSOR
) -> tuple[str, str]:
    """``(sha256 hex digest, method)`` over the model's parameters.

    Always hashed: every parameter's name, shape and dtype, in ``named_parameters`` order.
    Values: all bytes when the parameters take at most ``full_hash_max_bytes``; else
    ``samples_per_tensor`` evenly strided elements of each parameter (``flat[::stride]``),
    so a change to an unsampled element of a big model goes unnoticed. ``method`` says which.
    Parameters on the ``meta`` device contribute only their name, shape and dtype; a parameter
    sharded by FSDP2 its name, full shape and dtype and the values of this process's shard (the
    manifest is written by the main process alone, which cannot gather).
    """
    params = list(model.named_parameters())
    total_bytes = sum(p.numel() * p.element_size() for _, p in params)
    sample = None if total_bytes <= full_hash_max_bytes else samples_per_tensor
    digest = hashlib.sha256()
    for name, param in params:
        digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}\n".encode())
        digest.update(_value_bytes(param, sample))
    if sample is None:
        method = "sha256 over parameter names, shapes, dtypes and all values"
    else:
        method = (
            f"sha256 over parameter names, shapes, dtypes and {sample} evenly strided values per parameter "
            f"(parameters take {total_bytes} bytes > {full_hash_max_bytes})"
        )
    return digest.hexdigest(), method


def _value_bytes(param: torch.Tensor, sample: int | None) -> bytes:
    """The raw bytes of ``param``'s values (all, or ``sample`` strided ones), device independent."""
    if param.is_meta:
        return b"meta"
    if is_fsdp2_param(param):
        param = param.to_local()
    flat = param.detach().reshape(-1)
    if sample is not None and flat.numel() > sample:
        flat = flat[:: math.ceil(flat.numel() / sample)]
    return flat.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _logical_numel(param: torch.Tensor) -> int:
    """Elements the parameter represents: a bitsandbytes 4-bit weight stores two per byte and
    keeps its real shape in ``quant_state.shape``."""
    quant_state = getattr(param, "quant_state", None)
    shape = getattr(quant_state, "shape", None)
    return math.prod(shape) if shape is not None else param.numel()


def _parameter_summary(model: nn.Module) -> dict:
    """Trainable/total parameter counts and the dtype holding most elements."""
    trainable = total = 0
    by_dtype: dict[str, int] = {}
    for param in model.parameters():
        n = _logical_numel(param)
        total += n
        trainable += n if param.requires_grad else 0
        by_dtype[str(param.dtype)] = by_dtype.get(str(param.dtype), 0) + n
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return {"dtype": dtype, "parameter_dtypes": by_dtype, "parameters": {"trainable": trainable, "total": total}}


def _quantization(model: nn.Module, config) -> dict | None:
    """``config.quantization_config`` if set, else the bitsandbytes 4-bit layers found, else None."""
    from ..models.quantization import linear4bit_modules

    quant_config = getattr(config, "quantization_config", None)
    if quant_config is not None:
        return {"source": "config.quantization_config", "config": to_jsonable(quant_config)}
    layers = linear4bit_modules(model)
    if not layers:
        return None
    quant_types = sorted({str(getattr(m.weight, "quant_type", None)) for m in layers})  # "nf4" or "fp4"
    return {"source": "bitsandbytes Linear4bit layers", "linear4bit_layers": len(layers), "quant_types": quant_types}


def _adapters(model: nn.Module) -> list[dict]:
    """One entry per PEFT adapter of the first module carrying a ``peft_config`` dict."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and configs:
            break
    else:
        return []
    active = _active_adapters(module)
    return [
        {
            "name": name,
            "peft_type": to_jsonable(getattr(cfg, "peft_type", None)),
            "r": getattr(cfg, "r", None),
            "lora_alpha": getattr(cfg, "lora_alpha", None),
            "target_modules": to_jsonable(getattr(cfg, "target_modules", None)),
            "modules_to_save": to_jsonable(getattr(cfg, "modules_to_save", None)),
            "active": name in active,
        }
        for name, cfg in configs.items()
    ]


def _active_adapters(module: nn.Module) -> list[str]:
    """The active adapter names of a module carrying ``peft_config``: a ``PeftModel``'s properties,
    transformers' ``PeftAdapterMixin`` methods (``model.add_adapter``/``load_adapter``; they raise
    when the adapters were injected without it), else the names its LoRA layers have active."""
    for attr in ("active_adapters", "active_adapter"):
        value = getattr(module, attr, None)
        if callable(value):
            try:
                value = value()
            except (ValueError, RuntimeError):  # "no adapter loaded" from the mixin
                value = None
        if value:
            return [value] if isinstance(value, str) else list(value)
    names = set()
    for layer in module.modules():
        if layer is not module and hasattr(layer, "active_adapters") and hasattr(layer, "merged"):  # peft tuner layers
            value = layer.active_adapters
            names.update([value] if isinstance(value, str) else value)
    return sorted(names)


def model_identity(
    model: nn.Module,
    role: str,
    *,
    shared_with: list[str] | tuple[str, ...] | set[str] = (),
    revision: str | None = None,
    full_hash_max_bytes: int = FULL_HASH_MAX_BYTES,
    samples_per_tensor: int = SAMPLES_PER_TENSOR,
) -> dict:
    """What identifies one of the run's models.

    Args:
        model: the module (a transformers model, a ``PeftModel``, a value head, ...).
        role: ``"policy"``, ``"reference"``, ``"reward"``, ``"value"``, ...
        shared_with: roles whose parameters this model shares (e.g. the value head on the
            policy's backbone, a reference that is the policy with its adapter disabled).
        revision: the hub commit the weights were loaded from, when the caller knows it;
            default: ``config._commit_hash`` (transformers < 5 stored it), else None.
        full_hash_max_bytes / samples_per_tensor: see :func:`content_hash`.

    Returns:
        ``role``, ``class``, ``name_or_path``, ``revision``, ``content_hash``,
        ``content_hash_method``, ``dtype``, ``parameter_dtypes``, ``quantization``,
        ``adapters``, ``parameters`` (``trainable``, ``total``), ``shared_with``.
    """
    config = getattr(model, "config", None)
    digest, method = content_hash(
        model, full_hash_max_bytes=full_hash_max_bytes, samples_per_tensor=samples_per_tensor
    )
    identity = {
        "role": role,
        "class": type(model).__name__,
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "revision": revision or getattr(config, "_commit_hash", None),
        "content_hash": digest,
        "content_hash_method": method,
        **_parameter_summary(model),
        "quantization": _quantization(model, config),
        "adapters": _adapters(model),
        "shared_with": sorted(shared_with),
    }
    return to_jsonable(identity)


# ---------------------------------------------------------------------- tokenizer, data
def tokenizer_identity(tokenizer) -> dict:
    """Name/path, class, vocabulary size and hash, special-token ids, padding side and the
    sha256 of the chat template (None without one; a dict of named templates is hashed as
    sorted JSON)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = json.dumps(dict(template), sort_keys=True)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    return to_jsonable({
        "name_or_path": getattr(tokenizer, "name_or_path", None) or None,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "base_vocab_size": getattr(tokenizer, "vocab_size", None),
        "vocab_sha256": _sha256_text(json.dumps(sorted(vocab.items()))) if vocab is not None else None,
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
        "chat_template_sha256": _sha256_text(template) if template else None,
    })


def dataset_identity(dataset, *, sample_rows: int = 100) -> dict | None:
    """Fingerprint, size and columns of a dataset; None for ``dataset=None``.

    A Hugging Face ``Dataset`` carries a fingerprint of its content and every transform
    (``dataset._fingerprint``). Anything else is fingerprinted by the sha256 of its first
    ``sample_rows`` rows as JSON (``fingerprint_method`` says which); an iterable without
    ``__getitem__`` is iterated for them.
    """
    if dataset is None:
        return None
    fingerprint = getattr(dataset, "_fingerprint", None)
    columns = getattr(dataset, "column_names", None)
    try:
        size = len(dataset)
    except TypeError:
        size = None
    rows = None
    if fingerprint is not None:
        method = "datasets fingerprint"
    else:
        rows = _first_rows(dataset, sample_rows, size)
        fingerprint = _sha256_text(json.dumps(to_jsonable(rows), sort_keys=True))
        method = f"sha256 of the first {len(rows)} rows as JSON"
    if columns is None and rows and isinstance(rows[0], Mapping):
        columns = list(rows[0])
    return to_jsonable({
        "class": type(dataset).__name__, "fingerprint": fingerprint, "fingerprint_method": method,
        "size": size, "columns": columns,
    })


def _first_rows(dataset, n: int, size: int | None) -> list:
    if size is not None and hasattr(dataset, "__getitem__"):
        return [dataset[i] for i in range(min(n, size))]
    return list(itertools.islice(iter(dataset), n))


# ---------------------------------------------------------------------- software, hardware
def package_versions() -> dict[str, str | None]:
    """Installed versions of TRL, transformers, peft, accelerate, bitsandbytes, torch, datasets
    (None when not installed; read from package metadata, nothing is imported), trl-ppo-ext,
    Python, and the CUDA version torch was built with (None for a CPU build)."""
    from .._version import __version__

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    versions["trl-ppo-ext"] = __version__
    versions["python"] = platform.python_version()
    versions["torch_cuda"] = torch.version.cuda
    return versions


def environment_identity(accelerator=None) -> dict:
    """World size, process indices, device and device type of this process, distributed type
    and mixed precision (from ``accelerator``; without one, from ``torch.distributed`` or the
    ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` variables), the CUDA devices visible, the platform.

    ``device_types`` lists this process's device type; accelerate runs one device type on
    every process.
    """
    if accelerator is not None:
        topology = {
            "world_size": accelerator.num_processes,
            "process_index": accelerator.process_index,
            "local_process_index": accelerator.local_process_index,
            "device": str(accelerator.device),
            "distributed_type": to_jsonable(accelerator.distributed_type),
            "mixed_precision": to_jsonable(accelerator.mixed_precision),
        }
    else:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        topology = {
            "world_size": torch.distributed.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", 1)),
            "process_index": torch.distributed.get_rank() if distributed else int(os.environ.get("RANK", 0)),
            "local_process_index": int(os.environ.get("LOCAL_RANK", 0)),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "distributed_type": None,
            "mixed_precision": None,
        }
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        **topology,
        "device_types": [torch.device(topology["device"]).type],
        "cuda_device_count": cuda_count,
        "cuda_device_names": [torch.cuda.get_device_name(i) for i in range(cuda_count)],
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------- the manifest file
def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def manifest_path(output_dir: str | os.PathLike) -> str:
    """``<output_dir>/run_manifest.json``."""
    return os.path.join(output_dir, MANIFEST_FILENAME)


def build_manifest(
    *,
    models: dict[str, dict],
    tokenizer,
    train_dataset,
    eval_dataset,
    generation: dict,
    hyperparameters: dict,
    seed: int | None,
    environment: dict,
) -> dict:
    """The manifest of a run that is starting (``status="running"``, no stop yet).

    Args:
        models: role -> :func:`model_identity` dict (policy, reference, reward, value).
        tokenizer: the tokenizer (recorded with :func:`tokenizer_identity`).
        train_dataset / eval_dataset: recorded with :func:`dataset_identity` (eval may be None).
        generation: sampling settings (temperature, top-k/p, response_length, stop token, ...).
        hyperparameters: the training config, e.g. ``args.to_dict()``.
        seed: the run's seed.
        environment: :func:`environment_identity`'s dict.

    Returns:
        A JSON-serialisable dict: ``format_version``, ``status``, ``started_at`` (UTC ISO 8601),
        ``stopped_at``, ``stop_reason``, ``seed``, ``models``, ``tokenizer``, ``datasets``
        (``train``, ``eval``), ``generation``, ``hyperparameters``, ``environment``, ``packages``.
    """
    if not isinstance(models, Mapping) or not all(isinstance(v, Mapping) for v in models.values()):
        raise TypeError(
            f"models must map role -> model_identity(...) dict, got {type(models).__name__}. "
            "Build each entry with trl_ppo_ext.run.manifest.model_identity(model, role)."
        )
    return to_jsonable({
        "format_version": FORMAT_VERSION,
        "status": "running",
        "started_at": _now(),
        "stopped_at": None,
        "stop_reason": None,
        "seed": seed,
        "models": dict(models),
        "tokenizer": tokenizer_identity(tokenizer),
        "datasets": {"train": dataset_identity(train_dataset), "eval": dataset_identity(eval_dataset)},
        "generation": generation,
        "hyperparameters": hyperparameters,
        "environment": environment,
        "packages": package_versions(),
    })


def write_manifest(path: str | os.PathLike, manifest: dict) -> None:
    """Write ``manifest`` to ``path`` atomically (temp file in the same folder, fsync,
    ``os.replace``), as strict JSON. Call it on the main process only."""
    save_json(path, to_jsonable(manifest))


def finish_manifest(path: str | os.PathLike, stop_reason: str | None, status: str) -> dict:
    """Record the stop in the manifest at ``path``: ``stopped_at`` (now), ``stop_reason`` and
    ``status`` (one of ``FINAL_STATUSES``). Returns the updated manifest.

    Raises:
        ValueError: an unknown ``status``, or a damaged manifest file.
        FileNotFoundError: no manifest at ``path`` (write it with :func:`write_manifest` when
            training starts).
    """
    if status not in FINAL_STATUSES:
        raise ValueError(f"status must be one of {list(FINAL_STATUSES)}, got {status!r}.")
    try:
        manifest = load_json(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"No run manifest at {str(path)!r} to finish. Write it with write_manifest(path, build_manifest(...)) "
            "when training starts."
        ) from err
    manifest.update(status=status, stop_reason=stop_reason, stopped_at=_now())
    write_manifest(path, manifest)
    return manifest


class ManifestMixin:
    """The trainer's run manifest (``run_manifest.json`` in ``output_dir``): written when
    training starts, finished with the run's status when it ends. Mixed into ``PPOTrainer``;
    reads its models, tokenizer, datasets, config, KL controller and rewards."""

    def _manifest_path(self) -> str:
        return manifest_path(self.args.output_dir)

    def _write_manifest(self) -> None:
        if not self.accelerator.is_main_process:
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        shared = getattr(unwrapped, "is_actor_critic", False)
        models = {"policy": model_identity(unwrapped.policy, "policy")}
        if self.ref_model is None and not getattr(getattr(self, "scoring", None), "reference", True):
            models["reference"] = {"role": "reference", "none": "nothing reads it (kl_coef=0, no KL guard)"}
        elif self.ref_model is None:
            models["reference"] = {"role": "reference", "same_as": "policy with its adapter disabled",
                                   "shared_with": ["policy"]}
        else:
            models["reference"] = model_identity(self.ref_model, "reference")
        if getattr(unwrapped, "has_value", True):  # a critic-free run records no value model
            value = unwrapped if shared else unwrapped.value_model
            models["value"] = model_identity(value, "value", shared_with=["policy"] if shared else ())
        if self.reward_model is not None:
            models["reward"] = model_identity(self.reward_model, "reward")
        rewards = [
            {"name": r.name, "weight": r.weight, "kind": "model" if r.is_model else "function",
             **({} if r.is_model else {"qualname": getattr(r.source, "__qualname__", type(r.source).__name__),
                                        "module": getattr(r.source, "__module__", None)})}
            for r in self.rewards
        ]
        for r in self.rewards[1 if self.reward_model is not None else 0:]:
            if r.is_model:
                models[f"reward:{r.name}"] = model_identity(r.source, "reward")
        generation = {
            "response_length": self.args.response_length, "temperature": self.args.temperature, "top_k": 0,
            "top_p": 1.0, "stop_token_id": self.stop_token_id, "stop_token_ids": list(self.stop_token_ids),
            "pad_token_id": self.processing_class.pad_token_id,
        }
        hyper = self.args.to_dict()
        hyper.update(kl_controller=self.kl_controller.state_dict(), resumed_from=getattr(self, "_resume_path", None),
                     rewards=rewards)
        os.makedirs(self.args.output_dir, exist_ok=True)
        write_manifest(self._manifest_path(), build_manifest(
            models=models, tokenizer=self.processing_class, train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset, generation=generation, hyperparameters=hyper, seed=self.args.seed,
            environment=environment_identity(self.accelerator),
        ))

    def _finish_manifest(self, status: str, reason: str | None) -> None:
        if self.accelerator.is_main_process and os.path.exists(self._manifest_path()):
            finish_manifest(self._manifest_path(), reason, status)
