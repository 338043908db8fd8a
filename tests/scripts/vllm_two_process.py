"""Two colocated vLLM engines, one per process, the way TRL GRPO runs them (vLLM's external
launcher): meant for ``torchrun --nproc_per_node 2`` on the CPU (see tests/generation/test_vllm_colocate.py).

Each rank builds its engine from the same in-memory tiny policy, samples with its own seed,
pushes a changed policy and checks the engine's log-probs against a transformers forward of it,
closes the engine, then does an all-reduce on torch.distributed's default group (which vLLM's
teardown must have left alone) and destroys that group. Writes ``<out>/rank<k>.json``.
"""

import json
import os
import sys
from pathlib import Path

for _key, _value in (("OMP_NUM_THREADS", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                     ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trl_ppo_ext.generation.base import SamplingSettings  # noqa: E402
from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine  # noqa: E402
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer  # noqa: E402

PROMPTS = [[6, 7, 8], [9, 10], [20, 21, 22, 23]]


def engine_vs_transformers(model, samples) -> float:
    worst = 0.0
    with torch.no_grad():
        for prompt, ids, logprobs in zip(PROMPTS, samples.completion_ids, samples.logprobs):
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            reference = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            worst = max(worst, (reference - torch.tensor(logprobs)).abs().max().item())
    return worst


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_tiny_causal_lm(build_tiny_tokenizer(), hidden_size=128, num_heads=2, num_layers=2,
                                 max_position_embeddings=64)
    engine = VLLMColocateEngine(model, engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20})
    settings = SamplingSettings(max_tokens=8, temperature=1.0)
    engine.load_policy(model, 0)
    first = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05)
    engine.load_policy(model, 1)
    after = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(200 + rank))
    engine.close()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the default group outlived the engine
    result = {"rank": rank, "launcher": engine._external_launcher, "samples": first.completion_ids,
              "difference_after_sync": engine_vs_transformers(model, after), "all_reduce": total.item()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
