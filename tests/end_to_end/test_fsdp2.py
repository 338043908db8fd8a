"""FSDP2 on 2 CPU processes (gloo), launched the way the docs say:
`accelerate launch --config_file examples/accelerate_configs/fsdp2.yaml`, with `--num_processes 2
--mixed_precision no` on the command line. One launch of `tests/scripts/ppo_fsdp2.py` trains the
three layouts in turn (separate models, the shared LoRA actor-critic, the same with a value
adapter; 3 updates of 2 PPO epochs x 2 mini-batches), probes generation and resumes the separate
models' run from checkpoint-1. The DDP runs of the same layouts, data and seed are modes of the
DDP launch tests/test_distributed.py reads (tests/conftest.py's `two_process_runs`).

Before the fix, this launch gave two trainers that each believed they were process 0 of 1
(`DistributedType.NO`): two unsynchronised runs, silently.
"""

import json
import math
from pathlib import Path

import pytest
import tiny_setup
import torch

from trl_ppo_ext.reporting import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.launches]  # subprocess runs

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ppo_fsdp2.py"
CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2.yaml"
LAYOUTS = ["separate", "shared", "value_adapter"]


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    proc = tiny_setup.launch_two_processes(
        ["--config_file", str(CONFIG)],
        [str(SCRIPT), str(out), *LAYOUTS, "--resume-check", "1", "--probe-generation"],
        {"ACCELERATE_USE_CPU": None}, timeout=1200)  # FSDP must not be forced onto accelerate's CPU path
    return out, proc


def _ok(proc):
    started = [line for line in proc.stdout.splitlines() if line.startswith("ppo_fsdp2: run ")]
    where = f"failed after {started[-1]!r}\n" if started else ""
    assert proc.returncode == 0, where + proc.stdout[-3000:] + proc.stderr[-8000:]


