"""Guard rails: each guard fires at exactly the update it should (not one earlier), off means
never, messages name guard/value/threshold/update, figures are logged, state resumes exactly."""

import json
import math

import pytest

from trl_ppo_ext.run.guards import GUARD_NAMES, GuardDecision, GuardRails, GuardSettings

NAN = float("nan")


def healthy(**overrides):
    """One update's metrics under the trainer's log keys, all comfortably inside any bound."""
    metrics = {
        "loss/value_avg": 0.1,
        "val/explained_variance": 0.5,
        "objective/kl": 2.0,
        "policy/entropy_avg": 1.5,
        "val/response_length": 20.0,
        "policy/clipfrac_avg": 0.1,
        "objective/scores": 0.0,
    }
    metrics.update(overrides)
    return metrics


def run(guards, series, start=1):
    """``check`` each metrics dict in turn (updates start, start+1, ...); the decisions."""
    return [guards.check(m, update) for update, m in enumerate(series, start=start)]


def _halting(**overrides):
    """Every guard off but ``overrides``; heuristic guards halt and count from the first update."""
    return GuardSettings.all_off(**{"guard_action": "halt", "guard_warmup": 0, **overrides})


def halts(decisions):
    return [d.halt for d in decisions]


# ---------------------------------------------------------------------- defaults and off
def test_defaults_are_the_documented_ones():
    s = GuardSettings()
    assert s.nonfinite_halt_after == 3
    assert (s.min_explained_variance, s.value_patience, s.max_value_loss) == (-1.0, 10, None)
    assert (s.max_clip_fraction, s.clip_patience) == (0.5, 10)
    assert s.stale_halt_after == 5
    assert s.range_patience == 3
    assert [s.kl_min, s.kl_max, s.entropy_min, s.entropy_max, s.length_min, s.length_max] == [None] * 6
    assert s.reward_hacking_metric is None
    assert (s.guard_action, s.halt_guards, s.guard_warmup) == ("warn", None, 10)


def test_default_guards_stay_quiet_on_a_healthy_run_and_log_their_figures():
    guards = GuardRails()
    decisions = run(guards, [healthy(**{"objective/scores": float(u)}) for u in range(50)])
    assert not any(halts(decisions))
    assert decisions[-1] == GuardDecision(
        halt=False, guard=None, message="",
        figures={
            "guard/nonfinite": 0.0, "guard/value_divergence": 0.0,
            "guard/clip_fraction": 0.0, "guard/stale_rollouts": 0.0,
        },
    )


def test_everything_off_never_fires_and_needs_no_metrics():
    guards = GuardRails(_halting())
    terrible = {k: NAN for k in healthy()} | {"policy/clipfrac_avg": 0.99, "val/explained_variance": -100.0}
    for update in range(1, 31):
        for _ in range(5):
            assert not guards.nonfinite_step(update).halt
            assert not guards.stale_rollout(update).halt
        assert guards.check(terrible, update) == GuardDecision.keep_going({})
        assert guards.check({}, update) == GuardDecision.keep_going({})


def test_an_enabled_guard_with_its_metric_missing_says_which():
    guards = GuardRails(_halting(kl_max=10.0))
    expected = r"Guard 'kl_range' is on but metrics has no 'objective/kl'.*kl_min/kl_max=None"
    with pytest.raises(ValueError, match=expected):
        guards.check({"loss/value_avg": 0.1}, 1)


# ---------------------------------------------------------------------- nonfinite
def test_nonfinite_halts_at_the_third_consecutive_skipped_step():
    guards = GuardRails(_halting(nonfinite_halt_after=3))
    assert not guards.nonfinite_step(7).halt
    assert not guards.nonfinite_step(7).halt
    decision = guards.nonfinite_step(7)
    assert decision.halt and decision.guard == "nonfinite"
    for fragment in ("Guard 'nonfinite'", "at update 7", "3 consecutive optimizer steps", "NaN/inf",
                     "nonfinite_halt_after=3", "3 skipped in total"):
        assert fragment in decision.message
    assert decision.figures["guard/nonfinite"] == 3.0


