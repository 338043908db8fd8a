"""What a task module gives the run: its ``TaskSpec``, and the inputs of one run of each trainer.

A task module (``tasks/<name>.py``) has:

* ``SPEC``: a :class:`TaskSpec`;
* ``settings() -> dict``: its example's PPO settings;
* ``prepare(seed, tmp, hidden_size) -> dict``: builds under ``tmp`` the models every arm starts
  from for ``seed``, returns what ``info.json`` keeps of them;
* ``ours(arm, seed, *, make_config, model_dir, hidden_size) -> OursRun``: the inputs of one run
  of this package's trainer or of TRL 1.12's (``arm.trainer``); ``make_config(**fields)`` builds
  the trainer's config from the task's settings, the run's, ``fields`` and the arm's overrides;
* ``grpo(seed, ppo, *, model_dir, hidden_size, recorder) -> GRPOInputs``, where the ``trl_grpo``
  arm runs the task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskSpec:
    """What a task's runs share; ``episodes`` and ``hidden_size`` are its example's defaults (None:
    read from the example when the benchmark runs, see :func:`task_sizes`)."""

    episodes: int | None
    hidden_size: int | None
    reward_name: str  # what the row's "reward" is
    batch_size: int  # episodes per update
    rewards: tuple[str, ...] = ("default",)  # the reward variants an arm may pick (see REWARD_VARIANTS)
    # trainer -> why the task refuses it (e.g. TRL 1.12's PPOTrainer takes no rollout_func)
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class OursRun:
    """One run of a PPO trainer (this package's or TRL 1.12's) on a task."""

    config: object  # the trainer's config
    tokenizer: object  # the processing_class
    models: dict  # the trainer's other keywords: model, ref_model, value_model, reward_*, train_dataset, ...
    # logs of an update -> (the measured reward of its rollout or None, how many completions it covers or None)
    batch_reward: Callable[[dict], tuple]
    extras: dict = field(default_factory=dict)  # further figures of the update's rollout batch_reward sets


@dataclass
class GRPOInputs:
    """One run of TRL's GRPOTrainer on a task: what it shares with the ``ours`` arms."""

    tokenizer: object
    policy: object
    lora: object  # the task's LoRA config (``grpo_lora`` moves lm_head to modules_to_save)
    dataset: object
    funcs: list  # reward functions, the first one measuring through the recorder
    environments: dict = field(default_factory=dict)  # environment_factory=, where the task has one
