"""Two CPU processes through `accelerate launch` (gloo): a short train() runs, logs gathered
metrics, keeps parameters in sync; also with peft_config and ref_model=None, which crashes
TRL 1.12 ('DistributedDataParallel' object has no attribute 'policy'). One launch runs every
mode in turn (its start-up, ~10 s of imports and gloo set-up, is paid once); each mode's test
reads that mode's reports (the launch is a session fixture of tests/conftest.py: it also trains
tests/end_to_end/test_fsdp2.py's DDP reference runs). Then the helpers of `trl_ppo_ext.distributed` (the DeepSpeed runs
themselves are in tests/end_to_end/test_deepspeed.py)."""

import json
import math
from types import SimpleNamespace

import pytest
import tiny_setup
import torch

from trl_ppo_ext import distributed
from trl_ppo_ext.batching import BatchPlan
from trl_ppo_ext.models import sharding

pytestmark = pytest.mark.slow  # subprocess runs

# One DDP launch (tests/conftest.py's session fixture `two_process_runs`) runs these modes in turn,
# then tests/end_to_end/test_fsdp2.py's DDP reference runs.
MODES = list(tiny_setup.TWO_PROCESS_MODES)


def _finished(out, mode):
    return all((out / mode / f"rank{r}.json").exists() for r in (0, 1))


def _mode_reports(runs, mode):
    """Both processes' reports of ``mode``; a failure that names the mode when it did not finish."""
    out, proc = runs
    if _finished(out, mode):
        return [json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)]
    every = MODES + list(tiny_setup.DDP_REFERENCE_MODES)
    errors = {(m, r): (out / m / f"rank{r}.error").read_text() for m in every for r in (0, 1)
              if (out / m / f"rank{r}.error").exists()}
    first = next(m for m in every if not _finished(out, m))
    stopped = (f"mode {' and '.join(sorted({m for m, _ in errors}))} raised" if errors
               else f"the launch ended with exit status {proc.returncode} in mode {first}")
    pytest.fail(f"mode {mode!r} wrote no report on both processes ({stopped}; no mode after it runs):\n"
                + "".join(errors.values())[-6000:] + proc.stdout[-3000:] + proc.stderr[-6000:])


@pytest.mark.launches
def test_the_launch_of_every_mode_exits_cleanly(two_process_runs):
    """The exit status of the work (and of the launch's end) after the last mode."""
    out, proc = two_process_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.launches
