"""benchmarks/async_rollouts.py without vLLM: its command line (``--help``, the argument checks),
the reward, and the summary arithmetic on hand-made runs. (tests/test_async_rollouts.py tests the
module trl_ppo_ext/async_rollouts.py.)"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "async_rollouts.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_async_rollouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_vllm():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--seeds" in out.stdout and "--arms" in out.stdout


def test_arguments(bench):
    args = bench.parse_args(["--seeds", "3,4", "--arms", "sync,s2_tis", "--cores", "1,0"])
    assert args.seeds == [3, 4] and args.arms == ["sync", "s2_tis"]
    assert (args.trainer_core, args.server_core) == (1, 0)
    assert args.max_loras == 3  # versions v-2 .. v loaded at once
    assert bench.parse_args(["--arms", "sync"]).max_loras == 1


@pytest.mark.parametrize("argv", [["--arms", "sync,s3_tis"], ["--arms", "s1_tis"], ["--updates", "1"],
                                  ["--response-length", "125"], ["--cores", "0"]])
def test_bad_arguments_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_target_share_counts_every_position(bench):
    reward = bench.target_share_reward(target_id=7, response_length=4)
    # a response that stopped after 2 tokens (one of them the target) scores 1 of 4 positions
    assert reward([[7, 7, 1, 7], [7, 2], []]) == [0.75, 0.25, 0.0]


def test_time_to_threshold_and_episodes_per_second(bench):
    times, rewards = [1.0, 2.0, 3.0, 4.0], [0.0, 0.4, 0.4, 0.8]
    # trailing means over 2: 0, 0.2, 0.4, 0.6
    assert bench.time_to_threshold(times, rewards, 0.4, 2) == 3.0
    assert bench.time_to_threshold(times, rewards, 0.7, 2) is None
    # 3 updates of 8 episodes after the warm-up, in 3 s
    assert bench.episodes_per_second(times, 8) == 8.0


def test_summary_takes_ratios_per_seed(bench):
    args = bench.parse_args(["--seeds", "0,1", "--arms", "sync,s1_tis", "--final-window", "1", "--threshold", "0.5",
                             "--batch", "2", "--updates", "2"])
    runs = [
        {"arm": "sync", "seed": 0, "times": [1.0, 2.0], "rewards": [0.0, 0.2]},      # 2 ep/s
        {"arm": "sync", "seed": 1, "times": [1.0, 3.0], "rewards": [0.0, 0.4]},      # 1 ep/s
        {"arm": "s1_tis", "seed": 0, "times": [1.0, 1.5], "rewards": [0.6, 0.2]},    # 4 ep/s: 2x
        {"arm": "s1_tis", "seed": 1, "times": [1.0, 2.0], "rewards": [0.0, 0.4]},    # 2 ep/s: 2x
    ]
    sync, s1 = bench.summarise(runs, args)
    assert sync["ratio"] == 1.0 and s1["ratio"] == 2.0 and s1["ratio_min"] == s1["ratio_max"] == 2.0
    assert s1["episodes_per_s"] == 3.0
    assert sync["final_mean"] == pytest.approx(0.3) and sync["final_std"] == pytest.approx(0.02 ** 0.5)
    assert (s1["to_threshold_s"], s1["reached"]) == (1.0, 1) and sync["to_threshold_s"] is None
