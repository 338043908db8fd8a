"""Guard rails checked every PPO update: stop a run that has stopped learning anything useful.

What to stop on follows the design note ("Stop when"): nonfinite values repeat; the value
function diverges; KL, entropy or length leave their range; clip fraction or stale rollouts
are excessive; reward rises without held-out improvement (reward hacking).

The trainer drives a :class:`GuardRails` with

* ``nonfinite_step(update)`` / ``finite_step()`` after every optimizer step (skipped because
  the loss or gradient norm was NaN/inf, or taken);
* ``stale_rollout(update)`` / ``fresh_rollout()`` for every rollout it discards for being
  older than ``max_rollout_age`` / accepts;
* ``check(metrics, update)`` once per update, with the update's logged metrics.

Each returns a :class:`GuardDecision`; ``decision.figures`` (``guard/<name>`` keys) are meant
to be logged every update, ``decision.halt`` says stop. Every guard is off when its threshold
is None. Guards are deterministic functions of the metrics, so processes that see the same
(gathered) metrics reach the same decision.

Thresholds that count updates are "patience" values: a guard with patience ``K`` fires at
the ``K``-th consecutive update in violation, not before. A nonfinite figure (NaN/inf) is
never within bounds, so it counts as a violation.

Two kinds of guard. The *hard* ones (``nonfinite``, ``stale_rollouts``) see a run that cannot
go on (every step skipped, rollouts that can never be fresh) and halt. The *heuristic* ones
(value divergence, KL/entropy/length ranges, clip fraction, reward hacking) read trends that
a healthy run can show for a while -- a fresh critic's explained variance is far below 0
until it has fitted the returns -- so they start counting only after ``guard_warmup``
updates, the value guard also needs the value loss not to be falling, and by default they
warn (once per episode of trouble) instead of halting: ``guard_action="halt"``, or
``halt_guards=[...]`` for single guards, makes them stop the run.

Example:

>>> from trl_ppo_ext.run.guards import GuardRails, GuardSettings
>>> rails = GuardRails(GuardSettings(nonfinite_halt_after=2))
>>> rails.nonfinite_step(1).halt, rails.nonfinite_step(2).halt  # halts at the second skipped step in a row
(False, True)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from .._utils import help_metadata as _help
from .._utils import optional_number_from_text
from .state import RunCounters

# The trainer's log keys (``PPOTrainer.log_update``) that the guards read.
KEY_VALUE_LOSS = "loss/value_avg"
KEY_EXPLAINED_VARIANCE = "val/explained_variance"
KEY_KL = "objective/kl"
KEY_ENTROPY = "policy/entropy_avg"
KEY_LENGTH = "val/response_length"
KEY_CLIP_FRACTION = "policy/clipfrac_avg"
KEY_SCORE = "objective/scores"

# Thresholds that None turns off, with their type: on the command line they arrive as text.
OPTIONAL_THRESHOLDS = {
    "nonfinite_halt_after": int, "stale_halt_after": int, "max_value_loss": float, "min_explained_variance": float,
    "kl_min": float, "kl_max": float, "entropy_min": float, "entropy_max": float, "length_min": float,
    "length_max": float, "max_clip_fraction": float,
}

# Guard names, in the order they take precedence when several fire at the same update.
GUARD_NAMES = (
    "nonfinite", "value_divergence", "kl_range", "entropy_range", "length_range",
    "clip_fraction", "stale_rollouts", "reward_hacking",
)
# Guards that read a trend a healthy run can show: warm-up applies, and they warn by default.
HEURISTIC_GUARDS = frozenset(
    {"value_divergence", "kl_range", "entropy_range", "length_range", "clip_fraction", "reward_hacking"}
)


@dataclass
class GuardSettings:
    """Thresholds of the guard rails; None turns a guard off.

    Defaults are on only where the condition means the run is broken whatever the task, the
    reward scale or the response length; scale-dependent ranges are off until you set them.
    See each field's help for the reason behind its default.
    """

    guard_action: Literal["warn", "halt"] = field(default="warn", metadata=_help(
        "What a heuristic guard (value divergence, KL/entropy/length ranges, clip fraction, reward hacking) does "
        "when it fires: 'warn' logs a warning once per episode of trouble and trains on (default: a drop-in "
        "must finish the runs TRL finishes), 'halt' checkpoints and stops. The nonfinite and stale-rollout "
        "guards always halt."))
    halt_guards: list[str] | None = field(default=None, metadata=_help(
        "Heuristic guards that halt even with guard_action='warn', e.g. ['kl_range', 'reward_hacking']."))
    guard_warmup: int = field(default=10, metadata=_help(
        "Updates before the heuristic guards start counting. Default 10: a fresh critic (random head, or "
        "initialised from the reward model) has not fitted the returns yet, and its first updates say nothing "
        "about divergence."))
    nonfinite_halt_after: int | str | None = field(default=3, metadata=_help(
        "Halt after this many consecutive optimizer steps skipped for a NaN/inf loss or gradient norm. "
        "Default 3: one skipped step can be a transient fp16 overflow; three in a row means the weights, "
        "the reward or the learning rate are broken and every further step is wasted compute."))
    max_value_loss: float | str | None = field(default=None, metadata=_help(
        "Value divergence: `loss/value_avg` above this (for value_patience updates) fires. Default off: "
        "the value loss scales with the square of the reward scale, so no bound is portable."))
    min_explained_variance: float | str | None = field(default=-1.0, metadata=_help(
        "Value divergence: `val/explained_variance` below this (for value_patience updates, with the value "
        "loss not falling over them) fires. Default -1.0: below it the critic's error variance is more than twice "
        "the returns' variance, so its "
        "advantages are noisier than a constant baseline's; scale-free, so one default fits every task."))
    value_patience: int = field(default=10, metadata=_help(
        "Consecutive updates the value bounds must be violated before the guard fires. Default 10: a fresh "
        "critic (random head, or initialised from the reward model) needs a few updates to fit the returns."))
    kl_min: float | str | None = field(default=None, metadata=_help(
        "Lower bound of `objective/kl` (per-sequence KL to the reference, nats). Default off."))
    kl_max: float | str | None = field(default=None, metadata=_help(
        "Upper bound of `objective/kl`. Default off: the per-sequence KL grows with the response length and "
        "with a smaller kl_coef, so a healthy value for one run is a blow-up for another. A few times the "
        "adaptive controller's target is a reasonable setting."))
    entropy_min: float | str | None = field(default=None, metadata=_help(
        "Lower bound of `policy/entropy_avg` (mean per-token entropy, nats); catches collapse to "
        "deterministic text. Default off: healthy entropy depends on the model and the temperature."))
    entropy_max: float | str | None = field(default=None, metadata=_help(
        "Upper bound of `policy/entropy_avg`; catches degeneration into noise. Default off."))
    length_min: float | str | None = field(default=None, metadata=_help(
        "Lower bound of `val/response_length` (mean response tokens). Default off: task dependent."))
    length_max: float | str | None = field(default=None, metadata=_help(
        "Upper bound of `val/response_length`. Default off: task dependent (and capped by response_length)."))
    range_patience: int = field(default=3, metadata=_help(
        "Consecutive updates KL, entropy or length must be out of range before their guard fires. Default "
        "3: these are single-batch means, and one unlucky batch should not stop a run."))
    max_clip_fraction: float | str | None = field(default=0.5, metadata=_help(
        "Halt when `policy/clipfrac_avg` stays above this for clip_patience updates. Default 0.5: healthy "
        "PPO clips 0-0.3 of tokens; when most tokens sit outside the trust region every update, the update is "
        "too aggressive (learning rate, epochs) for the clipped objective to mean anything."))
    clip_patience: int = field(default=10, metadata=_help(
        "Consecutive updates above max_clip_fraction before the guard fires. Default 10 (as value_patience)."))
    stale_halt_after: int | str | None = field(default=5, metadata=_help(
        "Halt when this many consecutive rollouts were discarded as older than max_rollout_age. Default 5: "
        "each discard wastes a generation pass, and five in a row mean the age limit cannot be met by the "
        "schedule, so the trainer would otherwise regenerate forever. Inert when max_rollout_age is unset."))
    reward_hacking_metric: str | None = field(default=None, metadata=_help(
        "Held-out metric that must improve when the RM score does, e.g. 'eval/win_rate' (a name without "
        "'/' gets the 'eval/' prefix). Default None: the reward-hacking guard is off."))
    reward_hacking_metric_mode: Literal["max", "min"] = field(default="max", metadata=_help(
        "'max' if a higher held-out value is better (win rate, accuracy), 'min' if lower is (toxicity)."))
    reward_hacking_window: int = field(default=20, metadata=_help(
        "Updates compared, as two halves: the mean of the last window/2 against the mean of the window/2 "
        "before them. Even, >= 2. Default 20. The held-out metric must be logged at least once in each "
        "half, so evaluate at least every window/2 updates."))
    reward_hacking_margin: float = field(default=0.0, metadata=_help(
        "The RM score counts as risen when its half-window mean rose by more than this (RM units). "
        "Default 0.0 (any rise); raise it to ignore noise-sized rises."))
    reward_hacking_heldout_min_gain: float = field(default=0.0, metadata=_help(
        "The held-out metric counts as improved when its half-window mean improved (in the direction of "
        "reward_hacking_metric_mode) by more than this. Default 0.0 (any improvement)."))

    def __post_init__(self) -> None:
        self._read_command_line_values()
        if self.guard_action not in ("warn", "halt"):
            raise ValueError(f"GuardSettings.guard_action must be 'warn' or 'halt', got {self.guard_action!r}.")
        if isinstance(self.halt_guards, str):
            raise ValueError(f"GuardSettings.halt_guards must be a list of guard names, e.g. "
                             f"halt_guards=['{self.halt_guards}'], got the string {self.halt_guards!r}.")
        unknown = sorted(set(self.halt_guards or ()) - HEURISTIC_GUARDS)
        if unknown:
            raise ValueError(
                f"GuardSettings.halt_guards has {unknown}, which are not heuristic guards; choose among "
                f"{sorted(HEURISTIC_GUARDS)} (nonfinite and stale_rollouts always halt)."
            )
        if isinstance(self.guard_warmup, bool) or not isinstance(self.guard_warmup, int) or self.guard_warmup < 0:
            raise ValueError(f"GuardSettings.guard_warmup must be an int >= 0, got {self.guard_warmup!r}.")
        for name in ("nonfinite_halt_after", "stale_halt_after", "value_patience", "range_patience",
                     "clip_patience"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"GuardSettings.{name} must be an int >= 1 (or None where allowed), got {value!r}.")
        for low, high in (("kl_min", "kl_max"), ("entropy_min", "entropy_max"), ("length_min", "length_max")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"GuardSettings.{low}={lo} is above {high}={hi}; swap them or set one to None.")
        if self.max_clip_fraction is not None and not 0.0 <= self.max_clip_fraction < 1.0:
            raise ValueError(
                f"GuardSettings.max_clip_fraction must be in [0, 1) (a fraction of tokens), got "
                f"{self.max_clip_fraction}; use None to turn the clip-fraction guard off."
            )
        self._check_reward_hacking()

    def _read_command_line_values(self) -> None:
        """Values as the command line gives them, made what they are in Python: ``"None"`` ->
        None (argparse cannot produce None, so the optional thresholds are typed ``... | str``,
        which makes ``HfArgumentParser`` hand over the text) and a number's text -> the number."""
        if self.halt_guards is not None and [str(g).lower() for g in self.halt_guards] == ["none"]:
            self.halt_guards = None
        if isinstance(self.reward_hacking_metric, str) and self.reward_hacking_metric.lower() == "none":
            self.reward_hacking_metric = None
        for name, kind in OPTIONAL_THRESHOLDS.items():
            setattr(self, name, optional_number_from_text(getattr(self, name), kind, owner="GuardSettings", name=name,
                                                          off="turns the guard off"))

    def _check_reward_hacking(self) -> None:
        window = self.reward_hacking_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 2 or window % 2:
            raise ValueError(
                f"GuardSettings.reward_hacking_window must be an even int >= 2 (two halves are compared), got "
                f"{window!r}; e.g. 20."
            )
        if self.reward_hacking_metric_mode not in ("max", "min"):
            raise ValueError(
                f"GuardSettings.reward_hacking_metric_mode must be 'max' or 'min', got "
                f"{self.reward_hacking_metric_mode!r}."
            )
        if self.reward_hacking_metric is not None and "/" not in self.reward_hacking_metric:
            self.reward_hacking_metric = f"eval/{self.reward_hacking_metric}"

    @classmethod
    def all_off(cls, **overrides) -> GuardSettings:
        """Every guard off; ``overrides`` turn single ones on, e.g. ``all_off(kl_max=20.0)``."""
        off = dict(
            nonfinite_halt_after=None, min_explained_variance=None, max_clip_fraction=None, stale_halt_after=None
        )
        return cls(**{**off, **overrides})