@pytest.mark.parametrize("mode", MODES)
def test_two_process_train(two_process_runs, mode):
    ranks = _mode_reports(two_process_runs, mode)
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["batch_size"] == 8  # per_device 2 * grad_accum 2 * 2 processes
    # 16 episodes / 8 per update = 2 updates, logged with metrics gathered from both processes
    for r in ranks:
        assert len(r["logs"]) == 2
        assert all(math.isfinite(v) for log in r["logs"] for v in log.values() if isinstance(v, float))
    assert ranks[0]["logs"][-1]["objective/scores"] == ranks[1]["logs"][-1]["objective/scores"]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=0, abs=1e-9)
    # one optimizer step per mini-batch per PPO epoch on every process, at the prompt loader's epoch
    # ends (12 prompts, 8 per update over both processes: every update is an epoch's last batch); the
    # critic mode's third epoch is value-only (num_critic_epochs=3), its steps are optimizer steps too
    epochs = 3 if mode == "critic" else 2
    assert all(r["optimizer_steps"] == [2 * epochs, 2 * epochs] for r in ranks)
    if mode == "shared":  # the value adapter trains on both processes alike, under gradient checkpointing
        assert all(r["checkpointing"] for r in ranks)
        assert ranks[0]["value_adapter_end"] != ranks[0]["value_adapter_start"]
        assert ranks[0]["value_adapter_end"] == pytest.approx(ranks[1]["value_adapter_end"], rel=0, abs=1e-9)
    if mode == "budget":  # issue 32: unequal micro-batch counts per process (DDP syncs once per step): no hang
        assert ranks[0]["micro_batch_counts"] == [1] * 8 and ranks[1]["micro_batch_counts"] == [2] * 8
    else:  # the configured micro-batches: 2 rows per process per mini-batch, one micro-batch of 2
        assert all(r["micro_batch_counts"] == [1] * 4 * epochs for r in ranks)
    if mode == "critic":  # the value-only steps' own figures, the same on both processes (the checksum above:
        # the value model's weights stayed equal with its gradients averaged by hand); the value model read each
        # process's rows with their `answer` before the prompt (critic_context_column)
        assert all(0 <= log["val/clipfrac_critic_epochs_avg"] <= 1 and log["loss/value_critic_epochs_avg"] >= 0
                   for r in ranks for log in r["logs"])
        assert [log["loss/value_critic_epochs_avg"] for log in ranks[0]["logs"]] == [
            log["loss/value_critic_epochs_avg"] for log in ranks[1]["logs"]]
    if mode == "recipe":  # issue 21: the warm-up's first update held the policy on both processes alike
        assert all([log["train/critic_warmup"] for log in r["logs"]] == [1.0, 0.0] for r in ranks)
    if mode == "tools":  # one scripted call per episode on each process, counted over both
        assert all(log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
                   and log["rollout/turns_mean"] == 2.0 for r in ranks for log in r["logs"])
    if mode == "episodes":  # the reply words are environment tokens on both processes
        assert all(0 < log["rollout/env_token_frac"] < 1 and log["rollout/turns_mean"] == 2.0
                   for r in ranks for log in r["logs"])
    if mode == "eval":
        # each held-out prompt counted once, though accelerate repeats rows to even out the last batch
        for r in ranks:
            assert r["completions"] == 5
            assert all(log["eval/prompt_words"] == r["eval_prompt_words"] for log in r["logs"])
            # log_metric: rank 0 logs 1, rank 1 logs 2, once per scoring call and as often as each other
            # (even batches): the mean over both processes; a name only rank 1 logs reaches both
            for log in r["logs"]:
                assert log["reporter/rank_plus_one"] == 1.5 and log["reporter/only_rank1"] == 5.0
                assert log["eval/reporter/rank_plus_one"] == 1.5 and log["eval/reporter/only_rank1"] == 5.0
            # log_extra: a column of the completions table, one row per held-out prompt, from both processes
            assert len(r["rank_column"]) == 5 and set(r["rank_column"]) == {0, 1}


# ---------------------------------------------------------------------- trl_ppo_ext.distributed

@pytest.mark.parametrize(
    "deepspeed, world, cuda, expected",
    [("true", "2", False, True), ("true", "2", True, False), ("true", "1", False, False),
     ("false", "2", False, False), (None, "2", False, False)],
)
def test_gloo_only_for_a_multi_process_deepspeed_launch_without_cuda(monkeypatch, deepspeed, world, cuda, expected):
    if deepspeed is None:
        monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", deepspeed)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(distributed, "_has_device_accelerator", lambda: cuda)
    assert distributed.needs_gloo_backend() is expected


def _fake_accelerator(ds_config):
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config)))


def _ppo_args(max_grad_norm=1.0):
    return SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2,
                           max_grad_norm=max_grad_norm, num_ppo_epochs=1, total_episodes=96, num_train_epochs=1)


def test_configure_deepspeed_fills_auto_values_from_the_batch_plan():
    args = _ppo_args()
    plan = BatchPlan.from_config(args, world_size=2, dataset_len=100)
    # per process: a rollout of 4 * 3 = 12 prompts, 2 mini-batches of 6, micro-batches of 4 and 2
    config = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    distributed.configure_deepspeed(_fake_accelerator(config), args, plan)
    assert config["gradient_accumulation_steps"] == 2  # ceil(6 / 4) micro-batches per optimizer step
    assert config["gradient_clipping"] == 1.0
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["train_batch_size"] == 4 * 2 * 2  # what DeepSpeed checks: micro * accumulation * processes
    no_clip = {"zero_optimization": {"stage": 2}}  # absent keys count as auto
    distributed.configure_deepspeed(_fake_accelerator(no_clip), _ppo_args(max_grad_norm=None), plan)
    assert no_clip["gradient_clipping"] == 0.0  # DeepSpeed's "no clipping"


