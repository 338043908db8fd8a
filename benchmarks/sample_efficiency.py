"""Sample efficiency: reward against episodes, over seeds, for named arms.

    python benchmarks/sample_efficiency.py --task synthetic --arms trl112 defaults --seeds 8 --out DIR
    python benchmarks/sample_efficiency.py --task verifiable --arms trl112 defaults recipe --out DIR
    python benchmarks/sample_efficiency.py --task long --arms trl_grpo defaults --memory --out DIR
    python benchmarks/sample_efficiency.py --task tools_env --arms defaults trl_grpo --out DIR
    python benchmarks/sample_efficiency.py --list-arms

An *arm* is a name for a way to train: config overrides on top of the task's settings, which
trainer runs them (``TRAINERS``: ``ours``, this package's PPOTrainer; ``trl112``, TRL 1.12's own
``trl.experimental.ppo.PPOTrainer``; ``trl_grpo``, TRL's own ``trl.GRPOTrainer``, see below) and
which reward variant of the task it trains on (``default``; the
synthetic task also has the reward variants ``process``, ``process_prefix``, ``final`` and ``other_vocab``,
see ``REWARD_VARIANTS``: the true reward as per-token or final reward functions, an RM of another
vocabulary; each measured by the same true reward of the policy's completions).
``--arm NAME:field=value,field=value`` adds one on the command line (values are read as JSON,
else kept as strings; ``trainer=trl_grpo`` makes them ``GRPOConfig`` fields, e.g.
``--arm grpo_kl:trainer=trl_grpo,beta=0.04``). An arm naming a field the installed config lacks
is left out with a printed note, so the same command works before and after a field is wired.

Every arm of a task gets the same models (built once per seed by a ``--prepare`` process and
loaded by every run), prompts, batch sizes, learning rate, response length and seeds. Each
(arm, seed) runs in its own process with a timeout (``--timeout``), one thread each, ``--jobs``
at a time; the ``trl112`` arm runs under ``--trl-python`` (default: /work/venv112/bin/python
if it has a TRL with a PPO trainer; without one the arm is left out with a note), ``ours`` and
``trl_grpo`` under the python running the benchmark. A run writes one JSON row per update (one
rollout batch: ``update``, ``episode`` = completions so far, ``reward``, ``scored`` = completions
measured, ``kl``, ``entropy``, ...) to ``DIR/<task>/<arm>/<seed>.jsonl`` and a last row
``{"done": true, "train_s": ..., "updates": ...}`` (``train_s``: the wall seconds of
``trainer.train()``); a run that raises, times out, stops early or logs a non-finite value is
kept as *crashed* (its file ends ``{"done": true, "crashed": true, "reason": ...}``), never
dropped. Complete files are skipped, so an interrupted benchmark resumes where it stopped
(``--rerun-crashed`` runs crashed ones again).

The tasks (``TASKS``):

* ``synthetic``: ``examples/ppo_lora.py``'s demo: the rule of ``examples/synthetic_task.py``, a
  reward model trained on preference pairs from it (once per seed, shared by every arm), a
  tiny random Llama with LoRA (r 8, alpha 16, ``lm_head`` included), the demo's PPO settings
  (lr 5e-3, kl_coef 0.05, response_length 10, batch 32 = 8 x 4, 2 mini-batches). Its
  ``reward`` is the *true* reward (share of nice words + 0.5 for stopping in time, 0 .. 1.5)
  of the responses the reward model scored in that update's rollout, read by a forward hook
  on the reward model's backbone: the same measurement for every trainer.
* ``verifiable``: ``examples/ppo_verifiable.py``: ``max a b`` over 0..19 after a noisy SFT
  warm-up (once per seed, shared), rewards ``exact_answer`` + 0.2 ``format_reward`` + 0.2
  soft overlong punishment. Its ``reward`` is the accuracy (mean exact answer) of the update's
  rollout. This package trains on the example's reward functions; TRL's trainer takes only
  a reward model, so it gets ``RuleRewardModel``, the same weighted sum computed from token ids.

* ``long``: the synthetic task's words, prompts and tiny random Llama (saved once per seed so
  every trainer starts from the same weights), responses of up to 32 tokens and one reward at
  the end, the rule of ``long_task_reward``: the share of 24 nice words reached, + 0.5 for an
  ``<eos>`` after 24 or more words. Credit has to travel back ~30 tokens: the setting the critic
  recipe was made for. The demo's PPO settings with kl_coef 0.01 (``LONG_SETTINGS``); 2048
  episodes. Both trainers get the rule (TRL's as ``RuleRewardModel``).
* ``multiturn``: ``examples/ppo_multiturn.py``: episodes with turns from its ``rollout_func``
  (answer 1, the environment's 8-token verdict, answer 2; one reward at the end that depends on
  both answers), a tiny random Llama (saved once per seed) with the example's LoRA and PPO
  settings (768 episodes = 24 updates of 32, ``gamma`` 1, ``lam`` 0.95). Its ``reward`` is the
  mean episode reward of the update's rollout. This package's trainer only (TRL 1.12's has no
  ``rollout_func``); the arm ``step_through`` runs GAE through the environment's tokens as if
  they were actions (``step_through_gae``), against ``defaults``' GAE over the action tokens.
* ``tools_env``: ``examples/ppo_tools.py``'s calculator task (``examples/tool_task.py``: ``"23*47"``
  -> ``"1081"``; the tiny policy cannot multiply, the ``multiply`` tool can) as an environment
  with turns and one reward at the end: ``environment_factory=Calculator`` (TRL 1.16's contract:
  ``reset(**row)``, its public method ``multiply`` the tool, with the example's schema, so the
  prompts are the example's ids) for both trainers, and the same reward, the example's
  ``correct_answer`` (a message list per episode). The initial policy is the example's SFT
  warm-up, built once per seed (``build_tools_env_sft``: ``ppo_tools.TaskArguments``' defaults as
  they are when the benchmark runs, the hidden size among them); ``defaults`` trains it with
  ``ppo_tools.PPO_DEFAULTS`` (768 episodes = 24 updates of 32, response_length 48 = the whole
  episode, one round of tools, ``enable_thinking`` off, lr 3e-3, kl_coef 0.01, LoRA r 8 / alpha 16
  with the critic the value head on the policy's backbone, GAE over the policy's own tokens).
  Its ``reward`` is the accuracy (mean ``correct_answer``) of the update's rollout; its rows also
  keep ``call_rate``, the share of the rollout's episodes in which the calculator returned a
  product (counted by the environments, ``tool_calls_measured``), and the table a column of it.

TRL's trainer needs a separate value model: as TRL's example script does, it is initialised
from the reward model (synthetic) or, with no reward model, from the SFT checkpoint with a
fresh score head (verifiable). This package's arms use the shared LoRA actor-critic of the
examples (value head on the policy's backbone).

The ``trl_grpo`` arm is TRL's own ``GRPOTrainer`` (of the installed TRL, 1.16 in /work/venv), a
peer for this package's critic-free estimators (e.g. ``--arm
grpo:advantage_estimator=grpo,num_generations=4``; rloo, reinforce_pp_baseline alike), on the
``synthetic``, ``verifiable`` and ``long`` tasks, and against this package's critic on
``tools_env``, where both trainers run their tool loop with ``environment_factory=Calculator``
(``multiturn`` is refused: its ``rollout_func`` samples with this package's
``trainer.generate_continuations``). What it shares with the ``ours`` arms: the task's initial
policy per seed (built or loaded exactly as they do), the LoRA rank, alpha and targets as
``peft_config`` (but ``lm_head``, trained whole through ``modules_to_save``: TRL 1.16's GRPO refuses
an adapter there, its fused LM head reads ``lm_head.weight`` directly; see ``grpo_lora``), the
prompts (as text that its tokenizer turns back into exactly the same ids: ``prompt_texts``; on
tools_env the same conversations, which both render with the tool's schema), learning rate,
temperature (0.7 synthetic and long, 1.0 verifiable and tools_env), ``max_completion_length`` = the
task's response_length (on tools_env TRL's budget of the whole multi-turn completion, tool replies
included, as ours),
``max_tool_calling_iterations`` and ``chat_template_kwargs`` as ours, stopping at ``<eos>`` (the
tokenizer's EOS, which GRPO always adds to the model's generation_config), the episode budget
counted in completions, and the update shape (``grpo_settings``): one generation batch = the
task's rollout batch (32 synthetic, long and tools_env, 64 verifiable) of ``num_generations=4``
completions per prompt, as this package's group estimators are run (so 8 or 16 prompts per
batch where ``defaults`` has 32 or 64); ``steps_per_generation`` = our ``num_mini_batches`` (2) optimizer
steps of ``per_device_train_batch_size`` = batch / 2 rows, no gradient accumulation, and
``num_iterations`` = our ``num_ppo_epochs`` (4): 8 optimizer steps per rollout, as ours;
``max_steps`` = ``ceil(episodes / batch) * 8``, so both generate the same completions. The rest
is TRL GRPO's defaults: ``beta`` 0 (no KL term, no reference model; ``kl`` is None in its rows),
``loss_type`` "dapo", ``scale_rewards`` "group", ``epsilon`` 0.2, a linear learning-rate decay over
its optimizer steps (ours decays per update). Its rewards: synthetic, the task's trained reward
model read on prompt + completion ids at the last completion token (``reward_model_function``,
as this package reads it); verifiable, the example's reward functions with their weights
(``reward_weights``); long, ``long_task_reward`` on the completion ids; tools_env, ``correct_answer``
on the message lists, as ours. Its rows come from what
the reward functions saw per generation batch (``GRPORecorder``: the true reward or the exact
answer of those completions, measured as for the other arms; on tools_env also the call rate,
read from the environments the reward function is given) and from TRL's per-step logs
averaged over the rollout's optimizer steps (``entropy``; ``score`` is GRPO's ``reward``, the
weighted reward it trained on; ``reward_std`` and ``frac_reward_zero_std`` are kept too).

The table (markdown, to stdout and ``DIR/<task>/table.md``): per arm, runs and crashed runs;
the reward at half the episodes and at the end (each the mean of the ``--window`` updates that
end there, then mean +- standard deviation over the seeds that did not crash); episodes to
reach the threshold (the first episode at which that trailing mean reaches it; median over
seeds, and how many reached it); KL, token entropy and explained variance at the end. The
threshold is the ``trl112`` arm's mean final reward (the goal: reach it in half the
episodes), else ``--threshold``; then the mean training seconds per run and the median over runs
of the milliseconds per episode (``train_s`` over the run's episodes); where rows have a
``call_rate`` (tools_env), its mean +- sd over seeds at the first update and at the end. The
header warns when the finished runs' rows do not all count the same episodes per update
(``episode_mismatch``). With ``--memory`` each arm
also gets one more short run (seed 0, ``MEMORY_UPDATES`` = 2 updates) with training inside
``trl_ppo_ext.memory.live_tensor_bytes`` (tensors alive at its start, the models, counted); its
peak goes to ``DIR/<task>/<arm>/memory.json`` and a column "peak live tensors (MiB)" (the tracker
runs Python on every op, so this run is never a timed one). TRL GRPO's peak on these tiny models
is mostly its fused LM head's scratch tile, ``tokens x 32768`` float32 whatever the vocabulary
(28 MiB for 224 tokens); the trl112 arm's memory run goes through the same code in its own
python, untested where that python is missing. The plot (``DIR/<task>.png``): mean over seeds
of that trailing mean against episodes, with a band of +- one standard deviation per arm; KL
and entropy in panels beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRL_PYTHON = "/work/venv112/bin/python"

# What a row keeps of each update's log_history entry: row key -> the logged metric.
LOGGED = {
    "score": "objective/scores",
    "kl": "objective/kl",
    "entropy": "policy/entropy_avg",
    "explained_variance": "val/explained_variance",
}


# ------------------------------------------------------------------------------------ arms
@dataclass(frozen=True)
class Arm:
    """A way to train: config overrides (a ``PPOConfig``'s, or for ``trl_grpo`` a ``GRPOConfig``'s), the
    trainer (``TRAINERS``), the reward variant, and for ours the critic: the shared LoRA actor-critic
    of the examples, or a separate value model built as the ``trl112`` arm's (TRL's example script:
    the reward model, or the SFT checkpoint with a fresh head) beside a LoRA policy, trained whole
    (``separate``) or as a LoRA adapter and its head on a frozen base (``lora``: how a critic
    adapter of its own would learn)."""

    overrides: dict = field(default_factory=dict)
    trainer: str = "ours"
    reward: str = "default"
    note: str = ""
    # ours: "shared" (value head on the policy's LoRA backbone), "value_lora" (the shared actor-critic
    # with its own value adapter, SharedActorCritic(value_lora_config=...)), "separate" (TRL's value
    # model, every weight trained) or "lora" (that value model trained as a LoRA adapter + head)
    critic: str = "shared"
    # ours, on episodes with turns: "actions" (the package's GAE over the policy's own tokens) or
    # "step_through" (environment tokens as steps with value and reward 0: step_through_gae)
    gae: str = "actions"


# The recipe's values: VC-PPO/VAPO (2503.01491, 2504.05118), DAPO's clip-higher (2503.14476),
# dual-clip PPO (Ye et al. 2020). The warm-up is sized for runs of ~32 updates.
RECIPE = {
    "critic_warmup": {"critic_warmup_steps": 4, "critic_warmup_explained_variance": 0.5},
    "value_lam": {"value_lam": 1.0},
    "length_lam": {"lam_length_alpha": 0.05},
    "clip_higher": {"cliprange_high": 0.28},
    "dual_clip": {"dual_clip": 3.0},
}
# "ours": this package's PPOTrainer; "trl112": TRL 1.12's PPOTrainer (its own python, --trl-python);
# "trl_grpo": TRL's GRPOTrainer of the python that runs the benchmark (TRL 1.16 in /work/venv)
TRAINERS = ("ours", "trl112", "trl_grpo")
ARMS = {
    "trl112": Arm(trainer="trl112", note="TRL 1.12's own trainer"),
    "trl_grpo": Arm(trainer="trl_grpo", note="TRL's own GRPOTrainer, 4 completions per prompt"),
    "defaults": Arm(note="this package's defaults"),
    **{name: Arm(overrides, note="one recipe element") for name, overrides in RECIPE.items()},
    "loss_grpo": Arm({"loss_type": "grpo"}, note="sequence-mean token-mean loss"),
    "loss_dr_grpo": Arm({"loss_type": "dr_grpo"}, note="Dr. GRPO's constant normaliser"),
    "recipe": Arm({k: v for o in RECIPE.values() for k, v in o.items()}, note="every recipe element"),
}
# VAPO's alpha 0.05 gives lambda = 0 to every response under 20 tokens, and these tasks' responses
# are 1-10 tokens (synthetic) and ~2 (verifiable: a number and <eos>). SHORT_ALPHA = 2 makes the
# horizon 1 / (1 - lambda) = 2 L: lambda 0.9 at 5 tokens, 0.95 at 10, 0.75 at 2.
SHORT_ALPHA = 2.0
ARMS["length_lam_short"] = Arm({"lam_length_alpha": SHORT_ALPHA},
                               note="length-adaptive lambda, alpha sized for 1-10 tokens")
ARMS["recipe_short"] = Arm({**ARMS["recipe"].overrides, "lam_length_alpha": SHORT_ALPHA},
                           note="every recipe element, the short responses' alpha")


ARMS["step_through"] = Arm(gae="step_through", note="GAE steps through environment tokens (OpenRLHF, SkyRL)")
GAE_MODES = ("actions", "step_through")


def parse_arm(text: str) -> tuple[str, Arm]:
    """``NAME:field=value,field=value`` (values as JSON, else strings; ``reward=...`` picks the
    reward variant, ``trainer=trl112`` TRL's trainer) -> ``(NAME, Arm)``."""
    name, _, spec = text.partition(":")
    if not name or not spec:
        raise ValueError(f"--arm {text!r}: write NAME:field=value[,field=value...], e.g. clip:cliprange_high=0.28")
    overrides, extra = {}, {}
    for item in spec.split(","):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--arm {text!r}: {item!r} is not field=value.")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        (extra if key in ("reward", "trainer", "critic", "gae") else overrides)[key.strip()] = value
    return name, Arm(overrides, note="from --arm", **extra)


def missing_fields(arm: Arm, config_fields: set[str]) -> list[str]:
    """The overrides of ``arm`` that the installed PPOConfig does not have."""
    return sorted(k for k in arm.overrides if k not in config_fields)


# ----------------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class TaskSpec:
    """What a task's runs share; ``episodes`` and ``hidden_size`` are its example's defaults (None:
    read from the example when the benchmark runs, see :func:`task_sizes`)."""

    episodes: int | None
    hidden_size: int | None
    reward_name: str  # what the row's "reward" is
    batch_size: int  # episodes per update
    rewards: tuple[str, ...] = ("default",)  # the reward variants an arm may pick (see REWARD_VARIANTS)


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
TASKS = {
    "synthetic": TaskSpec(episodes=1024, hidden_size=32, reward_name="true reward (0 .. 1.5)", batch_size=32,
                          rewards=("default", "process", "process_prefix", "final", "other_vocab")),
    "verifiable": TaskSpec(episodes=4096, hidden_size=32, reward_name="accuracy", batch_size=64),
    "long": TaskSpec(episodes=2048, hidden_size=32, reward_name="true reward (0 .. 1.5)", batch_size=32),
    "multiturn": TaskSpec(episodes=768, hidden_size=32, reward_name="episode reward (0 .. 1)", batch_size=32),
    # examples/ppo_tools.py's total_episodes (768) and TaskArguments().hidden_size (64), read at run time
    "tools_env": TaskSpec(episodes=None, hidden_size=None, reward_name="accuracy", batch_size=32),
}
# The long task: the synthetic task's words and prompts, responses of up to LONG_RESPONSE_LENGTH
# tokens, one reward at the end that only a long answer earns (see long_task_reward). Its PPO
# settings are the synthetic demo's but LONG_SETTINGS: with the demo's kl_coef 0.05 the penalty
# summed over 32 tokens held every trainer near 0.4 for 4096 episodes (2 seeds; 0.01: 0.83).
LONG_RESPONSE_LENGTH = 32
LONG_TARGET_WORDS = 24
LONG_SETTINGS = {"response_length": LONG_RESPONSE_LENGTH, "kl_coef": 0.01}


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


def _examples_on_path() -> None:
    for path in (str(ROOT), str(ROOT / "examples")):
        if path not in sys.path:
            sys.path.insert(0, path)


def _quiet() -> None:
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Setting `save_embedding_layers`", category=UserWarning)


def task_settings(task_name: str, fields: set[str] | None = None) -> dict:
    """The PPO settings of ``task_name``'s example (see ``TASKS``), keeping only the keys in
    ``fields`` when given (the installed config's fields): ``DEMO_DEFAULTS`` (synthetic), with
    ``LONG_SETTINGS`` (long), ``examples/ppo_verifiable.py``'s, ``examples/ppo_multiturn.py``'s or
    ``examples/ppo_tools.py``'s (tools_env) ``PPO_DEFAULTS``. Run settings (output_dir, logging, ...)
    are the benchmark's, set on top."""
    _examples_on_path()
    if task_name in ("synthetic", "long"):
        from ppo_lora import DEMO_DEFAULTS

        settings = {**DEMO_DEFAULTS, **(LONG_SETTINGS if task_name == "long" else {})}
    elif task_name == "verifiable":
        from ppo_verifiable import PPO_DEFAULTS as settings
    elif task_name == "multiturn":
        from ppo_multiturn import PPO_DEFAULTS as settings
    elif task_name == "tools_env":
        from ppo_tools import PPO_DEFAULTS as settings
    else:
        raise ValueError(f"task {task_name!r}: pick one of {sorted(TASKS)}.")
    return {k: v for k, v in settings.items() if fields is None or k in fields}


def task_sizes(task_name: str) -> tuple[int, int]:
    """``(episodes, hidden_size)`` of ``task_name``: its ``TaskSpec``'s, or where that says None, its
    example's as they are now (tools_env: ``ppo_tools.PPO_DEFAULTS["total_episodes"]`` and
    ``ppo_tools.TaskArguments().hidden_size``), so a change of the example's defaults flows in."""
    spec = TASKS[task_name]
    episodes, hidden_size = spec.episodes, spec.hidden_size
    if task_name == "tools_env" and None in (episodes, hidden_size):
        _examples_on_path()
        from ppo_tools import PPO_DEFAULTS, TaskArguments

        episodes = episodes or PPO_DEFAULTS["total_episodes"]
        hidden_size = hidden_size or TaskArguments().hidden_size
    return episodes, hidden_size


def prepare(task_name: str, seed: int, model_dir: Path, hidden_size: int) -> None:
    """Build the models every arm of ``task_name`` starts from for ``seed``, saved to ``model_dir``:
    the reward model (synthetic), the SFT warm-up (verifiable, tools_env) or the initial policy (long,
    multiturn). Written atomically."""
    _quiet()
    _examples_on_path()
    import torch

    torch.set_num_threads(1)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if task_name in ("long", "multiturn"):  # the initial policy, so that every arm starts from the same weights
        from trl_ppo_ext.tiny import build_tiny_causal_lm

        if task_name == "long":
            from synthetic_task import build_task

            tokenizer = build_task(seed).tokenizer
        else:
            from multiturn_task import build_task

            tokenizer = build_task().tokenizer
        policy = build_tiny_causal_lm(tokenizer, seed=seed, hidden_size=hidden_size)
        policy.save_pretrained(tmp / "policy")
        info = {}
    elif task_name == "tools_env":
        info = build_tools_env_sft(seed, tmp / "sft", hidden_size, trainer_dir=tmp / "trainer")
    elif task_name == "synthetic":
        from ppo_lora import DEMO_DEFAULTS, ScriptArguments
        from synthetic_task import build_task, make_preference_pairs, train_reward_model

        script, task = ScriptArguments(), build_task(seed)
        length = DEMO_DEFAULTS["response_length"]
        pairs = make_preference_pairs(task, script.rm_pairs, seed=seed + 1, max_answer_tokens=length)
        held_out = make_preference_pairs(task, script.rm_eval_pairs, seed=seed + 2, max_answer_tokens=length)
        model, accuracy = train_reward_model(task, pairs, held_out, str(tmp / "trainer"), epochs=script.rm_epochs,
                                             seed=seed, learning_rate=script.rm_learning_rate, hidden_size=hidden_size)
        model.save_pretrained(tmp / "reward_model")
        info = {"rm_pair_accuracy": accuracy}
    else:
        from ppo_verifiable import TaskArguments
        from verifiable_task import build_task, sft_warm_up, split_pairs

        from trl_ppo_ext.tiny import build_tiny_causal_lm

        args = TaskArguments()
        task = build_task(args.operation, args.num_values)
        split = split_pairs(task, num_sft=args.num_sft_pairs, num_held_out=args.num_held_out_pairs,
                            seed=args.split_seed)
        model = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size)
        model = sft_warm_up(task, model, split.sft, str(tmp / "trainer"), max_steps=args.sft_steps,
                            learning_rate=args.sft_learning_rate, correct_fraction=args.sft_correct_fraction, seed=seed)
        model.save_pretrained(tmp / "sft")
        info = {}
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    (tmp / "info.json").write_text(json.dumps({"seed": seed, "hidden_size": hidden_size, **info}))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)


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