def _reports(out, layout):
    return [json.loads((out / layout / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _no_eps(logs):
    """The logs without their wall-clock figures (eps, step_time), which differ between processes."""
    return [{k: v for k, v in log.items() if k not in TIMING_KEYS} for log in logs]


def test_an_fsdp2_launch_on_the_cpu_is_one_sharded_two_process_run(fsdp2_runs):
    out, proc = fsdp2_runs
    _ok(proc)
    for layout in LAYOUTS:
        ranks = _reports(out, layout)
        for r in ranks:
            assert (r["world_size"], r["distributed_type"]) == (2, "DistributedType.FSDP"), layout
            assert r["optimizer_steps"] == [4, 4, 4]  # one per mini-batch and PPO epoch, as under DDP
            assert all(math.isfinite(v) for log in r["logs"] for v in log.values() if isinstance(v, float))
        # every trainable weight is a DTensor, and rank 1 holds less than the whole of each
        assert ranks[1]["sharded"] == ranks[1]["trainable"] > 0, layout
        assert _no_eps(ranks[0]["logs"]) == _no_eps(ranks[1]["logs"])  # one gathered view on both processes
    # units: the policy's LM, its backbone and its 2 blocks; the value model's backbone and blocks; the root
    assert _reports(out, "separate")[0]["fsdp_units"] == 4 + 3 + 1
    print(f"FSDP2, 2 CPU processes, 3 updates: {_reports(out, 'separate')[0]['train_seconds']:.1f} s (separate), "
          f"peak RSS {max(r['peak_rss_mb'] for r in _reports(out, 'separate')):.0f} MB per process")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_weights_equal_ddp_within_fp32_rounding(fsdp2_runs, two_process_runs, layout):
    out, proc = fsdp2_runs
    _ok(proc)
    ddp_out, ddp_proc = two_process_runs
    mode = f"ddp_{layout}"
    assert (ddp_out / mode / "params.pt").exists(), ddp_proc.stdout[-3000:] + ddp_proc.stderr[-6000:]
    ddp = json.loads((ddp_out / mode / "rank0.json").read_text())
    assert ddp["distributed_type"] == "DistributedType.MULTI_CPU" and ddp["sharded"] == 0
    a, b = torch.load(ddp_out / mode / "params.pt"), torch.load(out / layout / "params.pt")
    assert a.keys() == b.keys()
    # Same data, seed and sampled tokens; only the order of float operations may differ (FSDP2
    # reduce-scatters and sums gradients in its own order). Measured: 1.2e-7 for separate models
    # (the 12 steps clip: grad norm ~2 > max_grad_norm 1), 0 (bit-identical) for both LoRA layouts.
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"{layout}: FSDP2 weights differ from DDP's by {worst:.3g}"
    start = torch.load(out / layout / "start.pt")
    assert all(torch.equal(start[k], v) for k, v in torch.load(ddp_out / mode / "start.pt").items())  # same start
    moved = max((b[k] - start[k]).abs().max().item() for k in b)
    assert moved > 1000 * max(worst, 1e-8), "training barely moved the weights: the comparison would prove nothing"
    fsdp2 = _reports(out, layout)[0]
    for name in ("objective/scores", "val/response_length", "objective/kl_coef"):
        assert [log[name] for log in fsdp2["logs"]] == [log[name] for log in ddp["logs"]], name
    print(f"{layout}: FSDP2 vs DDP max |diff| {worst:.2g} after 12 steps (weights moved {moved:.2g})")


@pytest.mark.parametrize("layout", ["separate", "value_adapter"])
def test_fsdp2_checkpoints_resume_exactly_and_hold_whole_tensors(fsdp2_runs, layout):
    out, proc = fsdp2_runs
    _ok(proc)
    if layout == "separate":  # a fresh trainer resumed from checkpoint-1 and trained to the end
        assert _reports(out, layout)[0]["resume_check"] == {"params_equal": True, "logs_equal": True}
    # the optimizer state is torch's own format, whole: what a run without FSDP saves
    optimizer = torch.load(out / layout / "out" / "checkpoint-1" / "optimizer.pt")
    params = torch.load(out / layout / "out" / "checkpoint-1" / "trainable_state.pt")
    moments = [entry["exp_avg"].shape for entry in optimizer["state"].values()]
    assert sorted(map(tuple, moments)) == sorted(tuple(p.shape) for p in params.values())


def test_fsdp2_generation_gathers_the_policy_once_per_rollout(fsdp2_runs):
    out, proc = fsdp2_runs
    _ok(proc)
    probe = _reports(out, "separate")[0]["generation"]
    units = probe["policy_units"]  # the LM, its backbone, 2 blocks
    assert units == 4
    # ds3_gather_for_generation=True: one all-gather per unit for the whole rollout
    assert probe["True"]["gathers"] == units
    # False: every unit gathers at every generated token
    assert probe["False"]["gathers"] == units * probe["False"]["tokens"]
    assert probe["resharded_after"]  # the policy is sharded again when generation ends


def test_fsdp2_checkpoints_export_the_trained_weights(fsdp2_runs):
    out, proc = fsdp2_runs
    _ok(proc)
    from safetensors.torch import load_file

    params = torch.load(out / "separate" / "params.pt")  # the whole policy: a full fine-tune
    saved = load_file(out / "separate" / "out" / "checkpoint-3" / "model.safetensors")
    policy = {k.removeprefix("policy."): v for k, v in params.items() if k.startswith("policy.")}
    assert policy.keys() == saved.keys() and all(torch.equal(saved[k], v) for k, v in policy.items())
    params = torch.load(out / "value_adapter" / "params.pt")  # the adapters and the value head
    ckpt = out / "value_adapter" / "out" / "checkpoint-3"
    head = load_file(ckpt / "value_head.safetensors")
    assert all(torch.equal(head[k], params[f"value_head.{k}"]) for k in ("weight", "bias"))
    for adapter, folder in (("default", ckpt), ("value", ckpt / "value")):
        saved = load_file(folder / "adapter_model.safetensors")
        trained = {k.removeprefix("policy.").replace(f".{adapter}.", "."): v for k, v in params.items()
                   if f".{adapter}." in k}
        assert len(saved) == 8 and saved.keys() == trained.keys(), adapter  # LoRA A/B on q/v of 2 layers
        assert all(torch.equal(saved[k], v) for k, v in trained.items()), adapter
