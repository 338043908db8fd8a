"""The engines a rollout samples with, behind one small interface (``base.GenerationEngine``:
prompt ids -> completion ids + the engine's log-probs; receive new policy weights).

``arguments``  ``VLLMArguments``: TRL GRPO's vLLM config fields, checked
``base``       the interface, ``SamplingSettings``, ``EngineSamples``, request seeds
``weights``    the policy's weights as an engine loads them (full, merged LoRA, adapter folder)
``mismatch``   sampler-vs-trainer log-prob difference and truncated importance weights (pure math)
``vllm_colocate``  ``VLLMColocateEngine``: vLLM in the training process
``vllm_server``    ``VLLMServerEngine``: a running ``trl vllm-serve`` / ``vllm serve``

Nothing here imports vLLM until an engine is built.
"""
