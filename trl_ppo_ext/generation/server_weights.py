"""Policy weights to a vLLM server without CUDA: files the server reads, announced over HTTP.

``VLLMServerEngine`` pushes weights over NCCL (TRL's ``VLLMClient``), which needs CUDA on the
trainer's side. Here the weights travel as files in a folder that the trainer and the server
both see (the same machine, or a shared mount), in one of two forms:

* ``"adapter"``: the policy's LoRA adapter alone (``weights.save_policy_adapter``), loaded by
  the server as a new LoRA adapter named ``policy-v{version}`` (``POST /v1/load_lora_adapter``,
  as TRL's asynchronous LoRA sync does). Several versions live on the server at once, so a
  rollout can be sampled from an exact older version (``async_rollouts``' schedule). The server
  runs with ``--enable-lora --max-lora-rank R --max-loras K`` (``K`` at least
  ``max_staleness + 1``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; vLLM must accept every
  module the adapter adapts (``weights.adapter_sync_refusal``).
* ``"files"``: every weight of the policy (a LoRA policy's adapter merged in) as one safetensors
  file, which the server reloads in place through its worker's ``reload_weights`` (``POST
  /collective_rpc``, then ``POST /reset_prefix_cache``). The server runs with
  ``VLLM_SERVER_DEV_MODE=1``, which opens those endpoints to anyone who reaches its port: bind it
  to 127.0.0.1 or a private network. One version lives on the server at a time.

A push is two steps, so that it can be split across threads: :meth:`stage` (the trainer's thread,
right after an update: the weights are written, nothing is sent) and :meth:`activate` (the thread
that samples, between two batches: the server is told to use that version; it returns the model
name the next requests ask for). :meth:`release` deletes what no rollout needs any more. Only
safetensors and JSON cross: nothing the server reads can run code. Every request has a timeout
and a bounded number of retries (``vllm_server._with_retries``).

Example (no server needed: what each form is called on the server):

>>> from trl_ppo_ext.generation.server_weights import adapter_name
>>> adapter_name(3)
'policy-v3'
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

from torch import nn

from ..choices import SERVER_WEIGHT_SYNC_CHOICES, SERVER_WEIGHT_SYNCS
from .vllm_server import VLLMServerEngine, _http_json, _http_text, _with_retries
from .weights import _is_peft, adapter_sync_refusal, policy_weights, save_policy_adapter

# what a config may ask for: "auto" chooses (``choose_server_weight_sync``), "nccl" is ``VLLMServerEngine``'s push


def adapter_name(version: int) -> str:
    """The name the server knows the policy adapter of ``version`` by."""
    return f"policy-v{version}"


class _ServerFiles:
    """What both forms share: the folder, the HTTP calls, the staged versions."""

    def __init__(self, base_url: str, folder: str | None, *, timeout: float, retries: int, backoff: float):
        self.base_url = base_url.rstrip("/")
        self._own_folder = folder is None
        self.folder = tempfile.mkdtemp(prefix="trl_ppo_ext_weights_") if folder is None else folder
        os.makedirs(self.folder, exist_ok=True)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._staged: dict[int, str] = {}  # version -> folder, written and not yet released
        self._lock = threading.Lock()      # stage (trainer) and activate/release (sampler) on two threads

    def _post(self, path: str, payload: dict) -> str:
        url = f"{self.base_url}{path}"
        return _with_retries(lambda: _http_text(url, payload, self.timeout), self.retries, self.backoff)

    def _staged_folder(self, version: int) -> str:
        with self._lock:
            if version not in self._staged:
                raise KeyError(f"version {version} was never staged, or was released (staged now: "
                               f"{sorted(self._staged)}); stage(policy, {version}) first.")
            return self._staged[version]

    def _check_new(self, version: int) -> None:
        """A version's weights never change once staged (the server may hold them already)."""
        with self._lock:
            if version in self._staged:
                raise ValueError(f"version {version} is staged already; a version's weights never change, so "
                                 "stage new weights under a new version.")

    def _version_folder(self, kind: str, version: int) -> str:
        return os.path.join(self.folder, f"{kind}-v{version}")

    def release(self, below: int) -> None:
        """Forget the staged versions older than ``below`` and delete their files."""
        with self._lock:
            old = {v: f for v, f in self._staged.items() if v < below}
            for version in old:
                del self._staged[version]
        for folder in old.values():
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Delete every staged version (and the folder, when this object made it)."""
        self.release(below=2**63)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


class AdapterFilePush(_ServerFiles):
    """The policy's LoRA adapter, one server-side adapter per version (see the module docstring).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        adapter: the policy adapter's name in the ``PeftModel`` (never a value adapter).
        folder: where versions are written, seen by the server under the same path; None: a new
            temporary folder (a server on this machine).
        timeout, retries, backoff: of each request, as ``VLLMServerEngine``'s.
    """

    def __init__(self, base_url: str, adapter: str, folder: str | None = None, *, timeout: float = 240.0,
                 retries: int = 2, backoff: float = 1.0):
        super().__init__(base_url, folder, timeout=timeout, retries=retries, backoff=backoff)
        self.adapter = adapter
        self._loaded: set[int] = set()
        self._followed: set[int] = set()  # versions another process staged and loaded (several processes)

    def stage(self, policy: nn.Module, version: int) -> str:
        """Write ``adapter`` of ``policy`` as it is now for ``version``; returns its folder."""
        if not _is_peft(policy):
            raise ValueError("AdapterFilePush needs a peft.PeftModel policy (a LoRA adapter to send); for a plain "
                             "model use FullFilePush.")
        refusal = adapter_sync_refusal(policy, self.adapter)
        if refusal is not None:
            raise ValueError(f"The policy adapter {self.adapter!r} cannot go to vLLM as a LoRA adapter: {refusal}. "
                             "Use FullFilePush (merged weights) instead.")
        self._check_new(version)
        folder = save_policy_adapter(policy, self.adapter, self._version_folder("adapter", version))
        with self._lock:
            self._staged[version] = folder
        return folder

    def activate(self, version: int) -> str:
        """Load ``version`` on the server if it is not there yet; the model name to request."""
        with self._lock:
            if version in self._followed:
                return adapter_name(version)
        self.load(version)
        return adapter_name(version)

    def follow(self, version: int) -> None:
        """``version`` is on the server already, loaded by another process's push (process 0 of a
        run with several processes): this one requests it by name and never unloads it."""
        with self._lock:
            self._followed.add(version)

    def load(self, version: int) -> None:
        """Load the staged ``version`` on the server if it is not there yet."""
        folder = self._staged_folder(version)
        with self._lock:
            loaded = version in self._loaded
        if not loaded:
            # load_inplace: a retry after a load that did arrive is not refused as a duplicate
            self._post("/v1/load_lora_adapter",
                       {"lora_name": adapter_name(version), "lora_path": folder, "load_inplace": True})
            with self._lock:
                self._loaded.add(version)

    def release(self, below: int) -> None:
        with self._lock:
            old = sorted(v for v in self._loaded if v < below)
            self._loaded.difference_update(old)
            self._followed.difference_update([v for v in self._followed if v < below])
        for version in old:
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": adapter_name(version)})
            except (ConnectionError, RuntimeError):  # gone already, or the server is down: the files go anyway
                pass
        super().release(below)


class FullFilePush(_ServerFiles):
    """Every weight of the policy in one safetensors file, reloaded in place by the server (see the
    module docstring).

    Args:
        base_url, folder, timeout, retries, backoff: as ``AdapterFilePush``'s.
        adapter: for a ``PeftModel`` policy, the adapter merged into the weights (None: the base).
    """

    def __init__(self, base_url: str, folder: str | None = None, *, adapter: str | None = None,
                 timeout: float = 240.0, retries: int = 2, backoff: float = 1.0):
        super().__init__(base_url, folder, timeout=timeout, retries=retries, backoff=backoff)
        self.adapter = adapter
        self.active: int | None = None
        self.served_name: str | None = None

    def stage(self, policy: nn.Module, version: int) -> str:
        """Write the policy's weights as they are now for ``version``; returns their folder."""
        from safetensors.torch import save_file

        self._check_new(version)
        folder = self._version_folder("weights", version)
        os.makedirs(folder, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in policy_weights(policy, self.adapter)}
        partial = os.path.join(folder, "model.safetensors.partial")
        save_file(tensors, partial, metadata={"format": "pt"})
        os.replace(partial, os.path.join(folder, "model.safetensors"))  # never a half-written file seen
        with self._lock:
            self._staged[version] = folder
        return folder

    def activate(self, version: int) -> str:
        """Reload the server's weights from ``version``'s file (every weight in one call: a fused
        projection updated in part is corrupt) and drop its prefix cache; the model name to
        request (the served model's, unchanged)."""
        folder = self._staged_folder(version)
        if self.active != version:
            self._post("/collective_rpc", {"method": "reload_weights", "timeout": self.timeout,
                                           "kwargs": {"weights_path": folder, "is_checkpoint_format": True}})
            self._post("/reset_prefix_cache", {})
            self.active = version
        if self.served_name is None:
            url = f"{self.base_url}/v1/models"
            answer = _with_retries(lambda: _http_json(url, None, self.timeout), self.retries, self.backoff)
            self.served_name = answer["data"][0]["id"]
        return self.served_name

    def release(self, below: int) -> None:
        # the active version's file stays: the server's config points at it
        super().release(below if self.active is None else min(below, self.active))


