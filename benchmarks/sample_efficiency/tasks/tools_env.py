"""The ``tools_env`` task: ``examples/ppo_tools.py``'s calculator as an environment with turns.

``examples/tool_task.py``: ``"23*47"`` -> ``"1081"``; the tiny policy cannot multiply, the
``multiply`` tool can. ``environment_factory=Calculator`` (TRL 1.16's contract: ``reset(**row)``,
its public method ``multiply`` the tool, with the example's schema, so the prompts are the
example's ids) for both trainers, and the same reward, the example's ``correct_answer`` (a
message list per episode). The initial policy is the example's SFT warm-up, built once per seed
(``build_tools_env_sft``: ``ppo_tools.TaskArguments``' defaults as they are when the benchmark
runs, the hidden size among them); ``defaults`` trains it with ``ppo_tools.PPO_DEFAULTS`` and ``RECORDED`` (768
episodes = 24 updates of 32, response_length 48 = the whole episode, one round of tools,
``enable_thinking`` off, lr 3e-3, kl_coef 0.01, LoRA r 8 / alpha 16 with the critic the value head
on the policy's backbone, GAE over the policy's own tokens). Its ``reward`` is the accuracy (mean
``correct_answer``) of the update's rollout; its rows also keep ``call_rate``, the share of the
rollout's episodes in which the calculator returned a product (counted by the environments,
``tool_calls_measured``), and the table a column of it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..common import _examples_on_path
from ..critics import actor_and_critic
from ..scoring import measuring
from .base import GRPOInputs, OursRun, TaskSpec

# examples/ppo_tools.py's total_episodes (768) and TaskArguments().hidden_size (64), read at run time
SPEC = TaskSpec(episodes=None, hidden_size=None, reward_name="accuracy", batch_size=32,
                refused={"trl112": "the tools_env task needs environment_factory, which TRL 1.12's PPOTrainer does "
                                   "not take."})


# The critic settings every table of this task was measured with: the example's before it took the critic
# docs/critic.md recommends (a value head on the policy's backbone, kl_coef 0.01, 4 PPO epochs, which the trl_grpo
# arm mirrors as num_iterations). The task keeps them, so that `defaults` and the GRPO arm stay as recorded; an arm
# sets the example's own (e.g. use_value_adapter=true,lam_length_alpha=2.0,kl_coef=0.0,num_ppo_epochs=2).
RECORDED = {"use_value_adapter": False, "lam_length_alpha": None, "kl_coef": 0.01, "num_ppo_epochs": 4}


def settings() -> dict:
    """``examples/ppo_tools.py``'s ``PPO_DEFAULTS`` with the critic settings of ``RECORDED``."""
    from ppo_tools import PPO_DEFAULTS

    return {**PPO_DEFAULTS, **RECORDED}


def sizes() -> tuple[int, int]:
    """``(episodes, hidden_size)`` of the example as they are now: ``PPO_DEFAULTS["total_episodes"]`` and
    ``TaskArguments().hidden_size``, so a change of the example's defaults flows in."""
    _examples_on_path()
    from ppo_tools import PPO_DEFAULTS, TaskArguments

    return PPO_DEFAULTS["total_episodes"], TaskArguments().hidden_size


def prepare(seed: int, tmp: Path, hidden_size: int) -> dict:
    """The example's SFT warm-up of ``seed`` to ``tmp / "sft"`` (:func:`build_tools_env_sft`)."""
    return build_tools_env_sft(seed, tmp / "sft", hidden_size, trainer_dir=tmp / "trainer")


def calculator_class():
    """The tools_env task's environment: ``examples/tool_task.py``'s ``Calculator`` (TRL 1.16 GRPO's
    ``environment_factory`` contract: ``reset(**row)``, its one public method ``multiply`` the tool,
    with the schema of the example's ``multiply``, so both trainers render the example's prompt
    ids; ``calls`` lists the calls that returned a product)."""
    _examples_on_path()
    from tool_task import Calculator

    return Calculator


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """The tools_env task's reward, the same for both arms: ``examples/tool_task.py``'s
    ``correct_answer`` (1.0 when the episode's last message is an answer, without a tool call,
    whose stripped text is the product), in TRL GRPO's convention for tools (``completions``: one
    message list per episode)."""
    from tool_task import correct_answer as example_reward

    return example_reward(completions, answer)


def tool_calls_measured(kwargs: dict, rewards: list[float]) -> tuple[list[float], dict[str, list[float]]]:
    """What the tools_env runs record of each scored episode (for :func:`measuring`): the reward
    (the exact answer) and, from the ``environments`` the trainer passes (one per completion),
    ``call_rate``: 1.0 where the calculator returned a product, else 0.0.

    >>> Calculator = calculator_class()
    >>> env, idle = Calculator(), Calculator()
    >>> env.reset(prompt=[{"role": "user", "content": "2*3"}]); _ = env.multiply(2, 3)
    >>> idle.reset(prompt=[{"role": "user", "content": "2*3"}])
    >>> tool_calls_measured({"environments": [env, idle]}, [1.0, 0.0])
    ([1.0, 0.0], {'call_rate': [1.0, 0.0]})
    """
    return list(rewards), {"call_rate": [float(len(env.calls) > 0) for env in kwargs["environments"]]}


