"""Reading the runs: a run's rows (``read_run``), the values the table takes from them, the
markdown table, the plot, and ``report``, which writes both for a task's arms.

The table (markdown, to stdout and ``DIR/<task>/table.md``): per arm, runs and crashed runs; the
reward at half the episodes and at the end (each the mean of the ``--window`` updates that end
there, then mean +- standard deviation over the seeds that did not crash); episodes to reach the
threshold (the first episode at which that trailing mean reaches it; median over seeds, and how
many reached it) and the median wall seconds of training to reach it (and CPU seconds, where the
rows keep ``cpu_s``); KL, token entropy and
explained variance at the end. The threshold is ``--threshold``, else the ``trl112`` arm's mean
final reward, else the ``trl_grpo`` arm's (the peer the others race to); then the mean training
seconds per run and the median over runs of the
milliseconds per episode (``train_s`` over the run's episodes); where rows have a ``call_rate``
(tools_env), its mean +- sd over seeds at the first update and at the end. The header warns when
the finished runs' rows do not all count the same episodes per update (``episode_mismatch``).
With ``--memory`` a column "peak live tensors (MiB)" (one short run per arm, see ``run.timed_train``).
The plot (``DIR/<task>.png``): mean over seeds of that trailing mean against episodes, with a band
of +- one standard deviation per arm; KL and entropy in panels beside it. Where the rows keep
``time_s``, the same reward against the mean wall seconds of training (``DIR/<task>_wall.png``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .run import MEMORY_SEED, MEMORY_UPDATES
from .tasks import TASKS


@dataclass
class Run:
    """One (arm, seed): its per-update rows, and why it crashed (None if it did not)."""

    seed: int
    rows: list[dict]
    crashed: str | None = None
    train_s: float | None = None


def read_run(path: Path, seed: int) -> Run | None:
    """The run in ``path``; None if it is missing or incomplete. A run whose rows hold a
    non-finite reward, KL or entropy counts as crashed."""
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or not lines[-1].get("done"):
        return None
    end, rows = lines[-1], lines[:-1]
    run = Run(seed=seed, rows=rows, crashed=end.get("reason") if end.get("crashed") else None,
              train_s=end.get("train_s"))
    if run.crashed is None:
        for row in rows:
            bad = [k for k in ("reward", "kl", "entropy") if row.get(k) is not None and not math.isfinite(row[k])]
            if bad:
                run.crashed = f"non-finite {', '.join(bad)} at update {row['update']}"
                break
        if run.crashed is None and end.get("updates") is not None and len(rows) < end["updates"]:
            run.crashed = f"stopped after {len(rows)} of {end['updates']} updates"
    return run


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values up to each position (fewer at the start).

    >>> trailing_mean([1.0, 3.0, 5.0, 7.0], 2)
    [1.0, 2.0, 4.0, 6.0]
    """
    return [sum(values[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def value_at(run: Run, key: str, episode: float, window: int) -> float | None:
    """The mean of ``key`` over the ``window`` updates that end at the last update with
    ``episode`` episodes or fewer; None without such an update or values."""
    done = [r for r in run.rows if r["episode"] <= episode and r.get(key) is not None]
    if not done:
        return None
    last = done[-window:]
    return sum(r[key] for r in last) / len(last)


def episodes_to_reach(run: Run, threshold: float, window: int, key: str = "episode") -> float | None:
    """The first episode (or, with ``key="time_s"``, the wall seconds of training) at which the
    trailing ``window``-update mean reward reaches ``threshold``; None if it never does (or the
    row lacks ``key``).

    >>> run = Run(0, [{"reward": r, "episode": 32 * (i + 1), "time_s": 1.5 * (i + 1)} for i, r in enumerate([0, 1, 1])])
    >>> episodes_to_reach(run, 0.5, 2), episodes_to_reach(run, 0.5, 2, key="time_s"), episodes_to_reach(run, 2, 2)
    (64, 3.0, None)
    """
    rows = [r for r in run.rows if r.get("reward") is not None]
    for row, mean in zip(rows, trailing_mean([r["reward"] for r in rows], window)):
        if mean >= threshold:
            return row.get(key)
    return None


def median_to_reach(runs: list[Run], threshold: float, window: int, key: str, spec: str) -> str:
    """``"median (reached/runs)"`` of :func:`episodes_to_reach` over ``runs``, a run that never
    reaches ``threshold`` counting as beyond the budget."""
    hits = [episodes_to_reach(r, threshold, window, key) for r in runs]
    reached = sorted(h for h in hits if h is not None)
    ordered = reached + [math.inf] * (len(hits) - len(reached))
    median = statistics.median_low(ordered) if len(ordered) % 2 else statistics.median(ordered)
    return f"{'> budget' if math.isinf(median) else format(median, spec)} ({len(reached)}/{len(hits)})"


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def _mean(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.fmean(values):.3g}" if values else "n/a"


def _median(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.3g}" if values else "n/a"


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def final_reward(runs: list[Run], episodes: int, window: int) -> float | None:
    """Mean over the runs that did not crash of each one's final reward."""
    values = [value_at(r, "reward", episodes, window) for r in runs if r.crashed is None]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def ms_per_episode(run: Run) -> float | None:
    """Training wall time per episode of a finished run, in ms: ``train_s`` over its last row's
    ``episode``; None without either (a crashed run has no ``train_s``)."""
    if run.train_s is None or not run.rows or not run.rows[-1].get("episode"):
        return None
    return 1000.0 * run.train_s / run.rows[-1]["episode"]


def read_memory(path: Path) -> float | None:
    """The peak of live tensors (MiB) a memory run wrote to ``path``; None if there is none."""
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("peak_live_tensors_mib")


def table(runs_by_arm: dict[str, list[Run]], *, episodes: int, threshold: float | None, window: int,
          expected_seeds: int, memory: dict[str, float | None] | None = None) -> str:
    """The markdown table of the module docstring; with ``memory`` (arm -> peak MiB or None) a last
    column of the memory runs' peaks; where any row has a ``call_rate`` (tools_env), a column of it
    at the first update and at the end (the mean of the last ``window`` updates), each mean +- sd
    over the seeds."""
    calls = any("call_rate" in row for runs in runs_by_arm.values() for r in runs for row in r.rows)
    head = ("| arm | runs | crashed | reward at half | final reward | episodes to threshold (median, reached) "
            "| train s to threshold, wall / CPU (median) | final KL | final entropy | final expl. var. | train s / run "
            "| ms / episode (median) |")
    if calls:
        head += " call rate: first update → final |"
    if memory is not None:
        head += " peak live tensors (MiB) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, runs in runs_by_arm.items():
        ok = [r for r in runs if r.crashed is None]
        half = [value_at(r, "reward", episodes / 2, window) for r in ok]
        final = [value_at(r, "reward", episodes, window) for r in ok]
        reach = seconds = "n/a"
        if threshold is not None and ok:
            reach = median_to_reach(ok, threshold, window, "episode", ".0f")
            if all(row.get("time_s") is not None for r in ok for row in r.rows):
                seconds = median_to_reach(ok, threshold, window, "time_s", ".1f").split(" (")[0]
            if all(row.get("cpu_s") is not None for r in ok for row in r.rows):
                seconds += " / " + median_to_reach(ok, threshold, window, "cpu_s", ".1f").split(" (")[0]
        lines.append(
            f"| {name} | {len(ok)}/{max(expected_seeds, len(runs))} | {len(runs) - len(ok)} | {_mean_sd(half)} "
            f"| {_mean_sd(final)} | {reach} | {seconds} "
            f"| {_mean([value_at(r, 'kl', episodes, window) for r in ok])} "
            f"| {_mean([value_at(r, 'entropy', episodes, window) for r in ok])} "
            f"| {_mean([value_at(r, 'explained_variance', episodes, window) for r in ok])} "
            f"| {_mean([r.train_s for r in runs if r.train_s is not None])} "
            f"| {_median([ms_per_episode(r) for r in runs])} |"
            + (f" {_mean_sd([r.rows[0].get('call_rate') for r in ok if r.rows])} → "
               f"{_mean_sd([value_at(r, 'call_rate', episodes, window) for r in ok])} |" if calls else "")
            + (f" {_number(memory.get(name), '.1f')} |" if memory is not None else "")
        )
    return "\n".join(lines)


def curves(runs: list[Run], key: str, window: int) -> tuple[list[int], list[float], list[float]]:
    """Episodes, mean and standard deviation over the runs that did not crash of the trailing
    ``window``-update mean of ``key`` (updates every run has)."""
    ok = [r for r in runs if r.crashed is None and r.rows and all(x.get(key) is not None for x in r.rows)]
    if not ok:
        return [], [], []
    n = min(len(r.rows) for r in ok)
    series = [trailing_mean([x[key] for x in r.rows[:n]], window) for r in ok]
    episodes = [x["episode"] for x in ok[0].rows[:n]]
    means = [statistics.fmean(col) for col in zip(*series)]
    sds = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*series)]
    return episodes, means, sds


def plot(runs_by_arm: dict[str, list[Run]], path: Path, *, title: str, reward_name: str, threshold: float | None,
         episodes: int, window: int) -> None:
    """Mean reward (trailing ``window``-update mean) against episodes with a +-1 sd band per arm;
    KL and token entropy beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    for i, (name, runs) in enumerate(runs_by_arm.items()):
        color = f"C{i % 10}"  # one colour per arm in every panel, also where an arm logs no KL
        for ax, key in zip(axes, ("reward", "kl", "entropy")):
            x, mean, sd = curves(runs, key, window)
            if not x:
                continue
            ok = sum(r.crashed is None for r in runs)
            ax.plot(x, mean, label=f"{name} ({ok} seeds)" if key == "reward" else None, lw=1.5, color=color)
            ax.fill_between(x, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=color, alpha=0.2, lw=0)
    if threshold is not None:
        axes[0].axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold:.3f}")
    axes[0].axvline(episodes / 2, color="gray", ls=":", lw=1)
    axes[0].set(title=title, xlabel="episodes", ylabel=f"{reward_name}, mean of {window} updates")
    axes[1].set(title="objective/kl", xlabel="episodes")
    axes[2].set(title="policy/entropy_avg (nats)", xlabel="episodes")
    axes[0].legend(fontsize=8, loc="best")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def wall_times(runs: list[Run]) -> list[float]:
    """Per update, the mean over the runs that did not crash of ``time_s`` (wall seconds of training
    when the update ended), for the updates every such run has; [] where a row has no ``time_s``.

    >>> wall_times([Run(0, [{"time_s": 1.0}, {"time_s": 3.0}]), Run(1, [{"time_s": 2.0}])])
    [1.5]
    """
    ok = [r for r in runs if r.crashed is None and r.rows]
    if not ok or any(x.get("time_s") is None for r in ok for x in r.rows):
        return []
    n = min(len(r.rows) for r in ok)
    return [statistics.fmean(r.rows[i]["time_s"] for r in ok) for i in range(n)]


def plot_wall_time(runs_by_arm: dict[str, list[Run]], path: Path, *, title: str, reward_name: str,
                   threshold: float | None, window: int) -> bool:
    """Mean reward (trailing ``window``-update mean, +-1 sd band) against the mean wall seconds of
    training at each update, one curve per arm; False (nothing written) where no arm has ``time_s``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    drawn = False
    for i, (name, runs) in enumerate(runs_by_arm.items()):
        seconds, (_, mean, sd) = wall_times(runs), curves(runs, "reward", window)
        n = min(len(seconds), len(mean))
        if not n:
            continue
        drawn = True
        color = f"C{i % 10}"  # the colours of the episodes plot
        ok = sum(r.crashed is None for r in runs)
        ax.plot(seconds[:n], mean[:n], label=f"{name} ({ok} seeds)", lw=1.5, color=color)
        ax.fill_between(seconds[:n], [m - s for m, s in zip(mean, sd)][:n], [m + s for m, s in zip(mean, sd)][:n],
                        color=color, alpha=0.2, lw=0)
    if threshold is not None:
        ax.axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold:.3f}")
    ax.set(title=title, xlabel="wall seconds of training (one thread)", ylabel=f"{reward_name}, mean of {window}")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=72)
    plt.close(fig)
    return drawn


