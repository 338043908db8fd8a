"""A vLLM engine inside the training process ("colocate"): the one-GPU case the package exists for.

Built from a model folder or hub id, or from an in-memory policy (a temporary checkpoint is
written once). The policy's weights reach the engine through the worker's
``reload_weights``, every weight in one call, then the prefix cache is reset (the path that works
on vLLM's CPU backend too, which repacks its Linear weights so that the per-parameter
``model.load_weights`` TRL uses leaves empty parameters behind; a partial update of a fused
projection corrupts it). A LoRA policy goes as merged weights (what measured faster), or as its
adapter (a new ``LoRARequest`` per version) when asked or when its base is 4-bit. Requests are seeded from the
caller's RNG. Sleep mode (CUDA) frees the engine's memory while the trainer updates.

Environment set here when unset: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine stays in this
process: no spawned engine process, tensors passed by reference). Several training processes
each run their own engine with vLLM's ``external_launcher`` (as TRL GRPO does). On a CPU, set
``VLLM_CPU_KVCACHE_SPACE`` (GiB) or the KV cache takes ``gpu_memory_utilization`` of the RAM.

Example (no vLLM needed: the rank vLLM is asked to hold for a LoRA policy of rank 12):

>>> from trl_ppo_ext.generation.vllm_colocate import engine_lora_rank
>>> engine_lora_rank(12)
16
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile

import torch
from torch import nn

from ..models.quantization import is_4bit_model
from .arguments import require_vllm
from .base import EngineSamples, GenerationEngine, SamplingSettings, check_vllm_temperature, request_seeds
from .weights import _is_peft, adapter_sync_refusal, policy_weights, save_policy_adapter, write_checkpoint

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The LoRA ranks vLLM 0.32 accepts for max_lora_rank; an adapter's rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def resolve_sleep_mode(requested: bool, available: bool) -> bool:
    """Sleep mode if ``requested`` and the platform has it; else False, saying so once."""
    if requested and not available:
        warn_once("sleep_mode", "vllm_enable_sleep_mode=True is ignored: vLLM has no sleep mode on this platform "
                  "(CUDA, ROCm and XPU only). The engine keeps its weights and KV cache while the model trains.")
    return requested and available


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}).")


@contextlib.contextmanager
def preserved_rng():
    """Restore Python's, NumPy's and torch's (CPU and CUDA) global RNG states on exit: building a
    vLLM engine in-process reseeds them, which would change every later draw of the run."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def check_cpu_head_dim(policy: nn.Module) -> None:
    """Refuse, before anything is built, a model whose attention head size vLLM's CPU attention
    backend has no kernel for (it would fail at the first generation, or at start-up warm-up)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention has no kernel for this policy's head_dim={head_dim} (hidden_size / "
            f"num_attention_heads); it takes {supported}. Set use_vllm=False to sample with transformers, or "
            "use a model with a supported head size."
        )


# The variables a torchrun-style launcher sets, which vLLM's external launcher reads.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# Config fields that fix the shapes of the weights: a folder whose config differs in any of them
# (e.g. embeddings resized after loading, when a script adds a [PAD] token) cannot take the pushes.
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def folder_matches(config, folder: str) -> bool:
    """Whether the checkpoint ``folder``'s ``config.json`` has the in-memory ``config``'s weight shapes."""
    with open(os.path.join(folder, "config.json")) as f:
        on_disk = json.load(f)
    in_memory = config.to_dict()
    return all(on_disk.get(key) == in_memory.get(key) for key in _SHAPE_FIELDS)


def model_dtype(model: nn.Module) -> str:
    """The vLLM dtype name of ``model``'s first floating-point parameter (``"auto"`` if none):
    an fp32 policy must be sampled in fp32, or its log-probs drift from the trainer's by ~0.1."""
    for param in model.parameters():
        if param.is_floating_point():
            return _DTYPE_NAMES.get(param.dtype, "auto")
    return "auto"


