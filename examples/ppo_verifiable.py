"""PPO with verifiable rewards: a tiny model learns an exact-answer task on the CPU.

    accelerate launch examples/ppo_verifiable.py      # the whole run: CPU, no hub, 1-2 minutes
    python examples/ppo_verifiable.py --help           # every flag (the task's, LoRA's, PPOConfig's)

Nothing is downloaded. The run:

1. the task of ``examples/verifiable_task.py``: ``<user> max 3 17 <eos> <assistant>`` -> ``17 <eos>``,
   numbers 0..19, a word-level tokenizer with the tiny chat template;
2. the 400 operand pairs cut three ways: 150 for the SFT warm-up, 150 for PPO, 100 held out
   from both (``split_pairs``);
3. SFT warm-up: a random 2-layer Llama fine-tuned with TRL's ``SFTTrainer`` (conversational
   prompt-completion rows, loss on the completion only) on *noisy* data: 40% of its answers are
   the max, 60% the other operand, as from an annotator who mixed up max and min. The model
   learns the format and to answer with one of the two operands, and on held-out pairs picks
   the right one about a fifth to a third of the time;
4. PPO (``trl_ppo_ext.PPOTrainer``) on the PPO pairs with no reward model, only reward
   functions in TRL GRPO's calling convention: ``exact_answer`` (1 if the completion is the
   dataset's ``answer`` column, else 0), ``format_reward`` (one number then ``<eos>``, read from
   ``completion_ids``) and TRL's own ``trl.rewards.get_soft_overlong_punishment``, weighted by
   ``PPOConfig.reward_weights``. The policy is a LoRA adapter on the SFT model, the critic a
   value head on the same backbone, the reference the SFT model (adapter disabled);
5. before and after PPO: held-out accuracy (the mean of ``exact_answer``), format rate (of
   ``format_reward``) and the share answering the other operand, greedy and sampled at the
   training temperature, and greedy accuracy on PPO prompts; printed with sample completions
   and written to ``<output_dir>/summary.json``. Per-update metrics, among them
   ``rewards/<name>/mean`` and every 8 updates the held-out ``eval/<name>`` of each reward, are
   in ``log_history.json``.

Why this task and this warm-up. ``max`` over 20 numbers is within reach of a 2-layer Llama with
hidden size 32 (SFT on 200 clean pairs reaches 0.96 held-out accuracy in 50 steps), but not of
what a LoRA adapter learns from 150 PPO prompts in a CPU minute if the model lacks the order:
in tuning runs with a clean warm-up on 16 pairs (held-out accuracy 0.39, and 38% of its answers
not an operand at all) PPO reached 0.48, and even *supervised* LoRA training on the PPO pairs
peaked at 0.6 held out before it memorised its way down to 0.19. The noisy warm-up on 150 pairs
gives the model the order and the format, with the wrong choice as its habit; the exact-answer
reward then teaches it which operand to give, and that carries over to pairs it never saw
(tuning runs: 0.20-0.37 before, 0.70-0.80 after, over three seeds and two splits). Addition
mod 10 was tried as well: SFT fitted every training pair while held-out accuracy stayed at or
below 0.35.

Why TRL's ``trl.rewards.accuracy_reward`` is not among the rewards: it parses LaTeX answers
with ``math_verify`` and scores a bare ``17`` as 0 (only ``\\boxed{17}`` counts), so the exact
answer is checked here by ``exact_answer``. ``get_soft_overlong_punishment`` fits as it is: it
reads ``completion_ids``, which the trainer passes as GRPO does.

Why the LoRA targets include ``lm_head`` (as in ``examples/ppo_lora.py``): see that module's
docstring. Why rank 4 and 4096 episodes: in tuning runs rank 8 needed 6144 episodes for the held-out
accuracy (0.72) that rank 4 reached in 4096; learning rates of 1e-2 and 2e-2 made things worse,
2e-3 too slow; ``kl_coef`` 0.05 held the policy back (0.50 instead of 0.72).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the wall time reported in summary.json starts here

import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _startup, ppo_lora, verifiable_task
import _startup  # noqa: E402  (env defaults; the package from a source checkout)
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from ppo_lora import DEMO_LORA_TARGETS, BarOnly, set_cpu_threads  # noqa: E402
from transformers import HfArgumentParser, ProgressCallback, set_seed  # noqa: E402
from verifiable_task import (  # noqa: E402
    OPERATIONS,
    answered_other_operand,
    build_task,
    completion_text,
    exact_answer,
    make_format_reward,
    sft_warm_up,
    split_pairs,
)

from trl_ppo_ext import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo_ext.data import render_prompts  # noqa: E402
from trl_ppo_ext.run.manifest import package_versions, to_jsonable  # noqa: E402


@dataclass
class TaskArguments:
    """The task, the SFT warm-up, the tiny model and the before/after evaluation."""

    operation: str = field(default="max", metadata={"help": f"The operation asked for: one of {sorted(OPERATIONS)}."})
    num_values: int = field(default=20, metadata={"help": "Numbers are 0 .. num_values - 1 (num_values**2 pairs)."})
    num_sft_pairs: int = field(default=150, metadata={"help": "Operand pairs the SFT warm-up trains on."})
    num_held_out_pairs: int = field(
        default=100, metadata={"help": "Pairs held out from SFT and PPO: the before/after accuracy. PPO gets the rest."}
    )
    max_ppo_pairs: int | None = field(
        default=None, metadata={"help": "Use at most this many of the PPO pairs (default: all)."}
    )
    split_seed: int = field(default=0, metadata={"help": "Seed of the shuffle that splits the pairs."})
    sft_steps: int = field(default=200, metadata={"help": "SFT warm-up optimizer steps (batch 32)."})
    sft_learning_rate: float = field(default=3e-3, metadata={"help": "SFT warm-up learning rate (full model)."})
    sft_correct_fraction: float = field(
        default=0.4, metadata={"help": "Share of SFT rows with the right answer; the others give the other operand."}
    )
    hidden_size: int = field(default=32, metadata={"help": "Hidden size of the tiny 2-layer Llama."})
    soft_overlong_cache: int = field(
        default=2, metadata={"help": "TRL's soft overlong punishment: 0 up to response_length - this many tokens, "
                             "falling linearly to -1 at response_length."},
    )
    num_train_pairs_evaluated: int = field(
        default=100, metadata={"help": "PPO prompts on which greedy accuracy is also reported before and after."}
    )
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of the before/after evaluation."})
    num_samples_shown: int = field(default=4, metadata={"help": "Greedy completions printed before and after PPO."})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads; default: 1 on a machine with at most 2 cores, else 4 "
                                "at most."},
    )
    lora_r: int = field(default=4, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=8, metadata={"help": "LoRA alpha; the update is scaled by alpha/r."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEMO_LORA_TARGETS),
        metadata={"help": "Modules LoRA adapts; lm_head among them (see the module docstring)."},
    )
    value_lora: bool = field(
        default=False,
        metadata={"help": "Give the critic its own LoRA adapter (same rank and targets, lm_head excepted): a second "
                  "backbone pass; here it raised accuracy at half the budget from 0.771 to 0.811 (8 seeds, "
                  "docs/benchmarks.md)."},
    )


# The run's PPO settings; any of them can be overridden on the command line.
PPO_DEFAULTS = dict(
    output_dir="outputs/ppo_verifiable",
    total_episodes=4096,  # 64 updates of 64 episodes
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,
    num_mini_batches=2,
    learning_rate=5e-3,
    kl_coef=0.01,
    temperature=1.0,
    response_length=4,  # one number, <eos>, and room to ramble
    stop_token="eos",
    reward_weights=[1.0, 0.2, 0.2],  # exact_answer, format_reward, soft overlong punishment
    local_rollout_forward_batch_size=64,
    per_device_eval_batch_size=100,
    num_sample_generations=0,
    eval_strategy="steps",  # the held-out prompts every 8 updates: eval/exact_answer, eval/format_reward, ...
    eval_steps=8,
    save_strategy="no",
    logging_steps=4,
    report_to="none",
    seed=0,
    bf16=False,
)


def parse_args(argv: list[str] | None = None) -> tuple[TaskArguments, PPOConfig]:
    """Parse the command line, with ``PPO_DEFAULTS`` as the PPOConfig defaults; check the task's flags."""
    parser = HfArgumentParser((TaskArguments, PPOConfig))
    parser.set_defaults(**PPO_DEFAULTS)
    task_args, config = parser.parse_args_into_dataclasses(args=argv)
    if not 0.0 <= task_args.sft_correct_fraction <= 1.0:
        raise ValueError(f"--sft_correct_fraction={task_args.sft_correct_fraction}: pass a share between 0 and 1.")
    if not 0 <= task_args.soft_overlong_cache <= config.response_length:
        raise ValueError(
            f"--soft_overlong_cache={task_args.soft_overlong_cache} with --response_length={config.response_length}: "
            "pass 0 .. response_length tokens."
        )
    for flag in ("num_train_pairs_evaluated", "max_ppo_pairs", "num_sft_pairs", "num_held_out_pairs"):
        value = getattr(task_args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag}={value}: pass at least 1.")
    pairs = task_args.num_values**2
    if task_args.num_sft_pairs + task_args.num_held_out_pairs >= pairs:
        raise ValueError(
            f"--num_sft_pairs={task_args.num_sft_pairs} + --num_held_out_pairs={task_args.num_held_out_pairs} leave "
            f"PPO none of the {pairs} pairs (--num_values={task_args.num_values}): lower them or raise --num_values."
        )
    return task_args, config