def episode_mismatch(runs_by_arm: dict[str, list[Run]]) -> str | None:
    """None when every finished run's rows have the same ``episode`` column (the arms generated the
    same completions per update), else which runs differ from the first one's.

    >>> rows = lambda *episodes: [{"episode": e} for e in episodes]
    >>> episode_mismatch({"a": [Run(0, rows(32, 64))], "b": [Run(0, rows(32, 64)), Run(1, rows(32, 64))]}) is None
    True
    >>> episode_mismatch({"a": [Run(0, rows(32, 64))], "b": [Run(1, rows(32, 60))]})
    'episodes per update differ from a seed 0: b seed 1'
    """
    runs = [(name, r) for name, rs in runs_by_arm.items() for r in rs if r.crashed is None]
    if not runs:
        return None
    (first_name, first), *rest = runs
    episodes = [row["episode"] for row in first.rows]
    odd = [f"{name} seed {r.seed}" for name, r in rest if [row["episode"] for row in r.rows] != episodes]
    return f"episodes per update differ from {first_name} seed {first.seed}: {', '.join(odd)}" if odd else None


def report(args, task_dir: Path, arm_names: list[str], seeds: list[int]) -> str:
    """Read every run of ``arm_names``; write the table and the plot; return the table."""
    runs_by_arm = {}
    for name in arm_names:
        runs = [read_run(task_dir / name / f"{s}.jsonl", s) for s in seeds]
        runs_by_arm[name] = [r for r in runs if r is not None]
    threshold, source = args.threshold, "--threshold"
    for peer in ("trl112", "trl_grpo"):  # the peer whose final reward the others race to
        if threshold is None and runs_by_arm.get(peer):
            threshold, source = final_reward(runs_by_arm[peer], args.episodes, args.window), f"{peer}'s final reward"
    spec = TASKS[args.task]
    memory = {name: read_memory(task_dir / name / "memory.json") for name in arm_names}
    text = table(runs_by_arm, episodes=args.episodes, threshold=threshold, window=args.window,
                 expected_seeds=len(seeds), memory=memory if any(v is not None for v in memory.values()) else None)
    header = (f"task {args.task}: reward = {spec.reward_name} of each update's rollout; {args.episodes} episodes "
              f"({args.episodes // spec.batch_size} updates of {spec.batch_size}), hidden size {args.hidden_size}, "
              f"seeds {seeds[0]}..{seeds[-1]}; values are the mean of the {args.window} updates ending there, "
              f"mean ± sd over seeds")
    header += (f"; threshold {threshold:.3f} ({source})" if threshold is not None else "; no threshold")
    if any(v is not None for v in memory.values()):
        header += (f"; peak live tensors: one run per arm, seed {MEMORY_SEED}, {MEMORY_UPDATES} updates, inside "
                   "trl_ppo_ext.memory.live_tensor_bytes (models included)")
    mismatch = episode_mismatch(runs_by_arm)
    if mismatch:
        header += f"; WARNING: {mismatch}"
    text = header + "\n\n" + text
    (task_dir / "table.md").write_text(text + "\n")
    title = f"{args.task} task, {len(seeds)} seeds"
    plot(runs_by_arm, task_dir.parent / f"{args.task}.png", title=title, reward_name=spec.reward_name,
         threshold=threshold, episodes=args.episodes, window=args.window)
    plot_wall_time(runs_by_arm, task_dir.parent / f"{args.task}_wall.png", title=title, reward_name=spec.reward_name,
                   threshold=threshold, window=args.window)
    return text
