"""Exact-resume scenario, one process per call (see tests/trainer/test_trainer_run_control.py).

    ppo_resume.py OUT straight         6 updates in one go
    ppo_resume.py OUT killed           checkpoints every update, SIGKILLs itself during update 4
    ppo_resume.py OUT preempted        checkpoints every update, gets SIGTERM during update 4 (after
                                       its first optimizer step): checkpoints there and exits 0
    ppo_resume.py OUT resume           resumes from the latest checkpoint in OUT, to update 6
    ... --use_vllm                     the same with rollouts sampled by a colocated vLLM engine
                                       (head_dim 64 models; tests/generation/test_vllm_trainer.py)
    ... --generations                  the same with 2 samples per prompt and the GRPO estimator (no critic)
    ... --episodes                     the same with episodes of a rollout_func whose environment
                                       replies draw from the run's RNG

Writes OUT/final_params.pt (trainable parameters) and OUT/logs.json (logged metrics).
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from tiny_setup import VLLM_SHAPES, prompt_dataset, tiny_config, tiny_models, two_turn_rollout  # beside this file

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.tiny import build_tiny_tokenizer


class KilledDuringUpdate4(PPOTrainer):
    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step == 3:  # updates 1-3 done and checkpointed: we are inside update 4
            os.kill(os.getpid(), signal.SIGKILL)
        return super().compute_loss_terms(mb, adv, num_tokens)


class PreemptedDuringUpdate4(PPOTrainer):
    sent = False

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step == 3 and not self.sent:  # inside update 4, before its first step
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the handler only sets a flag
        return super().compute_loss_terms(mb, adv, num_tokens)


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    use_vllm = "--use_vllm" in sys.argv[3:]
    policy, ref, value, reward = tiny_models(tok, **(VLLM_SHAPES if use_vllm else {}))
    args = tiny_config(
        out, use_vllm=use_vllm, total_episodes=24, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2, save_strategy="no" if mode == "straight" else "steps", save_steps=1,
        adaptive_kl=True, kl_target=0.01, kl_horizon=100, save_total_limit=3,
        **(dict(num_generations=2, advantage_estimator="grpo") if "--generations" in sys.argv[3:] else {}),
    )
    if args.advantage_estimator != "gae":
        value = None
    cls = {"killed": KilledDuringUpdate4, "preempted": PreemptedDuringUpdate4}.get(mode, PPOTrainer)
    if use_vllm:  # small engines: eager, a 64 MiB KV cache
        cls = type(cls.__name__, (cls,), {"vllm_engine_kwargs": {"enforce_eager": True,
                                                                 "kv_cache_memory_bytes": 64 << 20}})
    episodes = "--episodes" in sys.argv[3:]
    trainer = cls(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                  train_dataset=prompt_dataset(tok, n=10), value_model=value,
                  rollout_func=two_turn_rollout(tok) if episodes else None)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    params = {k: v.detach() for k, v in trainer.unwrapped.named_parameters() if v.requires_grad}
    torch.save(params, out / f"final_params_{mode}.pt")
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    (out / f"logs_{mode}.json").write_text(json.dumps(logs))
