"""PPO with a tool: a tiny model learns to call a calculator on the CPU.

    accelerate launch examples/ppo_tools.py                # the whole run: CPU, no hub, about 35 s
    accelerate launch examples/ppo_tools.py --environment  # the same task through environment_factory=
    python examples/ppo_tools.py --help                     # every flag (the task's, LoRA's, PPOConfig's)

Nothing is downloaded. The run:

1. the task of ``examples/tool_task.py``: ``"23*47"`` -> ``"1081"``, factors 32..99, the
   byte-level chat tokenizer of ``trl_ppo_ext.tiny`` with TRL's Qwen3 template (the template's
   fixed text as whole tokens, see ``tool_task.build_task``) and one tool, ``multiply(a, b)``;
2. an SFT warm-up of a random 2-layer Llama with TRL's ``SFTTrainer`` on demonstrations of which
   half call the tool (tool call, the tool's reply, the product copied from it); the others
   answer at once with a wrong guess. The learning rate warms up over the first 10% of the steps
   and decays on a cosine: held constant at its peak, the copying failed to form on some seeds
   (seed 2 at 5e-3: no call with the prompt's factors). The model learns both formats and to
   copy the factors into the call and the tool's reply into the answer, and calls the tool about
   half of the time;
3. PPO (``trl_ppo_ext.PPOTrainer(..., tools=[multiply])``, TRL GRPO's argument) with one reward
   function in GRPO's calling convention for tools, ``correct_answer`` (it reads ``completions``,
   one message list per episode). The trainer runs the tool loop: it parses each turn with
   TRL's parser, calls the tool, appends its reply as environment tokens (no loss, no GAE step)
   and lets the policy answer. The policy is a LoRA adapter on the SFT model, the critic an
   adapter of its own on the same base with its own value head (``use_value_adapter``), lambda
   sized to each episode's length (``lam_length_alpha`` 2), no reference (``kl_coef`` 0, as
   GRPO's ``beta`` 0) and two PPO epochs per batch: the configuration docs/critic.md gives for
   tools and turns. With
   ``--environment`` the tool is the method of a ``tool_task.Calculator`` drawn per episode
   (``environment_factory=Calculator``, reset with the episode's row) and the reward
   ``calculator_answer`` reads the instances (``environments=``); prompts and warm-up are the same;
4. before and after PPO, on held-out factor pairs sampled at the training temperature: the
   accuracy (the mean of the reward), the share of episodes that call the tool, and the
   accuracy of the episodes that do; printed with sample episodes and written to
   ``<output_dir>/summary.json``. Per-update metrics, ``tools/call_frequency`` and
   ``rewards/correct_answer/mean`` (``rewards/calculator_answer/mean`` with ``--environment``)
   among them, are in ``log_history.json``.

Why a calculator: the tiny policy cannot multiply two 2-digit numbers (a direct answer is right
about never), so the reward comes through the tool, and what PPO has to learn is to call it,
every time. Why a warm-up that calls half of the time: the rise of ``tools/call_frequency`` is
then the reward's doing, not the warm-up's.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the wall time reported in summary.json starts here

import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _startup, ppo_lora, tool_task
import _startup  # noqa: E402  (env defaults; the package from a source checkout)
import torch  # noqa: E402
from ppo_lora import DEMO_LORA_TARGETS, BarOnly, set_cpu_threads  # noqa: E402
from tool_task import (  # noqa: E402
    CHAT_TEMPLATE_KWARGS,
    Calculator,
    build_task,
    calculator_answer,
    called_tool,
    correct_answer,
    demonstrations,
    multiply,
    prompt_rows,
    sft_warm_up,
    split_pairs,
)
from transformers import HfArgumentParser, ProgressCallback, set_seed  # noqa: E402

from trl_ppo_ext import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo_ext.data import render_prompts  # noqa: E402
from trl_ppo_ext.run.manifest import package_versions, to_jsonable  # noqa: E402


@dataclass
class TaskArguments:
    """The task, the SFT warm-up, the tiny model and the before/after evaluation."""

    num_sft_pairs: int = field(default=300, metadata={"help": "Factor pairs the SFT warm-up demonstrates."})
    num_ppo_pairs: int = field(default=512, metadata={"help": "Factor pairs PPO prompts with."})
    num_held_out_pairs: int = field(default=128, metadata={"help": "Pairs held out from both: the before/after."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the shuffle that splits the pairs."})
    sft_steps: int = field(default=500, metadata={"help": "SFT warm-up optimizer steps (batch 16)."})
    sft_learning_rate: float = field(default=3e-3, metadata={"help": "SFT warm-up peak learning rate (full model)."})
    sft_lr_scheduler_type: str = field(
        default="cosine", metadata={"help": "SFT warm-up learning-rate schedule after the warm-up steps (transformers' "
                                    "names: cosine, linear, constant, ...)."},
    )
    sft_warmup_ratio: float = field(
        default=0.1, metadata={"help": "Share of the SFT steps over which the learning rate rises linearly from 0."},
    )
    sft_call_fraction: float = field(
        default=0.5, metadata={"help": "Share of the demonstrations that call the tool; the others guess."}
    )
    hidden_size: int = field(default=64, metadata={"help": "Hidden size of the tiny 2-layer Llama."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of the before/after evaluation."})
    num_samples_shown: int = field(default=4, metadata={"help": "Episodes printed before and after PPO."})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads; default: 1 on a machine with at most 2 cores, else 4 "
                                "at most."},
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha; the update is scaled by alpha/r."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEMO_LORA_TARGETS),
        metadata={"help": "Modules LoRA adapts (lm_head among them, as in examples/ppo_lora.py)."},
    )
    environment: bool = field(
        default=False, metadata={"help": "Train with environment_factory=tool_task.Calculator (TRL GRPO's "
                                 "environments: the tool a method of a per-episode instance, reset with the row) and "
                                 "the reward calculator_answer, which reads the instances, instead of tools=[multiply] "
                                 "and correct_answer. The same task, prompts and warm-up."},
    )


# The run's PPO settings; any of them can be overridden on the command line.
PPO_DEFAULTS = dict(
    output_dir="outputs/ppo_tools",
    total_episodes=768,  # 24 updates of 32 episodes
    per_device_train_batch_size=16,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    learning_rate=3e-3,
    # the critic docs/critic.md recommends for tools and turns: an adapter of its own, lambda sized to the
    # episode, no reference, two PPO epochs (docs/examples.md gives this example's figures with it and before it)
    use_value_adapter=True,
    lam_length_alpha=2.0,
    kl_coef=0.0,
    num_ppo_epochs=2,
    temperature=1.0,
    response_length=48,  # the whole episode: call (~10 ids), the tool's reply (~19), the answer (~5)
    max_tool_calling_iterations=1,  # one round of tools, then the answer
    chat_template_kwargs=CHAT_TEMPLATE_KWARGS,
    stop_token="eos",
    local_rollout_forward_batch_size=32,
    per_device_eval_batch_size=64,
    num_sample_generations=0,
    save_strategy="no",
    logging_steps=2,
    report_to="none",
    seed=0,
    bf16=False,
)


def parse_args(argv: list[str] | None = None) -> tuple[TaskArguments, PPOConfig]:
    """Parse the command line, with ``PPO_DEFAULTS`` as the PPOConfig defaults; check the task's flags."""
    parser = HfArgumentParser((TaskArguments, PPOConfig))
    parser.set_defaults(**PPO_DEFAULTS)
    task_args, config = parser.parse_args_into_dataclasses(args=argv)
    for flag in ("sft_call_fraction", "sft_warmup_ratio"):
        if not 0.0 <= getattr(task_args, flag) <= 1.0:
            raise ValueError(f"--{flag}={getattr(task_args, flag)}: pass a share between 0 and 1.")
    for flag in ("num_sft_pairs", "num_ppo_pairs", "num_held_out_pairs"):
        if getattr(task_args, flag) < 1:
            raise ValueError(f"--{flag}={getattr(task_args, flag)}: pass at least 1.")
    return task_args, config


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts, *, seed: int, num_samples: int = 0) -> dict:
    """One episode per prompt at the training temperature, through the trainer's own rollout (the
    tool loop) and reward scoring; the training RNG is left untouched.

    Returns ``accuracy`` (the mean of the reward), ``call_rate`` (the share of episodes
    with a tool reply), ``accuracy_when_called`` (NaN when none called) and ``"samples"``: the
    first ``num_samples`` episodes as ``{"prompt", "episode", "answer", "reward"}``.
    """
    rows = [prompts[i] for i in range(len(prompts))]
    batch_size, correct, called, samples = trainer.args.per_device_eval_batch_size, [], [], []
    cuda = trainer.accelerator.device.type == "cuda"
    with torch.random.fork_rng(devices=None if cuda else []):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            rollout = trainer.generate_rollout(trainer.data_collator(rows[start : start + batch_size]))
            _, values, _ = trainer.score_rewards(rollout)  # (b, 1): the run's one reward
            completions = rollout.extras["completions"]
            correct += values[:, 0].tolist()
            called += called_tool(completions)
            tok = trainer.processing_class
            for i in range(min(num_samples - len(samples), rollout.batch_size)):
                samples.append({"prompt": rollout.extras["prompt"][i][-1]["content"],
                                "episode": tok.decode(rollout.responses[i][rollout.response_mask[i]].tolist()),
                                "answer": rollout.extras["answer"][i], "reward": correct[start + i]})
    hits = [r for r, c in zip(correct, called) if c]
    return {"accuracy": sum(correct) / len(correct), "call_rate": sum(called) / len(called),
            "accuracy_when_called": sum(hits) / len(hits) if hits else float("nan"), "samples": samples}


