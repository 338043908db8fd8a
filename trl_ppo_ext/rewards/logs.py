"""What reward functions report beside their rewards: TRL GRPO's ``log_metric`` and ``log_extra``.

GRPO passes every reward function two callables among its keyword arguments, and functions
written for GRPO call them:

* ``log_metric(name, value)``: a scalar for this batch. The trainer logs ``name`` with the
  update's metrics: the mean of every value logged under it since the last update, over every
  process (GRPO averages over each logging step the same way).
* ``log_extra(column, values)``: one value per completion of the batch, a column of the
  completions table. This trainer's table is the one ``num_sample_generations`` prints (and
  sends to ``report_to``); columns logged while that table's completions are scored land in it.
  Training rollouts have no table here, so their columns are dropped at each update.

:class:`RewardLogs` holds what was logged until the trainer takes it. It is plain bookkeeping;
the cross-process reduction takes the gather functions as arguments.

>>> logs = RewardLogs()
>>> kwargs = logs.kwargs()
>>> kwargs["log_metric"]("judge/latency_s", 2.0); kwargs["log_metric"]("judge/latency_s", 4.0)
>>> logs.take_metrics()
{'judge/latency_s': 3.0}
>>> logs.take_metrics()
{}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

# The keyword arguments this module adds to a reward function's call (never dataset columns).
KWARG_NAMES = ("log_metric", "log_extra")


class RewardLogs:
    """Metrics and completion-table columns reported by reward functions, pending until taken."""

    def __init__(self) -> None:
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._columns: dict[str, list] = defaultdict(list)

    def kwargs(self) -> dict[str, Callable]:
        """``{"log_metric": ..., "log_extra": ...}`` for a reward function's keyword arguments."""
        return {"log_metric": self.log_metric, "log_extra": self.log_extra}

    def log_metric(self, name: str, value: float) -> None:
        """Record a scalar ``value`` under ``name`` (a real number: a bool, a 1-element tensor or
        a numpy scalar is read as one). Raises ``TypeError`` / ``ValueError`` for anything else."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric: name={name!r}; it must be a non-empty string.")
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"log_metric({name!r}, {value!r}): the value must be one number.") from err
        self._metrics[name].append(number)

    def log_extra(self, column: str, values: Sequence) -> None:
        """Append ``values`` (one per completion of the batch being scored) to ``column``."""
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra: column={column!r}; it must be a non-empty string.")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"log_extra({column!r}, ...): values must be a list, one per completion; got "
                            f"{type(values).__name__}.")
        self._columns[column].extend(values)

    def take_metrics(self, gather_names: Callable[[list[str]], list[str]] | None = None,
                     reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """The mean of each metric's values since the last call, and forget them.

        Args:
            gather_names: ``list[str] -> list[str]``, every process's names concatenated
                (accelerate's ``gather_object``); None on one process.
            reduce_sums: ``(n, 2)`` float64 tensor of ``[sum, count]`` rows -> the same rows summed
                over the processes; None on one process.

        Every process must call it at the same point: names are taken in sorted order of their
        union, so each process reduces the same rows in the same order (a name another process
        logged and this one did not counts ``[0, 0]`` here). NaN values are kept (the guard rails
        see them); a name no process gave a value gets NaN.
        """
        mine = sorted(self._metrics)
        names = sorted(set(gather_names(mine))) if gather_names is not None else mine
        rows = torch.tensor([[sum(self._metrics.get(n, ())), len(self._metrics.get(n, ()))] for n in names],
                            dtype=torch.float64).reshape(len(names), 2)
        self._metrics.clear()
        if reduce_sums is not None and names:
            rows = reduce_sums(rows)
        return {n: (s / c if c else float("nan")) for n, (s, c) in zip(names, rows.tolist())}

    def take_columns(self, rows: int, reserved: Sequence[str] = ()) -> dict[str, list]:
        """The columns logged since the last call, each of ``rows`` values (the completions
        scored meanwhile), and forget them. A column with another count, or named as one of
        the table's own columns (``reserved``), is a ``ValueError`` naming it."""
        columns = dict(self._columns)
        self._columns.clear()
        clash = sorted(set(columns) & set(reserved))
        if clash:
            raise ValueError(f"log_extra: column(s) {clash} are the completions table's own; log under another name.")
        wrong = {c: len(v) for c, v in columns.items() if len(v) != rows}
        if wrong:
            raise ValueError(f"log_extra: column(s) {wrong} got that many values for {rows} completions; a reward "
                             "function logs one value per completion of the batch it scores.")
        return columns

    def clear_columns(self) -> None:
        """Forget the pending columns (a training rollout's: there is no table for them)."""
        self._columns.clear()
