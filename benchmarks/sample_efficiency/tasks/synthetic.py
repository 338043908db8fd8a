"""The ``synthetic`` task: ``examples/ppo_lora.py``'s demo.

The rule of ``examples/synthetic_task.py``, a reward model trained on preference pairs from it
(once per seed, shared by every arm), a tiny random Llama with LoRA (r 8, alpha 16, ``lm_head``
included), the demo's PPO settings (lr 5e-3, kl_coef 0.05, response_length 10, batch 32 = 8 x 4,
2 mini-batches). Its ``reward`` is the *true* reward (share of nice words + 0.5 for stopping in
time, 0 .. 1.5) of the responses the reward model scored in that update's rollout, read by a
forward hook on the reward model's backbone: the same measurement for every trainer. TRL 1.12's
trainer gets a value model initialised from the reward model, as TRL's example script does.

The reward variants (``REWARD_VARIANTS``) train this package's trainer on the true reward as
per-token or final reward functions, or on an RM of another vocabulary; each is measured by the
same true reward of the policy's completions.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..critics import actor_and_critic
from ..scoring import RewardRecorder, response_after_marker
from .base import GRPOInputs, OursRun, TaskSpec

# The reward variants of the synthetic task; every one is measured by the same true reward.
REWARD_VARIANTS = {
    "default": "the task's own reward: the trained reward model (synthetic), the example's functions (verifiable)",
    "process": "the true reward as a per-token reward function: each nice word's share on its token, the stop "
               "bonus on the <eos> (Task.token_rewards)",
    "process_prefix": "the true reward per token, each token's part depending only on the tokens up to it: the "
                      "change of the nice-word share it causes, the stop bonus on the <eos> "
                      "(Task.prefix_token_rewards)",
    "final": "the same true reward as a plain reward function: its sum on the last token",
    "other_vocab": "a reward model trained on another vocabulary (the words in reverse order), read through "
                   "reward_processing_classes (text rebuilt with its chat template)",
}
SPEC = TaskSpec(episodes=1024, hidden_size=32, reward_name="true reward (0 .. 1.5)", batch_size=32,
                rewards=tuple(REWARD_VARIANTS))


def settings() -> dict:
    """``examples/ppo_lora.py``'s ``DEMO_DEFAULTS``."""
    from ppo_lora import DEMO_DEFAULTS

    return dict(DEMO_DEFAULTS)


def demo_prompts_and_lora(task, seed: int, response_length: int, policy):
    """The synthetic and long tasks' PPO prompts (``examples/ppo_lora.py``'s training prompts of
    ``seed``, with room for ``response_length`` within ``policy``'s positions) and the demo's LoRA
    config (r, alpha, targets, ``lm_head`` among them; no dropout), the same for every arm."""
    from peft import LoraConfig
    from ppo_lora import DEMO_DEFAULTS, DEMO_LORA_TARGETS, ScriptArguments, _render_demo_prompts

    prompts = _render_demo_prompts(task, ScriptArguments().num_train_prompts, held_out=False, seed=seed + 3,
                                   response_length=response_length, max_length=policy.config.max_position_embeddings)
    lora = LoraConfig(r=DEMO_DEFAULTS["lora_r"], lora_alpha=DEMO_DEFAULTS["lora_alpha"], lora_dropout=0.0,
                      target_modules=DEMO_LORA_TARGETS, task_type="CAUSAL_LM")
    return prompts, lora


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    """The reward model of ``seed``, trained on preference pairs of the task's rule, to ``tmp / "reward_model"``."""
    from ppo_lora import DEMO_DEFAULTS, ScriptArguments
    from synthetic_task import build_task, make_preference_pairs, train_reward_model

    script, task = ScriptArguments(), build_task(seed)
    length = DEMO_DEFAULTS["response_length"]
    pairs = make_preference_pairs(task, script.rm_pairs, seed=seed + 1, max_answer_tokens=length)
    held_out = make_preference_pairs(task, script.rm_eval_pairs, seed=seed + 2, max_answer_tokens=length)
    model, accuracy = train_reward_model(task, pairs, held_out, str(tmp / "trainer"), epochs=script.rm_epochs,
                                         seed=seed, learning_rate=script.rm_learning_rate, hidden_size=hidden_size)
    model.save_pretrained(tmp / "reward_model")
    return {"rm_pair_accuracy": accuracy}


def other_vocab_tokenizer():
    """The synthetic task's words in reverse order after the same special tokens: every word has
    another id than in the policy's tokenizer, the chat template is the same."""
    from synthetic_task import NASTY_WORDS, NICE_WORDS, PROMPT_WORDS, TOPICS

    from trl_ppo_ext.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(list(NICE_WORDS + NASTY_WORDS + TOPICS + PROMPT_WORDS)[::-1])


