"""PPOTrainer(use_vllm=True) under `accelerate launch --num_processes 2` on the CPU: each process
samples with its own colocated engine (vLLM's external launcher) on its shard of the prompts; the
trainer's gradients stay in sync. Writes <out>/rank<k>.json."""
import json
import sys
from pathlib import Path

import torch
from tiny_setup import VLLM_SHAPES, VllmTrainer, prompt_dataset, run_and_exit, tiny_config, tiny_models

from trl_ppo_ext.tiny import build_tiny_tokenizer


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer()
    policy, ref, value, reward = tiny_models(tok, **VLLM_SHAPES)
    trainer = VllmTrainer(
        args=tiny_config(out, total_episodes=16, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         num_mini_batches=2, use_vllm=True, temperature=1.0),
        processing_class=tok, model=policy, ref_model=ref, reward_model=reward, value_model=value,
        train_dataset=prompt_dataset(tok, n=12),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters() if p.requires_grad))
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world_size": trainer.accelerator.num_processes, "logs": logs, "checksum": checksum}))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    run_and_exit(main)