class RewardRecorder:
    """Reads the token ids every call of a reward model's backbone receives (a forward pre-hook),
    so the task's own reward of the scored responses is measured the same way for any trainer."""

    def __init__(self, reward_model):
        backbone = getattr(reward_model, reward_model.base_model_prefix)
        self.batches = []
        backbone.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.batches.append(ids.detach().cpu())

    def take(self):
        """The sequences recorded since the last call, as rows of token ids."""
        rows = [row.tolist() for batch in self.batches for row in batch]
        self.batches = []
        return rows


def response_after_marker(ids: list[int], marker_id: int, pad_id: int) -> list[int]:
    """The response of a scored sequence: the tokens after the first ``marker_id`` (the chat
    template's ``<assistant>``, which ends a one-turn prompt; a response may contain it again),
    without the padding at its right end.

    >>> response_after_marker([0, 4, 9, 5, 7, 5, 3, 0], marker_id=5, pad_id=0)
    [7, 5, 3]
    """
    response = ids[ids.index(marker_id) + 1 :]
    while response and response[-1] == pad_id:
        response = response[:-1]
    return response


def _rule_reward_model_class():
    import torch
    from torch import nn
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class RuleBackbone(nn.Module):
        """Returns, as its last hidden state, each sequence's rule reward at every position."""

        def __init__(self, rule):
            super().__init__()
            self.rule = rule
            self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the module a device

        def forward(self, input_ids=None, **ignored):
            rewards = torch.tensor([self.rule(row) for row in input_ids.tolist()], dtype=torch.float32)
            hidden = rewards.to(self.anchor.device)[:, None, None].expand(*input_ids.shape, 1)
            return BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=(hidden,))

    class RuleRewardModel(nn.Module):
        """A reward "model" for trainers that only take one: ``rule(token_ids) -> float`` per sequence,
        behind the ``base_model_prefix`` backbone + ``score`` head that TRL's ``get_reward`` reads."""

        base_model_prefix = "model"

        def __init__(self, rule):
            super().__init__()
            self.model = RuleBackbone(rule)
            self.score = nn.Identity()

    return RuleRewardModel


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


