"""The ``multiturn`` task: ``examples/ppo_multiturn.py``.

Episodes with turns from its ``rollout_func`` (answer 1, the environment's 8-token verdict, answer
2; one reward at the end that depends on both answers), a tiny random Llama (saved once per seed)
with the example's LoRA and PPO settings (768 episodes = 24 updates of 32, ``gamma`` 1, ``lam``
0.95). Its ``reward`` is the mean episode reward of the update's rollout. This package's trainer
only; the arm ``step_through`` runs GAE through the environment's tokens as if they were actions
(``step_through_gae``), against ``defaults``' GAE over the action tokens.
"""

from __future__ import annotations

from pathlib import Path

from ..critics import actor_and_critic
from .base import OursRun, TaskSpec

SPEC = TaskSpec(
    episodes=768, hidden_size=32, reward_name="episode reward (0 .. 1)", batch_size=32,
    refused={"trl112": "the multiturn task needs rollout_func, which TRL 1.12's PPOTrainer does not take.",
             "trl_grpo": "the multiturn task is not run by the trl_grpo arm: the example's rollout_func samples its "
                         "turns with this package's trainer.generate_continuations, which TRL's GRPOTrainer does "
                         "not have. Run trl_grpo on the synthetic, verifiable or long task."})


# The critic settings every table of this task was measured with: the example's before it took the critic
# docs/critic.md recommends (a value head on the policy's backbone, lam 0.95, kl_coef 0.02, 4 PPO epochs); kept so
# that `defaults` stays as recorded. An arm sets the example's own.
RECORDED = {"use_value_adapter": False, "lam_length_alpha": None, "kl_coef": 0.02, "num_ppo_epochs": 4}


def settings() -> dict:
    """``examples/ppo_multiturn.py``'s ``PPO_DEFAULTS`` with the critic settings of ``RECORDED``."""
    from ppo_multiturn import PPO_DEFAULTS

    return {**PPO_DEFAULTS, **RECORDED}


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    """The initial policy of ``seed`` to ``tmp / "policy"``, so that every arm starts from the same weights."""
    from multiturn_task import build_task

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    policy = build_tiny_causal_lm(build_task().tokenizer, seed=seed, hidden_size=hidden_size)
    policy.save_pretrained(tmp / "policy")
    return {}


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's run on the saved policy, the example's LoRA, reward and ``rollout_func``."""
    from multiturn_task import build_task, make_reward, make_rollout_func, prompt_dataset
    from peft import LoraConfig
    from ppo_multiturn import TaskArguments
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    task_args = TaskArguments()
    task = build_task(task_args.first_turn_tokens)
    config = make_config()
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    value_model = AutoModelForSequenceClassification.from_pretrained  # TRL's example: a value model
    models = actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "policy", num_labels=1))
    models.update(reward_model=None, reward_funcs=[make_reward(task)], rollout_func=make_rollout_func(task),
                  train_dataset=prompt_dataset(task, repeats=task_args.train_repeats))

    def batch_reward(logs):
        return logs.get("rewards/multiturn_reward/mean"), None

    return OursRun(config, task.tokenizer, models, batch_reward)