def test_a_finite_step_resets_the_run_but_not_the_total():
    guards = GuardRails(_halting(nonfinite_halt_after=3))
    for step in ("nan", "nan", "ok", "nan", "nan", "ok"):
        decision = guards.nonfinite_step(1) if step == "nan" else guards.finite_step()
        assert decision is None or not decision.halt
    figures = guards.check({}, 1).figures
    # longest run was 2 < 3; 4 skipped steps in total
    assert figures == {"guard/nonfinite": 0.0} and guards.counters.nonfinite_steps == 4


def test_check_reports_a_run_that_reached_the_limit_inside_the_update_once():
    guards = GuardRails(_halting(nonfinite_halt_after=3))
    for _ in range(3):
        guards.nonfinite_step(4)
    guards.finite_step()  # the trainer kept going to the end of update 4
    decision = guards.check({}, 4)
    assert decision.halt and decision.guard == "nonfinite" and "at update 4" in decision.message
    assert decision.figures == {"guard/nonfinite": 0.0} and guards.counters.nonfinite_steps == 3
    assert not guards.check({}, 5).halt  # the run ended in update 4


def test_nonfinite_off_never_halts():
    guards = GuardRails(_halting(nonfinite_halt_after=None))
    assert not any(guards.nonfinite_step(1).halt for _ in range(20))