def choose_server_weight_sync(policy: nn.Module, adapter: str | None, requested: str = "auto",
                              cuda: bool = False) -> str:
    """``"nccl"`` (``VLLMServerEngine``'s push) where CUDA is and nothing else was asked for;
    without CUDA ``"adapter"`` for a LoRA policy vLLM takes as an adapter, else ``"files"``.

    Args:
        policy: the policy (a causal LM or a ``PeftModel``); adapter: its policy adapter or None.
        requested: ``"auto"``, ``"nccl"`` or one of ``SERVER_WEIGHT_SYNCS``.
        cuda: whether the trainer has a CUDA device.
    """
    if requested not in SERVER_WEIGHT_SYNC_CHOICES:
        raise ValueError(f"the server weight sync must be 'auto', 'nccl' or one of {list(SERVER_WEIGHT_SYNCS)}, "
                         f"got {requested!r}.")
    if requested == "nccl" and not cuda:
        raise ValueError("the 'nccl' server weight sync needs a CUDA device on the trainer; use 'adapter' or 'files'.")
    if requested != "auto":
        return requested
    if cuda:
        return "nccl"
    if adapter is not None and _is_peft(policy) and adapter_sync_refusal(policy, adapter) is None:
        return "adapter"
    return "files"


class VLLMServerFileEngine(VLLMServerEngine):
    """``VLLMServerEngine`` whose weights travel as files (:class:`AdapterFilePush` or
    :class:`FullFilePush`): works on a trainer without CUDA.

    ``load_policy(policy, version)`` stages, activates and releases the older versions at once
    (the synchronous loop). An asynchronous sampler splits it: :meth:`stage_policy` on the
    trainer's thread after each update, :meth:`use_version` on the sampling thread before a batch,
    :meth:`release_below` when no rollout needs the older versions.

    Args:
        base_url: the server.
        sync: ``"adapter"`` or ``"files"`` (``choose_server_weight_sync``).
        adapter: the policy adapter of a ``PeftModel`` policy.
        folder: where the versions are written (None: a temporary folder; a server on this machine).
        **kwargs: ``VLLMServerEngine``'s (``timeout``, ``retries``, ``max_concurrency``, ``backoff``).
    """

    def __init__(self, base_url: str, *, sync: str, adapter: str | None = None, folder: str | None = None,
                 **kwargs):
        if sync not in SERVER_WEIGHT_SYNCS:
            raise ValueError(f"sync must be one of {list(SERVER_WEIGHT_SYNCS)}, got {sync!r}.")
        if sync == "adapter" and adapter is None:
            raise ValueError("sync='adapter' needs adapter=<the policy adapter's name>.")
        super().__init__(base_url, adapter=adapter, **kwargs)
        http = dict(timeout=self.timeout, retries=self.retries, backoff=self.backoff)
        self.push = (AdapterFilePush(self.base_url, adapter, folder, **http) if sync == "adapter"
                     else FullFilePush(self.base_url, folder, adapter=adapter, **http))
        self.served_model = self.model_name

    def stage_policy(self, policy: nn.Module, version: int) -> None:
        """Write ``policy``'s weights for ``version`` (the trainer's thread; nothing is sent)."""
        self.push.stage(policy, version)

    @property
    def follows_versions(self) -> bool:
        """Whether the processes of a run other than process 0 can sample the versions process 0
        pushes: several versions live on the server at once (the adapter sync). The files sync
        reloads one version in place, under the requests of every process."""
        return isinstance(self.push, AdapterFilePush)

    def push_version(self, policy: nn.Module, version: int) -> None:
        """Stage ``policy``'s weights for ``version`` and load them on the server now (process 0
        of several, the trainer's thread: the others follow it once this returns)."""
        self.push.stage(policy, version)
        self.push.load(version)

    def follow_version(self, version: int) -> None:
        """Sample ``version``, which process 0 pushed (:meth:`push_version`), by its name."""
        self.push.follow(version)

    def use_version(self, version: int) -> None:
        """Make the next requests sample from the staged ``version`` (the sampling thread)."""
        self.served_model = self.push.activate(version)
        self.policy_version = version

    def release_below(self, version: int) -> None:
        """Drop the staged versions older than ``version``."""
        self.push.release(version)

    def _push_policy(self, policy: nn.Module, version: int) -> None:
        self.stage_policy(policy, version)
        self.use_version(version)
        self.release_below(version)

    def completion_payload(self, prompt, settings, seed) -> dict:
        return {**super().completion_payload(prompt, settings, seed), "model": self.served_model}

    def close(self) -> None:
        self.push.close()
        super().close()