def ppo_prompts(task, pairs) -> Dataset:
    """PPO prompt rows as a user would bring them: ``prompt`` (the conversation) and ``answer``,
    tokenised by ``trl_ppo_ext.data.render_prompts`` (chat template + generation prompt). Both
    columns stay and reach the reward functions: ``exact_answer`` reads ``answer``, and the
    conversational ``prompt`` makes completions arrive as messages, as in GRPO."""
    rows = Dataset.from_dict({"prompt": [task.conversation(a, b) for a, b in pairs],
                              "answer": [str(task.answer(a, b)) for a, b in pairs]})
    prompts, _ = render_prompts(rows, task.tokenizer)
    return prompts


def reward_functions(task, config: PPOConfig, task_args: TaskArguments) -> list:
    """``exact_answer``, ``format_reward`` and TRL's soft overlong punishment (``trl.rewards``)."""
    from trl.rewards import get_soft_overlong_punishment

    return [exact_answer, make_format_reward(task),
            get_soft_overlong_punishment(config.response_length, task_args.soft_overlong_cache)]


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: Dataset, *, temperature: float, seed: int, num_samples: int = 0) -> dict:
    """One completion per prompt at ``temperature`` (0: greedy), through the trainer's own rollout
    and reward scoring; the training RNG is left untouched.

    Returns the mean over ``prompts`` of each reward (``exact_answer``: the accuracy,
    ``format_reward``: the format rate, ...) and of ``other_operand`` (``answered_other_operand``),
    and ``"samples"``: the first ``num_samples`` as ``{"prompt", "completion", "answer"}``.
    """
    tok, batch_size = trainer.processing_class, trainer.args.per_device_eval_batch_size
    rows = [prompts[i] for i in range(len(prompts))]
    names = [r.name for r in trainer.rewards]
    sums = dict.fromkeys([*names, "other_operand"], 0.0)
    samples = []
    cuda = trainer.accelerator.device.type == "cuda"
    with torch.random.fork_rng(devices=None if cuda else []):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            rollout = trainer.generate_rollout(trainer.data_collator(rows[start : start + batch_size]),
                                               temperature=temperature)
            _, values, _ = trainer.score_rewards(rollout)  # (b, F); each reward here applies to every completion
            for name, total in zip(names, values.sum(0).tolist()):
                sums[name] += total
            completions = [tok.decode(r[m].tolist()) for r, m in zip(rollout.responses, rollout.response_mask)]
            sums["other_operand"] += sum(answered_other_operand(rollout.extras["prompt"], completions))
            for i in range(min(num_samples - len(samples), rollout.batch_size)):
                samples.append({"prompt": completion_text(rollout.extras["prompt"][i]), "completion": completions[i],
                                "answer": rollout.extras["answer"][i]})
    return {**{name: total / len(rows) for name, total in sums.items()}, "samples": samples}