@dataclass
class GuardDecision:
    """What the guards say after an update (or after a skipped step / discarded rollout)."""

    halt: bool  # stop training now
    guard: str | None  # the guard that halted (one of GUARD_NAMES), None when none did
    message: str  # why: the guard, the values, the threshold and the update; "" when none halted
    figures: dict[str, float]  # each enabled guard's current figure under `guard/<name>` keys, to log
    warnings: list[str] = field(default_factory=list)  # messages of warn-only guards that started firing now

    @classmethod
    def keep_going(cls, figures: dict[str, float]) -> GuardDecision:
        return cls(halt=False, guard=None, message="", figures=figures)


def _halt_message(name: str, update: int, body: str) -> str:
    """The message of guard ``name`` halting at ``update``; "" for an empty ``body`` (the guard
    did not fire). Each ``_check_*`` returns only the body, so a warning words it its own way."""
    return f"Guard '{name}' halted training at update {update}: {body}" if body else ""


def _fmt(value: float | None) -> str:
    return "None" if value is None else f"{value:.6g}"


def _outside(value: float, low: float | None, high: float | None) -> bool:
    """True when ``value`` is not within ``[low, high]`` (an open side is None); NaN/inf always are."""
    if not math.isfinite(value):
        return True
    return (low is not None and value < low) or (high is not None and value > high)