# ---------------------------------------------------------------------- value divergence
def test_explained_variance_fires_at_the_patience_th_consecutive_update():
    guards = GuardRails(_halting(min_explained_variance=-1.0, value_patience=3))
    ev = [-1.5, -1.5, -0.5, -1.0, -1.5, -2.0, -1.5]
    # streaks:  1,    2,    0 (reset), 0 (-1.0 is on the bound: allowed), 1, 2, 3 -> fires at update 7
    decisions = run(guards, [healthy(**{"val/explained_variance": v}) for v in ev])
    assert halts(decisions) == [False] * 6 + [True]
    assert [d.figures["guard/value_divergence"] for d in decisions] == [1.0, 2.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    last = decisions[-1]
    assert last.guard == "value_divergence"
    for fragment in ("at update 7", "val/explained_variance=-1.5", "min_explained_variance=-1",
                     "for 3 consecutive updates", "value_patience=3"):
        assert fragment in last.message


def test_value_loss_bound_and_nan_count_as_divergence():
    guards = GuardRails(_halting(max_value_loss=2.0, value_patience=2))
    losses = [2.0, 2.5, 1.0, 2.5, NAN]
    # 2.0 on the bound is fine; 2.5 -> 1; 1.0 resets; 2.5 -> 1; NaN -> 2: fires at update 5
    decisions = run(guards, [healthy(**{"loss/value_avg": v}) for v in losses])
    assert halts(decisions) == [False, False, False, False, True]
    assert "loss/value_avg=nan above max_value_loss=2" in decisions[-1].message


# ---------------------------------------------------------------------- ranges
@pytest.mark.parametrize(
    "name, key, prefix, low, high, inside, below, above",
    [
        ("kl_range", "objective/kl", "kl", 0.5, 20.0, 20.0, 0.4, 25.0),
        ("entropy_range", "policy/entropy_avg", "entropy", 0.1, 3.0, 0.1, 0.05, 3.5),
        ("length_range", "val/response_length", "length", 5.0, 100.0, 50.0, 2.0, 101.0),
    ],
)
def test_range_guards_fire_at_range_patience_on_either_side(name, key, prefix, low, high, inside, below, above):
    settings = _halting(**{f"{prefix}_min": low, f"{prefix}_max": high, "range_patience": 3})
    guards = GuardRails(settings)
    series = [above, below, inside, below, above, NAN]
    # streaks: 1, 2, 0 (bounds are inclusive), 1, 2, 3 (NaN is never inside) -> fires at update 6
    decisions = run(guards, [healthy(**{key: v}) for v in series])
    assert halts(decisions) == [False] * 5 + [True]
    assert [d.figures[f"guard/{name}"] for d in decisions] == [1.0, 2.0, 0.0, 1.0, 2.0, 3.0]
    assert decisions[-1].guard == name
    expected = (f"Guard '{name}' halted training at update 6: {key}=nan outside [{prefix}_min={low:g}, "
                f"{prefix}_max={high:g}] for 3 consecutive updates (range_patience=3).")
    assert decisions[-1].message == expected


def test_a_one_sided_range():
    guards = GuardRails(_halting(kl_max=10.0, range_patience=1))
    assert not guards.check(healthy(**{"objective/kl": -50.0}), 1).halt  # no lower bound
    decision = guards.check(healthy(**{"objective/kl": 10.5}), 2)
    assert decision.halt and "objective/kl=10.5 outside [kl_min=None, kl_max=10]" in decision.message


# ---------------------------------------------------------------------- clip fraction
def test_clip_fraction_fires_after_clip_patience_updates_above_the_bound():
    guards = GuardRails(_halting(max_clip_fraction=0.3, clip_patience=2))
    fractions = [0.31, 0.3, 0.35, 0.4]
    # 0.31 -> 1; 0.3 (on the bound) resets; 0.35 -> 1; 0.4 -> 2: fires at update 4
    decisions = run(guards, [healthy(**{"policy/clipfrac_avg": v}) for v in fractions])
    assert halts(decisions) == [False, False, False, True]
    assert decisions[-1].guard == "clip_fraction"
    for fragment in ("at update 4", "policy/clipfrac_avg=0.4", "max_clip_fraction=0.3", "clip_patience=2"):
        assert fragment in decisions[-1].message


# ---------------------------------------------------------------------- stale rollouts
def test_stale_rollouts_halt_at_the_limit_and_reset_on_a_fresh_one():
    guards = GuardRails(_halting(stale_halt_after=3))
    assert not guards.stale_rollout(2).halt
    assert not guards.stale_rollout(2).halt
    guards.fresh_rollout()
    assert guards.check({}, 2).figures == {"guard/stale_rollouts": 0.0} and guards.counters.stale_discarded == 2
    assert not guards.stale_rollout(3).halt
    assert not guards.stale_rollout(3).halt
    decision = guards.stale_rollout(3)
    assert decision.halt and decision.guard == "stale_rollouts"
    for fragment in ("at update 3", "3 consecutive rollouts were discarded", "stale_halt_after=3",
                     "5 discarded in total"):
        assert fragment in decision.message
    assert guards.check({}, 3).halt  # still three in a row when the update is checked


# ---------------------------------------------------------------------- reward hacking
def hacking_guards(**overrides):
    kwargs = dict(reward_hacking_metric="win_rate", reward_hacking_window=4, reward_hacking_margin=0.5)
    kwargs.update(overrides)
    return GuardRails(_halting(**kwargs))


def test_reward_hacking_fires_when_the_window_is_full_and_heldout_is_flat():
    guards = hacking_guards()
    series = [
        {"objective/scores": 0.0, "eval/win_rate": 0.5},
        {"objective/scores": 0.0},
        {"objective/scores": 1.0, "eval/win_rate": 0.5},
        {"objective/scores": 1.0},
    ]
    decisions = run(guards, series)
    # update 4: scores halves [0, 0] vs [1, 1]: rise 1.0 > 0.5; win rate [0.5] vs [0.5]: gain 0.0 <= 0
    assert halts(decisions) == [False, False, False, True]
    assert decisions[2].figures == {}  # window (4 updates) not full at update 3
    assert decisions[-1].figures == {"guard/reward_hacking_score_rise": 1.0, "guard/reward_hacking_heldout_gain": 0.0}
    message = decisions[-1].message
    for fragment in ("Guard 'reward_hacking'", "at update 4", "over updates 1-4", "objective/scores rose by 1",
                     "reward_hacking_margin=0.5", "eval/win_rate improved by only 0",
                     "reward_hacking_heldout_min_gain=0"):
        assert fragment in message


@pytest.mark.parametrize(
    "scores, heldout, mode, fires",
    [
        ([0.0, 0.0, 1.0, 1.0], [0.5, 0.6], "max", False),  # held-out rose by 0.1: real improvement
        ([0.0, 0.0, 0.5, 0.5], [0.5, 0.5], "max", False),  # score rise 0.5 is not > margin 0.5
        ([0.0, 0.0, 1.0, 1.0], [0.5, 0.4], "max", True),  # held-out fell by 0.1
        ([0.0, 0.0, 1.0, 1.0], [0.2, 0.1], "min", False),  # lower is better: 0.2 -> 0.1 is a gain of 0.1
        ([0.0, 0.0, 1.0, 1.0], [0.2, 0.3], "min", True),  # lower is better: 0.2 -> 0.3 is a gain of -0.1
        ([1.0, 1.0, 0.0, 0.0], [0.5, 0.4], "max", False),  # reward fell: not hacking
    ],
)
def test_reward_hacking_cases(scores, heldout, mode, fires):
    guards = hacking_guards(reward_hacking_metric_mode=mode)
    series = [{"objective/scores": s} for s in scores]
    series[0]["eval/win_rate"], series[2]["eval/win_rate"] = heldout
    assert halts(run(guards, series)) == [False, False, False, fires]


def test_reward_hacking_needs_heldout_in_both_halves_and_slides():
    guards = hacking_guards()
    # held-out only in the first half of the window ending at update 4: cannot judge
    series = [{"objective/scores": 0.0, "eval/win_rate": 0.5}, {"objective/scores": 0.0},
              {"objective/scores": 1.0}, {"objective/scores": 1.0}]
    decisions = run(guards, series)
    assert not any(halts(decisions))
    assert decisions[-1].figures == {"guard/reward_hacking_score_rise": 1.0}
    # update 5 slides the window to updates 2-5: scores [0, 1] vs [1, 2] (rise 1.0), win rate
    # None in [2, 3] -> still cannot judge; update 6: window 3-6, halves [1, 1] vs [2, 2] (rise 1.0),
    # win rate [] vs [0.5, 0.5] -> cannot judge
    decisions = run(guards, [{"objective/scores": 2.0, "eval/win_rate": 0.5},
                             {"objective/scores": 2.0, "eval/win_rate": 0.5}], start=5)
    assert not any(halts(decisions))
    # update 7: window 4-7, halves [1, 2] (mean 1.5) vs [2, 2.5] (mean 2.25): rise 0.75 > 0.5;
    # win rate [0.5] vs [0.5, 0.45] (mean 0.475): gain -0.025 -> fires
    decision = guards.check({"objective/scores": 2.5, "eval/win_rate": 0.45}, 7)
    assert decision.halt
    assert decision.figures["guard/reward_hacking_score_rise"] == pytest.approx(0.75, abs=1e-12)
    assert decision.figures["guard/reward_hacking_heldout_gain"] == pytest.approx(-0.025, abs=1e-12)


# ---------------------------------------------------------------------- several guards, settings
def test_the_first_guard_in_order_takes_precedence_and_names_the_others():
    guards = GuardRails(_halting(kl_max=1.0, max_clip_fraction=0.2, range_patience=1, clip_patience=1))
    decision = guards.check(healthy(**{"objective/kl": 5.0, "policy/clipfrac_avg": 0.9}), 1)
    assert decision.guard == "kl_range"
    assert decision.message.endswith("(Also fired: clip_fraction.)")
    assert GUARD_NAMES.index("kl_range") < GUARD_NAMES.index("clip_fraction")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(kl_min=5.0, kl_max=1.0), "kl_min=5.0 is above kl_max=1.0"),
        (dict(value_patience=0), "value_patience must be an int >= 1"),
        (dict(nonfinite_halt_after=0), "nonfinite_halt_after must be an int >= 1"),
        (dict(max_clip_fraction=1.5), r"max_clip_fraction must be in \[0, 1\)"),
        (dict(reward_hacking_window=5), "reward_hacking_window must be an even int >= 2"),
        (dict(reward_hacking_metric_mode="up"), "reward_hacking_metric_mode must be 'max' or 'min'"),
    ],
)
def test_bad_settings_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GuardSettings(**kwargs)


