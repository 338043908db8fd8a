"""Asynchronous rollouts on 2 processes (gloo, CPU; tests/scripts/async_two_process.py): each process
samples its own shard ahead (``max_staleness=1``, a ``rollout_func`` of two turns), process 0 pushes
every version to the shared fake server and the other follows it; no process switches to a version
before its push is done, both train batches of the same version, never more than one version old,
while the trainer's thread runs its collectives beside the producer threads."""

import json
from pathlib import Path

import pytest
import tiny_setup

pytestmark = pytest.mark.launches

SCRIPT = Path(__file__).parent / "scripts" / "async_two_process.py"


def test_two_processes_sample_their_shards_ahead_at_the_versions_process_0_pushed(tmp_path):
    out, server = tmp_path / "out", tmp_path / "server"
    out.mkdir()
    server.mkdir()
    ddp = ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    proc = tiny_setup.launch_two_processes(ddp, [str(SCRIPT), str(out), str(server)], {"ACCELERATE_USE_CPU": "1"},
                                           timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        updates = report["updates"]
        # batch k sampled at max(0, k - 1): at most one version behind the trainer's k
        assert [u["version"] for u in updates] == [0, 0, 1, 2]
        assert all(u["step"] - u["version"] <= 1 for u in updates)
        # its own shard (prompt 10 + 2 b + rank), both turns at the batch's version
        assert [u["prompt"] for u in updates] == [10 + 2 * b + rank for b in range(4)]
        assert all(u["turn_versions"] == [u["version"]] * 2 for u in updates)
        # both processes train a batch of the same version at each update
        assert all(u["gathered"] == [[u["version"], 0], [u["version"], 1]] for u in updates)
        assert report["threads"] == ["rollout-producer"]  # every request from the producer thread
    # process 0 pushed each version once (the start and 4 updates); process 1 pushed none and followed them all
    assert reports[0]["pushed"] == [0, 1, 2, 3, 4] and reports[0]["followed"] == []
    assert reports[1]["pushed"] == [] and reports[1]["followed"] == [0, 1, 2, 3, 4]