CRITICS = ("shared", "value_lora", "separate", "lora")


def shared_actor_critic(critic: str, policy, lora, config=None):
    """The examples' shared LoRA actor-critic; with ``critic="value_lora"`` the critic gets its own
    adapter of ``lora``'s rank and targets (the LM head excepted) on the same base. Without a value
    head when ``config`` trains no critic (a critic-free ``advantage_estimator``)."""
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    value_lora = None
    if critic == "value_lora":
        value_lora = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                target_modules=[t for t in lora.target_modules if t != "lm_head"])
    if not getattr(config, "trains_critic", True):
        return SharedActorCritic(policy, lora_config=lora, with_value=False)
    return SharedActorCritic(policy, lora_config=lora, value_lora_config=value_lora)


def critic_as(critic: str, value, lora):
    """The value model of a ``separate`` arm as it is, or of a ``lora`` arm with ``lora``'s adapter
    injected (peft, in place: the trainer sees a plain transformers model) and every weight but
    the adapter's and the ``score`` head's frozen (the optimizer takes what requires grad)."""
    if critic == "separate":
        return value
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t for t in lora.target_modules if t != "lm_head"]  # a sequence classifier has none
    value = inject_adapter_in_model(LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0,
                                               target_modules=targets), value)
    for name, param in value.named_parameters():
        param.requires_grad_("lora_" in name or name.startswith("score."))
    return value


def step_through_gae(rewards, values, response_mask, action_mask, gamma: float, lam: float,
                     value_lam: float | None = None):
    """GAE that steps through environment tokens as if they were actions (OpenRLHF, SkyRL): the
    benchmark's ``step_through`` arm, against the package's GAE over the action tokens only.

    At an environment position the reward and the value are taken as 0, but the recursion still
    steps there: each such token adds a factor ``gamma * lam`` between the action tokens around
    it, and the last action token before a reply bootstraps against ``V = 0`` instead of the value
    of the next action. Advantages and returns are then kept on the action tokens only (the loss
    never reads the others). Equivalent to::

        r, V = where(action_mask, rewards, 0), where(action_mask, values, 0)
        A, R = functional.masked_gae_decoupled(r, V, response_mask, gamma, lam, value_lam)
        A, R = where(action_mask, A, 0), where(action_mask, R, 0)

    Args:
        rewards, values: (B, T) float, the shaped rewards and the critic's values.
        response_mask: (B, T) bool, the real response tokens (a prefix per row).
        action_mask: (B, T) bool, inside ``response_mask``: the tokens the policy sampled.
        gamma, lam, value_lam: as in ``PPOConfig`` (``value_lam`` None: ``lam``).

    Returns:
        ``(advantages, returns)``, (B, T), 0 off ``action_mask``.
    """
    import torch

    from trl_ppo_ext import functional as F

    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    rewards, values = torch.where(action_mask, rewards, zero), torch.where(action_mask, values, zero)
    advantages, returns = F.masked_gae_decoupled(rewards, values, response_mask, gamma, lam, value_lam)
    return torch.where(action_mask, advantages, zero), torch.where(action_mask, returns, zero)