def evaluate_all(trainer: PPOTrainer, held_out: Dataset, train_subset: Dataset, task_args: TaskArguments) -> dict:
    """Held-out greedy (with samples) and sampled at the training temperature; PPO prompts greedy."""
    seed = task_args.eval_seed
    return {
        "held_out_greedy": evaluate(trainer, held_out, temperature=0.0, seed=seed,
                                    num_samples=task_args.num_samples_shown),
        "held_out_sampled": evaluate(trainer, held_out, temperature=trainer.args.temperature, seed=seed),
        "ppo_prompts_greedy": evaluate(trainer, train_subset, temperature=0.0, seed=seed),
    }


def print_samples(title: str, evaluation: dict) -> None:
    print(f"\n{title}")
    for s in evaluation["held_out_greedy"]["samples"]:
        mark = "right" if s["completion"].replace("<eos>", "").strip() == s["answer"] else "wrong"
        print(f"  {s['prompt']!r} -> {s['completion']!r}  (answer {s['answer']}: {mark})")


# --------------------------------------------------------------------------------- summary
PPO_SETTINGS = ("learning_rate", "total_episodes", "batch_size", "num_total_batches", "per_device_train_batch_size",
                "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs", "response_length", "temperature",
                "kl_coef", "kl_estimator", "cliprange", "cliprange_value", "vf_coef", "entropy_coef", "gamma", "lam",
                "whiten_rewards", "whiten_advantages", "missing_eos_penalty", "stop_token", "reward_weights",
                "lr_scheduler_type", "max_grad_norm", "use_vllm", "seed")