def print_samples(title: str, evaluation: dict) -> None:
    print(f"\n{title}")
    for s in evaluation["samples"]:
        print(f"  {s['prompt']!r} -> {s['episode']!r}  (answer {s['answer']}: reward {s['reward']:g})")


# --------------------------------------------------------------------------------- summary
PPO_SETTINGS = ("learning_rate", "total_episodes", "batch_size", "num_total_batches", "per_device_train_batch_size",
                "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs", "response_length", "temperature",
                "kl_coef", "kl_estimator", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam",
                "lam_length_alpha", "use_value_adapter", "whiten_rewards", "whiten_advantages", "missing_eos_penalty",
                "stop_token", "max_tool_calling_iterations", "chat_template_kwargs", "tool_timeout", "use_vllm", "seed")
FIGURES = ("accuracy", "call_rate", "accuracy_when_called")


def build_summary(before: dict, after: dict, *, trainer: PPOTrainer, task, split, task_args: TaskArguments,
                  threads: int, times: dict) -> dict:
    """summary.json: the before/after figures first, then every setting used."""
    summary = {"task": task.describe()}
    for key in FIGURES:
        summary[f"{key}_before"], summary[f"{key}_after"] = before[key], after[key]
    updates = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    summary["call_frequency_first_update"] = updates[0]["tools/call_frequency"] if updates else None
    summary["call_frequency_last_update"] = updates[-1]["tools/call_frequency"] if updates else None
    summary.update(times)
    summary["samples_before"], summary["samples_after"] = before["samples"], after["samples"]
    config = trainer.args
    summary["settings"] = {
        "task": {"split_seed": task_args.split_seed, "prompt_length": len(task.prompt_ids(10, 10)),
                 "pairs": {"sft": len(split.sft), "ppo": len(split.ppo), "held_out": len(split.held_out)}},
        "policy": {"model": "random tiny Llama (trl_ppo_ext.tiny), then SFT", "hidden_size": task_args.hidden_size,
                   "num_layers": trainer.unwrapped.policy.config.num_hidden_layers,
                   "vocab_size": len(task.tokenizer)},
        "sft": {"trainer": "trl.SFTTrainer", "steps": task_args.sft_steps, "learning_rate": task_args.sft_learning_rate,
                "lr_scheduler_type": task_args.sft_lr_scheduler_type, "warmup_ratio": task_args.sft_warmup_ratio,
                "call_fraction": task_args.sft_call_fraction},
        "tools": [multiply.__name__],
        "environment_factory": Calculator.__name__ if task_args.environment else None,
        "rewards": [{"name": r.name, "weight": r.weight} for r in trainer.rewards],
        "lora": {"r": task_args.lora_r, "lora_alpha": task_args.lora_alpha,
                 "target_modules": sorted(task_args.lora_target_modules),
                 "reference": "the SFT model (the policy with its LoRA adapter disabled)"},
        "ppo": {name: getattr(config, name, None) for name in PPO_SETTINGS},
        "evaluation": {"held_out_pairs": len(split.held_out), "seed": task_args.eval_seed,
                       "temperature": config.temperature},
        "output_dir": config.output_dir, "torch_num_threads": threads, "device": str(trainer.accelerator.device),
        "versions": package_versions(),
    }
    return to_jsonable(summary)


