"""The run's own state beyond transformers' ``TrainerState``: :class:`RunCounters` (where the
run is in the data, what went wrong), saved in ``ppo_state.json`` as a unit;
:class:`OnlineTrainerState`, the ``TrainerState`` of an online run (episodes, why it stopped); and
:class:`LoopState`, what the training loop and the checkpoint code keep between updates and never
save (the policy's version, the SIGTERM watcher, a preempted update, the clock of this ``train()``).

Saving and loading a run is :mod:`trl_ppo_ext.run.checkpointing`.

Example:

>>> from trl_ppo_ext.run.state import RunCounters
>>> RunCounters(epoch=1, batches=3).state_dict()["data_cursor"]
{'epoch': 1, 'batches': 3}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from transformers import TrainerState

from .preemption import InflightUpdate, SigtermWatcher


@dataclasses.dataclass
class RunCounters:
    """What a PPO run counts beyond ``TrainerState`` (global step, episode): where it is in the
    data and how many things went wrong. Saved in ``ppo_state.json`` as a unit and restored
    before the first resumed update."""

    epoch: int = 0  # the data epoch the next batch comes from
    batches: int = 0  # batches of that epoch already consumed (the next one is skipped to on resume)
    stale_discarded: int = 0  # rollouts discarded for being older than max_rollout_age, in total
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient, in total
    rollout_age: int = 0  # updates between sampling the current rollout and training on it (policy lag)
    critic_warmup_updates: int = 0  # updates that trained the critic only (critic_warmup_steps)
    critic_warmup_over: bool = False  # the warm-up ended (its update count, or its explained variance reached)

    def state_dict(self) -> dict:
        """``{"data_cursor": {epoch, batches}, "counters": {...}}``, the keys of ``ppo_state.json``."""
        return {
            "data_cursor": {"epoch": self.epoch, "batches": self.batches},
            "counters": {"stale_discarded": self.stale_discarded, "nonfinite_steps": self.nonfinite_steps,
                         "rollout_age": self.rollout_age, "critic_warmup_updates": self.critic_warmup_updates,
                         "critic_warmup_over": self.critic_warmup_over},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`'s form (every released version wrote each key)."""
        cursor, counters = state["data_cursor"], state["counters"]
        self.epoch, self.batches = int(cursor["epoch"]), int(cursor["batches"])
        self.stale_discarded = int(counters["stale_discarded"])
        self.nonfinite_steps = int(counters["nonfinite_steps"])
        self.rollout_age = int(counters["rollout_age"])
        self.critic_warmup_updates = int(counters["critic_warmup_updates"])
        self.critic_warmup_over = bool(counters["critic_warmup_over"])



@dataclasses.dataclass
class OnlineTrainerState(TrainerState):
    """``TrainerState`` plus the episodes (sampled responses) seen so far and why the run stopped."""

    episode: int = 0
    stop_reason: str | None = None  # a guard's message when a guard halted the run
    halted_by: str | None = None  # the guard's name


@dataclasses.dataclass
class LoopState:
    """What the training loop keeps between its updates, in one place: the trainer's phases and
    the checkpoint code (``run.checkpointing.CheckpointMixin``) read and write these fields, and
    no other trainer attribute holds loop state. Nothing here is saved as it is: a checkpoint
    records ``inflight`` and the counters, and a resume fills ``resume_*``."""

    # the global step the policy's weights are from: advanced by a step that moved the policy (not a critic
    # warm-up step), set by a resume; a generation engine gets weights when it changes
    policy_version: int = 0
    applied_steps: int = 0  # optimizer steps taken (not skipped) by this trainer object
    sigterm: SigtermWatcher = dataclasses.field(default_factory=lambda: SigtermWatcher("off"))  # train()'s own
    batches: Iterator | None = None  # the prompt batches from the data cursor (data.repeat_batches); train() sets
    inflight: InflightUpdate | None = None  # a preempted update's progress, to checkpoint
    resume_inflight: InflightUpdate | None = None  # ... and the one a resumed run continues
    resume_path: str | None = None  # the checkpoint this train() resumed from
    resume_exact: bool = True  # whether it resumes bit for bit (same number of processes)
    last_checkpoint: tuple[int, str] | None = None  # (global step, path) of the latest save
    protected_checkpoints: set[str] = dataclasses.field(default_factory=set)  # never rotated away
    # this train() call's start (time.time(), episode, global step), its last update's end and its loss sum
    start_time: float = 0.0
    start_episode: int = 0
    start_step: int = 0
    last_update_time: float = 0.0
    loss_total: float = 0.0