def step_through_trainer(base):
    """``base`` (this package's PPOTrainer) with ``compute_advantages`` replaced by
    ``step_through_gae`` on episodes with turns; rewards, KL, the loss and whitening stay over
    the action tokens, exactly as the package computes them."""
    import dataclasses as dc

    from trl_ppo_ext import functional as F

    class StepThroughTrainer(base):
        def compute_advantages(self, rollout):
            targets = super().compute_advantages(rollout)
            if rollout.action_mask is None:  # no environment tokens: nothing to step through
                return targets
            args, mask = self.args, rollout.action_mask
            if args.lam_length_alpha is not None:
                raise ValueError("the step_through arm takes a fixed lam; unset lam_length_alpha")
            advantages, returns = step_through_gae(targets.rewards, rollout.values, rollout.response_mask, mask,
                                                   args.gamma, args.lam, args.value_lam)
            mean, var = F.masked_global_mean_var(advantages, mask)
            if args.whiten_advantages:
                advantages = F.masked_global_whiten(advantages, mask)
            return dc.replace(targets, advantages=advantages, returns=returns, raw_advantage_mean=mean,
                              raw_advantage_std=var.sqrt())

    return StepThroughTrainer


# ------------------------------------------------------------------------ the tools_env task
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
    length = len(task.prompt_ids(*split.sft[0])) + task_settings("tools_env")["response_length"]
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


# ------------------------------------------------------------------------- the trl_grpo arm
# Completions per prompt of the trl_grpo arm: as this package's group arms (advantage_estimator grpo, rloo,
# reinforce_pp_baseline with num_generations=4), so a rollout batch of 32 holds 8 prompts.
GRPO_GENERATIONS = 4


def grpo_settings(ppo, episodes: int, num_generations: int = GRPO_GENERATIONS) -> dict:
    """The ``GRPOConfig`` fields of the ``trl_grpo`` arm that mirror a task's ``PPOConfig`` ``ppo``.

    Ours samples a rollout batch of ``B = per_device_train_batch_size * gradient_accumulation_steps``
    completions (one process), then takes ``num_mini_batches`` optimizer steps over it per epoch
    for ``num_ppo_epochs`` epochs. TRL GRPO gets the same shape: a generation batch of ``B``
    (``steps_per_generation = num_mini_batches`` steps of ``per_device_train_batch_size = B /
    num_mini_batches`` rows, no accumulation), reused ``num_iterations = num_ppo_epochs`` times;
    ``max_steps`` covers ``ceil(episodes / B)`` rollouts, ours' ``num_total_batches``, so both runs
    generate the same completions. Learning rate, temperature and completion budget
    (``max_completion_length = response_length``: for episodes with tools TRL's budget of the whole
    multi-turn completion, tool replies included, as our ``response_length``) are ours, and so are
    the tool loop's ``max_tool_calling_iterations`` and ``chat_template_kwargs`` (None where ``ppo``
    has none: GRPO's defaults).

    >>> from types import SimpleNamespace as NS
    >>> ppo = NS(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_mini_batches=2,
    ...          num_ppo_epochs=4, learning_rate=5e-3, temperature=0.7, response_length=10)
    >>> s = grpo_settings(ppo, 1024)
    >>> s["per_device_train_batch_size"], s["steps_per_generation"], s["num_iterations"], s["max_steps"]
    (16, 2, 4, 256)
    """
    batch, steps = ppo.per_device_train_batch_size * ppo.gradient_accumulation_steps, ppo.num_mini_batches
    if batch % steps or batch % num_generations:
        raise ValueError(f"trl_grpo: the rollout batch {batch} must split into num_mini_batches={steps} optimizer "
                         f"steps and into groups of num_generations={num_generations}.")
    rollouts = math.ceil(episodes / batch)
    return dict(per_device_train_batch_size=batch // steps, gradient_accumulation_steps=1,
                steps_per_generation=steps, num_iterations=ppo.num_ppo_epochs, num_generations=num_generations,
                max_steps=rollouts * steps * ppo.num_ppo_epochs, learning_rate=ppo.learning_rate,
                temperature=ppo.temperature, max_completion_length=ppo.response_length,
                max_tool_calling_iterations=getattr(ppo, "max_tool_calling_iterations", None),
                chat_template_kwargs=getattr(ppo, "chat_template_kwargs", None))


def grpo_lora(lora):
    """The LoRA config of the ``trl_grpo`` arm from the task's ``lora``: the same rank, alpha, dropout
    and targets, but ``lm_head`` trained whole (``modules_to_save``) instead of by an adapter.

    TRL 1.16's GRPOTrainer refuses an adapter on ``lm_head``: its fused LM head computes the
    log-probs from ``lm_head.weight`` directly, so the adapter would never be trained. Every task
    here adapts ``lm_head`` (a random tiny Llama does not learn without it, see
    ``examples/ppo_lora.py``); a full copy of the head (``vocab x hidden`` weights, 46 x 32 on the
    synthetic task, against the adapter's ``r (vocab + hidden)``) is the nearest thing TRL GRPO
    trains: ``get_output_embeddings().weight`` is then the trained copy's.
    """
    targets = list(lora.target_modules)
    if "lm_head" not in targets:
        return lora
    return dataclasses.replace(lora, target_modules=[t for t in targets if t != "lm_head"],
                               modules_to_save=[*(lora.modules_to_save or []), "lm_head"])


def prompt_texts(tokenizer, prompt_ids: list[list[int]]) -> list[str]:
    """Text prompts that ``tokenizer(text=...)`` (how TRL GRPO tokenizes a text prompt) turns back
    into exactly ``prompt_ids``: the ids decoded with their special tokens. Raises if one does not
    round-trip (a tokenizer that adds a BOS, merges words differently, ...).

    >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
    >>> prompt_texts(build_tiny_tokenizer(), [[4, 6, 7, 3, 5]])
    ['<user> w0 w1 <eos> <assistant>']
    """
    texts = [tokenizer.decode(ids) for ids in prompt_ids]
    back = tokenizer(text=texts)["input_ids"]
    for ids, text, again in zip(prompt_ids, texts, back):
        if list(again) != list(ids):
            raise ValueError(f"prompt_texts: {text!r} tokenizes to {list(again)}, not the prompt's {list(ids)}.")
    return texts