def folder_dtype(folder: str) -> str:
    """The dtype a checkpoint folder's ``config.json`` declares, as a vLLM dtype name (``"auto"``
    when it declares none): vLLM's ``"auto"`` picks bf16 for an fp32 checkpoint on some CPUs."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return "auto"
    with open(path) as f:
        config = json.load(f)
    declared = config.get("dtype") or config.get("torch_dtype")
    return declared if declared in ("float32", "bfloat16", "float16") else "auto"


class VLLMColocateEngine(GenerationEngine):
    """A ``vllm.LLM`` in this process that samples rollouts for the policy.

    Args:
        policy: the policy: a causal LM, a ``PeftModel`` around one (the shared actor-critic's
            ``.policy``), or a model folder / hub id (its weights are replaced at the first
            :meth:`load_policy` anyway).
        adapter: the policy's adapter in a ``PeftModel`` (default: its active adapter). Any other
            adapter (the critic's ``"value"``) never reaches the engine.
        lora_sync: ``"adapter"`` (push the adapter as a vLLM LoRA), ``"merged"`` (push
            ``W + B @ A``), or ``"auto"``: merged, except the adapter for a 4-bit base.
        max_lora_rank: the engine's LoRA rank limit (default: the adapter's rank).
        dtype: vLLM dtype; default: the policy's parameter dtype (a folder: its config's).
        gpu_memory_utilization, max_model_length, tensor_parallel_size, enable_sleep_mode: as
            ``VLLMArguments``' ``vllm_*`` fields.
        seed: the engine's own seed (requests carry their own seeds; this one only matters for
            anything unseeded).
        engine_kwargs: further ``vllm.LLM`` keywords.
    """

    def __init__(self, policy: nn.Module | str, *, adapter: str | None = None, lora_sync: str = "auto",
                 max_lora_rank: int | None = None, dtype: str | None = None, gpu_memory_utilization: float = 0.3,
                 max_model_length: int | None = None, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False, seed: int = 0, engine_kwargs: dict | None = None):
        require_vllm("use_vllm")
        if lora_sync not in ("auto", "adapter", "merged"):
            raise ValueError(f"lora_sync must be 'auto', 'adapter' or 'merged', got {lora_sync!r}.")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm.platforms import current_platform

        self.adapter = None
        if isinstance(policy, nn.Module) and _is_peft(policy):
            self.adapter = adapter or policy.active_adapter
        self.sync_mode = self._choose_sync_mode(policy, lora_sync)
        if isinstance(policy, nn.Module) and current_platform.is_cpu():
            check_cpu_head_dim(policy)
        self.enable_sleep_mode = resolve_sleep_mode(enable_sleep_mode, current_platform.is_sleep_mode_available())
        self._asleep = False
        self._weights_awake = True  # while asleep: the weights were woken for a push, the KV cache not yet
        self._weights_discarded = False
        self._lora_request = None
        self._external_launcher = False
        self.llm = None
        self._workdir = tempfile.mkdtemp(prefix="trl_ppo_ext_vllm_")
        try:
            self.llm = self._build(policy, dtype=dtype, max_lora_rank=max_lora_rank, seed=seed, engine_kwargs=dict(
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_length,
                tensor_parallel_size=tensor_parallel_size, **(engine_kwargs or {})))
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)  # a failed start leaves no files behind
            raise

    def _build(self, policy, *, dtype: str | None, max_lora_rank: int | None, seed: int, engine_kwargs: dict):
        """The ``vllm.LLM``: its source folder, dtype and keywords; vLLM's own errors become one
        that says what the engine needs."""
        from vllm import LLM

        source = self._model_source(policy)
        if dtype is None:
            dtype = model_dtype(policy) if isinstance(policy, nn.Module) else folder_dtype(source)
        kwargs = dict(
            model=source, dtype=dtype, enable_sleep_mode=self.enable_sleep_mode, seed=seed,
            skip_tokenizer_init=True,  # ids in, ids out: no tokenizer files needed
            generation_config="vllm",  # the checkpoint's sampling defaults never apply
            logprobs_mode="processed_logprobs",  # log-probs after the temperature, as the trainer's
        )
        if isinstance(policy, nn.Module) and is_4bit_model(policy):
            kwargs["quantization"] = "bitsandbytes"  # vLLM loads the folder's base in 4-bit (CUDA only)
        if self.sync_mode == "adapter":
            rank = engine_lora_rank(max_lora_rank or int(policy.peft_config[self.adapter].r))
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        unset = {name for name in _LAUNCHER_ENV if name not in os.environ}
        kwargs.update(self._distributed_kwargs(engine_kwargs.get("tensor_parallel_size", 1), seed))
        self._external_launcher = kwargs.get("distributed_executor_backend") == "external_launcher"
        kwargs.update(engine_kwargs)
        try:
            with preserved_rng():  # vLLM seeds the global RNGs of the process it runs in
                return LLM(**kwargs)
        except Exception as err:
            raise RuntimeError(
                f"vLLM could not load the policy from {source!r} (dtype={dtype}): {err}. The engine needs a model "
                "architecture vLLM supports (and, on a CPU, a head_dim its attention backend takes). Set "
                "use_vllm=False to sample with transformers instead."
            ) from err
        finally:
            # The launcher variables set for vLLM's external launcher go once the engine is built:
            # left behind (e.g. by a second engine in one process, which finds the first one's
            # one-process group), they make the next accelerate/transformers state in this process
            # believe it was launched by torchrun and wait for a rendezvous that never comes.
            for name in unset:
                os.environ.pop(name, None)

    # ---------------------------------------------------------------- construction helpers
    def _choose_sync_mode(self, policy, lora_sync: str) -> str:
        """``"full"`` for a plain model; for a LoRA policy ``"merged"``, or ``"adapter"`` when asked
        for or when the base is 4-bit (its packed weights cannot be pushed). Merged is the default
        because it measured better on the CPU (benchmarks/generation_speed.py, 97M policy, LoRA
        r=16 on q/k/v/o: sync 0.27 s + generation 2.2 s merged, 0.013 s + 4.4 s as a vLLM LoRA,
        whose kernels slow every token) and is what TRL GRPO pushes."""
        if self.adapter is None:
            return "full"
        if lora_sync == "adapter" or (lora_sync == "auto" and is_4bit_model(policy)):
            refusal = adapter_sync_refusal(policy, self.adapter)
            if refusal is not None:
                raise ValueError(f"The policy adapter {self.adapter!r} must go to vLLM as a LoRA adapter "
                                 f"(lora_sync={lora_sync!r}, 4-bit base: {is_4bit_model(policy)}), but vLLM cannot "
                                 f"take it: {refusal}.")
            return "adapter"
        return "merged"

    def _model_source(self, policy) -> str:
        """A folder or hub id vLLM can load: given as a string, the in-memory model's own folder
        (when its shapes still match it), or a temporary checkpoint of its base weights written
        here once."""
        if isinstance(policy, str):
            return policy
        base = policy.get_base_model() if _is_peft(policy) else policy
        own = getattr(base, "name_or_path", "") or ""
        has_folder = os.path.isfile(os.path.join(own, "config.json"))
        if is_4bit_model(policy):
            # The packed 4-bit weights cannot be written or pushed as checkpoint weights: vLLM must
            # quantize the original folder itself, and only the adapter can travel.
            if self.sync_mode != "adapter" or not has_folder:
                raise ValueError(
                    "A 4-bit policy can be sampled with vLLM only as a LoRA adapter on a base loaded from a local "
                    f"folder (vLLM's bitsandbytes path); here sync={self.sync_mode!r}, base folder={own!r}. Load the "
                    "base from a folder and adapt only q/k/v/o/gate/up/down projections, or set use_vllm=False."
                )
            return own
        if has_folder and self.sync_mode != "adapter" and folder_matches(base.config, own):
            return own  # its weights are replaced by the first load_policy
        return write_checkpoint(policy, os.path.join(self._workdir, "model"))

    @staticmethod
    def _distributed_kwargs(tensor_parallel_size: int, seed: int) -> dict:
        """Several training processes: one engine each, launched by us (vLLM's external launcher),
        seeded alike within a tensor-parallel group. One process: vLLM's default executor."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            if tensor_parallel_size != 1:
                raise ValueError(f"vllm_tensor_parallel_size={tensor_parallel_size} needs that many training "
                                 "processes (accelerate launch / torchrun); this one runs alone.")
            return {}
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if world % tensor_parallel_size:
            raise ValueError(f"vllm_tensor_parallel_size={tensor_parallel_size} must divide the number of "
                             f"processes ({world}).")
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("LOCAL_RANK", str(rank)))
        return {"distributed_executor_backend": "external_launcher", "seed": seed + rank // tensor_parallel_size}

    # ---------------------------------------------------------------- weights
    @property
    def needs_weights(self) -> bool:
        return self._weights_discarded

    def _push_policy(self, policy: nn.Module, version: int) -> None:
        if self.sync_mode == "adapter":
            self._push_adapter(policy, version)
            return
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        weights = list(policy_weights(policy, self.adapter if self.sync_mode == "merged" else None))
        # Every weight in one call: vLLM fuses q/k/v and gate/up, and a fused weight updated from
        # part of its pieces is corrupt.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self._weights_discarded = False

    def _push_adapter(self, policy: nn.Module, version: int) -> None:
        from vllm.lora.request import LoRARequest

        folder = save_policy_adapter(policy, self.adapter, os.path.join(self._workdir, f"adapter-v{version}"))
        previous = self._lora_request
        # lora_int_id must be > 0 and new for new weights: vLLM caches adapters by id.
        new_id = 1 if previous is None else previous.lora_int_id + 1
        self._lora_request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=new_id, lora_path=folder)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ---------------------------------------------------------------- sampling
    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 generator: torch.Generator | None = None) -> EngineSamples:
        if self.policy_version is None or self._weights_discarded:
            raise RuntimeError("VLLMColocateEngine.generate without the policy's weights (before the first "
                               "load_policy, or after a sleep that discarded them). Call load_policy(policy, version).")
        from vllm import SamplingParams
        check_vllm_temperature(settings.temperature)

        self.wake_up()
        seeds = request_seeds(len(prompts), generator)
        params = [SamplingParams(
            n=1, temperature=settings.temperature, **settings.filter_params(),
            max_tokens=settings.max_tokens, min_tokens=0, stop_token_ids=list(settings.stop_token_ids),
            ignore_eos=True,  # only the rollout's stop ids end a response, as in the transformers path
            logprobs=0, seed=seed, detokenize=False,
        ) for seed in seeds]
        with preserved_rng():  # the samples come from the seeded requests; the run's RNG stays as it was
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                        use_tqdm=False, lora_request=self._lora_request)
        completion_ids, logprobs, reasons = [], [], []
        for request in outputs:
            sample = request.outputs[0]
            ids = list(sample.token_ids)
            completion_ids.append(ids)
            logprobs.append([float(position[token].logprob) for position, token in zip(sample.logprobs, ids)])
            reasons.append(sample.finish_reason)  # "length" before max_tokens: the context ran out
        return EngineSamples(completion_ids=completion_ids, logprobs=logprobs, finish_reasons=reasons)

    def sleep(self) -> None:
        """Sleep mode only: level 1 (weights to host memory) when the base stays and adapters are
        pushed, level 2 (weights discarded; the next load_policy pushes them) otherwise."""
        if not self.enable_sleep_mode or self._asleep:
            return
        level = 1 if self.sync_mode == "adapter" else 2
        self.llm.sleep(level=level)
        self._asleep, self._weights_awake = True, False
        self._weights_discarded = level == 2

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep, self._weights_awake = False, True

    def close(self) -> None:
        """Shut the engine down and drop its temporary files (the model copy, adapter versions).

        One process: vLLM's full teardown (it also ends the one-process ``torch.distributed``
        group that building the engine started). Several processes (external launcher): vLLM's
        teardown would destroy torch.distributed's default group, which the trainer still uses,
        and, left to interpreter exit, fails once the trainer destroyed that group; so it is
        cancelled and the engine's memory goes with the process."""
        if self.llm is not None:
            core = self.llm.llm_engine.engine_core
            finalizer = getattr(core, "_finalizer", None)
            if self._external_launcher and finalizer is not None:
                finalizer.detach()
            else:
                core.shutdown()
            self.llm = None
        shutil.rmtree(self._workdir, ignore_errors=True)