def test_a_metric_name_gets_the_eval_prefix():
    assert GuardSettings(reward_hacking_metric="win_rate").reward_hacking_metric == "eval/win_rate"
    assert GuardSettings(reward_hacking_metric="custom/x").reward_hacking_metric == "custom/x"


# ---------------------------------------------------------------------- exact resume
def test_state_round_trip_resumes_every_counter_exactly():
    settings = GuardSettings(
        guard_action="halt", guard_warmup=0,
        nonfinite_halt_after=3, min_explained_variance=-1.0, value_patience=3, kl_max=10.0, range_patience=3,
        max_clip_fraction=0.5, clip_patience=3, stale_halt_after=3,
        reward_hacking_metric="win_rate", reward_hacking_window=4, reward_hacking_margin=0.5,
    )
    before = [
        healthy(**{"val/explained_variance": -2.0, "objective/kl": 11.0, "objective/scores": 0.0,
                   "eval/win_rate": 0.5}),
        healthy(**{"val/explained_variance": -2.0, "objective/kl": 11.0, "objective/scores": 0.0,
                   "policy/clipfrac_avg": 0.6}),
    ]
    after = [healthy(**{"val/explained_variance": -2.0, "objective/scores": 1.0, "eval/win_rate": 0.5}),
             healthy(**{"objective/scores": 1.0})]
    original = GuardRails(settings)
    run(original, before)
    original.nonfinite_step(2), original.nonfinite_step(2), original.stale_rollout(2), original.stale_rollout(2)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = GuardRails(settings)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == original.state_dict()
    # the value streak (2 of 3) fires at update 3 on both, and both carry the nonfinite run of 2
    expected = run(original, after, start=3)
    assert run(resumed, after, start=3) == expected
    assert expected[0].halt and expected[0].guard == "value_divergence"
    assert expected[0].figures["guard/nonfinite"] == 2.0 and expected[0].figures["guard/stale_rollouts"] == 2.0
    # update 4: scores [0, 0] vs [1, 1] and win rate [0.5] vs [0.5] -> reward hacking, from the restored window
    assert expected[1].guard == "reward_hacking"
    # nonfinite and stale runs continue where they were: one more each reaches 3
    assert resumed.nonfinite_step(5).halt and resumed.stale_rollout(5).halt