def prepare_other_vocab(seed: int, model_dir: Path, hidden_size: int) -> Path:
    """The ``other_vocab`` variant's reward model for ``seed`` (built on first use, atomically, under
    ``model_dir``): trained as ``prepare``'s, but on ids of :func:`other_vocab_tokenizer`, and on the
    sequences the trainer's text path gives it (every answer closed by ``<eos>``: the RM's chat
    template closes the assistant turn, whether or not the policy stopped). Returns its directory."""
    import torch
    from ppo_lora import DEMO_DEFAULTS, ScriptArguments
    from synthetic_task import Task, make_preference_pairs, train_reward_model

    final = model_dir / "reward_model_other_vocab"
    if (final / "config.json").is_file():
        return final
    torch.set_num_threads(1)
    tokenizer = other_vocab_tokenizer()
    script, task = ScriptArguments(), Task(tokenizer=tokenizer, seed=seed)
    eos = tokenizer.eos_token_id

    def closed(rows):
        keys = ("chosen_ids", "rejected_ids")
        return rows.map(lambda r: {k: r[k] if r[k][-1] == eos else r[k] + [eos] for k in keys})

    length = DEMO_DEFAULTS["response_length"]
    pairs = closed(make_preference_pairs(task, script.rm_pairs, seed=seed + 1, max_answer_tokens=length))
    held_out = closed(make_preference_pairs(task, script.rm_eval_pairs, seed=seed + 2, max_answer_tokens=length))
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model, accuracy = train_reward_model(task, pairs, held_out, str(tmp / "trainer"), epochs=script.rm_epochs,
                                         seed=seed, learning_rate=script.rm_learning_rate, hidden_size=hidden_size)
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "info.json").write_text(json.dumps({"seed": seed, "rm_pair_accuracy": accuracy}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def synthetic_reward_function(task, variant: str, seen: list):
    """The synthetic task's true reward as a reward function in GRPO's convention.

    ``variant`` "process": per completion, ``task.token_rewards`` (one value per token: each nice
    word's share on its token, the stop bonus on the ``<eos>``); "process_prefix":
    ``task.prefix_token_rewards`` (each token's change of the share); "final": their sum, a number
    (the trainer puts it on the last token); "measure": the same number, for a zero-weight function
    that only measures. Every completion's ``task.true_reward`` is appended to ``seen``.
    """
    spread = {"process": task.token_rewards, "process_prefix": task.prefix_token_rewards}
    if variant not in (*spread, "final", "measure"):
        raise ValueError(f"synthetic_reward_function: variant={variant!r}; use 'process', 'process_prefix', 'final' "
                         "or 'measure'.")

    def true_reward(completion_ids, **kwargs):
        ids = [[int(t) for t in c] for c in completion_ids]
        seen.extend(task.true_reward(None, c) for c in ids)
        if variant in spread:
            return [spread[variant](c) for c in ids]
        return [sum(task.token_rewards(c)) for c in ids]  # the true reward, as the runs measured it

    return true_reward


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's or TRL 1.12's run: the demo's policy (built from ``seed``), the task's reward model
    (or the reward variant ``arm.reward``), its prompts and LoRA; the true reward read per update."""
    from synthetic_task import build_task
    from transformers import AutoModelForSequenceClassification

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    task = build_task(seed)
    # other_vocab: the reward model, then a zero-weight function that only measures the true reward
    weights = {"reward_weights": [1.0, 0.0]} if arm.reward == "other_vocab" else {}
    config = make_config(**weights)
    policy = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size)
    reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir / "reward_model").eval()
    prompts, lora = demo_prompts_and_lora(task, seed, config.response_length, policy)
    recorder = RewardRecorder(reward_model)
    marker, pad = task.tokenizer.convert_tokens_to_ids("<assistant>"), task.tokenizer.pad_token_id

    def batch_reward(logs):
        rows = recorder.take()
        values = [task.true_reward(None, response_after_marker(r, marker, pad)) for r in rows]
        return (sum(values) / len(values) if values else None), len(values)

    models = dict(reward_model=reward_model, train_dataset=prompts)
    value_model = AutoModelForSequenceClassification.from_pretrained
    models.update(actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "reward_model")))
    if arm.trainer == "trl112":
        models.update(train_dataset=prompts.select_columns(["input_ids"]))  # TRL's collator pads every column
    if arm.reward != "default":  # the reward variants: the true reward read from the policy's own ids
        seen: list[float] = []

        def batch_reward(logs):
            values = seen[:]
            seen.clear()
            return (sum(values) / len(values) if values else None), len(values)

    if arm.reward in ("process", "process_prefix", "final"):
        models.update(reward_model=None, reward_funcs=[synthetic_reward_function(task, arm.reward, seen)])
    elif arm.reward == "other_vocab":
        from transformers import AutoTokenizer

        path = prepare_other_vocab(seed, model_dir, hidden_size)
        models.update(reward_model=AutoModelForSequenceClassification.from_pretrained(path).eval(),
                      reward_processing_classes=[AutoTokenizer.from_pretrained(path)],
                      reward_funcs=[synthetic_reward_function(task, "measure", seen)])
    return OursRun(config, task.tokenizer, models, batch_reward)


def grpo(seed: int, ppo, *, model_dir: Path, hidden_size: int, recorder) -> GRPOInputs:
    """TRL GRPO's run: the policy built exactly as the "ours" arms build it (same seed, same draws), the
    task's trained reward model read as this package reads it, the true reward measured."""
    from synthetic_task import build_task
    from transformers import AutoModelForSequenceClassification

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    from ..scoring import measuring
    from ..trl_grpo import grpo_prompts, reward_model_function

    task = build_task(seed)
    policy = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size)
    prompts, lora = demo_prompts_and_lora(task, seed, ppo.response_length, policy)
    dataset = grpo_prompts(prompts, task.tokenizer)
    reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir / "reward_model").eval()
    truth = lambda kwargs, rewards: [task.true_reward(None, [int(t) for t in c])  # noqa: E731
                                     for c in kwargs["completion_ids"]]
    funcs = [measuring(reward_model_function(reward_model, task.tokenizer), truth, recorder.measure)]
    return GRPOInputs(task.tokenizer, policy, lora, dataset, funcs)
