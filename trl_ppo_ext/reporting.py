"""The run as people read it: which updates are logged, the key names ``report_to`` backends
show, and one readable console line per logged update.

* :func:`log_due`: ``logging_steps`` honoured as in every transformers trainer (TRL's PPO logged
  every update whatever it said): an update is logged when its number is a multiple of
  ``logging_steps``, when it is the first and ``logging_first_step`` is set, and always the last.
* :func:`backend_keys` / :func:`with_backend_keys`: transformers' integrations (TensorBoard,
  wandb, trackio, ...) prefix every key with ``train/`` unless it starts with ``eval_``, so this
  trainer's held-out ``eval/true_reward`` showed as ``train/eval/true_reward`` and its counter
  ``train/nonfinite_steps`` as ``train/train/nonfinite_steps``. The backends' callbacks get the
  keys in transformers' own convention (``eval_true_reward``, ``nonfinite_steps``) and show
  ``eval/true_reward`` and ``train/nonfinite_steps``; ``state.log_history`` keeps this package's
  names.
* :func:`console_line`: score, KL, entropy (per token), length, each reward, the held-out figures
  and seconds per update in one line.
* :class:`UpdateProgress`: the console's callback. The line above is the one thing printed per
  logged update; transformers' progress callbacks also printed the whole metrics dict (54 keys)
  and, with the output in a file, a tqdm bar's every redraw between the lines. The bar is drawn
  only on a terminal; the dict only when asked (``PPOConfig.print_metrics_dict``).

Example:

>>> from trl_ppo_ext.reporting import backend_keys, console_line
>>> backend_keys({"eval/true_reward": 1.0, "train/nonfinite_steps": 0.0, "objective/kl": 0.5})
{'eval_true_reward': 1.0, 'nonfinite_steps': 0.0, 'objective/kl': 0.5}
>>> print(console_line({"objective/scores": 1.25, "objective/kl": 0.5, "policy/entropy_avg": 2.0,
...                     "val/response_length": 3.5, "val/eos_rate": 1.0}, update=3, total=10, seconds=1.5))
update 3/10 | score 1.250 | kl 0.500 | entropy 2.000 | length 3.5 | eos 1.00 | 1.50 s/update
"""

from __future__ import annotations

import functools
import sys

from transformers.trainer_callback import ProgressCallback

# Logged keys that measure wall-clock time (episodes per second; TRL GRPO's seconds per update): the
# only ones two runs of the same seed may differ in.
TIMING_KEYS = ("eps", "step_time")

# The console line: (metric key, label, format), in this order; a key a run does not log is left out.
# The entropy is per token (TRL GRPO's `entropy`); `objective/entropy` is a per-response sum.
CONSOLE_FIELDS = (
    ("objective/scores", "score", ".3f"),
    ("objective/kl", "kl", ".3f"),
    ("policy/entropy_avg", "entropy", ".3f"),
    ("val/response_length", "length", ".1f"),
    ("val/eos_rate", "eos", ".2f"),
)


def log_due(global_step: int, max_steps: int, logging_steps: int | float, logging_first_step: bool = False) -> bool:
    """Whether update ``global_step`` (1-based, already counted) is logged.

    ``logging_steps`` as transformers' trainer state holds it (an int >= 1; a fraction of
    ``max_steps`` was turned into an int when training began)."""
    every = max(int(logging_steps), 1)
    return global_step % every == 0 or global_step >= max_steps or (logging_first_step and global_step == 1)


def backend_keys(logs: dict | None) -> dict | None:
    """``logs`` with keys named as transformers' integrations expect: ``eval/x`` -> ``eval_x`` (they
    show ``eval/x``), ``train/x`` -> ``x`` (they show ``train/x``); other keys unchanged."""
    if logs is None:
        return None
    renamed = {}
    for key, value in logs.items():
        if key.startswith("eval/"):
            key = "eval_" + key[len("eval/"):]
        elif key.startswith("train/"):
            key = key[len("train/"):]
        renamed[key] = value
    return renamed


@functools.cache
def with_backend_keys(callback_cls: type) -> type:
    """A subclass of a ``report_to`` callback class whose ``on_log`` receives :func:`backend_keys`;
    ``isinstance(callback, callback_cls)`` still holds, so ``trainer.remove_callback(cls)`` works."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return callback_cls.on_log(self, args, state, control, logs=backend_keys(logs), **kwargs)

    return type(callback_cls.__name__, (callback_cls,), {"on_log": on_log, "__module__": callback_cls.__module__,
                                                         "__qualname__": callback_cls.__qualname__})


def console_line(metrics: dict, *, update: int, total: int, seconds: float) -> str:
    """One readable line for a logged update: the figures of :data:`CONSOLE_FIELDS` it has, then
    each reward's mean (``rewards/<name>/mean`` as ``<name>``) and each held-out figure
    (``eval/<name>``)."""
    parts = [f"update {update}/{total}"]
    parts += [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in CONSOLE_FIELDS if key in metrics]
    parts += [f"{key[len('rewards/'):-len('/mean')]} {value:.3f}" for key, value in metrics.items()
              if key.startswith("rewards/") and key.endswith("/mean")]
    parts += [f"{key} {value:.3f}" for key, value in metrics.items() if key.startswith("eval/")]
    parts.append(f"{seconds:.2f} s/update")
    return " | ".join(parts)


class UpdateProgress(ProgressCallback):
    """transformers' progress callback, made to keep the console to one line per logged update.

    Args:
        show_bar: draw the tqdm bar of updates; None: only where stderr is a terminal (in a log
            file every redraw of the bar would sit between the update lines).
        print_dicts: also print each logged dict as transformers does (every key).
    """

    def __init__(self, show_bar: bool | None = None, print_dicts: bool = False):
        super().__init__()
        self.show_bar, self.print_dicts = show_bar, print_dicts

    def on_train_begin(self, args, state, control, **kwargs):
        show = sys.stderr.isatty() if self.show_bar is None else self.show_bar
        if show:
            super().on_train_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.print_dicts or not state.is_world_process_zero:
            return
        if self.training_bar is not None:
            super().on_log(args, state, control, logs=logs, **kwargs)
        else:
            print({k: v for k, v in (logs or {}).items() if k != "total_flos"})

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)


def update_progress(args) -> UpdateProgress:
    """The console callback a config asks for: no bar with ``disable_tqdm``, else a bar on a
    terminal; the metrics dicts with ``print_metrics_dict``."""
    show_bar = False if getattr(args, "disable_tqdm", False) else None
    return UpdateProgress(show_bar=show_bar, print_dicts=getattr(args, "print_metrics_dict", False))