def print_summary(summary: dict, path: str) -> None:
    print("\n" + "=" * 72)
    print(f"Task: {summary['task']}")
    for key, title in (("accuracy", "held-out accuracy, sampled"), ("call_rate", "held-out tool-call rate"),
                       ("accuracy_when_called", "accuracy of episodes that call")):
        before, after = (f"{v:6.3f}" if isinstance(v, float) else f"{v!s:>6}" for v in
                         (summary[key + "_before"], summary[key + "_after"]))  # "nan" when no episode called
        print(f"{title:<34} before {before}   after {after}")
    print(f"tools/call_frequency: first update {summary['call_frequency_first_update']:.3f}, last "
          f"{summary['call_frequency_last_update']:.3f}")
    print(f"wall time: {summary['wall_time_s']:.1f} s (SFT {summary['sft_time_s']:.1f} s, PPO "
          f"{summary['ppo_train_time_s']:.1f} s)")
    print(f"summary written to {path}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None, *, start_time: float | None = None) -> dict:
    """SFT warm-up, PPO with a tool, before/after evaluation; returns the summary."""
    from peft import LoraConfig

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    start = time.perf_counter() if start_time is None else start_time
    task_args, config = parse_args(argv)
    threads = set_cpu_threads(task_args.num_threads)
    _startup.vllm_cpu_defaults(config.use_vllm)
    task_args.hidden_size = _startup.vllm_demo_hidden_size(task_args.hidden_size, config.use_vllm)
    set_seed(config.seed)
    task = build_task()
    split = split_pairs(num_sft=task_args.num_sft_pairs, num_ppo=task_args.num_ppo_pairs,
                        num_held_out=task_args.num_held_out_pairs, seed=task_args.split_seed)
    prompt_length = len(task.prompt_ids(10, 10))
    print(f"Task: {task.describe()}\nPairs: {len(split.sft)} SFT, {len(split.ppo)} PPO, {len(split.held_out)} held "
          f"out; every prompt is {prompt_length} ids")

    sft_start = time.perf_counter()
    # room for the prompt and the whole episode, as the tool loop checks (max_model_len)
    model = build_tiny_causal_lm(task.tokenizer, seed=config.seed, hidden_size=task_args.hidden_size,
                                 max_position_embeddings=prompt_length + config.response_length)
    rows = demonstrations(task, split.sft, call_fraction=task_args.sft_call_fraction, seed=config.seed)
    model = sft_warm_up(task, model, rows, os.path.join(config.output_dir, "sft"), max_steps=task_args.sft_steps,
                        learning_rate=task_args.sft_learning_rate, lr_scheduler_type=task_args.sft_lr_scheduler_type,
                        warmup_ratio=task_args.sft_warmup_ratio, seed=config.seed)
    sft_time = time.perf_counter() - sft_start
    print(f"SFT warm-up: {task_args.sft_steps} steps on {len(split.sft)} demonstrations ({sft_time:.1f} s)")

    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    held_out, _ = render_prompts(prompt_rows(task, split.held_out), task.tokenizer)  # the collator pads input_ids
    # the same tool either way: a function, or the method of an environment drawn per episode and reset with its row
    tooling, reward = (({"environment_factory": Calculator}, calculator_answer) if task_args.environment
                       else ({"tools": [multiply]}, correct_answer))
    # the trainer builds the actor-critic from the LoRA config: the critic's own adapter (use_value_adapter), or
    # with --use_value_adapter false a value head on the policy's backbone
    trainer = PPOTrainer(args=config, processing_class=task.tokenizer, model=model, peft_config=lora,
                         ref_model=None, reward_model=None, reward_funcs=[reward],
                         train_dataset=prompt_rows(task, split.ppo), value_model=None, **tooling)
    if not config.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnly())
    before = evaluate(trainer, held_out, seed=task_args.eval_seed, num_samples=task_args.num_samples_shown)
    print_samples("Before PPO (after SFT): held-out prompts", before)

    how = "environment_factory=Calculator" if task_args.environment else "tools=[multiply]"
    print(f"\nPPO: {config.total_episodes} episodes, {config.num_total_batches} updates, {how}, reward "
          f"{reward.__name__}")
    ppo_start = time.perf_counter()
    trainer.train()
    ppo_time = time.perf_counter() - ppo_start
    after = evaluate(trainer, held_out, seed=task_args.eval_seed, num_samples=task_args.num_samples_shown)
    print_samples("After PPO: the same prompts", after)

    trainer.save_model(config.output_dir)
    times = {"sft_time_s": sft_time, "ppo_train_time_s": ppo_time, "wall_time_s": time.perf_counter() - start}
    summary = build_summary(before, after, trainer=trainer, task=task, split=split, task_args=task_args,
                            threads=threads, times=times)
    path = _startup.write_run_files(trainer, config.output_dir, summary)
    if path is not None:
        print_summary(summary, path)
    return summary


if __name__ == "__main__":
    main(start_time=_T0)
