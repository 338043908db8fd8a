"""PPO on episodes with turns: a tiny model learns a two-turn task on the CPU, through ``rollout_func``.

    accelerate launch examples/ppo_multiturn.py      # the whole run: CPU, no hub, under a minute
    python examples/ppo_multiturn.py --help           # every flag (the task's, LoRA's, PPOConfig's)

Nothing is downloaded. The run:

1. the task of ``examples/multiturn_task.py``: the policy answers a prompt with up to 3 words,
   the environment replies with a verdict on each word (8 environment tokens), the policy
   answers again; one reward at the end, ``(nice share of answer 1 + closing share of answer
   2) / 2``, so the first answer's credit crosses the environment's tokens;
2. the episodes come from ``make_rollout_func``, a ``rollout_func(prompts, trainer)`` in TRL
   1.16 GRPO's contract: ``trainer.generate_continuations`` samples each turn with the current
   policy (on the vLLM engine with ``--use_vllm``), ``env_mask`` marks the environment's
   tokens, and the extra columns ``first_answer`` / ``second_answer`` reach the reward function;
3. PPO (``trl_ppo_ext.PPOTrainer``) on a tiny random Llama with a LoRA policy (``lm_head``
   among the targets, as in ``examples/ppo_lora.py``, whose docstring says why) and a critic
   with an adapter of its own on the same base (``use_value_adapter``), lambda sized to each
   episode's length (``lam_length_alpha`` 2) and no reference (``kl_coef`` 0): the configuration
   docs/critic.md gives for episodes with turns. The loss, whitening and GAE run over the
   policy's own tokens;
4. before and after PPO: episodes on held-out prompts (topics never seen in training) sampled
   at the training temperature, their reward and the two turn scores; printed with sample
   episodes and written to ``<output_dir>/summary.json`` (per-update metrics, the turn figures
   ``rollout/turns_mean`` and ``rollout/env_token_frac`` among them, in ``log_history.json``).

Why these settings: the ones of ``examples/ppo_lora.py``'s demo (LoRA r 8, alpha 16, lr 5e-3)
and the package's ``gamma`` 1; for the critic, ``benchmarks/sample_efficiency --task multiturn``
(8 seeds, docs/investigations/critic-vs-grpo.md): final reward 0.965 +- 0.049 with this critic,
against 0.764 +- 0.085 with a value head on the policy's backbone, ``lam`` 0.95 and ``kl_coef``
0.02 (``--use_value_adapter false --lam_length_alpha none --kl_coef 0.02``).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the wall time reported in summary.json starts here

import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _startup, ppo_lora, multiturn_task
import _startup  # noqa: E402  (env defaults; the package from a source checkout)
import torch  # noqa: E402
from multiturn_task import build_task, make_reward, make_rollout_func, prompt_dataset  # noqa: E402
from ppo_lora import DEMO_LORA_TARGETS, BarOnly, set_cpu_threads  # noqa: E402
from transformers import HfArgumentParser, ProgressCallback, set_seed  # noqa: E402

from trl_ppo_ext import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo_ext.run.manifest import package_versions, to_jsonable  # noqa: E402


@dataclass
class TaskArguments:
    """The task, the tiny model and the before/after evaluation."""

    first_turn_tokens: int = field(
        default=3, metadata={"help": "Answer 1's budget in tokens; the environment's reply is this + 5 tokens."}
    )
    hidden_size: int = field(default=32, metadata={"help": "Hidden size of the tiny 2-layer Llama."})
    train_repeats: int = field(default=4, metadata={"help": "Each of the 48 training prompts this many times."})
    eval_repeats: int = field(
        default=8, metadata={"help": "Each of the 12 held-out prompts this many times in the before/after evaluation."}
    )
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
        metadata={"help": "Modules LoRA adapts; lm_head among them (see examples/ppo_lora.py)."},
    )


# The run's PPO settings; any of them can be overridden on the command line.
PPO_DEFAULTS = dict(
    output_dir="outputs/ppo_multiturn",
    total_episodes=768,  # 24 updates of 32 episodes
    per_device_train_batch_size=8,
    gradient_accumulation_steps=4,
    num_mini_batches=2,
    learning_rate=5e-3,
    use_value_adapter=True,  # the recommended critic (see the docstring's "Why these settings")
    lam_length_alpha=2.0,
    kl_coef=0.0,
    temperature=1.0,
    response_length=14,  # answer 1 (3) + the environment's reply (8) + answer 2 (3)
    stop_token="eos",  # a turn ends at <eos>
    local_rollout_forward_batch_size=64,
    per_device_eval_batch_size=96,
    num_sample_generations=0,
    eval_strategy="no",  # the before/after evaluation below
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
    for flag in ("first_turn_tokens", "train_repeats", "eval_repeats"):
        if getattr(task_args, flag) < 1:
            raise ValueError(f"--{flag}={getattr(task_args, flag)}: pass at least 1.")
    episode = 2 * task_args.first_turn_tokens + 5  # answer 1 + the reply; answer 2 needs at least one more
    if config.response_length <= episode:
        raise ValueError(
            f"--response_length={config.response_length} with --first_turn_tokens={task_args.first_turn_tokens}: "
            f"answer 1 and the environment's reply take up to {episode} tokens; pass at least {episode + 1}."
        )
    return task_args, config


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(trainer: PPOTrainer, task, prompts, *, seed: int, num_samples: int = 0) -> dict:
    """One episode per prompt row at the training temperature, through the trainer's own rollout
    (``rollout_func``); the training RNG is left untouched.

    Returns the means over ``prompts`` of ``reward``, ``first_turn`` (nice share of answer 1)
    and ``second_turn`` (closing share of answer 2), and ``"samples"``: the first
    ``num_samples`` episodes as text.
    """
    tok, batch_size = trainer.processing_class, trainer.args.per_device_eval_batch_size
    rows = [prompts[i] for i in range(len(prompts))]
    sums = dict.fromkeys(("reward", "first_turn", "second_turn"), 0.0)
    samples = []
    cuda = trainer.accelerator.device.type == "cuda"
    with torch.random.fork_rng(devices=None if cuda else []):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            sample = trainer.generate_rollout(trainer.data_collator(rows[start : start + batch_size]))
            for i, (a, b) in enumerate(zip(sample.extras["first_answer"], sample.extras["second_answer"])):
                first, second = task.turn_scores(a, b)
                sums["first_turn"] += first
                sums["second_turn"] += second
                sums["reward"] += (first + second) / 2
                if len(samples) < num_samples:
                    episode = sample.responses[i][sample.response_mask[i]].tolist()
                    samples.append({"prompt": sample.extras["prompt"][i][0]["content"], "episode": tok.decode(episode),
                                    "reward": (first + second) / 2})
    return {**{k: v / len(rows) for k, v in sums.items()}, "samples": samples}


def print_samples(title: str, evaluation: dict) -> None:
    print(f"\n{title}")
    for s in evaluation["samples"]:
        print(f"  {s['prompt']!r} -> {s['episode']!r}  (reward {s['reward']:.2f})")


# --------------------------------------------------------------------------------- summary
PPO_SETTINGS = ("learning_rate", "total_episodes", "batch_size", "num_total_batches", "per_device_train_batch_size",
                "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs", "response_length", "temperature",
                "kl_coef", "kl_estimator", "cliprange", "cliprange_value", "vf_coef", "entropy_coef", "gamma", "lam",
                "lam_length_alpha", "use_value_adapter", "whiten_rewards", "whiten_advantages", "missing_eos_penalty",
                "stop_token", "use_vllm", "seed")


def build_summary(before: dict, after: dict, *, trainer: PPOTrainer, task, task_args: TaskArguments,
                  num_eval: int, threads: int, times: dict) -> dict:
    """summary.json: the before/after figures first, then every setting used."""
    summary = {"task": task.describe()}
    for key in ("reward", "first_turn", "second_turn"):
        summary[f"{key}_before"] = before[key]
        summary[f"{key}_after"] = after[key]
    summary.update(times)
    summary["samples_before"], summary["samples_after"] = before["samples"], after["samples"]
    config = trainer.args
    summary["settings"] = {
        "task": {"first_turn_tokens": task.first_turn_tokens, "reply_length": task.reply_length,
                 "train_prompts": len(trainer.train_dataset), "held_out_episodes": num_eval},
        "policy": {"model": "random tiny Llama (trl_ppo_ext.tiny)", "hidden_size": task_args.hidden_size,
                   "num_layers": trainer.unwrapped.policy.config.num_hidden_layers,
                   "vocab_size": len(task.tokenizer)},
        "lora": {"r": task_args.lora_r, "lora_alpha": task_args.lora_alpha,
                 "target_modules": sorted(task_args.lora_target_modules),
                 "reference": "the initial model (the policy with its LoRA adapter disabled)"},
        "ppo": {name: getattr(config, name, None) for name in PPO_SETTINGS},
        "evaluation": {"seed": task_args.eval_seed, "temperature": config.temperature},
        "output_dir": config.output_dir, "torch_num_threads": threads, "device": str(trainer.accelerator.device),
        "versions": package_versions(),
    }
    return to_jsonable(summary)


def print_summary(summary: dict, path: str) -> None:
    print("\n" + "=" * 72)
    print(f"Task: {summary['task']}")
    for key, title in (("reward", "held-out reward"), ("first_turn", "answer 1: nice-word share"),
                       ("second_turn", "answer 2: closing-word share")):
        print(f"{title:<32} before {summary[key + '_before']:6.3f}   after {summary[key + '_after']:6.3f}")
    print(f"wall time: {summary['wall_time_s']:.1f} s (PPO {summary['ppo_train_time_s']:.1f} s)")
    print(f"summary written to {path}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None, *, start_time: float | None = None) -> dict:
    """PPO with a ``rollout_func`` on the two-turn task, before/after evaluation; returns the summary."""
    from peft import LoraConfig

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    start = time.perf_counter() if start_time is None else start_time
    task_args, config = parse_args(argv)
    threads = set_cpu_threads(task_args.num_threads)
    _startup.vllm_cpu_defaults(config.use_vllm)
    task_args.hidden_size = _startup.vllm_demo_hidden_size(task_args.hidden_size, config.use_vllm)
    set_seed(config.seed)
    task = build_task(task_args.first_turn_tokens)
    print(f"Task: {task.describe()}")

    model = build_tiny_causal_lm(task.tokenizer, seed=config.seed, hidden_size=task_args.hidden_size)
    lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                      target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
    train = prompt_dataset(task, held_out=False, repeats=task_args.train_repeats)
    held_out = prompt_dataset(task, held_out=True, repeats=task_args.eval_repeats)
    # the trainer builds the actor-critic from the LoRA config (the critic's own adapter: use_value_adapter)
    trainer = PPOTrainer(args=config, processing_class=task.tokenizer, model=model, peft_config=lora,
                         ref_model=None, reward_model=None, reward_funcs=[make_reward(task)], train_dataset=train,
                         value_model=None, rollout_func=make_rollout_func(task))
    if not config.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnly())
    before = evaluate(trainer, task, held_out, seed=task_args.eval_seed, num_samples=task_args.num_samples_shown)
    print_samples("Before PPO: held-out prompts, sampled", before)

    print(f"\nPPO: {config.total_episodes} episodes, {config.num_total_batches} updates, gamma {config.gamma}, "
          f"lam {config.lam}")
    ppo_start = time.perf_counter()
    trainer.train()
    ppo_time = time.perf_counter() - ppo_start
    after = evaluate(trainer, task, held_out, seed=task_args.eval_seed, num_samples=task_args.num_samples_shown)
    print_samples("After PPO: the same prompts, sampled", after)

    trainer.save_model(config.output_dir)
    times = {"ppo_train_time_s": ppo_time, "wall_time_s": time.perf_counter() - start}
    summary = build_summary(before, after, trainer=trainer, task=task, task_args=task_args, num_eval=len(held_out),
                            threads=threads, times=times)
    path = _startup.write_run_files(trainer, config.output_dir, summary)
    if path is not None:
        print_summary(summary, path)
    return summary


if __name__ == "__main__":
    main(start_time=_T0)
