"""benchmarks/sample_efficiency/report.py without training: its table, plot and log reading on fake
logs written here, and the command line reading them back (``--report-only``)."""

import json
import math
from pathlib import Path

import pytest


def write_run(path: Path, rewards, *, kl=0.1, entropy=1.0, batch=32, end=None, seconds_per_update=None):
    """A run file as a worker writes it: one row per update, then the ``done`` row; with
    ``seconds_per_update`` each row keeps the wall seconds of training when its update ended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"update": i + 1, "episode": batch * (i + 1), "reward": r, "scored": batch, "score": r,
             "kl": kl, "entropy": entropy, "explained_variance": None} for i, r in enumerate(rewards)]
    if seconds_per_update is not None:
        for i, row in enumerate(rows):
            row["time_s"] = seconds_per_update * (i + 1)
            row["cpu_s"] = seconds_per_update * (i + 1) / 2
    end = end if end is not None else {"done": True, "train_s": 2.0, "updates": len(rewards)}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [end]))


def test_trailing_mean_by_hand(se):
    # window 3 over [0, 3, 6, 9]: [0], [0,3], [0,3,6], [3,6,9] -> 0, 1.5, 3, 6
    assert se.trailing_mean([0.0, 3.0, 6.0, 9.0], 3) == [0.0, 1.5, 3.0, 6.0]
    assert se.trailing_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_value_at_and_episodes_to_reach(se, tmp_path):
    write_run(tmp_path / "r.jsonl", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])  # episodes 32 .. 256
    run = se.read_run(tmp_path / "r.jsonl", 0)
    # half = 128 episodes = updates 1..4; window 2 -> mean(0.4, 0.6) = 0.5
    assert se.value_at(run, "reward", 128, 2) == pytest.approx(0.5, abs=1e-12)
    # end: mean(1.0, 1.0) over updates 7, 8
    assert se.value_at(run, "reward", 256, 2) == pytest.approx(1.0, abs=1e-12)
    # trailing means (window 2): 0, .1, .3, .5, .7, .9, 1, 1 -> first >= 0.7 at update 5 = episode 160
    assert se.episodes_to_reach(run, 0.7, 2) == 160
    assert se.episodes_to_reach(run, 1.01, 2) is None
    assert se.value_at(run, "reward", 16, 2) is None  # no update had ended by episode 16


def test_read_run_incomplete_crashed_non_finite_short(se, tmp_path):
    assert se.read_run(tmp_path / "missing.jsonl", 0) is None
    write_run(tmp_path / "partial.jsonl", [0.1, 0.2], end={"update": 3})  # no done row: still running
    assert se.read_run(tmp_path / "partial.jsonl", 0) is None
    write_run(tmp_path / "crash.jsonl", [0.1], end={"done": True, "crashed": True, "reason": "exit 1: boom"})
    assert se.read_run(tmp_path / "crash.jsonl", 0).crashed == "exit 1: boom"
    write_run(tmp_path / "nan.jsonl", [0.1, float("nan"), 0.3])
    assert se.read_run(tmp_path / "nan.jsonl", 0).crashed == "non-finite reward at update 2"
    write_run(tmp_path / "short.jsonl", [0.1, 0.2], end={"done": True, "train_s": 1.0, "updates": 4})
    assert se.read_run(tmp_path / "short.jsonl", 0).crashed == "stopped after 2 of 4 updates"
    write_run(tmp_path / "ok.jsonl", [0.1, 0.2])
    ok = se.read_run(tmp_path / "ok.jsonl", 3)
    assert (ok.crashed, ok.seed, ok.train_s, len(ok.rows)) == (None, 3, 2.0, 2)


def _fake_arms(se, tmp_path):
    """Arm "a": seeds 0, 1 learn (final 0.8 and 0.6), seed 2 crashed; arm "b": two seeds, final 0.2 and 0.4."""
    write_run(tmp_path / "a0.jsonl", [0.0, 0.4, 0.8, 0.8], kl=0.5, entropy=2.0)
    write_run(tmp_path / "a1.jsonl", [0.0, 0.2, 0.6, 0.6], kl=0.3, entropy=1.0)
    write_run(tmp_path / "a2.jsonl", [0.0], end={"done": True, "crashed": True, "reason": "timed out"})
    write_run(tmp_path / "b0.jsonl", [0.0, 0.1, 0.2, 0.2])
    write_run(tmp_path / "b1.jsonl", [0.0, 0.3, 0.4, 0.4])
    return {"a": [se.read_run(tmp_path / f"a{s}.jsonl", s) for s in range(3)],
            "b": [se.read_run(tmp_path / f"b{s}.jsonl", s) for s in range(2)]}


def test_table_on_fake_logs(se, tmp_path):
    runs = _fake_arms(se, tmp_path)
    assert se.final_reward(runs["a"], 128, 1) == pytest.approx(0.7, abs=1e-12)  # (0.8 + 0.6) / 2, crash left out
    text = se.table(runs, episodes=128, threshold=0.5, window=1, expected_seeds=3)
    head, rule, a, b = text.splitlines()
    cells = {name: [c.strip() for c in line.strip("|").split("|")] for name, line in (("a", a), ("b", b))}
    assert head.count("|") == rule.count("|") == 13
    # a: 2 of 3 ran, 1 crashed; half = episode 64 = update 2: 0.4, 0.2 -> mean 0.3, sd sqrt(0.02) = 0.1414
    # final 0.8, 0.6 -> 0.7 +- 0.1414; threshold 0.5 first reached at update 3 (96) by both -> median 96 (2/2)
    # KL mean (0.5 + 0.3) / 2 = 0.4, entropy (2 + 1) / 2 = 1.5, no explained variance, 2 s per run (crash has none),
    # 2 s over 128 episodes = 15.625 ms per episode
    # the fake rows keep no time_s: no seconds to the threshold
    assert cells["a"] == ["a", "2/3", "1", "0.300 ± 0.141", "0.700 ± 0.141", "96 (2/2)", "n/a", "0.4", "1.5", "n/a",
                          "2", "15.6"]
    # b never reaches 0.5: median over [inf, inf] -> "> budget"
    assert cells["b"][:6] == ["b", "2/3", "0", "0.200 ± 0.141", "0.300 ± 0.141", "> budget (0/2)"]
    assert se.table(runs, episodes=128, threshold=None, window=1, expected_seeds=3).splitlines()[2].split("|")[6] \
        .strip() == "n/a"


def test_median_episodes_counts_unreached_runs_as_beyond_the_budget(se, tmp_path):
    # three seeds: reach 0.5 at episode 64, at 96, never -> sorted [64, 96, inf], median 96
    write_run(tmp_path / "0.jsonl", [0.0, 0.5, 0.5])
    write_run(tmp_path / "1.jsonl", [0.0, 0.0, 0.5])
    write_run(tmp_path / "2.jsonl", [0.0, 0.0, 0.0])
    runs = {"x": [se.read_run(tmp_path / f"{s}.jsonl", s) for s in range(3)]}
    row = se.table(runs, episodes=96, threshold=0.5, window=1, expected_seeds=3).splitlines()[2]
    assert "| 96 (2/3) |" in row


def test_seconds_to_the_threshold_median_over_seeds(se, tmp_path):
    # seed 0 reaches 0.5 at update 2 after 2 x 1.5 s = 3.0 s, seed 1 at update 3 after 3 x 2.0 s = 6.0 s, seed 2 never:
    # sorted [3.0, 6.0, inf] -> median 6.0; CPU seconds are half the wall seconds in these rows -> 3.0
    write_run(tmp_path / "0.jsonl", [0.0, 0.5, 0.5], seconds_per_update=1.5)
    write_run(tmp_path / "1.jsonl", [0.0, 0.0, 0.5], seconds_per_update=2.0)
    write_run(tmp_path / "2.jsonl", [0.0, 0.0, 0.0], seconds_per_update=1.0)
    runs = {"x": [se.read_run(tmp_path / f"{s}.jsonl", s) for s in range(3)]}
    cells = [c.strip() for c in se.table(runs, episodes=96, threshold=0.5, window=1, expected_seeds=3)
             .splitlines()[2].strip("|").split("|")]
    assert cells[5:7] == ["96 (2/3)", "6.0 / 3.0"]


def test_curves_mean_and_sd_over_seeds(se, tmp_path):
    runs = _fake_arms(se, tmp_path)["a"]
    episodes, mean, sd = se.curves(runs, "reward", 1)
    assert episodes == [32, 64, 96, 128]
    # seeds 0, 1 (the crash is left out): (0,0) (0.4,0.2) (0.8,0.6) (0.8,0.6)
    assert mean == pytest.approx([0.0, 0.3, 0.7, 0.7], abs=1e-12)
    assert sd == pytest.approx([0.0, math.sqrt(0.02)] + [math.sqrt(0.02)] * 2, abs=1e-12)


def test_plot_writes_a_png(se, tmp_path):
    out = tmp_path / "plot.png"
    se.plot(_fake_arms(se, tmp_path), out, title="fake", reward_name="reward", threshold=0.5, episodes=128, window=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_only_main_writes_table_and_plot(se, tmp_path, capsys):
    for arm, finals in (("fast", (0.9, 0.7)), ("slow", (0.3, 0.5))):
        for seed, final in enumerate(finals):
            write_run(tmp_path / "synthetic" / arm / f"{seed}.jsonl", [0.0] * 16 + [final] * 16)
    argv = ["--report-only", "--out", str(tmp_path), "--seeds", "2", "--arms", "defaults", "--threshold", "0.6",
            "--window", "1", "--arm", "fast:learning_rate=0.001", "--arm", "slow:learning_rate=0.0001"]
    assert se.main(argv) == 0
    table = (tmp_path / "synthetic" / "table.md").read_text()
    assert "threshold 0.600 (--threshold)" in table
    # 32 updates of 32 = the 1024 default episodes; half (update 16) is still 0; final = 0.8 +- sqrt(0.02);
    # both seeds of "fast" pass 0.6 at update 17 = episode 544, neither of "slow" (0.3, 0.5) does
    assert "| fast | 2/2 | 0 | 0.000 ± 0.000 | 0.800 ± 0.141 | 544 (2/2) |" in table
    assert "| slow | 2/2 | 0 | 0.000 ± 0.000 | 0.400 ± 0.141 | > budget (0/2) |" in table
    assert "| defaults | 0/2 | 0 |" in table  # no logs for it: 0 of 2 ran, none crashed
    assert (tmp_path / "synthetic.png").read_bytes()[:4] == b"\x89PNG"
    assert "table:" in capsys.readouterr().out


def test_an_arm_keeps_its_colour_in_every_panel_when_another_logs_no_kl(se, tmp_path, monkeypatch):
    """TRL's GRPO (beta 0) logs no KL: its curve is missing from the KL panel, and the arm after it must
    not take its colour there."""
    import matplotlib.figure

    write_run(tmp_path / "a.jsonl", [0.1, 0.2], kl=None)
    write_run(tmp_path / "b.jsonl", [0.3, 0.4], kl=0.5)
    runs = {"no_kl": [se.read_run(tmp_path / "a.jsonl", 0)], "with_kl": [se.read_run(tmp_path / "b.jsonl", 0)]}
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    se.plot(runs, tmp_path / "p.png", title="t", reward_name="r", threshold=None, episodes=64, window=1)
    reward_ax, kl_ax, _ = saved[0].axes
    colour = {line.get_label(): line.get_color() for line in reward_ax.lines}["with_kl (1 seeds)"]
    assert [line.get_color() for line in kl_ax.lines] == [colour]


def test_wall_times_and_the_wall_time_plot(se, tmp_path, monkeypatch):
    """Seeds 0 and 1 end their updates at 2, 4, 6 s and 4, 8 s (seed 1 stopped after two of three:
    crashed, left out); seed 2 at 3, 5, 7 s. Mean over seeds 0 and 2: 2.5, 4.5, 6.5 s."""
    import matplotlib.figure

    def run(seed, times, updates=3):
        path = tmp_path / f"{seed}.jsonl"
        rows = [{"update": i + 1, "episode": 32 * (i + 1), "reward": 0.1 * (i + 1), "time_s": t}
                for i, t in enumerate(times)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"done": True, "updates": updates}]))
        return se.read_run(path, seed)

    runs = [run(0, [2.0, 4.0, 6.0]), run(1, [4.0, 8.0]), run(2, [3.0, 5.0, 7.0])]
    assert runs[1].crashed == "stopped after 2 of 3 updates"
    assert se.wall_times(runs) == [2.5, 4.5, 6.5]
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    assert se.plot_wall_time({"a": runs}, tmp_path / "w.png", title="t", reward_name="r", threshold=None, window=1)
    (line,) = drawn[0].axes[0].get_lines()
    assert list(line.get_xdata()) == [2.5, 4.5, 6.5] and list(line.get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    # rows without time_s (runs written before it was kept): no plot
    write_run(tmp_path / "old.jsonl", [0.5, 0.6])
    assert se.wall_times([se.read_run(tmp_path / "old.jsonl", 0)]) == []
    assert not se.plot_wall_time({"old": [se.read_run(tmp_path / "old.jsonl", 0)]}, tmp_path / "x.png", title="t",
                                 reward_name="r", threshold=None, window=1)
    assert len(drawn) == 1