def build_summary(before: dict, after: dict, *, trainer: PPOTrainer, task, split, task_args: TaskArguments,
                  threads: int, times: dict) -> dict:
    """summary.json: the before/after figures first, then every setting used."""
    summary = {"task": task.describe()}
    for key, what in (("accuracy", "exact_answer"), ("format_rate", "format_reward"),
                      ("other_operand_rate", "other_operand")):
        for where in ("held_out_greedy", "held_out_sampled", "ppo_prompts_greedy"):
            summary[f"{key}_{where}_before"] = before[where][what]
            summary[f"{key}_{where}_after"] = after[where][what]
    summary.update(times)
    summary["samples_before"] = before["held_out_greedy"]["samples"]
    summary["samples_after"] = after["held_out_greedy"]["samples"]
    config, sft_pairs = trainer.args, len(split.sft)
    summary["settings"] = {
        "task": {"operation": task.operation, "num_values": task.num_values, "split_seed": task_args.split_seed,
                 "pairs": {"sft": sft_pairs, "ppo": len(trainer.train_dataset), "held_out": len(split.held_out)}},
        "policy": {"model": "random tiny Llama (trl_ppo_ext.tiny), then SFT", "hidden_size": task_args.hidden_size,
                   "num_layers": trainer.unwrapped.policy.config.num_hidden_layers,
                   "vocab_size": len(task.tokenizer)},
        "sft": {"trainer": "trl.SFTTrainer", "steps": task_args.sft_steps, "learning_rate": task_args.sft_learning_rate,
                "batch_size": min(32, sft_pairs), "correct_fraction": task_args.sft_correct_fraction},
        "rewards": [{"name": r.name, "weight": r.weight} for r in trainer.rewards],
        "lora": {"r": task_args.lora_r, "lora_alpha": task_args.lora_alpha,
                 "target_modules": sorted(task_args.lora_target_modules),
                 "value_adapter": getattr(trainer.unwrapped, "value_adapter", None),
                 "reference": "the SFT model (the policy with its LoRA adapter disabled)"},
        "ppo": {name: getattr(config, name, None) for name in PPO_SETTINGS},
        "evaluation": {"held_out_pairs": len(split.held_out), "seed": task_args.eval_seed,
                       "ppo_pairs_evaluated": min(task_args.num_train_pairs_evaluated, len(trainer.train_dataset)),
                       "greedy": "temperature 0", "sampled_temperature": config.temperature},
        "output_dir": config.output_dir, "torch_num_threads": threads, "device": str(trainer.accelerator.device),
        "versions": package_versions(),
    }
    return to_jsonable(summary)