@pytest.mark.parametrize("key, value", [("gradient_accumulation_steps", 8), ("gradient_clipping", 0.5)])
def test_configure_deepspeed_refuses_a_value_that_contradicts_the_run(key, value):
    args = _ppo_args()
    plan = BatchPlan.from_config(args, world_size=2, dataset_len=100)
    with pytest.raises(ValueError, match=rf"DeepSpeed config has {key}={value} but this PPO run needs .*\"auto\""):
        distributed.configure_deepspeed(_fake_accelerator({key: value}), args, plan)


def test_gathered_and_full_state_are_plain_copies_without_zero3():
    layer = torch.nn.Linear(3, 2)
    with sharding.gathered(layer.parameters()):
        pass  # no DeepSpeed import, no collective
    copies = sharding.full_state(layer.named_parameters(), keep=True)
    assert set(copies) == {"weight", "bias"} and torch.equal(copies["weight"], layer.weight)
    copies["weight"].zero_()
    assert not torch.equal(copies["weight"], layer.weight)  # copies, not views
    assert sharding.full_state(layer.named_parameters(), keep=False) == {}


# ------------------------------------------------------- FSDP launches (tests/end_to_end/test_fsdp2.py runs one)
def _fsdp_env(monkeypatch, version="2", world="2"):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", version)
    monkeypatch.setenv("WORLD_SIZE", world)


@pytest.mark.parametrize("world, cuda, expected", [("2", False, True), ("2", True, False), ("1", False, False)])
def test_gloo_for_a_multi_process_fsdp_launch_without_cuda(monkeypatch, world, cuda, expected):
    _fsdp_env(monkeypatch, world=world)
    monkeypatch.setattr(distributed, "_has_device_accelerator", lambda: cuda)
    assert distributed.needs_gloo_backend() is expected


def test_an_fsdp1_launch_is_refused_by_name(monkeypatch):
    _fsdp_env(monkeypatch, version="1")
    with pytest.raises(ValueError, match="FSDP version 1 .*supports FSDP2 only. Set fsdp_version: 2"):
        distributed.check_fsdp_version()
    monkeypatch.delenv("FSDP_VERSION")  # accelerate's default is FSDP1 too
    with pytest.raises(ValueError, match="FSDP version 1"):
        distributed.process_state()
    monkeypatch.setenv("FSDP_VERSION", "2")
    distributed.check_fsdp_version()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("FSDP_VERSION", "1")
    distributed.check_fsdp_version()  # not an FSDP launch: nothing to refuse


@pytest.mark.parametrize("before", ["NO", "MULTI_CPU"])
def test_a_cpu_fsdp_state_is_handed_to_accelerate_as_a_device_run(monkeypatch, before):
    """accelerate makes an FSDP run only of a device run: the state a CPU launch gets (each process
    alone, or use_cpu's plain DDP) is marked as one, which AcceleratorState then turns into FSDP."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    _fsdp_env(monkeypatch)
    monkeypatch.setattr(AcceleratorState, "_reset_state", lambda **kwargs: None)  # this process's own stays
    state = SimpleNamespace(num_processes=2, distributed_type=DistributedType[before])
    distributed._make_fsdp_state(state)
    assert state.distributed_type == DistributedType.MULTI_GPU
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(RuntimeError, match="started 2 processes for FSDP, but this one sees a process group of 1"):
        distributed._make_fsdp_state(alone)


def test_an_fsdp_launch_that_did_not_become_an_fsdp2_run_is_refused(monkeypatch):
    from accelerate.utils import DistributedType

    _fsdp_env(monkeypatch)
    plugin = SimpleNamespace(fsdp_version=2)
    good = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2,
                           state=SimpleNamespace(fsdp_plugin=plugin))
    distributed.check_fsdp_run(good)
    for bad in (SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, state=SimpleNamespace()),
                SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, state=SimpleNamespace())):
        with pytest.raises(RuntimeError, match="asked for FSDP2 on 2 processes, but the accelerator runs"):
            distributed.check_fsdp_run(bad)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    distributed.check_fsdp_run(SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1))