class GuardRails:
    """Stateful guard rails; see the module docstring for the protocol.

    Args:
        settings: thresholds; default ``GuardSettings()``.
        counters: the run's :class:`~trl_ppo_ext.run.state.RunCounters`, which keep the totals
            of skipped steps and discarded rollouts (``nonfinite_steps``, ``stale_discarded``):
            the guards count them there and read them for their figures and messages. The
            trainer passes its own, which its checkpoints save; without one the guards keep
            their own, saved in :meth:`state_dict`.
    """

    def __init__(self, settings: GuardSettings | None = None, counters: RunCounters | None = None) -> None:
        self.settings = settings if settings is not None else GuardSettings()
        self._owns_counters = counters is None
        self.counters = RunCounters() if counters is None else counters  # the totals live here, once
        self._streaks = {name: 0 for name in GUARD_NAMES}  # consecutive updates in violation
        self._nonfinite_run = 0  # consecutive skipped optimizer steps, now
        self._nonfinite_peak = 0  # longest such run since the last check()
        self._stale_run = 0  # consecutive discarded rollouts, now
        self._rollout_cause: str | None = None  # why the accepted rollout's rewards are not finite, if they are not
        # (update, RM score, held-out value or None) of the last reward_hacking_window updates.
        self._history: deque = deque(maxlen=self.settings.reward_hacking_window)
        self._value_losses: deque = deque(maxlen=self.settings.value_patience)  # during the value streak
        self._warning: set[str] = set()  # warn-only guards firing at the last update

    # ------------------------------------------------------------------ events
    def nonfinite_step(self, update: int, cause: str | None = None) -> GuardDecision:
        """Record an optimizer step skipped for a NaN/inf loss or gradient norm during ``update``;
        ``cause``: what made it non-finite when known (default: the one :meth:`fresh_rollout` recorded
        for the rollout in training, e.g. which reward returned NaN for which completions), said in
        the halt message."""
        cause = self._rollout_cause if cause is None else cause
        self._nonfinite_run += 1
        self.counters.nonfinite_steps += 1
        self._nonfinite_peak = max(self._nonfinite_peak, self._nonfinite_run)
        body = self._nonfinite_message(self._nonfinite_run, update)
        if body and cause:
            body = f"{body} At update {update}: {cause}."
        message = _halt_message("nonfinite", update, body)
        figures = self._event_figures()
        return GuardDecision(True, "nonfinite", message, figures) if message else GuardDecision.keep_going(figures)

    def finite_step(self) -> None:
        """Record an optimizer step that was taken: the run of skipped steps ends."""
        self._nonfinite_run = 0

    def stale_rollout(self, update: int) -> GuardDecision:
        """Record a rollout discarded during ``update`` for being older than ``max_rollout_age``."""
        self._stale_run += 1
        self.counters.stale_discarded += 1
        message = _halt_message("stale_rollouts", update, self._stale_message(update))
        figures = self._event_figures()
        return GuardDecision(True, "stale_rollouts", message, figures) if message else GuardDecision.keep_going(figures)

    @property
    def rollout_cause(self) -> str | None:
        """What :meth:`fresh_rollout` said makes the accepted rollout's rewards non-finite, or None."""
        return self._rollout_cause

    def fresh_rollout(self, nonfinite_cause: str | None = None) -> None:
        """Record a rollout that was accepted: the run of discarded rollouts ends. ``nonfinite_cause``:
        which of its rewards returned NaN/inf for which completions, None when all are finite; the
        steps skipped while it is trained on name it (:meth:`nonfinite_step`)."""
        self._stale_run = 0
        self._rollout_cause = nonfinite_cause

    # ------------------------------------------------------------------ per update
    def check(self, metrics: dict[str, float], update: int) -> GuardDecision:
        """Evaluate every enabled guard on one update's logged metrics.

        Every guard's counters advance even when an earlier one fires, so the state after
        ``check`` does not depend on which guard took precedence.

        Args:
            metrics: the update's metrics under the trainer's log keys (``loss/value_avg``,
                ``val/explained_variance``, ``objective/kl``, ``policy/entropy_avg``,
                ``val/response_length``, ``policy/clipfrac_avg``, ``objective/scores`` and, when
                evaluated this update, ``eval/<name>``).
            update: the update number, for messages.

        Returns:
            The decision of the first guard that fired and halts (in ``GUARD_NAMES`` order),
            else ``halt=False``; ``warnings`` holds the messages of warn-only guards that
            started firing now; ``figures`` always holds every enabled guard's figure.

        Raises:
            ValueError: an enabled guard's metric is missing from ``metrics``.
        """
        figures: dict[str, float] = {}
        fired: list[tuple[str, str]] = []
        for name, guard in (
            ("nonfinite", self._check_nonfinite),
            ("value_divergence", self._check_value),
            ("kl_range", self._check_kl),
            ("entropy_range", self._check_entropy),
            ("length_range", self._check_length),
            ("clip_fraction", self._check_clip_fraction),
            ("stale_rollouts", self._check_stale),
            ("reward_hacking", self._check_reward_hacking),
        ):
            body = guard(metrics, update, figures)
            if body:
                fired.append((name, body))
        warnings = self._new_warnings(fired, update)
        halting = [name for name, _ in fired if self._halts(name)]
        if not halting:
            return GuardDecision(halt=False, guard=None, message="", figures=figures, warnings=warnings)
        name = halting[0]
        message = _halt_message(name, update, dict(fired)[name])
        if len(fired) > 1:
            message += f" (Also fired: {', '.join(other for other, _ in fired if other != name)}.)"
        return GuardDecision(halt=True, guard=name, message=message, figures=figures, warnings=warnings)

    def _halts(self, name: str) -> bool:
        s = self.settings
        return name not in HEURISTIC_GUARDS or s.guard_action == "halt" or name in (s.halt_guards or ())

    def _new_warnings(self, fired: list[tuple[str, str]], update: int) -> list[str]:
        """Messages of warn-only guards that fired now and did not at the previous update (one
        warning per episode of trouble); a guard that stops firing can warn again later.
        ``fired``: ``(guard name, message body)`` pairs."""
        now = {name for name, _ in fired if not self._halts(name)}
        new = [
            f"Guard '{name}' fired at update {update}: {body} Training goes on (guard_action='warn'); set "
            f"halt_guards=['{name}'] or guard_action='halt' to stop."
            for name, body in fired if name in now and name not in self._warning
        ]
        self._warning = now
        return new

    def _counting(self, update: int) -> bool:
        """Heuristic guards count violations only after the warm-up."""
        return update > self.settings.guard_warmup

    # ------------------------------------------------------------------ single guards
    def _check_nonfinite(self, metrics, update, figures) -> str:
        if self.settings.nonfinite_halt_after is None:
            return ""
        figures["guard/nonfinite"] = float(self._nonfinite_run)
        peak, self._nonfinite_peak = self._nonfinite_peak, self._nonfinite_run
        return self._nonfinite_message(peak, update)

    def _nonfinite_message(self, run: int, update: int) -> str:
        limit = self.settings.nonfinite_halt_after
        if limit is None or run < limit:
            return ""
        return (
            f"{run} consecutive optimizer steps were skipped "
            f"because the loss or gradient norm was NaN/inf (threshold nonfinite_halt_after={limit}; "
            f"{self.counters.nonfinite_steps} skipped in total). Lower the learning rate, check the reward scale, or "
            "train in bf16/fp32 instead of fp16."
        )

    def _check_value(self, metrics, update, figures) -> str:
        s = self.settings
        if s.max_value_loss is None and s.min_explained_variance is None:
            return ""
        broken = []
        if s.max_value_loss is not None:
            loss = _metric(metrics, KEY_VALUE_LOSS, "value_divergence", "max_value_loss")
            if _outside(loss, None, s.max_value_loss):
                broken.append(f"{KEY_VALUE_LOSS}={_fmt(loss)} above max_value_loss={_fmt(s.max_value_loss)}")
        if s.min_explained_variance is not None:
            ev = _metric(metrics, KEY_EXPLAINED_VARIANCE, "value_divergence", "min_explained_variance")
            if _outside(ev, s.min_explained_variance, None):
                broken.append(
                    f"{KEY_EXPLAINED_VARIANCE}={_fmt(ev)} below min_explained_variance={_fmt(s.min_explained_variance)}"
                )
        violated = bool(broken) and self._counting(update)
        streak = self._advance("value_divergence", violated, figures)
        if not violated:
            self._value_losses.clear()
            return ""
        self._value_losses.append(float(metrics.get(KEY_VALUE_LOSS, float("nan"))))
        if streak < s.value_patience or _falling(list(self._value_losses)):
            return ""  # a critic whose loss falls is still fitting, not diverging
        return (
            f"{' and '.join(broken)}, for {streak} "
            f"consecutive updates (value_patience={s.value_patience}) while {KEY_VALUE_LOSS} did not fall. The "
            "critic is diverging: lower the learning rate or vf_coef, enable cliprange_value, or check the reward "
            "scale (whiten_rewards)."
        )

    def _check_kl(self, metrics, update, figures) -> str:
        return self._range_guard("kl_range", KEY_KL, "kl", metrics, update, figures)

    def _check_entropy(self, metrics, update, figures) -> str:
        return self._range_guard("entropy_range", KEY_ENTROPY, "entropy", metrics, update, figures)

    def _check_length(self, metrics, update, figures) -> str:
        return self._range_guard("length_range", KEY_LENGTH, "length", metrics, update, figures)

    def _range_guard(self, name: str, key: str, prefix: str, metrics, update, figures) -> str:
        low, high = getattr(self.settings, f"{prefix}_min"), getattr(self.settings, f"{prefix}_max")
        if low is None and high is None:
            return ""
        value = _metric(metrics, key, name, f"{prefix}_min/{prefix}_max")
        streak = self._advance(name, _outside(value, low, high) and self._counting(update), figures)
        patience = self.settings.range_patience
        if streak < patience:
            return ""
        return (
            f"{key}={_fmt(value)} outside "
            f"[{prefix}_min={_fmt(low)}, {prefix}_max={_fmt(high)}] for {streak} consecutive updates "
            f"(range_patience={patience})."
        )

    def _check_clip_fraction(self, metrics, update, figures) -> str:
        bound = self.settings.max_clip_fraction
        if bound is None:
            return ""
        value = _metric(metrics, KEY_CLIP_FRACTION, "clip_fraction", "max_clip_fraction")
        streak = self._advance("clip_fraction", _outside(value, None, bound) and self._counting(update), figures)
        patience = self.settings.clip_patience
        if streak < patience:
            return ""
        return (
            f"{KEY_CLIP_FRACTION}={_fmt(value)} above "
            f"max_clip_fraction={_fmt(bound)} for {streak} consecutive updates (clip_patience={patience}). The "
            "policy moves too far per update: lower the learning rate, num_ppo_epochs or cliprange."
        )

    def _check_stale(self, metrics, update, figures) -> str:
        if self.settings.stale_halt_after is None:
            return ""
        figures["guard/stale_rollouts"] = float(self._stale_run)
        return self._stale_message(update)

    def _stale_message(self, update: int) -> str:
        limit = self.settings.stale_halt_after
        if limit is None or self._stale_run < limit:
            return ""
        return (
            f"{self._stale_run} consecutive rollouts "
            f"were discarded as older than max_rollout_age (threshold stale_halt_after={limit}; "
            f"{self.counters.stale_discarded} discarded in total). Raise max_rollout_age or lower num_ppo_epochs * "
            "num_mini_batches so rollouts are consumed in time."
        )

    def _check_reward_hacking(self, metrics, update, figures) -> str:
        s = self.settings
        if s.reward_hacking_metric is None:
            return ""
        score = _metric(metrics, KEY_SCORE, "reward_hacking", "reward_hacking_metric")
        heldout = metrics.get(s.reward_hacking_metric)
        self._history.append((update, score, None if heldout is None else float(heldout)))
        rises = _half_window_rises(list(self._history), s.reward_hacking_window)
        if rises is None or not self._counting(update):
            return ""
        score_rise, heldout_rise = rises
        figures["guard/reward_hacking_score_rise"] = score_rise
        if heldout_rise is None:
            return ""
        gain = heldout_rise if s.reward_hacking_metric_mode == "max" else -heldout_rise
        figures["guard/reward_hacking_heldout_gain"] = gain
        if not (score_rise > s.reward_hacking_margin and gain <= s.reward_hacking_heldout_min_gain):
            return ""
        first, last = self._history[0][0], self._history[-1][0]
        return (
            f"over updates {first}-{last} the mean "
            f"{KEY_SCORE} rose by {_fmt(score_rise)} (> reward_hacking_margin={_fmt(s.reward_hacking_margin)}) "
            f"between the first and second half of the window, while {s.reward_hacking_metric} improved by only "
            f"{_fmt(gain)} (needs > reward_hacking_heldout_min_gain={_fmt(s.reward_hacking_heldout_min_gain)}). "
            "The policy is likely exploiting the reward model; keep the last-known-good checkpoint and inspect "
            "samples."
        )

    def _advance(self, name: str, violated: bool, figures: dict[str, float]) -> int:
        """Extend or reset ``name``'s streak of violating updates; log it as ``guard/<name>``."""
        self._streaks[name] = self._streaks[name] + 1 if violated else 0
        figures[f"guard/{name}"] = float(self._streaks[name])
        return self._streaks[name]

    def _event_figures(self) -> dict[str, float]:
        # the totals are the run's counters (RunCounters), which their owner logs
        return {"guard/nonfinite": float(self._nonfinite_run), "guard/stale_rollouts": float(self._stale_run)}

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Every counter and the reward-hacking window; JSON-serialisable (NaN allowed). The
        totals (``nonfinite_total``, ``stale_total``) only when the guards keep their own
        counters: the run's are saved by their owner (``ppo_state.json``'s ``counters``)."""
        totals = {"nonfinite_total": self.counters.nonfinite_steps,
                  "stale_total": self.counters.stale_discarded} if self._owns_counters else {}
        return {
            "streaks": dict(self._streaks),
            "nonfinite_run": self._nonfinite_run, "nonfinite_peak": self._nonfinite_peak,
            "stale_run": self._stale_run, **totals,
            "history": [list(item) for item in self._history],
            "value_losses": list(self._value_losses), "warning": sorted(self._warning),
            "settings": asdict(self.settings),  # informational: the thresholds in force when saved
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counters saved by :meth:`state_dict`. Thresholds stay those of ``self.settings``.

        The totals (``nonfinite_total``, ``stale_total``) are read only by guards that keep their
        own counters; a trainer's guards count into the run's ``RunCounters``, restored from
        ``ppo_state.json``'s ``counters``."""
        required = {"streaks", "nonfinite_run", "nonfinite_peak", "stale_run", "history", "value_losses", "warning"}
        missing = required - set(state)
        if missing:
            raise ValueError(
                f"Guard state is missing {sorted(missing)}; it was not written by GuardRails.state_dict(). "
                "Resume from a checkpoint saved by this package, or start the guards fresh."
            )
        self._streaks = {name: int(state["streaks"].get(name, 0)) for name in GUARD_NAMES}
        self._nonfinite_run, self._nonfinite_peak = int(state["nonfinite_run"]), int(state["nonfinite_peak"])
        self._stale_run = int(state["stale_run"])
        if self._owns_counters:
            # a trainer's guard state has no totals (its RunCounters hold them): 0 for guards of their own
            self.counters.nonfinite_steps = int(state.get("nonfinite_total", 0))
            self.counters.stale_discarded = int(state.get("stale_total", 0))
        self._history = deque(
            ((int(u), float(s), None if h is None else float(h)) for u, s, h in state["history"]),
            maxlen=self.settings.reward_hacking_window,
        )
        self._value_losses = deque((float(v) for v in state["value_losses"]),
                                   maxlen=self.settings.value_patience)
        self._warning = set(state["warning"])


