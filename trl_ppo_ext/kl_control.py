"""KL coefficient controllers: the ``beta`` of the shaped reward ``r_t = -beta * KL_t (+ score)``.

Two controllers with one interface (``value``, ``update``, ``state_dict``, ``load_state_dict``):

* :class:`FixedKLController` -- ``beta`` never changes (TRL's PPO behaviour).
* :class:`AdaptiveKLController` -- Ziegler et al. 2019, "Fine-Tuning Language Models from
  Human Preferences" (arXiv:1909.08593), section 2.2: after each update

      e = clip(KL / target - 1, -0.2, 0.2)
      beta <- beta * (1 + e * n_steps / horizon)

  where ``KL`` is the measured per-sequence KL of the rollout, ``n_steps`` the number of
  samples (episodes) the update consumed and ``horizon`` the number of samples over which
  the controller should close a proportional error. The clip bounds the change of ``beta``
  per sample, so one odd batch cannot swing it far.

The trainer reads ``controller.value`` when it shapes rewards and calls
``controller.update(kl, n_steps)`` once per update, after the update's KL is known.
"""

from __future__ import annotations

import math

# Ziegler et al. (2019) bound the proportional error to +-20% (section 2.2).
PROPORTIONAL_ERROR_CLIP = 0.2


def _check_finite(name: str, value: float, *, minimum: float, strict: bool, fix: str) -> float:
    """``value`` as a float; ValueError naming ``name`` when it is not finite or below ``minimum``."""
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a number, got {value!r}. {fix}") from err
    too_small = number <= minimum if strict else number < minimum
    if not math.isfinite(number) or too_small:
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}. {fix}")
    return number


def _check_n_steps(n_steps: int) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        raise ValueError(
            f"n_steps must be an int >= 0 (the number of samples the update consumed, e.g. the rollout "
            f"batch size), got {n_steps!r}."
        )
    return n_steps


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: ``beta``, >= 0 (0 turns the KL penalty off).

    >>> FixedKLController(0.05).value
    0.05
    """

    kind = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = _check_finite(
            "kl_coef", kl_coef, minimum=0.0, strict=False, fix="Pass e.g. kl_coef=0.05 (TRL's default)."
        )

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed. Arguments are validated like the adaptive one's."""
        _check_n_steps(n_steps)

    def state_dict(self) -> dict:
        """``{"kind": "fixed", "value": beta}``; JSON-serialisable."""
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Check that ``state`` came from a fixed controller. ``value`` keeps the constructor's
        coefficient: a fixed ``beta`` is configuration, so a changed ``kl_coef`` on resume wins."""
        _check_kind(state, self.kind)

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value})"


class AdaptiveKLController:
    """Ziegler et al. (2019) adaptive KL coefficient (see the module docstring).

    Args:
        init_kl_coef: starting ``beta``, > 0 (the update is multiplicative, so 0 would stay 0).
        target: the per-sequence KL (nats) the controller steers towards, > 0.
        horizon: samples over which a proportional error is corrected, > 0. With
            ``n_steps / horizon = 1/100``, ``beta`` moves by at most 0.2% per update.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = _check_finite(
            "init_kl_coef", init_kl_coef, minimum=0.0, strict=True,
            fix="The adaptive update multiplies beta, so it must start > 0; use FixedKLController(0.0) for no "
            "KL penalty.",
        )
        self.target = _check_finite(
            "target", target, minimum=0.0, strict=True,
            fix="Pass the per-sequence KL (nats) to steer towards, e.g. target=6.0 (Ziegler et al. 2019).",
        )
        self.horizon = _check_finite(
            "horizon", horizon, minimum=0.0, strict=True,
            fix="Pass the number of samples over which to correct the KL error, e.g. horizon=10000.",
        )

    def update(self, current_kl: float, n_steps: int) -> None:
        """``beta *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

        Args:
            current_kl: the update's measured per-sequence KL (``objective/kl``). A nonfinite KL
                leaves ``beta`` unchanged: one broken batch must not poison the coefficient for
                the rest of the run (the nonfinite guard deals with the batch itself).
            n_steps: samples consumed by the update (the global rollout batch size), >= 0.
        """
        _check_n_steps(n_steps)
        kl = float(current_kl)
        if not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """``kind``, the current ``value`` and, for the record, ``target`` and ``horizon``."""
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restore the evolved ``beta``. ``target`` and ``horizon`` stay the constructor's (they are
        configuration; the saved ones are informational)."""
        _check_kind(state, self.kind)
        self.value = _check_finite(
            "state['value']", state.get("value"), minimum=0.0, strict=True,
            fix="The saved KL controller state is damaged; resume from an earlier checkpoint.",
        )

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


KLController = FixedKLController | AdaptiveKLController


def _check_kind(state: dict, expected: str) -> None:
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind != expected:
        raise ValueError(
            f"Cannot load a KL controller state of kind {kind!r} into a controller of kind {expected!r}. Resume with "
            "the KL settings the checkpoint was saved with (kl_coef, adaptive target/horizon), or start a new run."
        )


def build_kl_controller(
    kl_coef: float, adaptive: bool = False, target: float | None = None, horizon: float | None = None
) -> KLController:
    """The controller a config asks for.

    Args:
        kl_coef: fixed ``beta``, or the adaptive controller's initial ``beta``.
        adaptive: False -> :class:`FixedKLController` (``target``/``horizon`` must then be None);
            True -> :class:`AdaptiveKLController` (both required).

    >>> build_kl_controller(0.1, adaptive=True, target=6.0, horizon=10000)
    AdaptiveKLController(value=0.1, target=6.0, horizon=10000.0)
    """
    if adaptive:
        if target is None or horizon is None:
            raise ValueError(
                f"Adaptive KL control needs both target and horizon, got target={target!r}, horizon={horizon!r}. "
                "Set e.g. target=6.0 and horizon=10000, or adaptive=False for a fixed kl_coef."
            )
        return AdaptiveKLController(kl_coef, target, horizon)
    if target is not None or horizon is not None:
        raise ValueError(
            f"target={target!r} and horizon={horizon!r} only apply to adaptive KL control, and adaptive=False. "
            "Set adaptive=True to use them, or leave them None."
        )
    return FixedKLController(kl_coef)


def kl_controller_from_config(args) -> KLController:
    """:func:`build_kl_controller` with a ``PPOConfig``'s ``kl_coef``, ``adaptive_kl`` and, when
    adaptive, its ``kl_target`` and ``kl_horizon``."""
    adaptive = args.adaptive_kl
    return build_kl_controller(args.kl_coef, adaptive, args.kl_target if adaptive else None,
                               args.kl_horizon if adaptive else None)
