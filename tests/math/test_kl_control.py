"""KL controllers: hand-computed Ziegler et al. (2019) updates, the +-0.2 clip, validation, state."""

import json
import math

import pytest

from trl_ppo_ext.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller

# Relative tolerance for a handful of float multiplications: far tighter than any wrong formula.
REL = 1e-12


def adaptive(init=0.1, target=6.0, horizon=10000):
    return AdaptiveKLController(init, target, horizon)


def test_fixed_never_changes():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 64)
    ctl.update(-3.0, 64)
    assert ctl.value == 0.05


def test_adaptive_one_update_inside_the_clip():
    ctl = adaptive()
    ctl.update(6.6, 100)
    # e = 6.6 / 6 - 1 = 0.1 (inside [-0.2, 0.2]); beta = 0.1 * (1 + 0.1 * 100 / 10000) = 0.1 * 1.001
    assert ctl.value == pytest.approx(0.1001, rel=REL)


@pytest.mark.parametrize(
    "kl, expected",
    [
        # e = 12 / 6 - 1 = 1.0 -> clipped to 0.2: beta = 0.1 * (1 + 0.2 * 0.01) = 0.1002
        (12.0, 0.1002),
        # e = 7.2 / 6 - 1 = 0.2 exactly: the clip's edge gives the same 0.1002
        (7.2, 0.1002),
        # e = 0 / 6 - 1 = -1.0 -> clipped to -0.2: beta = 0.1 * (1 - 0.2 * 0.01) = 0.0998
        (0.0, 0.0998),
        # k1 KL estimates can be negative: e = -3 / 6 - 1 = -1.5 -> -0.2: 0.0998
        (-3.0, 0.0998),
        # e = 5.7 / 6 - 1 = -0.05 (inside): beta = 0.1 * (1 - 0.05 * 0.01) = 0.09995
        (5.7, 0.09995),
    ],
)
def test_adaptive_clip_at_plus_minus_0_2(kl, expected):
    ctl = adaptive()
    ctl.update(kl, 100)
    assert ctl.value == pytest.approx(expected, rel=REL)


def test_adaptive_updates_compound_and_scale_with_n_steps():
    ctl = adaptive()
    ctl.update(6.6, 100)  # 0.1 * 1.001 = 0.1001
    ctl.update(3.0, 200)
    # e = 3 / 6 - 1 = -0.5 -> -0.2; factor = 1 - 0.2 * 200 / 10000 = 0.996; 0.1001 * 0.996 = 0.0996996
    assert ctl.value == pytest.approx(0.0996996, rel=REL)


def test_adaptive_zero_steps_and_nonfinite_kl_leave_beta_unchanged():
    ctl = adaptive()
    ctl.update(12.0, 0)  # factor 1 + 0.2 * 0 / 10000 = 1
    ctl.update(float("nan"), 100)
    ctl.update(float("inf"), 100)
    assert ctl.value == 0.1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(init_kl_coef=0.1, target=0.0, horizon=10000), "target must be a finite number > 0, got 0.0"),
        (dict(init_kl_coef=0.1, target=-1.0, horizon=10000), "target must be a finite number > 0, got -1.0"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=0), "horizon must be a finite number > 0, got 0"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=float("inf")), "horizon must be a finite number > 0, got inf"),
        (dict(init_kl_coef=0.0, target=6.0, horizon=10000), "init_kl_coef must be a finite number > 0, got 0.0"),
    ],
)
def test_adaptive_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        AdaptiveKLController(**kwargs)


def test_fixed_rejects_negative_coef_and_update_rejects_bad_n_steps():
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got -0.1"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="n_steps must be an int >= 0"):
        adaptive().update(6.0, -1)
    with pytest.raises(ValueError, match="n_steps must be an int >= 0"):
        FixedKLController(0.1).update(6.0, 1.5)


def test_build_kl_controller():
    fixed = build_kl_controller(0.05)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    ada = build_kl_controller(0.2, adaptive=True, target=6.0, horizon=10000)
    assert isinstance(ada, AdaptiveKLController)
    assert (ada.value, ada.target, ada.horizon) == (0.2, 6.0, 10000.0)
    with pytest.raises(ValueError, match="needs both target and horizon"):
        build_kl_controller(0.2, adaptive=True, target=6.0)
    with pytest.raises(ValueError, match="only apply to adaptive KL control"):
        build_kl_controller(0.2, adaptive=False, target=6.0, horizon=10000)


def test_adaptive_state_round_trip_through_json():
    ctl = adaptive()
    ctl.update(12.0, 100)  # 0.1002
    state = json.loads(json.dumps(ctl.state_dict()))
    resumed = adaptive()  # a fresh run built from the same config
    resumed.load_state_dict(state)
    assert resumed.value == ctl.value
    ctl.update(6.6, 100)
    resumed.update(6.6, 100)
    # 0.1002 * 1.001 = 0.1003002, identically in both
    assert resumed.value == ctl.value
    assert math.isclose(resumed.value, 0.1003002, rel_tol=REL)


def test_load_state_rejects_the_other_kind():
    with pytest.raises(ValueError, match="kind 'fixed' into a controller of kind 'adaptive'"):
        adaptive().load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="kind 'adaptive' into a controller of kind 'fixed'"):
        FixedKLController(0.1).load_state_dict(adaptive().state_dict())


def test_fixed_state_keeps_the_configured_coefficient():
    saved = FixedKLController(0.05).state_dict()
    assert saved == {"kind": "fixed", "value": 0.05}
    resumed = FixedKLController(0.07)
    resumed.load_state_dict(saved)
    assert resumed.value == 0.07
