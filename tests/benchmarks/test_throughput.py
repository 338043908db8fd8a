"""benchmarks/throughput.py end to end on the tiny size: every phase it times is still where it
shadows it (the update's gradient clipping moved once and the benchmark broke without a test), and
it prints a ratio per contender. Figures are printed, never asserted."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tiny_run_times_every_phase_of_each_contender():
    contenders = ["shared", "shared_grpo", "shared_vlora_kl0", "shared_branch_mid_kl0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "tiny", "--repeats", "1",
         "--updates", "1", "--contenders", ",".join(contenders)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [line for line in proc.stdout.splitlines() if "grad clip" in line and "optimizer step" in line]
    assert len(phases) == len(contenders)  # backward, clipping and the step timed for each
    for name in contenders[1:]:  # against ours with separate models, or TRL's PPO trainer where it has one
        assert re.search(rf"throughput ratio {name}/(separate|upstream): \d", proc.stdout), name


def _throughput_module():
    spec = importlib.util.spec_from_file_location("throughput_under_test", ROOT / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_reward_counts_distinct_ids_and_replaces_the_reward_model():
    module = _throughput_module()
    # [5, 5, 7]: 2 distinct ids -> 0.02; [9]: 1 -> 0.01; []: 0
    assert module.cheap_reward(["p"] * 3, ["c"] * 3, [[5, 5, 7], [9], []]) == [0.02, 0.01, 0.0]
    assert module.reward_inputs() == {}  # --reward model: the caller passes the reward model
    module.REWARD = "python"
    assert module.reward_inputs() == {"reward_model": None, "reward_funcs": [module.cheap_reward]}


@pytest.mark.slow
def test_the_issue_shape_runs_with_a_python_reward_and_whole_batch_generation():
    """B=16 in micro-batches of 4, T=64, early stop, one generate call for the batch (``--rollout-chunk 16``),
    the Python reward: ours' grpo arm and TRL's GRPO, with the shape in the table's title."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "tiny", "--repeats", "1",
         "--updates", "1", "--batch", "16", "--micro", "4", "--rollout-chunk", "16", "--response-length", "64",
         "--workload", "early_stop", "--reward", "python", "--contenders", "shared_grpo,trl_grpo"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "B=16 in micro-batches of 4, rollout chunks of 16, T=64, workload early_stop, reward python" in proc.stdout
    assert re.search(r"throughput ratio trl_grpo/separate: \d", proc.stdout)
