"""Runs that survive preemption: SIGTERM becomes "stop after this optimizer step, checkpoint".

Clusters and spot machines send SIGTERM some seconds before they kill a job. The trainer
installs :class:`SigtermWatcher` for the length of ``train()``: the signal handler only sets a
flag; the training loop reads it after every optimizer step (all processes agree first, so
they stop at the same step), writes a complete checkpoint, records ``stop_reason =
"preempted"`` and leaves ``train()`` (and, with ``on_sigterm="save_and_exit"``, the program,
with exit status 0).

A stop between two optimizer steps of one PPO update leaves a rollout half used. The
checkpoint then carries it as an :class:`InflightUpdate` (per process: the rollout, its
advantages, the mini-batch order of the current PPO epoch and how far the update got), so the
resumed run finishes that update exactly as the uninterrupted run would have.

Example:

>>> from trl_ppo_ext.run.preemption import inflight_filename
>>> inflight_filename(1)  # the update a SIGTERM interrupted, as process 1 saves it
'inflight_update_1.pt'
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

logger = logging.getLogger(__name__)

PREEMPTED = "preempted"  # the stop_reason and manifest status of a preempted run
ON_SIGTERM_CHOICES = ("save_and_exit", "save_and_return", "off")


class SigtermWatcher:
    """Turns SIGTERM into a stop request the training loop reads at its next safe point.

    Args:
        action: ``PPOConfig.on_sigterm``; ``"off"`` installs nothing (SIGTERM then ends the
            process as usual).
    """

    def __init__(self, action: str = "save_and_exit"):
        if action not in ON_SIGTERM_CHOICES:
            raise ValueError(f"on_sigterm must be one of {list(ON_SIGTERM_CHOICES)}, got {action!r}.")
        self.action = action
        self.received = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> SigtermWatcher:
        """Install the handler (main thread only: Python delivers signals there)."""
        if self.action != "off" and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        # Only a flag: the loop finishes the optimizer step it is in before acting on it.
        if self.received:
            self._second_notice(signum, frame)
            return
        os.write(2, b"SIGTERM received: finishing the current optimizer step, then checkpointing "
                    b"(a second SIGTERM stops now, without the checkpoint).\n")
        self.received = True

    def _second_notice(self, signum, frame) -> None:
        """A second SIGTERM means "now": the handler that was there before takes it (the default
        one ends the process with status 143), even in the middle of the checkpoint's writing (the
        checkpoint folder is written atomically, so no half-written checkpoint is left to resume)."""
        os.write(2, b"second SIGTERM: stopping now, without the checkpoint.\n")
        previous = self._previous if self._previous is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        self._installed = False
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signal.SIGTERM)

    def stop_agreed(self, accelerator) -> bool:
        """True when any process received SIGTERM. Every process must call it at the same
        point (one all-reduce of a scalar under several processes; nothing on the device
        with one, so no host sync per optimizer step)."""
        if self.action == "off":
            return False
        if accelerator.num_processes == 1:
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


class UpdatePreempted(Exception):
    """Raised between two optimizer steps of an update once every process agreed to stop;
    ``inflight``: where the update stopped (:func:`stop_if_preempted`), for the checkpoint."""

    def __init__(self, message: str = "", inflight: InflightUpdate | None = None):
        super().__init__(message)
        self.inflight = inflight


@dataclass
class InflightUpdate:
    """Where a preempted PPO update stopped, on one process.

    ``rollout`` and ``advantages`` are the fields of the trainer's ``Rollout`` and
    ``PPOTargets`` (tensors and ints). The update resumes at PPO epoch ``epoch``, mini-batch
    ``mini_batch`` (those before it are done), with the epoch's row order ``order``.
    """

    rollout: dict
    advantages: dict
    epoch: int
    mini_batch: int
    order: torch.Tensor | None  # (B,) long: the shuffled rows of PPO epoch `epoch`; None: it shuffles afresh
    stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per-micro-batch statistics so far
    rollout_age: int = 0

    def save(self, path: str) -> None:
        """``torch.save`` to ``path`` (tensors moved to the CPU; loads with ``weights_only``)."""
        cpu = lambda v: v.detach().cpu() if torch.is_tensor(v) else v  # noqa: E731
        torch.save({
            "rollout": {k: cpu(v) for k, v in self.rollout.items()},
            "advantages": {k: cpu(v) for k, v in self.advantages.items()},
            "epoch": self.epoch, "mini_batch": self.mini_batch, "order": cpu(self.order),
            "stats": {k: [cpu(v) for v in vs] for k, vs in self.stats.items()},
            "rollout_age": self.rollout_age,
        }, path)

    @classmethod
    def load(cls, path: str, device) -> InflightUpdate:
        """Read :meth:`save`'s file, tensors placed on ``device``."""
        raw = torch.load(path, map_location="cpu", weights_only=True)
        dev = lambda v: v.to(device) if torch.is_tensor(v) else v  # noqa: E731
        return cls(
            rollout={k: dev(v) for k, v in raw["rollout"].items()},
            advantages={k: dev(v) for k, v in raw["advantages"].items()},
            epoch=raw["epoch"], mini_batch=raw["mini_batch"], order=dev(raw["order"]),
            stats={k: [dev(v) for v in vs] for k, vs in raw["stats"].items()},
            rollout_age=raw["rollout_age"],
        )


