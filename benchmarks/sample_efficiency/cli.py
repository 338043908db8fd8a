"""The command line: parse it, prepare each seed's models, run every (arm, seed) in its own process
(``--jobs`` at a time, ``--timeout`` each), then report."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .arms import ARMS, Arm, missing_fields, parse_arm
from .common import PACKAGE_DIR, ROOT
from .report import read_memory, read_run, report
from .run import MEMORY_SEED, MEMORY_UPDATES, prepare, run_one
from .tasks import TASKS, task_module, task_sizes
from .trl_grpo import trl_grpo_ok

DEFAULT_TRL_PYTHON = "/work/venv112/bin/python"


def trl_python_ok(python: str) -> str | None:
    """None if ``python`` has a TRL with a PPO trainer, else why not."""
    if not python or not Path(python).exists():
        return f"--trl-python {python!r} does not exist"
    probe = "import trl.experimental.ppo as m; print(m.PPOTrainer.__name__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"--trl-python {python!r} failed: {err}"
    if done.returncode:
        return f"--trl-python {python!r} has no trl.experimental.ppo.PPOTrainer (TRL 1.0 - 1.12 has one)"
    return None


def _subprocess(cmd: list[str], log: Path, timeout: float) -> str | None:
    """Run ``cmd`` with its output in ``log``; None on success, else why it failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("w") as f:
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    if done.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"exit {done.returncode}: {tail[0][:300]}"
    return None