def test_load_state_rejects_a_foreign_dict():
    with pytest.raises(ValueError, match=r"Guard state is missing \[.*'history'.*\]"):
        GuardRails().load_state_dict({"streaks": {}})


def test_state_keeps_nan_scores_through_json():
    guards = GuardRails(_halting(reward_hacking_metric="win_rate", reward_hacking_window=4))
    guards.check({"objective/scores": NAN}, 1)
    state = json.loads(json.dumps(guards.state_dict()))
    resumed = GuardRails(guards.settings)
    resumed.load_state_dict(state)
    assert math.isnan(resumed.state_dict()["history"][0][1])


# ---------------------------------------------------------------------- warm-up, trend, warn by default
def _fresh_critic_series(n, ev=-7.2, loss_start=11.0, loss_step=-0.02):
    """A fresh critic fitting slowly: explained variance far below -1, value loss falling."""
    return [healthy(**{"val/explained_variance": ev, "loss/value_avg": loss_start + loss_step * u})
            for u in range(n)]


def test_a_fresh_critic_with_a_falling_value_loss_never_fires_the_value_guard():
    # The run: EV -7.2 for many updates while the value loss falls 11.0 -> 9.4.
    guards = GuardRails(GuardSettings(guard_action="halt"))
    decisions = run(guards, _fresh_critic_series(80))
    assert not any(halts(decisions)) and not any(d.warnings for d in decisions)


def test_value_guard_counts_only_after_the_warm_up_and_needs_a_loss_that_does_not_fall():
    settings = _halting(min_explained_variance=-1.0, value_patience=4, guard_warmup=5)
    guards = GuardRails(settings)
    # updates 1-5 are warm-up: nothing counts; from update 6 the streak runs 1, 2, 3, 4 -> fires at 9
    decisions = run(guards, _fresh_critic_series(9, loss_step=0.0))
    assert [d.figures["guard/value_divergence"] for d in decisions] == [0, 0, 0, 0, 0, 1, 2, 3, 4]
    assert halts(decisions) == [False] * 8 + [True]
    assert "while loss/value_avg did not fall" in decisions[-1].message
    # the same run with the loss falling by 0.1 an update: second half of the window is lower -> no fire
    falling = run(GuardRails(settings), _fresh_critic_series(12, loss_step=-0.1))
    assert not any(halts(falling))


def test_heuristic_guards_warn_once_per_episode_by_default():
    guards = GuardRails(GuardSettings.all_off(max_clip_fraction=0.3, clip_patience=2, guard_warmup=0))
    clip = [0.4, 0.4, 0.4, 0.4, 0.1, 0.4, 0.4]
    decisions = run(guards, [healthy(**{"policy/clipfrac_avg": c}) for c in clip])
    assert not any(halts(decisions))
    # streaks 1, 2 (fires: warns), 3 (still firing: silent), 4, 0 (clear), 1, 2 (fires again: warns)
    assert [len(d.warnings) for d in decisions] == [0, 1, 0, 0, 0, 0, 1]
    warning = decisions[1].warnings[0]
    for fragment in ("Guard 'clip_fraction' fired at update 2", "policy/clipfrac_avg=0.4",
                     "Training goes on (guard_action='warn')", "halt_guards=['clip_fraction']"):
        assert fragment in warning