def inflight_filename(process_index: int) -> str:
    """``inflight_update_<process>.pt``: one file per process in a preempted checkpoint."""
    return f"inflight_update_{process_index}.pt"


def stop_if_preempted(rollout, advantages, position: tuple[int, int], order: torch.Tensor, stats: dict,
                      *, num_ppo_epochs: int, num_mini_batches: int, stop_agreed: Callable[[], bool],
                      rollout_age: int = 0) -> None:
    """After the optimizer step of PPO epoch ``position[0]``, mini-batch ``position[1]``: raise
    :class:`UpdatePreempted` carrying the :class:`InflightUpdate` that resumes the update at its
    next mini-batch, once ``stop_agreed()`` says every process received SIGTERM.

    ``stop_agreed`` is not called after the update's last step (the update finishes and the
    loop checks at its end), so every process calls it at the same steps. ``rollout`` and
    ``advantages`` are dataclasses (the trainer's ``Rollout`` and ``PPOTargets``), saved field by
    field; ``order`` ``(B,)`` is the epoch's row order, kept when the next mini-batch is of the
    same epoch; ``stats`` the per-micro-batch statistics so far.

    Example:
        >>> from dataclasses import make_dataclass
        >>> part = make_dataclass("Part", ["x"])(x=torch.zeros(2))
        >>> stop_if_preempted(part, part, (1, 1), torch.arange(2), {}, num_ppo_epochs=2, num_mini_batches=2,
        ...                   stop_agreed=lambda: True)  # the update's last step: it finishes
        >>> try:
        ...     stop_if_preempted(part, part, (0, 1), torch.arange(2), {}, num_ppo_epochs=2, num_mini_batches=2,
        ...                       stop_agreed=lambda: True)
        ... except UpdatePreempted as stop:
        ...     print(stop, (stop.inflight.epoch, stop.inflight.mini_batch), stop.inflight.order)
        SIGTERM after PPO epoch 0, mini-batch 1 (1, 0) None
    """
    epoch, index = position
    if (epoch, index) == (num_ppo_epochs - 1, num_mini_batches - 1):
        return
    if not stop_agreed():
        return
    next_epoch, next_index = (epoch, index + 1) if index + 1 < num_mini_batches else (epoch + 1, 0)
    inflight = InflightUpdate(
        rollout={f.name: getattr(rollout, f.name) for f in fields(rollout)},
        advantages={f.name: getattr(advantages, f.name) for f in fields(advantages)},
        epoch=next_epoch, mini_batch=next_index, order=order if next_epoch == epoch else None,
        stats={k: list(v) for k, v in stats.items()}, rollout_age=rollout_age,
    )
    raise UpdatePreempted(f"SIGTERM after PPO epoch {epoch}, mini-batch {index}", inflight)