def execute(args, task_dir: Path, arms: dict[str, Arm], seeds: list[int], python_for: dict[str, str]) -> None:
    """Prepare the models of every seed, then run every (arm, seed) whose file is not complete; with
    ``--memory``, then one memory run per arm that has no ``memory.json`` yet (see ``timed_train``)."""
    script = str(PACKAGE_DIR)
    size = ["--episodes", str(args.episodes), "--hidden-size", str(args.hidden_size)]

    def prepare_seed(seed):
        model_dir = task_dir / "_models" / f"seed{seed}"
        if (model_dir / "info.json").is_file():
            return None
        cmd = [sys.executable, script, "--task", args.task, "--prepare", str(seed), "--out", str(args.out), *size]
        return _subprocess(cmd, task_dir / "_models" / f"seed{seed}.log", args.timeout)

    def train(arm_name, seed):
        out = task_dir / arm_name / f"{seed}.jsonl"
        arm = arms[arm_name]
        cmd = [python_for[arm.trainer], script, "--task", args.task, "--run", arm_name, str(seed),
               "--arm-json", json.dumps(dataclasses.asdict(arm)), "--out", str(args.out), *size]
        start = time.perf_counter()
        why = _subprocess(cmd, out.with_suffix(".log"), args.timeout)
        partial = out.with_suffix(".partial")
        if why is not None:
            with partial.open("a") as f:
                f.write(json.dumps({"done": True, "crashed": True, "reason": why}) + "\n")
        os.replace(partial, out)
        return f"{arm_name} seed {seed}: {'crashed, ' + why if why else 'done'} ({time.perf_counter() - start:.0f} s)"

    def measure_memory(arm_name):
        arm, arm_dir = arms[arm_name], task_dir / arm_name
        episodes = MEMORY_UPDATES * TASKS[args.task].batch_size
        cmd = [python_for[arm.trainer], script, "--task", args.task, "--run", arm_name, str(MEMORY_SEED),
               "--arm-json", json.dumps(dataclasses.asdict(arm)), "--out", str(args.out), "--memory",
               "--episodes", str(episodes), "--hidden-size", str(args.hidden_size)]
        start = time.perf_counter()
        why = _subprocess(cmd, arm_dir / "memory.log", args.timeout)
        if (arm_dir / "memory.partial").is_file():
            os.replace(arm_dir / "memory.partial", arm_dir / "memory.jsonl")
        peak = read_memory(arm_dir / "memory.json")
        return (f"{arm_name} memory run: " + (f"failed, {why}" if why else f"peak live tensors {peak:.1f} MiB")
                + f" ({time.perf_counter() - start:.0f} s)")

    (task_dir / "_models").mkdir(parents=True, exist_ok=True)
    prepared = sorted(set(seeds) | ({MEMORY_SEED} if args.memory else set()))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for seed, why in zip(prepared, pool.map(prepare_seed, prepared)):
            if why is not None:
                raise SystemExit(f"preparing the models of seed {seed} failed ({why}); see "
                                 f"{task_dir / '_models' / f'seed{seed}.log'}")
        todo = []
        for arm_name in arms:
            (task_dir / arm_name).mkdir(exist_ok=True)
            for seed in seeds:
                run = read_run(task_dir / arm_name / f"{seed}.jsonl", seed)
                if run is None or (args.rerun_crashed and run.crashed is not None):
                    todo.append((arm_name, seed))
        print(f"{len(todo)} runs to do ({args.jobs} at a time)", flush=True)
        for line in pool.map(lambda job: train(*job), todo):
            print(line, flush=True)
        if args.memory:
            pending = [name for name in arms if not (task_dir / name / "memory.json").is_file()]
            print(f"{len(pending)} memory runs to do", flush=True)
            for line in pool.map(measure_memory, pending):
                print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=PACKAGE_DOC.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="synthetic")
    p.add_argument("--arms", nargs="+", default=["trl112", "defaults"], help="arm names (see --list-arms)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:field=value,...",
                   help="add an arm: PPOConfig overrides (JSON values); reward=VARIANT, trainer=trl112 also")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 (default 8)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--episodes", type=int, default=None, help="episodes per run (default: the example's)")
    p.add_argument("--hidden-size", type=int, default=None, help="tiny models' hidden size (default: the example's)")
    p.add_argument("--window", type=int, default=4, help="updates averaged for each reported value (default 4)")
    p.add_argument("--threshold", type=float, default=None,
                   help="reward to reach (default: the trl112 arm's mean final reward)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run counts as crashed")
    p.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON, help="a python with TRL <= 1.12 for the trl112 arm")
    p.add_argument("--out", type=Path, default=Path("outputs/sample_efficiency"))
    p.add_argument("--rerun-crashed", action="store_true")
    p.add_argument("--report-only", action="store_true", help="only read the logs: table and plot")
    p.add_argument("--memory", action="store_true",
                   help=f"per arm, one more run (seed {MEMORY_SEED}, {MEMORY_UPDATES} updates) inside the live-tensor "
                   "tracker: DIR/<task>/<arm>/memory.json, a table column")
    p.add_argument("--list-arms", action="store_true")
    p.add_argument("--prepare", type=int, metavar="SEED", help=argparse.SUPPRESS)
    p.add_argument("--run", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--arm-json", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    episodes, hidden_size = task_sizes(args.task)
    args.episodes = args.episodes or episodes
    args.hidden_size = args.hidden_size or hidden_size
    task_dir = args.out / args.task
    missing = getattr(task_module(args.task), "missing", lambda: None)()
    if missing is not None and not args.report_only:
        print(f"note: task {args.task!r} skipped: {missing}")
        return 0
    if args.prepare is not None:
        prepare(args.task, args.prepare, task_dir / "_models" / f"seed{args.prepare}", args.hidden_size)
        return 0
    if args.run is not None:
        arm_name, seed = args.run[0], int(args.run[1])
        arm_dir = task_dir / arm_name
        out, memory = (arm_dir / "memory.jsonl", arm_dir / "memory.json") if args.memory else (
            arm_dir / f"{seed}.jsonl", None)
        run_one(args.task, Arm(**json.loads(args.arm_json)), seed, model_dir=task_dir / "_models" / f"seed{seed}",
                episodes=args.episodes, hidden_size=args.hidden_size, out=out, memory=memory)
        return 0

    arms = dict(ARMS)
    arms.update(parse_arm(text) for text in args.arm)
    if args.list_arms:
        for name, arm in arms.items():
            gae = f" gae={arm.gae}" if arm.gae != "actions" else ""
            print(f"{name:14} {arm.trainer:8} reward={arm.reward:8}{gae} {json.dumps(arm.overrides)}  {arm.note}")
        return 0
    wanted = list(dict.fromkeys(args.arms + [parse_arm(t)[0] for t in args.arm]))
    unknown = [a for a in wanted if a not in arms]
    if unknown:
        raise SystemExit(f"--arms {unknown}: unknown; pick from {sorted(arms)} or add one with --arm.")
    sys.path.insert(0, str(ROOT))
    from trl import GRPOConfig

    from trl_ppo_ext import PPOConfig

    config_fields = {"ours": {f.name for f in dataclasses.fields(PPOConfig)},
                     "trl_grpo": {f.name for f in dataclasses.fields(GRPOConfig)}}
    chosen = {}
    for name in wanted:
        trainer = arms[name].trainer
        missing = missing_fields(arms[name], config_fields.get(trainer, config_fields["ours"]))
        if missing:
            print(f"note: arm {name!r} left out: {'GRPOConfig' if trainer == 'trl_grpo' else 'PPOConfig'} here has "
                  f"no {', '.join(missing)}")
        elif arms[name].trainer == "trl112" and (why := trl_python_ok(args.trl_python)):
            print(f"note: arm {name!r} left out: {why}")
        elif arms[name].trainer == "trl_grpo" and not args.report_only and (why := trl_grpo_ok()):
            # (reading the logs needs no GRPOTrainer)
            print(f"note: arm {name!r} left out: {why}")
        else:
            chosen[name] = arms[name]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if not args.report_only:
        python_for = {"ours": sys.executable, "trl_grpo": sys.executable, "trl112": args.trl_python}
        execute(args, task_dir, chosen, seeds, python_for)
    print(report(args, task_dir, list(chosen), seeds))
    print(f"table: {task_dir / 'table.md'}\nplot: {args.out / (args.task + '.png')}")
    return 0
