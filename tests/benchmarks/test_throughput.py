"""benchmarks/throughput.py end to end on the tiny size: every phase it times is still where it
shadows it (the update's gradient clipping moved once and the benchmark broke without a test), and
it prints a ratio per contender. Figures are printed, never asserted."""

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