def test_halt_guards_makes_one_heuristic_guard_halt_under_warn():
    settings = GuardSettings.all_off(max_clip_fraction=0.3, clip_patience=1, kl_max=3.0, range_patience=1,
                                     guard_warmup=0, halt_guards=["kl_range"])
    guards = GuardRails(settings)
    clipping = guards.check(healthy(**{"policy/clipfrac_avg": 0.9}), 1)
    assert not clipping.halt and len(clipping.warnings) == 1
    kl = guards.check(healthy(**{"objective/kl": 5.0}), 2)
    assert kl.halt and kl.guard == "kl_range"


def test_hard_guards_halt_whatever_guard_action_says():
    guards = GuardRails(GuardSettings.all_off(nonfinite_halt_after=2, stale_halt_after=2))
    assert guards.settings.guard_action == "warn"
    guards.nonfinite_step(1)
    assert guards.nonfinite_step(1).halt
    guards.stale_rollout(1)
    assert guards.stale_rollout(1).halt


@pytest.mark.parametrize("kwargs, message", [
    (dict(guard_action="stop"), "guard_action must be 'warn' or 'halt', got 'stop'"),
    (dict(halt_guards=["nonfinite"]), r"halt_guards has \['nonfinite'\], which are not heuristic guards"),
    (dict(guard_warmup=-1), "guard_warmup must be an int >= 0, got -1"),
    (dict(halt_guards="kl_range"), r"halt_guards must be a list of guard names, e.g. halt_guards=\['kl_range'\]"),
])
def test_bad_guard_action_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuardSettings(**kwargs)


def test_every_guard_field_that_takes_none_takes_it_on_the_command_line_too():
    """Issue 23: `--nonfinite_halt_after None` failed in HfArgumentParser (int('None')). Every
    GuardSettings field whose type admits None now parses 'None' to None, and numbers to numbers."""
    import typing

    from transformers import HfArgumentParser

    from trl_ppo_ext import PPOConfig

    hints = typing.get_type_hints(GuardSettings)
    optional = [name for name, hint in hints.items() if type(None) in typing.get_args(hint)]
    assert {"nonfinite_halt_after", "stale_halt_after", "kl_max", "max_clip_fraction", "min_explained_variance",
            "reward_hacking_metric", "halt_guards"} <= set(optional)
    parser = HfArgumentParser(PPOConfig)
    argv = ["--output_dir", "unused"]
    for name in optional:
        argv += [f"--{name}", "None"]
    (config,) = parser.parse_args_into_dataclasses(args=argv)
    assert {name: getattr(config, name) for name in optional} == dict.fromkeys(optional)
    assert {name: getattr(config.guard_settings(), name) for name in optional} == dict.fromkeys(optional)
    (config,) = parser.parse_args_into_dataclasses(
        args=["--output_dir", "unused", "--nonfinite_halt_after", "5", "--kl_max", "2.5", "--length_min", "3"])
    assert (config.nonfinite_halt_after, config.kl_max, config.length_min) == (5, 2.5, 3.0)
    assert type(config.nonfinite_halt_after) is int and type(config.length_min) is float
    with pytest.raises(ValueError, match=r"nonfinite_halt_after must be an int or None, got 'three'"):
        parser.parse_args_into_dataclasses(args=["--output_dir", "unused", "--nonfinite_halt_after", "three"])


# ---------------------------------------------------------------- the totals live in RunCounters, once
def test_the_guards_count_the_totals_in_the_runs_counters_and_do_not_save_them_twice():
    from trl_ppo_ext.run.state import RunCounters

    counters = RunCounters()
    guards = GuardRails(_halting(nonfinite_halt_after=3, stale_halt_after=3), counters)
    guards.nonfinite_step(1), guards.finite_step(), guards.nonfinite_step(2), guards.stale_rollout(2)
    assert (counters.nonfinite_steps, counters.stale_discarded) == (2, 1)
    state = guards.state_dict()
    assert "nonfinite_total" not in state and "stale_total" not in state  # ppo_state.json's "counters" has them
    assert guards.check({}, 2).figures == {"guard/nonfinite": 1.0, "guard/stale_rollouts": 1.0}
    assert (counters.nonfinite_steps, counters.stale_discarded) == (2, 1)