def run_guards(args, counters: RunCounters) -> GuardRails:
    """The guards of a run configured by ``args`` (a ``PPOConfig``), counting into the run's
    ``counters``; without a critic (``args.trains_critic`` False) the value-divergence guard has
    nothing to read and is off."""
    settings = args.guard_settings()
    if not args.trains_critic:
        settings = replace(settings, max_value_loss=None, min_explained_variance=None)
    return GuardRails(settings, counters)


def _metric(metrics: dict[str, float], key: str, guard: str, setting: str) -> float:
    if key not in metrics:
        raise ValueError(
            f"Guard '{guard}' is on but metrics has no {key!r} (keys: {sorted(metrics)}). Pass the trainer's "
            f"logged metrics, or turn the guard off (GuardSettings.{setting}=None)."
        )
    return float(metrics[key])


def _half_window_rises(history: list, window: int) -> tuple[float, float | None] | None:
    """``(score rise, held-out rise)`` between the two halves of a full window, else None.

    The rise of a series is ``mean(second half) - mean(first half)``; the held-out rise
    averages only the updates that logged the metric, and is None when a half has none.
    """
    if len(history) < window:
        return None
    first, second = history[: window // 2], history[window // 2 :]
    score_rise = _mean([s for _, s, _ in second]) - _mean([s for _, s, _ in first])
    held_first = [h for _, _, h in first if h is not None]
    held_second = [h for _, _, h in second if h is not None]
    if not held_first or not held_second:
        return score_rise, None
    return score_rise, _mean(held_second) - _mean(held_first)


def _falling(values: list[float]) -> bool:
    """True when the second half of ``values`` has a lower mean than the first (a series of
    fewer than 2 values, or with NaN, is not falling)."""
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return False
    half = len(values) // 2
    return _mean(values[-half:]) < _mean(values[:half])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
