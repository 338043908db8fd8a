"""Two CPU processes through `accelerate launch` (gloo): a short train() runs, logs gathered
metrics, keeps parameters in sync; also with peft_config and ref_model=None, which crashes
TRL 1.12 ('DistributedDataParallel' object has no attribute 'policy')."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocess runs

SCRIPT = Path(__file__).parent / "scripts" / "ppo_two_process.py"


def _launch(args, timeout=600):
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("mode", ["separate", "peft", "eval"])
def test_two_process_train(tmp_path, mode):
    proc = _launch([str(SCRIPT), str(tmp_path), mode])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["batch_size"] == 8  # per_device 2 * grad_accum 2 * 2 processes
    # 16 episodes / 8 per update = 2 updates, logged with metrics gathered from both processes
    for r in ranks:
        assert len(r["logs"]) == 2
        assert all(math.isfinite(v) for log in r["logs"] for v in log.values() if isinstance(v, float))
    assert ranks[0]["logs"][-1]["objective/scores"] == ranks[1]["logs"][-1]["objective/scores"]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=0, abs=1e-9)
    # one optimizer step per mini-batch per PPO epoch on every process, at the prompt loader's epoch
    # ends (12 prompts, 8 per update over both processes: every update is an epoch's last batch)
    assert all(r["optimizer_steps"] == [2 * 2, 2 * 2] for r in ranks)
    if mode == "eval":
        # each held-out prompt counted once, though accelerate repeats rows to even out the last batch
        for r in ranks:
            assert r["completions"] == 5
            assert all(log["eval/prompt_words"] == r["eval_prompt_words"] for log in r["logs"])
