"""Sample efficiency: reward against episodes, over seeds, for named arms.

    python benchmarks/sample_efficiency --task synthetic --arms trl112 defaults --seeds 8 --out DIR
    python benchmarks/sample_efficiency --task verifiable --arms trl112 defaults recipe --out DIR
    python benchmarks/sample_efficiency --task long --arms trl_grpo defaults --memory --out DIR
    python benchmarks/sample_efficiency --task tools_env --arms defaults trl_grpo --out DIR
    python benchmarks/sample_efficiency --task gem_guess --arms trl_grpo defaults --arm vl:critic=value_lora --out DIR
    python benchmarks/sample_efficiency --list-arms

An *arm* is a name for a way to train: config overrides on top of the task's settings, which
trainer runs them (``TRAINERS``: ``ours``, this package's PPOTrainer; ``trl112``, TRL 1.12's own
``trl.experimental.ppo.PPOTrainer``; ``trl_grpo``, TRL's own ``trl.GRPOTrainer``, see ``trl_grpo.py``) and
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
``trainer.train()``; a row's ``time_s``: those seconds when its update ended); a run that raises,
times out, stops early or logs a non-finite value is kept as *crashed* (its file ends ``{"done":
true, "crashed": true, "reason": ...}``), never dropped. Complete files are skipped, so an
interrupted benchmark resumes where it stopped (``--rerun-crashed`` runs crashed ones again).

The tasks (``TASKS``, one module each under ``tasks/``: ``synthetic``, ``verifiable``, ``long``,
``multiturn``, ``tools_env``, ``gem_guess``) say what their runs share and what their ``reward`` is. TRL 1.12's
trainer needs a separate value model: as TRL's example script does, it is initialised from the
reward model (synthetic) or, with no reward model, from the initial policy with a fresh score head.
This package's arms use the shared LoRA actor-critic of the examples (value head on the policy's
backbone), or the critic ``Arm.critic`` names (``critics.py``).

With ``--memory`` each arm also gets one more short run (seed 0, ``MEMORY_UPDATES`` = 2 updates)
with training inside ``trl_ppo_ext.memory.live_tensor_bytes`` (tensors alive at its start, the
models, counted); its peak goes to ``DIR/<task>/<arm>/memory.json`` and a column "peak live
tensors (MiB)" (the tracker runs Python on every op, so this run is never a timed one). TRL GRPO's
peak on these tiny models is mostly its fused LM head's scratch tile, ``tokens x 32768`` float32
whatever the vocabulary (28 MiB for 224 tokens); the trl112 arm's memory run goes through the same
code in its own python, untested where that python is missing.

The modules: ``arms`` (the arms and ``--arm``), ``tasks/`` (one per task), ``critics`` (the critic
of an ``ours`` arm), ``scoring`` (the reward measured whatever the trainer), ``step_through`` (the
``step_through`` arm's GAE), ``trl_grpo`` (TRL's GRPOTrainer as an arm), ``run`` (one process: the
models of a seed, one run), ``report`` (reading the runs: the table and the plot), ``cli`` (the
command line: every run in its own process). This package re-exports their public names.
"""

from .arms import ARMS, CRITICS, GAE_MODES, RECIPE, SHORT_ALPHA, TRAINERS, Arm, missing_fields, parse_arm
from .cli import DEFAULT_TRL_PYTHON, build_parser, execute, main, trl_python_ok
from .common import LOGGED, ROOT
from .critics import actor_and_critic, critic_as, shared_actor_critic
from .report import (
    Run,
    curves,
    episode_mismatch,
    episodes_to_reach,
    final_reward,
    ms_per_episode,
    plot,
    plot_wall_time,
    read_memory,
    read_run,
    report,
    table,
    trailing_mean,
    value_at,
    wall_times,
)
from .run import MEMORY_SEED, MEMORY_UPDATES, MIB, prepare, run_one, timed_train
from .scoring import RewardRecorder, _rule_reward_model_class, measuring, response_after_marker
from .step_through import step_through_gae, step_through_trainer
from .tasks import TASKS, TaskSpec, task_module, task_settings, task_sizes
from .tasks.long import LONG_RESPONSE_LENGTH, LONG_SETTINGS, LONG_TARGET_WORDS, long_task_reward
from .tasks.synthetic import (
    REWARD_VARIANTS,
    demo_prompts_and_lora,
    other_vocab_tokenizer,
    prepare_other_vocab,
    synthetic_reward_function,
)
from .tasks.tools_env import (
    build_tools_env_sft,
    calculator_class,
    correct_answer,
    tool_calls_measured,
    tools_env_inputs,
)
from .tasks.verifiable import verifiable_rule
from .trl_grpo import (
    GRPO_GENERATIONS,
    TRL_GRPO_MIN,
    GRPORecorder,
    grpo_config,
    grpo_lora,
    grpo_prompts,
    grpo_row,
    grpo_settings,
    prompt_texts,
    reward_model_function,
    run_grpo,
    trl_grpo_ok,
)

MODULES = ("arms", "cli", "common", "critics", "report", "run", "scoring", "step_through", "trl_grpo",
           "tasks", "tasks.base", "tasks.gem_guess", "tasks.long", "tasks.multiturn", "tasks.synthetic",
           "tasks.tools_env", "tasks.verifiable")
__all__ = ["actor_and_critic",
           "Arm", "ARMS", "build_parser", "build_tools_env_sft", "calculator_class", "correct_answer", "critic_as",
           "CRITICS", "curves", "DEFAULT_TRL_PYTHON", "demo_prompts_and_lora", "episode_mismatch",
           "episodes_to_reach", "execute", "final_reward", "GAE_MODES", "grpo_config", "GRPO_GENERATIONS",
           "grpo_lora", "grpo_prompts", "grpo_row", "grpo_settings", "GRPORecorder", "LOGGED",
           "LONG_RESPONSE_LENGTH", "LONG_SETTINGS", "LONG_TARGET_WORDS", "long_task_reward", "main", "measuring",
           "MEMORY_SEED", "MEMORY_UPDATES", "MIB", "missing_fields", "ms_per_episode", "other_vocab_tokenizer",
           "parse_arm", "plot", "plot_wall_time",
           "prepare", "prepare_other_vocab", "prompt_texts", "read_memory", "read_run",
           "RECIPE", "report", "response_after_marker", "reward_model_function", "REWARD_VARIANTS", "RewardRecorder",
           "ROOT", "_rule_reward_model_class", "Run", "run_grpo", "run_one", "shared_actor_critic", "SHORT_ALPHA",
           "step_through_gae", "step_through_trainer", "synthetic_reward_function", "table", "task_module",
           "task_settings", "task_sizes", "TASKS", "TaskSpec", "timed_train", "tool_calls_measured",
           "tools_env_inputs", "trailing_mean", "TRAINERS", "TRL_GRPO_MIN", "trl_grpo_ok", "trl_python_ok",
           "value_at", "wall_times", "verifiable_rule"]
