"""The ``long`` task: credit that has to travel back ~30 tokens.

The synthetic task's words, prompts and tiny random Llama (saved once per seed so every trainer
starts from the same weights), responses of up to 32 tokens and one reward at the end, the rule
of ``long_task_reward``: the share of 24 nice words reached, + 0.5 for an ``<eos>`` after 24 or
more words: the setting the critic recipe was made for. The demo's PPO settings with kl_coef 0.01
(``LONG_SETTINGS``); 2048 episodes. Every trainer gets the rule (TRL 1.12's as a
``RuleRewardModel``; its value model the initial policy with a fresh head, as TRL's example).
"""

from __future__ import annotations

from pathlib import Path

from ..critics import actor_and_critic
from ..scoring import _rule_reward_model_class, response_after_marker
from .base import GRPOInputs, OursRun, TaskSpec
from .synthetic import demo_prompts_and_lora

SPEC = TaskSpec(episodes=2048, hidden_size=32, reward_name="true reward (0 .. 1.5)", batch_size=32)
# The long task: the synthetic task's words and prompts, responses of up to LONG_RESPONSE_LENGTH
# tokens, one reward at the end that only a long answer earns (see long_task_reward). Its PPO
# settings are the synthetic demo's but LONG_SETTINGS: with the demo's kl_coef 0.05 the penalty
# summed over 32 tokens held every trainer near 0.4 for 4096 episodes (2 seeds; 0.01: 0.83).
LONG_RESPONSE_LENGTH = 32
LONG_TARGET_WORDS = 24
LONG_SETTINGS = {"response_length": LONG_RESPONSE_LENGTH, "kl_coef": 0.01}


def long_task_reward(task, response, target_words: int = LONG_TARGET_WORDS) -> float:
    """The long task's rule: ``min(nice words, target_words) / target_words``, plus the synthetic
    task's ``stop_bonus`` for an ``<eos>`` after at least ``target_words`` words. 0 .. 1 + bonus.

    A response earns its reward only at its end, and the best ones are ``target_words`` or more
    nice words then ``<eos>``: every token's credit has to travel back up to ~30 positions (lambda
    0.95 keeps 0.95^24 = 0.29 of it), the setting the critic recipe was made for (VC-PPO, VAPO).

    >>> from synthetic_task import build_task
    >>> task = build_task(0)
    >>> long_task_reward(task, "kind " * 12, target_words=24)
    0.5
    >>> long_task_reward(task, "kind " * 3 + "rude <eos>", target_words=3)
    1.5
    """
    words, stopped = task.answer_words(response)
    nice = set(task.nice_words)
    count = sum(w in nice for w in words)
    bonus = task.stop_bonus if stopped and len(words) >= target_words else 0.0
    return min(count, target_words) / target_words + bonus


def settings() -> dict:
    """The synthetic demo's ``DEMO_DEFAULTS`` with ``LONG_SETTINGS``."""
    from ppo_lora import DEMO_DEFAULTS

    return {**DEMO_DEFAULTS, **LONG_SETTINGS}


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    """The initial policy of ``seed`` to ``tmp / "policy"``, so that every arm starts from the same weights."""
    from synthetic_task import build_task

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    tokenizer = build_task(seed).tokenizer
    policy = build_tiny_causal_lm(tokenizer, seed=seed, hidden_size=hidden_size)
    policy.save_pretrained(tmp / "policy")
    return {}


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's or TRL 1.12's run on the saved policy, the demo's prompts and LoRA, and the rule."""
    from synthetic_task import build_task
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    task = build_task(seed)
    config = make_config()
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
    prompts, lora = demo_prompts_and_lora(task, seed, config.response_length, policy)
    marker, pad = task.tokenizer.convert_tokens_to_ids("<assistant>"), task.tokenizer.pad_token_id
    seen: list[float] = []
    value_model = AutoModelForSequenceClassification.from_pretrained  # TRL's example: a value model
    models = actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "policy", num_labels=1))
    if arm.trainer == "trl112":
        def rule(ids):
            value = long_task_reward(task, response_after_marker(ids, marker, pad))
            seen.append(value)
            return value

        models.update(reward_model=_rule_reward_model_class()(rule),
                      train_dataset=prompts.select_columns(["input_ids"]))
    else:
        def long_reward(completion_ids, **kwargs):
            values = [long_task_reward(task, [int(t) for t in c]) for c in completion_ids]
            seen.extend(values)
            return values

        models.update(reward_model=None, reward_funcs=[long_reward], train_dataset=prompts)

    def batch_reward(logs):
        values = seen[:]
        seen.clear()
        return (sum(values) / len(values) if values else None), len(values)

    return OursRun(config, task.tokenizer, models, batch_reward)


def grpo(seed: int, ppo, *, model_dir: Path, hidden_size: int, recorder) -> GRPOInputs:
    """TRL GRPO's run: the saved policy, the demo's prompts and LoRA, ``long_task_reward`` on the completion ids."""
    from synthetic_task import build_task
    from transformers import AutoModelForCausalLM

    from ..scoring import measuring
    from ..trl_grpo import grpo_prompts

    task = build_task(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
    prompts, lora = demo_prompts_and_lora(task, seed, ppo.response_length, policy)
    dataset = grpo_prompts(prompts, task.tokenizer)

    def long_reward(completion_ids, **kwargs):
        return [long_task_reward(task, [int(t) for t in c]) for c in completion_ids]

    funcs = [measuring(long_reward, lambda kwargs, rewards: rewards, recorder.measure)]
    return GRPOInputs(task.tokenizer, policy, lora, dataset, funcs)