def build_tools_env_sft(seed: int, out: Path, hidden_size: int, *, trainer_dir: Path,
                        sft_steps: int | None = None) -> dict:
    """The tools_env task's initial policy for ``seed``, saved to ``out``: ``examples/ppo_tools.py``'s
    SFT warm-up (a random tiny Llama of ``hidden_size``, room for the prompt and the whole episode,
    ``tool_task.sft_warm_up`` on its demonstrations) with that script's ``TaskArguments`` defaults
    as they are now (pairs, split seed, call fraction, steps, learning rate), ``seed`` where the
    script takes its ``--seed``. ``sft_steps`` overrides the steps (the tests' short runs; 0: the
    random model, no warm-up). Returns what ``info.json`` keeps of it."""
    from ppo_tools import TaskArguments
    from tool_task import build_task, demonstrations, sft_warm_up, split_pairs

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    args = TaskArguments()
    task = build_task()
    split = split_pairs(num_sft=args.num_sft_pairs, num_ppo=args.num_ppo_pairs, num_held_out=args.num_held_out_pairs,
                        seed=args.split_seed)
    length = len(task.prompt_ids(*split.sft[0])) + settings()["response_length"]
    model = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size, max_position_embeddings=length)
    steps = args.sft_steps if sft_steps is None else sft_steps
    rows = demonstrations(task, split.sft, call_fraction=args.sft_call_fraction, seed=seed)
    if steps:  # (a Trainer given max_steps=0 would train for its epochs instead)
        model = sft_warm_up(task, model, rows, str(trainer_dir), max_steps=steps,
                            learning_rate=args.sft_learning_rate, lr_scheduler_type=args.sft_lr_scheduler_type,
                            warmup_ratio=args.sft_warmup_ratio, seed=seed)
    model.save_pretrained(out)
    return {"sft_steps": steps, "sft_learning_rate": args.sft_learning_rate,
            "sft_lr_scheduler_type": args.sft_lr_scheduler_type, "sft_warmup_ratio": args.sft_warmup_ratio,
            "sft_call_fraction": args.sft_call_fraction, "num_sft_pairs": len(split.sft)}


def tools_env_inputs(model_dir: Path):
    """``(task, policy, lora, train_dataset)`` of a tools_env run: the example's task, the SFT policy of
    ``model_dir``, its LoRA (``TaskArguments``' rank, alpha, targets) and its PPO prompt rows
    (``prompt`` conversations and ``answer``, as a GRPO user brings them)."""
    from peft import LoraConfig
    from ppo_tools import TaskArguments
    from tool_task import build_task, prompt_rows, split_pairs
    from transformers import AutoModelForCausalLM

    args = TaskArguments()
    task = build_task()
    split = split_pairs(num_sft=args.num_sft_pairs, num_ppo=args.num_ppo_pairs, num_held_out=args.num_held_out_pairs,
                        seed=args.split_seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=args.lora_target_modules, task_type="CAUSAL_LM")
    return task, policy, lora, prompt_rows(task, split.ppo)


def ours(arm, seed: int, *, make_config, model_dir: Path, hidden_size: int) -> OursRun:
    """This package's run: the SFT policy, the example's LoRA and prompt rows, ``environment_factory=Calculator``,
    ``correct_answer`` measured with the call rate."""
    from transformers import AutoModelForSequenceClassification

    task, policy, lora, dataset = tools_env_inputs(model_dir)
    config = make_config()
    value_model = AutoModelForSequenceClassification.from_pretrained  # TRL's example: a value model
    models = actor_and_critic(arm, policy, lora, config, lambda: value_model(model_dir / "sft", num_labels=1))
    seen: list[tuple[list[float], dict]] = []  # per reward call: the rewards and the call rates
    models.update(reward_model=None, reward_funcs=[measuring(correct_answer, tool_calls_measured, seen.append)],
                  environment_factory=calculator_class(), train_dataset=dataset)
    extras: dict = {}

    def batch_reward(logs):
        values = [v for rewards, _ in seen for v in rewards]
        calls = [c for _, more in seen for c in more["call_rate"]]
        seen.clear()
        extras["call_rate"] = statistics.fmean(calls) if calls else None
        return (statistics.fmean(values) if values else None), len(values)

    return OursRun(config, task.tokenizer, models, batch_reward, extras)


def grpo(seed: int, ppo, *, model_dir: Path, hidden_size: int, recorder) -> GRPOInputs:
    """TRL GRPO's run: the same environment, reward, policy, LoRA and prompt rows as ours."""
    task, policy, lora, dataset = tools_env_inputs(model_dir)
    funcs = [measuring(correct_answer, tool_calls_measured, lambda m: recorder.measure(*m))]
    return GRPOInputs(task.tokenizer, policy, lora, dataset, funcs, {"environment_factory": calculator_class()})
