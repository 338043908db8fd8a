"""Runs you can trust and resume: guards, adaptive KL, policy lag, manifest, exact resume."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.tiny import build_tiny_tokenizer

SCRIPT = Path(__file__).parents[1] / "scripts" / "ppo_resume.py"


@pytest.fixture
def make_run(make_trainer):
    """``make_trainer`` with the tokenizer every run here uses (pad == eos), a fresh one per trainer."""

    def make_run(tok=None, **kwargs):
        return make_trainer(build_tiny_tokenizer(pad_equals_eos=True) if tok is None else tok, **kwargs)

    return make_run


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped.named_parameters() if v.requires_grad}


class NaNScores(PPOTrainer):
    def reward_scores(self, part, inputs):
        return torch.full((part.batch_size,), float("nan"))


def test_nan_scores_skip_steps_then_halt_with_nothing_changed(tmp_path, make_run):
    trainer = make_run(cls=NaNScores, num_ppo_epochs=2, total_episodes=16, save_strategy="steps",
                       save_steps=1)
    before = _params(trainer)
    trainer.train()
    # 2 epochs x 1 mini-batch = 2 skipped steps per update: the 3rd in a row (update 2) halts
    assert trainer.state.halted_by == "nonfinite"
    assert trainer.state.global_step == 2 and trainer.counters.nonfinite_steps == 3
    after = _params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed a parameter"
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert [h["train/nonfinite_steps"] for h in logs] == [2.0, 3.0]
    manifest = json.loads((tmp_path / "out" / "run_manifest.json").read_text())
    assert manifest["status"] == "halted" and "nonfinite" in manifest["stop_reason"]
    out = tmp_path / "out"
    # the halted state sits next to the last good checkpoint; the pre-PPO start is kept
    assert (out / "checkpoint-2-halted" / "trainer_state.json").exists()
    assert (out / "checkpoint-0" / "trainer_state.json").exists()
    assert (out / "checkpoint-1" / "trainer_state.json").exists()
    assert not (out / "checkpoint-2").exists()


def test_kl_bound_halts_naming_kl(make_run):
    trainer = make_run(kl_max=-1.0, range_patience=2, total_episodes=16, kl_estimator="k3",
                       guard_action="halt", guard_warmup=0)
    trainer.train()
    assert trainer.state.halted_by == "kl_range"
    assert "objective/kl" in trainer.state.stop_reason and "update 2" in trainer.state.stop_reason
    assert trainer.state.global_step == 2


def test_a_heuristic_guard_warns_once_by_default_and_the_run_finishes(make_run, caplog):
    import logging

    trainer = make_run(kl_max=-1.0, range_patience=2, total_episodes=16, kl_estimator="k3",
                       guard_warmup=0)
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.trainer"):
        trainer.train()
    assert trainer.state.halted_by is None and trainer.state.global_step == trainer.args.num_total_batches
    warnings = [r.getMessage() for r in caplog.records if "Guard 'kl_range' fired at update 2" in r.getMessage()]
    assert len(warnings) == 1  # k3 KL >= 0 > kl_max every update: one episode of trouble, one warning


class StaleFirst(PPOTrainer):
    """Serves its first rollout as if an asynchronous producer had sampled it 3 updates ago."""

    def produce_rollout(self):
        rollout = super().produce_rollout()
        self.served = getattr(self, "served", 0) + 1
        if self.served == 1:
            rollout.policy_version = self.state.global_step - 3  # as if an async producer lagged
        return rollout


def test_stale_rollout_is_discarded_and_regenerated(make_run):
    trainer = make_run(cls=StaleFirst, max_rollout_age=1)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert [h["rollout/stale_discarded"] for h in logs] == [1.0, 1.0]
    assert all(h["policy/lag"] == 0.0 for h in logs)
    assert trainer.state.global_step == 2 and trainer.state.halted_by is None


def test_adaptive_kl_coefficient_moves_and_is_logged(make_run):
    trainer = make_run(adaptive_kl=True, kl_coef=0.1, kl_target=1e-6, kl_horizon=10, total_episodes=16,
                       kl_estimator="k3")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    coefs = [h["objective/kl_coef"] for h in logs]
    assert coefs[0] == pytest.approx(0.1)
    # update 1's KL is 0 (policy == reference): beta *= 1 + clip(0/target - 1, -.2, .2) * 4/10 = 0.92
    assert coefs[1] == pytest.approx(0.1 * 0.92, rel=1e-9)


def test_manifest_has_every_field(tmp_path, make_run):
    trainer = make_run(total_episodes=4)
    trainer.train()
    m = json.loads((tmp_path / "out" / "run_manifest.json").read_text())
    for key in ("status", "started_at", "stopped_at", "stop_reason", "seed", "models", "tokenizer", "datasets",
                "generation", "hyperparameters", "environment", "packages"):
        assert key in m, key
    assert m["status"] == "completed" and m["stopped_at"] is not None
    assert set(m["models"]) == {"policy", "reference", "value", "reward"}
    for role in ("policy", "reference", "value", "reward"):
        assert m["models"][role]["dtype"] == "torch.float32"
    assert {"trl", "transformers", "peft", "accelerate", "bitsandbytes", "torch", "trl-ppo-ext"} <= set(m["packages"])
    assert m["tokenizer"]["chat_template_sha256"] is not None
    assert m["datasets"]["train"]["size"] == 16
    assert m["hyperparameters"]["kl_coef"] == 0.05 and m["environment"]["world_size"] == 1


def test_heldout_evaluation_logs_user_metrics(make_run, make_prompts):
    def short(prompts, completions):
        return [float(len(c.split()) <= 3) for c in completions]

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    trainer = make_run(tok, eval_dataset=make_prompts(tok, n=6, seed=5), eval_metrics={"short": short},
                       eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3)
    torch.manual_seed(123)
    state_before = torch.random.get_rng_state()
    metrics = trainer.evaluate_heldout()
    assert torch.equal(torch.random.get_rng_state(), state_before), "evaluation moved the training RNG"
    assert set(metrics) == {"eval/rm_score", "eval/response_length", "eval/kl", "eval/short"}
    assert metrics == trainer.evaluate_heldout()  # fixed seed: the same completions again
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert all(0.0 <= h["eval/short"] <= 1.0 and math.isfinite(h["eval/kl"]) for h in logs)


def test_corrupt_checkpoint_gives_a_clear_error(tmp_path, make_run):
    trainer = make_run(total_episodes=4, save_strategy="steps", save_steps=1)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    (ckpt / "optimizer.pt").write_bytes(b"not a torch file")
    fresh = make_run(total_episodes=8)
    with pytest.raises(ValueError, match=r"could not be read.*damaged"):
        fresh.train(resume_from_checkpoint=str(ckpt))
    os.remove(ckpt / "ppo_state.json")
    with pytest.raises(ValueError, match=r"incomplete: missing \['ppo_state.json'\]"):
        make_run(total_episodes=8).train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        make_run(total_episodes=8).train(resume_from_checkpoint=str(tmp_path / "nope"))


def test_save_total_limit_keeps_the_pre_ppo_checkpoint(tmp_path, make_run):
    trainer = make_run(total_episodes=16, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer.train()
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-0", "checkpoint-4"]
    resumed = make_run(total_episodes=24, save_strategy="steps", save_steps=1, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-0", "checkpoint-6"], "a resumed run rotated the pre-PPO checkpoint away"


def _run(out, mode, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, str(SCRIPT), str(out), mode, *flags], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """6 updates in one go, in a subprocess: the run every interrupted one must equal."""
    out = tmp_path_factory.mktemp("straight")
    straight = _run(out, "straight")
    assert straight.returncode == 0, straight.stderr[-4000:]
    return out


def _assert_resume_matches(straight_dir, resumed_dir):
    a = torch.load(straight_dir / "final_params_straight.pt")
    b = torch.load(resumed_dir / "final_params_resume.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs_a = json.loads((straight_dir / "logs_straight.json").read_text())
    logs_b = json.loads((resumed_dir / "logs_resume.json").read_text())
    assert len(logs_a) == len(logs_b) == 6
    for la, lb in zip(logs_a[3:], logs_b[3:]):
        assert {k: v for k, v in la.items() if k not in TIMING_KEYS} == {k: v for k, v in lb.items()
                                                                         if k not in TIMING_KEYS}


@pytest.mark.slow
def test_sigkill_during_update_4_then_resume_matches_a_straight_run(tmp_path, straight_run):
    killed = _run(tmp_path, "killed")
    assert killed.returncode == -9, killed.stderr[-4000:]  # SIGKILL
    assert (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").exists()
    resumed = _run(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_resume_matches(straight_run, tmp_path)


@pytest.mark.slow
@pytest.mark.launches
def test_episodes_with_several_samples_per_prompt_resume_exactly_after_sigkill(tmp_path):
    # --episodes: a rollout_func whose environment replies and policy turns draw from the run's RNG;
    # --generations: each prompt sampled twice, the GRPO estimator, no critic (both at once: one run of each kind)
    flags = ("--episodes", "--generations")
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = _run(straight_dir, "straight", *flags)
    assert straight.returncode == 0, straight.stderr[-4000:]
    killed = _run(killed_dir, "killed", *flags)
    assert killed.returncode == -9, killed.stderr[-4000:]
    resumed = _run(killed_dir, "resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_resume_matches(straight_dir, killed_dir)
    logs = json.loads((killed_dir / "logs_resume.json").read_text())
    assert all("rollout/turns_mean" in log and "frac_reward_zero_std" in log for log in logs)
    assert not any("loss/value_avg" in log for log in logs)


@pytest.mark.slow
@pytest.mark.launches
def test_sigterm_during_update_4_exits_0_with_a_checkpoint_that_resumes_exactly(tmp_path, straight_run):
    preempted = _run(tmp_path, "preempted")  # a real SIGTERM after update 4's first optimizer step
    assert preempted.returncode == 0, preempted.stderr[-4000:]
    assert "SIGTERM received" in preempted.stderr
    ckpt = tmp_path / "out" / "checkpoint-3-preempted"
    assert (ckpt / "trainer_state.json").exists() and (ckpt / "inflight_update_0.pt").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["stop_reason"] == "preempted"
    manifest = json.loads((tmp_path / "out" / "run_manifest.json").read_text())
    assert (manifest["status"], manifest["stop_reason"]) == ("preempted", "preempted")
    resumed = _run(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_resume_matches(straight_run, tmp_path)


def test_resume_on_another_process_count_warns_and_carries_the_state_over(tmp_path, make_run, caplog):
    import logging

    first = make_run(total_episodes=8, save_strategy="steps", save_steps=1, adaptive_kl=True,
                     kl_target=0.01, kl_horizon=100)
    first.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    # Pretend 2 processes wrote it: 8 prompts per update, 1 batch of the epoch consumed.
    state = json.loads((ckpt / "ppo_state.json").read_text())
    state.update(world_size=2, batch_size=8, data_cursor={"epoch": 0, "batches": 1})
    (ckpt / "ppo_state.json").write_text(json.dumps(state))
    resumed = make_run(total_episodes=16, adaptive_kl=True, kl_target=0.01, kl_horizon=100)
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.run.checkpointing"):
        resumed._load_checkpoint(str(ckpt))
    assert any("2 process(es) and this run has 1" in r.getMessage() and "NOT bit-exact" in r.getMessage()
               for r in caplog.records)
    saved = torch.load(ckpt / "trainable_state.pt")
    now = _params(resumed)
    assert saved.keys() == now.keys() and all(torch.equal(saved[k], now[k]) for k in saved)
    moments = torch.load(ckpt / "optimizer.pt", weights_only=False)["state"]
    loaded = resumed.optimizer.state_dict()["state"]
    assert moments.keys() == loaded.keys() and all(
        torch.equal(moments[i]["exp_avg"], loaded[i]["exp_avg"]) for i in moments)
    assert resumed.kl_controller.value == first.kl_controller.value != 0.05  # adapted, then carried over
    assert resumed.state.global_step == 2 and resumed.counters.nonfinite_steps == first.counters.nonfinite_steps
    # 1 batch x 8 prompts consumed of epoch 0; here a batch is 4 prompts: continue at batch 8 / 4 = 2
    assert (resumed.counters.epoch, resumed.counters.batches) == (0, 2)
    again = make_run(total_episodes=16, adaptive_kl=True, kl_target=0.01, kl_horizon=100)
    again.train(resume_from_checkpoint=str(ckpt))  # and it trains on (random streams re-seeded)
    assert again.state.global_step == 4


def test_deepspeed_checkpoints_refuse_another_setup_by_name():
    from types import SimpleNamespace

    from trl_ppo_ext.run.checkpointing import CheckpointMixin

    def run(world, stage):
        plugin = None if stage is None else SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}})
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=world, state=SimpleNamespace(
            deepspeed_plugin=plugin)), is_deepspeed_enabled=stage is not None)

    zero2 = {"world_size": 2, "optimizer_format": "deepspeed", "zero_stage": 2}
    assert CheckpointMixin._check_resume_topology(run(2, 2), "ck", zero2) is True
    with pytest.raises(ValueError, match=r"written by 2 DeepSpeed process\(es\) and this run has 4.*--num_processes 2"):
        CheckpointMixin._check_resume_topology(run(4, 2), "ck", zero2)
    with pytest.raises(ValueError, match="written under DeepSpeed ZeRO-2 and this run runs without DeepSpeed"):
        CheckpointMixin._check_resume_topology(run(2, None), "ck", zero2)
    with pytest.raises(ValueError, match="written under DeepSpeed ZeRO-2 and this run runs under DeepSpeed ZeRO-3"):
        CheckpointMixin._check_resume_topology(run(2, 3), "ck", zero2)
    plain = {"world_size": 2, "optimizer_format": "torch", "zero_stage": None}
    with pytest.raises(ValueError, match="written without DeepSpeed and this run runs under DeepSpeed ZeRO-2"):
        CheckpointMixin._check_resume_topology(run(2, 2), "ck", plain)


# ------------------------------------------------------------------ issue 23
def always_one(completions, **kwargs):
    return [1.0] * len(completions)


class AllTruncated(PPOTrainer):
    """Every response counts as cut off at response_length (no stop token)."""

    def generate_rollout(self, batch, temperature=None):
        import dataclasses

        sample = super().generate_rollout(batch, temperature)
        return dataclasses.replace(sample, has_stop=torch.zeros_like(sample.has_stop))


def test_objective_scores_are_logged_after_the_missing_eos_penalty(make_run):
    """Constant reward 1, penalty 1, every response truncated: the score GAE trains on is
    1 - 1 = 0.0, and that is `objective/scores` (TRL 1.12 logs the same) and what the
    reward-hacking guard reads; the raw 1.0 keeps its own key."""
    trainer = make_run(cls=AllTruncated, reward_model=None, reward_funcs=[always_one], missing_eos_penalty=1.0,
                       reward_hacking_metric="eval/none", reward_hacking_window=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(h["val/eos_rate"] == 0.0 for h in logs)  # every response truncated
    assert [h["objective/scores"] for h in logs] == [0.0, 0.0]
    assert [h["objective/scores_before_penalty"] for h in logs] == [1.0, 1.0]
    assert [score for _, score, _ in trainer.guards._history] == [0.0, 0.0]  # the guard saw the penalised one


def test_adaptive_kl_stays_put_on_an_update_whose_every_step_was_skipped(make_run):
    """NaN scores: every optimizer step of both updates is skipped, the policy never moves, so
    the KL measured says nothing new: the coefficient stays 0.1. (Before: 0.1 * 0.92 after
    update 1, as test_adaptive_kl_coefficient_moves_and_is_logged computes for a KL of 0.)"""
    trainer = make_run(cls=NaNScores, adaptive_kl=True, kl_coef=0.1, kl_target=1e-6, kl_horizon=10,
                       total_episodes=8, nonfinite_halt_after=None)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert [h["train/nonfinite_steps"] for h in logs] == [1.0, 2.0]
    assert [h["objective/kl_coef"] for h in logs] == [0.1, 0.1] and trainer.kl_controller.value == 0.1


def test_a_halt_is_announced_once(make_run, capsys, caplog):
    import logging

    trainer = make_run(cls=NaNScores, total_episodes=16, nonfinite_halt_after=1)
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.trainer"):
        trainer.train()
    assert trainer.state.halted_by == "nonfinite"
    captured = capsys.readouterr()
    said = captured.out + captured.err + "\n".join(r.getMessage() for r in caplog.records)
    assert said.count("PPO run halted by guard") == 1


def test_the_update_a_guard_halts_at_is_logged_whatever_logging_steps(make_run):
    """logging_steps=10 logs update 10, 20, ... and the last; a run a guard stops at update 1 still
    logs that update, marked guard/halted, so the figures that stopped it are in log_history."""
    trainer = make_run(cls=NaNScores, total_episodes=16, nonfinite_halt_after=1, logging_steps=10)
    trainer.train()
    assert trainer.state.halted_by == "nonfinite" and trainer.state.global_step == 1
    (log,) = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert log["guard/halted"] == 1.0 and log["guard/nonfinite"] >= 1


def test_eval_kl_uses_the_configured_estimator(make_run, make_prompts):
    """eval/kl is the mean over held-out prompts of sum_t k3(t) with k3 = exp(logr) - 1 - logr,
    logr = log pi_ref - log pi, computed here from the same samples (same seed)."""
    from trl_ppo_ext.run.checkpointing import isolated_rng
    from trl_ppo_ext.tiny import build_tiny_causal_lm

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    trainer = make_run(tok, ref_model=build_tiny_causal_lm(tok, seed=7), kl_estimator="k3",
                       eval_dataset=make_prompts(tok, n=5, seed=5), per_device_eval_batch_size=3)
    logged = trainer.evaluate_heldout()["eval/kl"]
    k1, k3 = [], []
    with isolated_rng(seed=trainer.args.seed):
        for batch in trainer.eval_dataloader:
            r = trainer.score_rollout(trainer.generate_rollout(batch))
            for row in range(r.batch_size):
                m = r.response_mask[row]
                logr = (r.ref_logprobs[row][m] - r.logprobs[row][m]).double()
                k3.append(float(sum(torch.exp(x) - 1 - x for x in logr)))  # token by token
                k1.append(float(-logr.sum()))
    assert len(k3) == 5
    assert logged == pytest.approx(sum(k3) / 5, rel=1e-6, abs=1e-9)
    assert abs(sum(k1) / 5 - logged) > 1e-3  # the old k1 figure is another number


class PicklePayload:
    """Unpickling this runs ``open(path, "w")``: a file appears if it is ever loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_resume_refuses_a_checkpoint_whose_pickle_would_run_code(tmp_path, make_run, name):
    trainer = make_run(total_episodes=4, save_strategy="steps", save_steps=1)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    marker = tmp_path / "code_ran"
    state = torch.load(ckpt / name, weights_only=True)
    torch.save({**state, "extra": PicklePayload(marker)}, ckpt / name)
    fresh = make_run(total_episodes=8, output_dir=str(tmp_path / "again"))
    before = _params(fresh)
    with pytest.raises(ValueError, match=rf"{name}.* holds pickled objects other than tensors .* not loaded "
                                         r"\(weights_only=True\)"):
        fresh.train(resume_from_checkpoint=str(ckpt))
    assert not marker.exists(), "loading the checkpoint ran its pickled code"
    assert all(torch.equal(v, _params(fresh)[k]) for k, v in before.items())


def test_max_rollout_age_parses_from_the_command_line_none_and_numbers():
    """`--max_rollout_age None` failed in HfArgumentParser (int('None')), so a script could not
    spell out its default; the text is now read as None or an int, other text is named."""
    from transformers import HfArgumentParser

    from trl_ppo_ext import PPOConfig

    parser = HfArgumentParser(PPOConfig)
    base = ["--output_dir", "unused", "--report_to", "none"]
    (config,) = parser.parse_args_into_dataclasses(args=base + ["--max_rollout_age", "None"])
    assert config.max_rollout_age is None
    (config,) = parser.parse_args_into_dataclasses(args=base + ["--max_rollout_age", "2"])
    assert config.max_rollout_age == 2 and type(config.max_rollout_age) is int
    (config,) = parser.parse_args_into_dataclasses(args=base)
    assert config.max_rollout_age is None
    with pytest.raises(ValueError, match=r"PPOConfig.max_rollout_age must be an int or None, got 'two'"):
        parser.parse_args_into_dataclasses(args=base + ["--max_rollout_age", "two"])
    with pytest.raises(ValueError, match=r"max_rollout_age must be >= 0 or None"):
        parser.parse_args_into_dataclasses(args=base + ["--max_rollout_age", "-1"])
