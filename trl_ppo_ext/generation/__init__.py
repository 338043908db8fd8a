"""The engines a rollout samples with, behind one small interface (``base.GenerationEngine``:
prompt ids -> completion ids + the engine's log-probs; receive new policy weights).

``arguments``  ``VLLMArguments``: TRL GRPO's vLLM config fields, checked
``base``       the interface, ``SamplingSettings``, ``EngineSamples``, request seeds
``weights``    the policy's weights as an engine loads them (full, merged LoRA, adapter folder)
``mismatch``   sampler-vs-trainer log-prob difference and truncated importance weights (pure math)
``vllm_colocate``  ``VLLMColocateEngine``: vLLM in the training process
``vllm_server``    ``VLLMServerEngine``: a running ``trl vllm-serve`` / ``vllm serve``
``server_weights``  ``VLLMServerFileEngine``: the same server, weights pushed as files (no CUDA needed)

Nothing here imports vLLM until an engine is built (``build_vllm_engine``).

Example (the fields and checks need no vLLM):
    >>> args = VLLMArguments()
    >>> args.use_vllm, args.vllm_mode, args.vllm_gpu_memory_utilization
    (False, 'colocate', 0.3)
    >>> VLLMArguments(vllm_gpu_memory_utilization=1.5)
    Traceback (most recent call last):
    ...
    ValueError: vllm_gpu_memory_utilization must be in (0, 1] ...
"""

from __future__ import annotations

from .arguments import VLLMArguments
from .base import EngineSamples, GenerationEngine, SamplingSettings, sample_responses

__all__ = ["EngineSamples", "GenerationEngine", "SamplingSettings", "VLLMArguments", "build_vllm_engine",
           "sample_responses", "server_weight_sync"]


def build_vllm_engine(args: VLLMArguments, policy, *, adapter: str | None = None, seed: int = 0,
                      engine_kwargs: dict | None = None) -> GenerationEngine:
    """The engine ``args`` asks for: with ``vllm_mode="server"`` an engine of the server at
    ``args.vllm_server_url`` whose weight push :func:`server_weight_sync` chooses (NCCL:
    ``VLLMServerEngine``; adapter or weight files: ``server_weights.VLLMServerFileEngine``), else a
    ``VLLMColocateEngine`` of ``policy`` (a causal LM, a ``PeftModel`` whose ``adapter`` is the
    policy's, or a folder / hub id)."""
    if args.vllm_mode == "server":
        from .server_weights import VLLMServerFileEngine
        from .vllm_server import VLLMServerEngine

        sync = server_weight_sync(args, policy, adapter)
        if sync == "nccl":
            return VLLMServerEngine(args.vllm_server_url, timeout=args.vllm_server_timeout,
                                    group_port=args.vllm_group_port, adapter=adapter)
        return VLLMServerFileEngine(args.vllm_server_url, sync=sync, adapter=adapter,
                                    folder=getattr(args, "vllm_server_weight_dir", None),
                                    timeout=args.vllm_server_timeout)
    from .vllm_colocate import VLLMColocateEngine

    return VLLMColocateEngine(
        policy, adapter=adapter, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length, tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode, seed=seed, engine_kwargs=engine_kwargs,
    )


def server_weight_sync(args, policy, adapter: str | None) -> str:
    """How the policy's weights reach the server: ``args.vllm_server_weight_sync`` (a
    ``PPOConfig`` field; ``"auto"`` for a bare ``VLLMArguments``) resolved by
    ``server_weights.choose_server_weight_sync``. NCCL counts as available only with CUDA and
    synchronous rollouts (``max_staleness=0``): the asynchronous sampler stages each version on the
    trainer's thread and switches to it on its own, which the file pushes do."""
    import torch

    from .server_weights import choose_server_weight_sync

    synchronous = getattr(args, "max_staleness", 0) == 0
    return choose_server_weight_sync(policy, adapter, getattr(args, "vllm_server_weight_sync", "auto"),
                                     cuda=torch.cuda.is_available() and synchronous)
