"""The ``verifiable`` task: ``examples/ppo_verifiable.py``.

``max a b`` over 0..19 after a noisy SFT warm-up (once per seed, shared), rewards
``exact_answer`` + 0.2 ``format_reward`` + 0.2 soft overlong punishment. Its ``reward`` is the
accuracy (mean exact answer) of the update's rollout. This package trains on the example's
reward functions; TRL 1.12's trainer takes only a reward model, so it gets ``RuleRewardModel``,
the same weighted sum computed from token ids (``verifiable_rule``), and a value model that is
the SFT checkpoint with a fresh score head, as TRL's example script does.
"""

from __future__ import annotations

from pathlib import Path

from ..critics import actor_and_critic
from ..scoring import RewardRecorder, _rule_reward_model_class, response_after_marker
from .base import GRPOInputs, OursRun, TaskSpec

SPEC = TaskSpec(episodes=4096, hidden_size=32, reward_name="accuracy", batch_size=64)


def settings() -> dict:
    """``examples/ppo_verifiable.py``'s ``PPO_DEFAULTS``."""
    from ppo_verifiable import PPO_DEFAULTS

    return PPO_DEFAULTS


def _split():
    from ppo_verifiable import TaskArguments
    from verifiable_task import build_task, split_pairs

    args = TaskArguments()
    task = build_task(args.operation, args.num_values)
    split = split_pairs(task, num_sft=args.num_sft_pairs, num_held_out=args.num_held_out_pairs, seed=args.split_seed)
    return args, task, split


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    """The example's SFT warm-up of a random tiny Llama of ``seed``, to ``tmp / "sft"``."""
    from verifiable_task import sft_warm_up

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    args, task, split = _split()
    model = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size)
    model = sft_warm_up(task, model, split.sft, str(tmp / "trainer"), max_steps=args.sft_steps,
                        learning_rate=args.sft_learning_rate, correct_fraction=args.sft_correct_fraction, seed=seed)
    model.save_pretrained(tmp / "sft")
    return {}


def verifiable_rule(task, *, weights: tuple[float, float, float], response_length: int, overlong_cache: int):
    """``rule(token_ids) -> (reward, exact)`` of the verifiable example, from a scored sequence:
    ``weights`` . (exact answer, format, TRL's soft overlong punishment)."""
    tok = task.tokenizer
    marker, pad, eos = tok.convert_tokens_to_ids("<assistant>"), tok.pad_token_id, tok.eos_token_id
    user = tok.convert_tokens_to_ids("<user>")

    def rule(ids: list[int]) -> tuple[float, float]:
        prompt = ids[ids.index(user) + 1 :]  # the first <user>: the prompt's (a response may repeat it)
        operation, a, b = tok.convert_ids_to_tokens(prompt[:3])
        response = response_after_marker(ids, marker, pad)
        text = tok.decode(response, skip_special_tokens=True).strip()
        exact = float(text == str(task.answer(int(a), int(b))))
        form = float(len(response) == 2 and response[0] in task.number_ids and response[1] == eos)
        n, limit = len(response), response_length - overlong_cache
        overlong = 0.0 if n <= limit else (limit - n) / overlong_cache if n <= response_length else -1.0
        return weights[0] * exact + weights[1] * form + weights[2] * overlong, exact

    return rule


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's run on the example's reward functions, or TRL 1.12's on their rule as a reward model."""
    from peft import LoraConfig
    from ppo_verifiable import PPO_DEFAULTS, ppo_prompts, reward_functions
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    task_args, task, split = _split()
    weights = tuple(PPO_DEFAULTS["reward_weights"])
    config = make_config()
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
    prompts = ppo_prompts(task, split.ppo[: task_args.max_ppo_pairs])
    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    rule = verifiable_rule(task, weights=weights, response_length=config.response_length,
                           overlong_cache=task_args.soft_overlong_cache)
    value_model = AutoModelForSequenceClassification.from_pretrained  # TRL's example: a value model
    models = actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "sft", num_labels=1))
    if arm.trainer == "trl112":
        rule_model = _rule_reward_model_class()(lambda ids: rule(ids)[0])
        recorder = RewardRecorder(rule_model)
        models.update(reward_model=rule_model, train_dataset=prompts.select_columns(["input_ids"]))

        def batch_reward(logs):
            rows = recorder.take()
            values = [rule(r)[1] for r in rows]
            return (sum(values) / len(values) if values else None), len(values)
    else:
        models.update(reward_model=None, reward_funcs=reward_functions(task, config, task_args),
                      train_dataset=prompts)

        def batch_reward(logs):
            return logs.get("rewards/exact_answer/mean"), None

    return OursRun(config, task.tokenizer, models, batch_reward)


def grpo(seed: int, ppo, *, model_dir: Path, hidden_size: int, recorder) -> GRPOInputs:
    """TRL GRPO's run: the SFT policy, the example's prompts (with their ``answer``), LoRA and reward
    functions with their weights; ``exact_answer`` first, its values the accuracy."""
    from peft import LoraConfig
    from ppo_verifiable import ppo_prompts, reward_functions
    from transformers import AutoModelForCausalLM

    from ..scoring import measuring
    from ..trl_grpo import grpo_prompts

    task_args, task, split = _split()
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
    dataset = grpo_prompts(ppo_prompts(task, split.ppo[: task_args.max_ppo_pairs]), task.tokenizer, keep=("answer",))
    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    funcs = reward_functions(task, ppo, task_args)  # exact_answer first: its values are the accuracy
    funcs[0] = measuring(funcs[0], lambda kwargs, rewards: rewards, recorder.measure)
    return GRPOInputs(task.tokenizer, policy, lora, dataset, funcs)