def grpo_prompts(prompts, tokenizer, keep: tuple[str, ...] = ()):
    """A ``Dataset`` for TRL GRPO from the one ours trains on: a text ``prompt`` column giving back
    its ``input_ids`` (:func:`prompt_texts`), and the columns ``keep`` (``answer``: the reward's)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompt_texts(tokenizer, prompts["input_ids"]),
                              **{name: prompts[name] for name in keep}})


def reward_model_function(reward_model, tokenizer):
    """A reward model as a reward function in TRL GRPO's convention, read as this package's trainer
    reads one: prompt ids (the text prompt tokenized as GRPO does) then the completion ids,
    scored at the last completion token (its ``<eos>`` when it stopped) by ``score_at``, with the
    positions of the valid tokens. Rows are padded on the right, so the padding is never read."""
    import torch

    from trl_ppo_ext.models.policy_value import score_at

    def reward_model_score(prompts, completion_ids, **kwargs) -> list[float]:
        rows = [list(p) + [int(t) for t in c] for p, c in zip(tokenizer(text=list(prompts))["input_ids"],
                                                             completion_ids)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            return score_at(reward_model, ids, mask, positions, index=mask.sum(1) - 1).tolist()

    return reward_model_score


def measuring(func, measure, sink):
    """``func``, a reward function in TRL GRPO's convention (keywords only), that also hands
    ``sink`` the measured reward of each completion of a call: ``measure(kwargs, rewards)``."""

    @functools.wraps(func)
    def measured(**kwargs):
        rewards = func(**kwargs)
        sink(measure(kwargs, rewards))
        return rewards

    return measured


def grpo_row(update: int, measured: list[list[float]], logs: list[dict], steps_per_rollout: int,
             extras: list[dict[str, list[float]]] | None = None) -> dict:
    """The benchmark's row of rollout ``update`` (1-based) of a ``trl_grpo`` run.

    Args:
        measured: per generation batch so far, the measured reward of each completion (the true
            reward, or the exact answer), as the reward functions saw them.
        logs: TRL's logs, one per optimizer step, each with its global ``step``; rollout ``k``
            trained in steps ``(k - 1) * steps_per_rollout + 1 .. k * steps_per_rollout``.
        extras: per generation batch, further per-completion figures by name (tools_env:
            ``call_rate``), each kept in the row as its mean; None: none.
    Returns:
        ``update``, ``episode`` (completions generated up to this rollout), ``reward`` (mean of
        its measured values), ``scored``, and the mean over its steps of what TRL logged:
        ``score`` (GRPO's ``reward``: the weighted reward it trained on), ``kl`` (only with
        beta != 0), ``entropy``, ``reward_std``, ``frac_reward_zero_std``; None where not logged; then
        the mean of each of ``extras``' figures for this rollout.
    """
    values = measured[update - 1]
    first, last = (update - 1) * steps_per_rollout + 1, update * steps_per_rollout
    mine = [log for log in logs if first <= log["step"] <= last]

    def mean(key):
        found = [log[key] for log in mine if log.get(key) is not None]
        return statistics.fmean(found) if found else None

    return {"update": update, "episode": sum(len(m) for m in measured[:update]), "reward": statistics.fmean(values),
            "scored": len(values), "score": mean("reward"), "kl": mean("kl"), "entropy": mean("entropy"),
            "explained_variance": None, "reward_std": mean("reward_std"),
            "frac_reward_zero_std": mean("frac_reward_zero_std"),
            **{key: statistics.fmean(v) for key, v in (extras[update - 1] if extras else {}).items()}}


class GRPORecorder:
    """Rows of a ``trl_grpo`` run from what its reward functions measured per generation batch
    (``measure``: the reward measured, and optionally further per-completion figures by name) and
    from TRL's per-step logs (``log``): a rollout's row is complete once the log of its last
    optimizer step arrives."""

    def __init__(self, steps_per_rollout: int):
        self.steps_per_rollout = steps_per_rollout
        self.measured: list[list[float]] = []
        self.extras: list[dict[str, list[float]]] = []
        self.logs: list[dict] = []
        self.rows: list[dict] = []

    def measure(self, values, extras: dict | None = None) -> None:
        self.measured.append([float(v) for v in values])
        self.extras.append({key: [float(v) for v in got] for key, got in (extras or {}).items()})

    def log(self, step: int, logs: dict) -> list[dict]:
        """Keep the log of optimizer step ``step``; return the rows it completes."""
        if "train_runtime" not in logs:  # the Trainer's closing summary is not a step's log
            self.logs.append({**logs, "step": step})
        new = []
        while len(self.rows) < len(self.measured) and step >= (len(self.rows) + 1) * self.steps_per_rollout:
            new.append(grpo_row(len(self.rows) + 1, self.measured, self.logs, self.steps_per_rollout, self.extras))
            self.rows.append(new[-1])
        return new


def grpo_config(task_name: str, episodes: int, *, output_dir: str, seed: int, overrides: dict | None = None):
    """``(GRPOConfig, PPOConfig)`` of the ``trl_grpo`` arm on ``task_name``: the task's PPOConfig as the
    "ours" arms get it (its example's settings, :func:`task_settings`), and the GRPOConfig
    mirroring it (:func:`grpo_settings`, ``reward_weights`` the task's), one log per optimizer
    step, everything else TRL GRPO's defaults (``beta`` 0, its ``loss_type``, ``scale_rewards``,
    ``epsilon``, ...) unless ``overrides`` (GRPOConfig fields, the arm's) say otherwise."""
    from trl import GRPOConfig

    from trl_ppo_ext import PPOConfig

    run = dict(output_dir=output_dir, eval_strategy="no", save_strategy="no", report_to="none", seed=seed, bf16=False)
    ppo = PPOConfig(**{**task_settings(task_name, {f.name for f in dataclasses.fields(PPOConfig)}), **run,
                       "total_episodes": episodes})
    weights = list(ppo.reward_weights) if ppo.reward_weights is not None else None
    config = GRPOConfig(**{**grpo_settings(ppo, episodes), "reward_weights": weights, "logging_steps": 1,
                           "disable_tqdm": True, **run, **(overrides or {})})
    return config, ppo


def run_grpo(task_name: str, arm: Arm, seed: int, *, model_dir: Path, episodes: int, hidden_size: int,
             out: Path, memory: Path | None = None) -> int:
    """The ``trl_grpo`` arm of ``run_one``: TRL's ``GRPOTrainer`` on ``task_name``'s policy, LoRA,
    prompts and reward, sized by :func:`grpo_settings` from the task's PPO settings. Returns the updates."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl import GRPOTrainer

    from trl_ppo_ext.tiny import build_tiny_causal_lm

    if task_name not in ("synthetic", "verifiable", "long", "tools_env"):
        raise ValueError(f"the trl_grpo arm runs the synthetic, verifiable, long and tools_env tasks, not "
                         f"{task_name!r}.")
    config, ppo = grpo_config(task_name, episodes, output_dir=str(out.parent / f".{out.stem}_trainer"), seed=seed,
                              overrides=arm.overrides)
    steps_per_rollout = config.steps_per_generation * config.num_iterations
    recorder = GRPORecorder(steps_per_rollout)
    environments = {}
    if task_name == "tools_env":  # the same environment, reward, policy, LoRA and prompt rows as ours
        task, policy, lora, dataset = tools_env_inputs(model_dir)
        funcs = [measuring(correct_answer, tool_calls_measured, lambda m: recorder.measure(*m))]
        environments = {"environment_factory": calculator_class()}
    elif task_name in ("synthetic", "long"):
        from synthetic_task import build_task

        task = build_task(seed)
        if task_name == "synthetic":  # built exactly as the "ours" arms build it (same seed, same draws)
            policy = build_tiny_causal_lm(task.tokenizer, seed=seed, hidden_size=hidden_size)
        else:
            policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
        prompts, lora = demo_prompts_and_lora(task, seed, ppo.response_length, policy)
        dataset = grpo_prompts(prompts, task.tokenizer)
        if task_name == "synthetic":
            reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir / "reward_model").eval()
            truth = lambda kwargs, rewards: [task.true_reward(None, [int(t) for t in c])  # noqa: E731
                                             for c in kwargs["completion_ids"]]
            funcs = [measuring(reward_model_function(reward_model, task.tokenizer), truth, recorder.measure)]
        else:
            def long_reward(completion_ids, **kwargs):
                return [long_task_reward(task, [int(t) for t in c]) for c in completion_ids]

            funcs = [measuring(long_reward, lambda kwargs, rewards: rewards, recorder.measure)]
    else:
        from ppo_verifiable import TaskArguments, ppo_prompts, reward_functions
        from verifiable_task import build_task, split_pairs

        task_args = TaskArguments()
        task = build_task(task_args.operation, task_args.num_values)
        split = split_pairs(task, num_sft=task_args.num_sft_pairs, num_held_out=task_args.num_held_out_pairs,
                            seed=task_args.split_seed)
        policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
        dataset = grpo_prompts(ppo_prompts(task, split.ppo[: task_args.max_ppo_pairs]), task.tokenizer,
                               keep=("answer",))
        lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                          target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
        funcs = reward_functions(task, ppo, task_args)  # exact_answer first: its values are the accuracy
        funcs[0] = measuring(funcs[0], lambda kwargs, rewards: rewards, recorder.measure)
    lora = grpo_lora(lora)

    partial = out.with_suffix(".partial")
    handle = partial.open("w")

    class Rows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            for row in recorder.log(state.global_step, logs or {}):
                handle.write(json.dumps(row) + "\n")
                handle.flush()

    trainer = GRPOTrainer(model=policy, reward_funcs=funcs, args=config, train_dataset=dataset,
                          processing_class=task.tokenizer, peft_config=lora, callbacks=[Rows()], **environments)
    train_s = timed_train(trainer, memory)
    handle.close()
    updates = config.max_steps // steps_per_rollout
    with partial.open("a") as f:
        f.write(json.dumps({"done": True, "train_s": train_s, "updates": updates}) + "\n")
    shutil.rmtree(config.output_dir, ignore_errors=True)
    return updates


# ----------------------------------------------------------------------------- one run
# The memory run (--memory): one short process per arm, seed 0, this many updates, training inside
# live_tensor_bytes (every ATen op goes through Python there, so it is never a timed run).
MEMORY_UPDATES = 2
MEMORY_SEED = 0
MIB = 2**20


def timed_train(trainer, memory: Path | None = None) -> float:
    """``trainer.train()``; returns its wall seconds. With ``memory`` (a path), training runs inside
    ``trl_ppo_ext.memory.live_tensor_bytes`` with every tensor alive at the start counted (the
    models, the optimizer's state once made, ...), and the peak of live tensor bytes is written
    there as JSON: ``{"peak_live_tensors_mib", "start_live_tensors_mib", "train_s"}``."""
    if memory is None:
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start
    from trl_ppo_ext.memory import live_tensor_bytes

    with live_tensor_bytes() as live:
        live.count_existing()
        at_start = live.current
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
    result = {"peak_live_tensors_mib": live.peak / MIB, "start_live_tensors_mib": at_start / MIB, "train_s": train_s}
    tmp = memory.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, memory)
    return train_s


def run_one(task_name: str, arm: Arm, seed: int, *, model_dir: Path, episodes: int, hidden_size: int,
            out: Path, memory: Path | None = None) -> int:
    """Train one (arm, seed); write a row per update to ``out`` (``.partial`` until done). Returns the updates.
    With ``memory``, training runs inside the live-tensor tracker and its peak goes there (:func:`timed_train`)."""
    _quiet()
    _examples_on_path()
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback, set_seed

    torch.set_num_threads(1)
    set_seed(seed)
    variants = TASKS[task_name].rewards
    if arm.reward not in variants:
        raise ValueError(f"reward variant {arm.reward!r}: the {task_name} task has {', '.join(map(repr, variants))}.")
    if arm.trainer not in TRAINERS:
        raise ValueError(f"trainer={arm.trainer!r}: pick one of {', '.join(map(repr, TRAINERS))}.")
    if arm.critic not in CRITICS or (arm.critic != "shared" and arm.trainer != "ours"):
        raise ValueError(f"critic={arm.critic!r}: this package's arms take {', '.join(map(repr, CRITICS))}; the "
                         "trl112 arm always has TRL's separate value model, the trl_grpo arm none.")
    if arm.reward != "default" and arm.trainer != "ours":
        raise ValueError(f"reward variant {arm.reward!r} needs this package's trainer; TRL 1.12's takes one reward "
                         "model of the policy's vocabulary, and the trl_grpo arm trains on the task's own reward.")
    if arm.gae not in GAE_MODES or (arm.gae != "actions" and arm.trainer != "ours"):
        raise ValueError(f"gae={arm.gae!r}: this package's arms take {', '.join(map(repr, GAE_MODES))}.")
    if task_name == "multiturn" and arm.trainer == "trl112":
        raise ValueError("the multiturn task needs rollout_func, which TRL 1.12's PPOTrainer does not take.")
    if task_name == "tools_env" and arm.trainer == "trl112":
        raise ValueError("the tools_env task needs environment_factory, which TRL 1.12's PPOTrainer does not take.")
    if task_name == "multiturn" and arm.trainer == "trl_grpo":
        raise ValueError("the multiturn task is not run by the trl_grpo arm: the example's rollout_func samples its "
                         "turns with this package's trainer.generate_continuations, which TRL's GRPOTrainer does not "
                         "have. Run trl_grpo on the synthetic, verifiable or long task.")
    if arm.trainer == "trl_grpo":
        return run_grpo(task_name, arm, seed, model_dir=model_dir, episodes=episodes, hidden_size=hidden_size,
                        out=out, memory=memory)
    if arm.trainer == "trl112":
        from trl_ppo_ext._compat import load_trl_ppo

        trainer_cls, config_cls, _ = load_trl_ppo()
    else:
        from trl_ppo_ext import PPOConfig as config_cls
        from trl_ppo_ext import PPOTrainer as trainer_cls

        if arm.gae == "step_through":
            trainer_cls = step_through_trainer(trainer_cls)

    names = {f.name for f in dataclasses.fields(config_cls)}
    batch_extras: dict = {}  # further figures of the update's rollout a task's batch_reward sets (tools_env)
    common = dict(output_dir=str(out.parent / f".{out.stem}_trainer"), total_episodes=episodes,
                  num_sample_generations=0, eval_strategy="no", save_strategy="no", logging_steps=1,
                  report_to="none", disable_tqdm=True, seed=seed, bf16=False)
    if task_name == "synthetic":
        from synthetic_task import build_task

        from trl_ppo_ext.tiny import build_tiny_causal_lm

        task = build_task(seed)
        # other_vocab: the reward model, then a zero-weight function that only measures the true reward
        weights = {"reward_weights": [1.0, 0.0]} if arm.reward == "other_vocab" else {}
        config = config_cls(**{**task_settings(task_name, names), **common, **weights, **arm.overrides})
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
        if arm.trainer == "trl112":
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "reward_model")
            models.update(model=policy, ref_model=None, value_model=value, peft_config=lora,
                          train_dataset=prompts.select_columns(["input_ids"]))  # TRL's collator pads every column
        elif arm.critic in ("separate", "lora"):
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "reward_model")
            models.update(model=policy, ref_model=None, value_model=critic_as(arm.critic, value, lora),
                          peft_config=lora)
        else:
            models.update(model=shared_actor_critic(arm.critic, policy, lora, config), ref_model=None, value_model=None)
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
    elif task_name == "long":
        from synthetic_task import build_task

        task = build_task(seed)
        config = config_cls(**{**task_settings(task_name, names), **common, **arm.overrides})
        policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
        prompts, lora = demo_prompts_and_lora(task, seed, config.response_length, policy)
        marker, pad = task.tokenizer.convert_tokens_to_ids("<assistant>"), task.tokenizer.pad_token_id
        seen: list[float] = []
        if arm.trainer == "trl112" or arm.critic in ("separate", "lora"):  # TRL's example: a value model, fresh head
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "policy", num_labels=1)
            models = dict(model=policy, ref_model=None, value_model=critic_as(arm.critic, value, lora),
                          peft_config=lora)
        else:
            models = dict(model=shared_actor_critic(arm.critic, policy, lora, config), ref_model=None, value_model=None)
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
    elif task_name == "multiturn":
        from multiturn_task import build_task, make_reward, make_rollout_func, prompt_dataset
        from ppo_multiturn import TaskArguments

        task_args = TaskArguments()
        task = build_task(task_args.first_turn_tokens)
        config = config_cls(**{**task_settings(task_name, names), **common, **arm.overrides})
        policy = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
        lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                          target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
        if arm.critic in ("separate", "lora"):
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "policy", num_labels=1)
            models = dict(model=policy, ref_model=None, value_model=critic_as(arm.critic, value, lora),
                          peft_config=lora)
        else:
            models = dict(model=shared_actor_critic(arm.critic, policy, lora), ref_model=None, value_model=None)
        models.update(reward_model=None, reward_funcs=[make_reward(task)], rollout_func=make_rollout_func(task),
                      train_dataset=prompt_dataset(task, repeats=task_args.train_repeats))

        def batch_reward(logs):
            return logs.get("rewards/multiturn_reward/mean"), None
    elif task_name == "tools_env":
        task, policy, lora, dataset = tools_env_inputs(model_dir)
        config = config_cls(**{**task_settings(task_name, names), **common, **arm.overrides})
        if arm.critic in ("separate", "lora"):
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "sft", num_labels=1)
            models = dict(model=policy, ref_model=None, value_model=critic_as(arm.critic, value, lora),
                          peft_config=lora)
        else:
            models = dict(model=shared_actor_critic(arm.critic, policy, lora, config), ref_model=None, value_model=None)
        seen: list[tuple[list[float], dict]] = []  # per reward call: the rewards and the call rates
        models.update(reward_model=None, reward_funcs=[measuring(correct_answer, tool_calls_measured, seen.append)],
                      environment_factory=calculator_class(), train_dataset=dataset)

        def batch_reward(logs):
            values = [v for rewards, _ in seen for v in rewards]
            calls = [c for _, extras in seen for c in extras["call_rate"]]
            seen.clear()
            batch_extras["call_rate"] = statistics.fmean(calls) if calls else None
            return (statistics.fmean(values) if values else None), len(values)
    else:
        from ppo_verifiable import PPO_DEFAULTS, TaskArguments, ppo_prompts, reward_functions
        from verifiable_task import build_task, split_pairs

        task_args = TaskArguments()
        task = build_task(task_args.operation, task_args.num_values)
        split = split_pairs(task, num_sft=task_args.num_sft_pairs, num_held_out=task_args.num_held_out_pairs,
                            seed=task_args.split_seed)
        weights = tuple(PPO_DEFAULTS["reward_weights"])
        config = config_cls(**{**task_settings(task_name, names), **common, **arm.overrides})
        policy = AutoModelForCausalLM.from_pretrained(model_dir / "sft")
        prompts = ppo_prompts(task, split.ppo[: task_args.max_ppo_pairs])
        lora = LoraConfig(r=task_args.lora_r, lora_alpha=task_args.lora_alpha, lora_dropout=0.0,
                          target_modules=task_args.lora_target_modules, task_type="CAUSAL_LM")
        rule = verifiable_rule(task, weights=weights, response_length=config.response_length,
                               overlong_cache=task_args.soft_overlong_cache)
        if arm.trainer == "trl112":
            rule_model = _rule_reward_model_class()(lambda ids: rule(ids)[0])
            recorder = RewardRecorder(rule_model)
            value = AutoModelForSequenceClassification.from_pretrained(model_dir / "sft", num_labels=1)
            models = dict(model=policy, ref_model=None, value_model=value, peft_config=lora, reward_model=rule_model,
                          train_dataset=prompts.select_columns(["input_ids"]))

            def batch_reward(logs):
                rows = recorder.take()
                values = [rule(r)[1] for r in rows]
                return (sum(values) / len(values) if values else None), len(values)
        else:
            if arm.critic in ("separate", "lora"):
                value = AutoModelForSequenceClassification.from_pretrained(model_dir / "sft", num_labels=1)
                models = dict(model=policy, ref_model=None, value_model=critic_as(arm.critic, value, lora),
                              peft_config=lora)
            else:
                models = dict(model=shared_actor_critic(arm.critic, policy, lora, config), ref_model=None,
                              value_model=None)
            models.update(reward_model=None, reward_funcs=reward_functions(task, config, task_args),
                          train_dataset=prompts)

            def batch_reward(logs):
                return logs.get("rewards/exact_answer/mean"), None

    partial = out.with_suffix(".partial")
    handle = partial.open("w")

    class Rows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "episode" not in logs:
                return
            reward, scored = batch_reward(logs)
            row = {"update": state.global_step, "episode": logs["episode"], "reward": reward, "scored": scored,
                   **{key: logs.get(metric) for key, metric in LOGGED.items()}, **batch_extras}
            handle.write(json.dumps(row) + "\n")
            handle.flush()

    trainer = trainer_cls(args=config, processing_class=task.tokenizer, callbacks=[Rows()], **models)
    train_s = timed_train(trainer, memory)
    handle.close()
    updates = config.num_total_batches
    with partial.open("a") as f:
        f.write(json.dumps({"done": True, "train_s": train_s, "updates": updates}) + "\n")
    shutil.rmtree(config.output_dir, ignore_errors=True)
    return updates


# ------------------------------------------------------------------------ reading the logs
@dataclass
class Run:
    """One (arm, seed): its per-update rows, and why it crashed (None if it did not)."""

    seed: int
    rows: list[dict]
    crashed: str | None = None
    train_s: float | None = None


def read_run(path: Path, seed: int) -> Run | None:
    """The run in ``path``; None if it is missing or incomplete. A run whose rows hold a
    non-finite reward, KL or entropy counts as crashed."""
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or not lines[-1].get("done"):
        return None
    end, rows = lines[-1], lines[:-1]
    run = Run(seed=seed, rows=rows, crashed=end.get("reason") if end.get("crashed") else None,
              train_s=end.get("train_s"))
    if run.crashed is None:
        for row in rows:
            bad = [k for k in ("reward", "kl", "entropy") if row.get(k) is not None and not math.isfinite(row[k])]
            if bad:
                run.crashed = f"non-finite {', '.join(bad)} at update {row['update']}"
                break
        if run.crashed is None and end.get("updates") is not None and len(rows) < end["updates"]:
            run.crashed = f"stopped after {len(rows)} of {end['updates']} updates"
    return run


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values up to each position (fewer at the start).

    >>> trailing_mean([1.0, 3.0, 5.0, 7.0], 2)
    [1.0, 2.0, 4.0, 6.0]
    """
    return [sum(values[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def value_at(run: Run, key: str, episode: float, window: int) -> float | None:
    """The mean of ``key`` over the ``window`` updates that end at the last update with
    ``episode`` episodes or fewer; None without such an update or values."""
    done = [r for r in run.rows if r["episode"] <= episode and r.get(key) is not None]
    if not done:
        return None
    last = done[-window:]
    return sum(r[key] for r in last) / len(last)


def episodes_to_reach(run: Run, threshold: float, window: int) -> int | None:
    """The first episode at which the trailing ``window``-update mean reward reaches ``threshold``."""
    rows = [r for r in run.rows if r.get("reward") is not None]
    for row, mean in zip(rows, trailing_mean([r["reward"] for r in rows], window)):
        if mean >= threshold:
            return row["episode"]
    return None


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def _mean(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.fmean(values):.3g}" if values else "n/a"


def _median(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.3g}" if values else "n/a"


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def final_reward(runs: list[Run], episodes: int, window: int) -> float | None:
    """Mean over the runs that did not crash of each one's final reward."""
    values = [value_at(r, "reward", episodes, window) for r in runs if r.crashed is None]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def ms_per_episode(run: Run) -> float | None:
    """Training wall time per episode of a finished run, in ms: ``train_s`` over its last row's
    ``episode``; None without either (a crashed run has no ``train_s``)."""
    if run.train_s is None or not run.rows or not run.rows[-1].get("episode"):
        return None
    return 1000.0 * run.train_s / run.rows[-1]["episode"]


def read_memory(path: Path) -> float | None:
    """The peak of live tensors (MiB) a memory run wrote to ``path``; None if there is none."""
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("peak_live_tensors_mib")


def table(runs_by_arm: dict[str, list[Run]], *, episodes: int, threshold: float | None, window: int,
          expected_seeds: int, memory: dict[str, float | None] | None = None) -> str:
    """The markdown table of the module docstring; with ``memory`` (arm -> peak MiB or None) a last
    column of the memory runs' peaks; where any row has a ``call_rate`` (tools_env), a column of it
    at the first update and at the end (the mean of the last ``window`` updates), each mean +- sd
    over the seeds."""
    calls = any("call_rate" in row for runs in runs_by_arm.values() for r in runs for row in r.rows)
    head = ("| arm | runs | crashed | reward at half | final reward | episodes to threshold (median, reached) "
            "| final KL | final entropy | final expl. var. | train s / run | ms / episode (median) |")
    if calls:
        head += " call rate: first update → final |"
    if memory is not None:
        head += " peak live tensors (MiB) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, runs in runs_by_arm.items():
        ok = [r for r in runs if r.crashed is None]
        half = [value_at(r, "reward", episodes / 2, window) for r in ok]
        final = [value_at(r, "reward", episodes, window) for r in ok]
        reach = "n/a"
        if threshold is not None and ok:
            hits = [episodes_to_reach(r, threshold, window) for r in ok]
            reached = sorted(h for h in hits if h is not None)
            # unreached runs count as "more than the budget" for the median
            ordered = reached + [math.inf] * (len(hits) - len(reached))
            median = statistics.median_low(ordered) if len(ordered) % 2 else statistics.median(ordered)
            shown = "> budget" if math.isinf(median) else f"{median:.0f}"
            reach = f"{shown} ({len(reached)}/{len(hits)})"
        lines.append(
            f"| {name} | {len(ok)}/{max(expected_seeds, len(runs))} | {len(runs) - len(ok)} | {_mean_sd(half)} "
            f"| {_mean_sd(final)} | {reach} "
            f"| {_mean([value_at(r, 'kl', episodes, window) for r in ok])} "
            f"| {_mean([value_at(r, 'entropy', episodes, window) for r in ok])} "
            f"| {_mean([value_at(r, 'explained_variance', episodes, window) for r in ok])} "
            f"| {_mean([r.train_s for r in runs if r.train_s is not None])} "
            f"| {_median([ms_per_episode(r) for r in runs])} |"
            + (f" {_mean_sd([r.rows[0].get('call_rate') for r in ok if r.rows])} → "
               f"{_mean_sd([value_at(r, 'call_rate', episodes, window) for r in ok])} |" if calls else "")
            + (f" {_number(memory.get(name), '.1f')} |" if memory is not None else "")
        )
    return "\n".join(lines)


def curves(runs: list[Run], key: str, window: int) -> tuple[list[int], list[float], list[float]]:
    """Episodes, mean and standard deviation over the runs that did not crash of the trailing
    ``window``-update mean of ``key`` (updates every run has)."""
    ok = [r for r in runs if r.crashed is None and r.rows and all(x.get(key) is not None for x in r.rows)]
    if not ok:
        return [], [], []
    n = min(len(r.rows) for r in ok)
    series = [trailing_mean([x[key] for x in r.rows[:n]], window) for r in ok]
    episodes = [x["episode"] for x in ok[0].rows[:n]]
    means = [statistics.fmean(col) for col in zip(*series)]
    sds = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*series)]
    return episodes, means, sds


def plot(runs_by_arm: dict[str, list[Run]], path: Path, *, title: str, reward_name: str, threshold: float | None,
         episodes: int, window: int) -> None:
    """Mean reward (trailing ``window``-update mean) against episodes with a +-1 sd band per arm;
    KL and token entropy beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    for i, (name, runs) in enumerate(runs_by_arm.items()):
        color = f"C{i % 10}"  # one colour per arm in every panel, also where an arm logs no KL
        for ax, key in zip(axes, ("reward", "kl", "entropy")):
            x, mean, sd = curves(runs, key, window)
            if not x:
                continue
            ok = sum(r.crashed is None for r in runs)
            ax.plot(x, mean, label=f"{name} ({ok} seeds)" if key == "reward" else None, lw=1.5, color=color)
            ax.fill_between(x, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=color, alpha=0.2, lw=0)
    if threshold is not None:
        axes[0].axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold:.3f}")
    axes[0].axvline(episodes / 2, color="gray", ls=":", lw=1)
    axes[0].set(title=title, xlabel="episodes", ylabel=f"{reward_name}, mean of {window} updates")
    axes[1].set(title="objective/kl", xlabel="episodes")
    axes[2].set(title="policy/entropy_avg (nats)", xlabel="episodes")
    axes[0].legend(fontsize=8, loc="best")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# ------------------------------------------------------------------------------- the driver
# The trl_grpo arm is measured against this TRL's GRPOTrainer (environment_factory, the tool parser and
# the chat-template helpers the tools_env task needs arrived by 1.16).
TRL_GRPO_MIN = "1.16"


def trl_grpo_ok() -> str | None:
    """None if this python's TRL can run the ``trl_grpo`` arm (TRL >= ``TRL_GRPO_MIN`` whose
    ``GRPOTrainer`` imports), else why not."""
    import importlib.metadata

    from packaging.version import Version

    try:
        installed = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "TRL is not installed"
    if Version(installed) < Version(TRL_GRPO_MIN):
        return f"the trl_grpo arm needs TRL >= {TRL_GRPO_MIN}, this python has {installed}"
    try:
        from trl import GRPOTrainer  # noqa: F401
    except Exception as err:  # TRL's lazy module wraps the import error in a RuntimeError
        return f"trl.GRPOTrainer does not import here: {err}"
    return None


def trl_python_ok(python: str) -> str | None:
    """None if ``python`` has a TRL with a PPO trainer, else why not."""
    if not python or not Path(python).exists():
        return f"--trl-python {python!r} does not exist"
    probe = "import trl.experimental.ppo as m; print(m.PPOTrainer.__name__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"--trl-python {python!r} failed: {err}"
    if done.returncode:
        return f"--trl-python {python!r} has no trl.experimental.ppo.PPOTrainer (TRL 1.0 - 1.12 has one)"
    return None


def _subprocess(cmd: list[str], log: Path, timeout: float) -> str | None:
    """Run ``cmd`` with its output in ``log``; None on success, else why it failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("w") as f:
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    if done.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"exit {done.returncode}: {tail[0][:300]}"
    return None


def execute(args, task_dir: Path, arms: dict[str, Arm], seeds: list[int], python_for: dict[str, str]) -> None:
    """Prepare the models of every seed, then run every (arm, seed) whose file is not complete; with
    ``--memory``, then one memory run per arm that has no ``memory.json`` yet (see ``timed_train``)."""
    script = str(Path(__file__).resolve())
    size = ["--episodes", str(args.episodes), "--hidden-size", str(args.hidden_size)]

    def prepare_seed(seed):
        model_dir = task_dir / "_models" / f"seed{seed}"
        if (model_dir / "info.json").is_file():
            return None
        cmd = [sys.executable, script, "--task", args.task, "--prepare", str(seed), "--out", str(args.out), *size]
        return _subprocess(cmd, task_dir / "_models" / f"seed{seed}.log", args.timeout)

    def train(arm_name, seed):
        out = task_dir / arm_name / f"{seed}.jsonl"
        arm = arms[arm_name]
        cmd = [python_for[arm.trainer], script, "--task", args.task, "--run", arm_name, str(seed),
               "--arm-json", json.dumps(dataclasses.asdict(arm)), "--out", str(args.out), *size]
        start = time.perf_counter()
        why = _subprocess(cmd, out.with_suffix(".log"), args.timeout)
        partial = out.with_suffix(".partial")
        if why is not None:
            with partial.open("a") as f:
                f.write(json.dumps({"done": True, "crashed": True, "reason": why}) + "\n")
        os.replace(partial, out)
        return f"{arm_name} seed {seed}: {'crashed, ' + why if why else 'done'} ({time.perf_counter() - start:.0f} s)"

    def measure_memory(arm_name):
        arm, arm_dir = arms[arm_name], task_dir / arm_name
        episodes = MEMORY_UPDATES * TASKS[args.task].batch_size
        cmd = [python_for[arm.trainer], script, "--task", args.task, "--run", arm_name, str(MEMORY_SEED),
               "--arm-json", json.dumps(dataclasses.asdict(arm)), "--out", str(args.out), "--memory",
               "--episodes", str(episodes), "--hidden-size", str(args.hidden_size)]
        start = time.perf_counter()
        why = _subprocess(cmd, arm_dir / "memory.log", args.timeout)
        if (arm_dir / "memory.partial").is_file():
            os.replace(arm_dir / "memory.partial", arm_dir / "memory.jsonl")
        peak = read_memory(arm_dir / "memory.json")
        return (f"{arm_name} memory run: " + (f"failed, {why}" if why else f"peak live tensors {peak:.1f} MiB")
                + f" ({time.perf_counter() - start:.0f} s)")

    (task_dir / "_models").mkdir(parents=True, exist_ok=True)
    prepared = sorted(set(seeds) | ({MEMORY_SEED} if args.memory else set()))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for seed, why in zip(prepared, pool.map(prepare_seed, prepared)):
            if why is not None:
                raise SystemExit(f"preparing the models of seed {seed} failed ({why}); see "
                                 f"{task_dir / '_models' / f'seed{seed}.log'}")
        todo = []
        for arm_name in arms:
            (task_dir / arm_name).mkdir(exist_ok=True)
            for seed in seeds:
                run = read_run(task_dir / arm_name / f"{seed}.jsonl", seed)
                if run is None or (args.rerun_crashed and run.crashed is not None):
                    todo.append((arm_name, seed))
        print(f"{len(todo)} runs to do ({args.jobs} at a time)", flush=True)
        for line in pool.map(lambda job: train(*job), todo):
            print(line, flush=True)
        if args.memory:
            pending = [name for name in arms if not (task_dir / name / "memory.json").is_file()]
            print(f"{len(pending)} memory runs to do", flush=True)
            for line in pool.map(measure_memory, pending):
                print(line, flush=True)


def episode_mismatch(runs_by_arm: dict[str, list[Run]]) -> str | None:
    """None when every finished run's rows have the same ``episode`` column (the arms generated the
    same completions per update), else which runs differ from the first one's.

    >>> rows = lambda *episodes: [{"episode": e} for e in episodes]
    >>> episode_mismatch({"a": [Run(0, rows(32, 64))], "b": [Run(0, rows(32, 64)), Run(1, rows(32, 64))]}) is None
    True
    >>> episode_mismatch({"a": [Run(0, rows(32, 64))], "b": [Run(1, rows(32, 60))]})
    'episodes per update differ from a seed 0: b seed 1'
    """
    runs = [(name, r) for name, rs in runs_by_arm.items() for r in rs if r.crashed is None]
    if not runs:
        return None
    (first_name, first), *rest = runs
    episodes = [row["episode"] for row in first.rows]
    odd = [f"{name} seed {r.seed}" for name, r in rest if [row["episode"] for row in r.rows] != episodes]
    return f"episodes per update differ from {first_name} seed {first.seed}: {', '.join(odd)}" if odd else None


def report(args, task_dir: Path, arm_names: list[str], seeds: list[int]) -> str:
    """Read every run of ``arm_names``; write the table and the plot; return the table."""
    runs_by_arm = {}
    for name in arm_names:
        runs = [read_run(task_dir / name / f"{s}.jsonl", s) for s in seeds]
        runs_by_arm[name] = [r for r in runs if r is not None]
    threshold, source = args.threshold, "--threshold"
    if threshold is None and runs_by_arm.get("trl112"):
        threshold, source = final_reward(runs_by_arm["trl112"], args.episodes, args.window), "trl112's final reward"
    spec = TASKS[args.task]
    memory = {name: read_memory(task_dir / name / "memory.json") for name in arm_names}
    text = table(runs_by_arm, episodes=args.episodes, threshold=threshold, window=args.window,
                 expected_seeds=len(seeds), memory=memory if any(v is not None for v in memory.values()) else None)
    header = (f"task {args.task}: reward = {spec.reward_name} of each update's rollout; {args.episodes} episodes "
              f"({args.episodes // spec.batch_size} updates of {spec.batch_size}), hidden size {args.hidden_size}, "
              f"seeds {seeds[0]}..{seeds[-1]}; values are the mean of the {args.window} updates ending there, "
              f"mean ± sd over seeds")
    header += (f"; threshold {threshold:.3f} ({source})" if threshold is not None else "; no threshold")
    if any(v is not None for v in memory.values()):
        header += (f"; peak live tensors: one run per arm, seed {MEMORY_SEED}, {MEMORY_UPDATES} updates, inside "
                   "trl_ppo_ext.memory.live_tensor_bytes (models included)")
    mismatch = episode_mismatch(runs_by_arm)
    if mismatch:
        header += f"; WARNING: {mismatch}"
    text = header + "\n\n" + text
    (task_dir / "table.md").write_text(text + "\n")
    plot(runs_by_arm, task_dir.parent / f"{args.task}.png", title=f"{args.task} task, {len(seeds)} seeds",
         reward_name=spec.reward_name, threshold=threshold, episodes=args.episodes, window=args.window)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="synthetic")
    p.add_argument("--arms", nargs="+", default=["trl112", "defaults"], help="arm names (see --list-arms)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:field=value,...",
                   help="add an arm: PPOConfig overrides (JSON values); reward=VARIANT, trainer=trl112 also")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 (default 8)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--episodes", type=int, default=None, help="episodes per run (default: the example's)")
    p.add_argument("--hidden-size", type=int, default=None, help="tiny models' hidden size (default: the example's)")
    p.add_argument("--window", type=int, default=4, help="updates averaged for each reported value (default 4)")
    p.add_argument("--threshold", type=float, default=None,
                   help="reward to reach (default: the trl112 arm's mean final reward)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run counts as crashed")
    p.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON, help="a python with TRL <= 1.12 for the trl112 arm")
    p.add_argument("--out", type=Path, default=Path("outputs/sample_efficiency"))
    p.add_argument("--rerun-crashed", action="store_true")
    p.add_argument("--report-only", action="store_true", help="only read the logs: table and plot")
    p.add_argument("--memory", action="store_true",
                   help=f"per arm, one more run (seed {MEMORY_SEED}, {MEMORY_UPDATES} updates) inside the live-tensor "
                   "tracker: DIR/<task>/<arm>/memory.json, a table column")
    p.add_argument("--list-arms", action="store_true")
    p.add_argument("--prepare", type=int, metavar="SEED", help=argparse.SUPPRESS)
    p.add_argument("--run", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--arm-json", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    episodes, hidden_size = task_sizes(args.task)
    args.episodes = args.episodes or episodes
    args.hidden_size = args.hidden_size or hidden_size
    task_dir = args.out / args.task
    if args.prepare is not None:
        prepare(args.task, args.prepare, task_dir / "_models" / f"seed{args.prepare}", args.hidden_size)
        return 0
    if args.run is not None:
        arm_name, seed = args.run[0], int(args.run[1])
        arm_dir = task_dir / arm_name
        out, memory = (arm_dir / "memory.jsonl", arm_dir / "memory.json") if args.memory else (
            arm_dir / f"{seed}.jsonl", None)
        run_one(args.task, Arm(**json.loads(args.arm_json)), seed, model_dir=task_dir / "_models" / f"seed{seed}",
                episodes=args.episodes, hidden_size=args.hidden_size, out=out, memory=memory)
        return 0

    arms = dict(ARMS)
    arms.update(parse_arm(text) for text in args.arm)
    if args.list_arms:
        for name, arm in arms.items():
            gae = f" gae={arm.gae}" if arm.gae != "actions" else ""
            print(f"{name:14} {arm.trainer:8} reward={arm.reward:8}{gae} {json.dumps(arm.overrides)}  {arm.note}")
        return 0
    wanted = list(dict.fromkeys(args.arms + [parse_arm(t)[0] for t in args.arm]))
    unknown = [a for a in wanted if a not in arms]
    if unknown:
        raise SystemExit(f"--arms {unknown}: unknown; pick from {sorted(arms)} or add one with --arm.")
    sys.path.insert(0, str(ROOT))
    from trl import GRPOConfig

    from trl_ppo_ext import PPOConfig

    config_fields = {"ours": {f.name for f in dataclasses.fields(PPOConfig)},
                     "trl_grpo": {f.name for f in dataclasses.fields(GRPOConfig)}}
    chosen = {}
    for name in wanted:
        trainer = arms[name].trainer
        missing = missing_fields(arms[name], config_fields.get(trainer, config_fields["ours"]))
        if missing:
            print(f"note: arm {name!r} left out: {'GRPOConfig' if trainer == 'trl_grpo' else 'PPOConfig'} here has "
                  f"no {', '.join(missing)}")
        elif arms[name].trainer == "trl112" and (why := trl_python_ok(args.trl_python)):
            print(f"note: arm {name!r} left out: {why}")
        elif arms[name].trainer == "trl_grpo" and not args.report_only and (why := trl_grpo_ok()):
            # (reading the logs needs no GRPOTrainer)
            print(f"note: arm {name!r} left out: {why}")
        else:
            chosen[name] = arms[name]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if not args.report_only:
        python_for = {"ours": sys.executable, "trl_grpo": sys.executable, "trl112": args.trl_python}
        execute(args, task_dir, chosen, seeds, python_for)
    print(report(args, task_dir, list(chosen), seeds))
    print(f"table: {task_dir / 'table.md'}\nplot: {args.out / (args.task + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