def print_summary(summary: dict, path: str) -> None:
    print("\n" + "=" * 72)
    print(f"Task: {summary['task']}")
    for key, title in (("accuracy_held_out_greedy", "held-out accuracy, greedy"),
                       ("accuracy_held_out_sampled", "held-out accuracy, sampled"),
                       ("format_rate_held_out_greedy", "held-out format rate, greedy"),
                       ("other_operand_rate_held_out_greedy", "held-out other operand, greedy"),
                       ("accuracy_ppo_prompts_greedy", "PPO-prompt accuracy, greedy")):
        print(f"{title:<32} before {summary[key + '_before']:6.3f}   after {summary[key + '_after']:6.3f}")
    print(f"wall time: {summary['wall_time_s']:.1f} s (SFT {summary['sft_time_s']:.1f} s, PPO "
          f"{summary['ppo_train_time_s']:.1f} s)")
    print(f"summary written to {path}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None, *, start_time: float | None = None) -> dict:
    """SFT warm-up, PPO with reward functions, before/after evaluation; returns the summary."""
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.tiny import build_tiny_causal_lm

    start = time.perf_counter() if start_time is None else start_time
    task_args, config = parse_args(argv)
    threads = set_cpu_threads(task_args.num_threads)
    _startup.vllm_cpu_defaults(config.use_vllm)
    task_args.hidden_size = _startup.vllm_demo_hidden_size(task_args.hidden_size, config.use_vllm)
    set_seed(config.seed)
    task = build_task(task_args.operation, task_args.num_values)
    split = split_pairs(task, num_sft=task_args.num_sft_pairs, num_held_out=task_args.num_held_out_pairs,
                        seed=task_args.split_seed)
    ppo_pairs = split.ppo[: task_args.max_ppo_pairs]
    print(f"Task: {task.describe()}\nPairs: {len(split.sft)} SFT, {len(ppo_pairs)} PPO, {len(split.held_out)} held out")

    sft_start = time.perf_counter()
    model = build_tiny_causal_lm(task.tokenizer, seed=config.seed, hidden_size=task_args.hidden_size)
    model = sft_warm_up(task, model, split.sft, os.path.join(config.output_dir, "sft"), max_steps=task_args.sft_steps,
                        learning_rate=task_args.sft_learning_rate, correct_fraction=task_args.sft_correct_fraction,
                        seed=config.seed)
    sft_time = time.perf_counter() - sft_start
    print(f"SFT warm-up: {task_args.sft_steps} steps on {len(split.sft)} pairs ({sft_time:.1f} s)")

    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    held_out = ppo_prompts(task, split.held_out)
    train = ppo_prompts(task, ppo_pairs)
    value_lora = None
    if task_args.value_lora:  # the value pass never reaches lm_head
        value_lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                                target_modules=[t for t in task_args.lora_target_modules if t != "lm_head"])
    actor_critic = SharedActorCritic(model, lora_config=lora, value_lora_config=value_lora)
    trainer = PPOTrainer(args=config, processing_class=task.tokenizer, model=actor_critic,
                         ref_model=None, reward_model=None, reward_funcs=reward_functions(task, config, task_args),
                         train_dataset=train, eval_dataset=held_out, value_model=None,
                         eval_metrics={"other_operand": answered_other_operand})
    if not config.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnly())
    train_subset = train.select(range(min(task_args.num_train_pairs_evaluated, len(train))))
    before = evaluate_all(trainer, held_out, train_subset, task_args)
    print_samples("Before PPO (after SFT): held-out prompts, greedy", before)

    print(f"\nPPO: {config.total_episodes} episodes, {config.num_total_batches} updates, rewards "
          + ", ".join(f"{r.name} x{r.weight:g}" for r in trainer.rewards))
    ppo_start = time.perf_counter()
    trainer.train()
    ppo_time = time.perf_counter() - ppo_start
    after = evaluate_all(trainer, held_out, train_subset, task_args)
    print_samples("After PPO: the same prompts, greedy", after)

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
