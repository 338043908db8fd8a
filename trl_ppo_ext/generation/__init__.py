"""The engines a rollout samples with, behind one small interface (``base.GenerationEngine``:
prompt ids -> completion ids + the engine's log-probs; receive new policy weights).

``arguments``  ``VLLMArguments``: TRL GRPO's vLLM config fields, checked
``base``       the interface, ``SamplingSettings``, ``EngineSamples``, request seeds
``weights``    the policy's weights as an engine loads them (full, merged LoRA, adapter folder)
``mismatch``   sampler-vs-trainer log-prob difference and truncated importance weights (pure math)
``vllm_colocate``  ``VLLMColocateEngine``: vLLM in the training process
``vllm_server``    ``VLLMServerEngine``: a running ``trl vllm-serve`` / ``vllm serve``

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
           "sample_responses"]


def build_vllm_engine(args: VLLMArguments, policy, *, adapter: str | None = None, seed: int = 0,
                      engine_kwargs: dict | None = None) -> GenerationEngine:
    """The engine ``args`` asks for: a ``VLLMServerEngine`` at ``args.vllm_server_url``
    (``vllm_mode="server"``), else a ``VLLMColocateEngine`` of ``policy`` (a causal LM, a
    ``PeftModel`` whose ``adapter`` is the policy's, or a folder / hub id)."""
    if args.vllm_mode == "server":
        from .vllm_server import VLLMServerEngine

        return VLLMServerEngine(args.vllm_server_url, timeout=args.vllm_server_timeout,
                                group_port=args.vllm_group_port, adapter=adapter)
    from .vllm_colocate import VLLMColocateEngine

    return VLLMColocateEngine(
        policy, adapter=adapter, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length, tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode, seed=seed, engine_kwargs=engine_kwargs,
    )
