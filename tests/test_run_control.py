"""Runs you can trust and resume: guards, adaptive KL, policy lag, manifest, exact resume."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import prompt_dataset, tiny_config, tiny_models
from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.tiny import build_tiny_tokenizer

SCRIPT = Path(__file__).parent / "scripts" / "ppo_resume.py"


def _trainer(tmp_path, cls=PPOTrainer, eval_dataset=None, eval_metrics=None, **overrides):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok)
    trainer = cls(
        args=tiny_config(tmp_path, **overrides), processing_class=tok, model=policy, ref_model=ref,
        reward_model=reward, train_dataset=prompt_dataset(tok), value_model=value,
        eval_dataset=eval_dataset(tok) if eval_dataset else None, eval_metrics=eval_metrics,
    )
    return trainer


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped.named_parameters() if v.requires_grad}


class NaNScores(PPOTrainer):
    def reward_scores(self, part, inputs):
        return torch.full((part.batch_size,), float("nan"))


def test_nan_scores_skip_steps_then_halt_with_nothing_changed(tmp_path):
    trainer = _trainer(tmp_path, cls=NaNScores, num_ppo_epochs=2, total_episodes=16, save_strategy="steps",
                       save_steps=1)
    before = _params(trainer)
    trainer.train()
    # 2 epochs x 1 mini-batch = 2 skipped steps per update: the 3rd in a row (update 2) halts
    assert trainer.state.halted_by == "nonfinite"
    assert trainer.state.global_step == 2 and trainer._nonfinite_steps == 3
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


def test_kl_bound_halts_naming_kl(tmp_path):
    trainer = _trainer(tmp_path, kl_max=-1.0, range_patience=2, total_episodes=16, kl_estimator="k3",
                       guard_action="halt", guard_warmup=0)
    trainer.train()
    assert trainer.state.halted_by == "kl_range"
    assert "objective/kl" in trainer.state.stop_reason and "update 2" in trainer.state.stop_reason
    assert trainer.state.global_step == 2


def test_a_heuristic_guard_warns_once_by_default_and_the_run_finishes(tmp_path, caplog):
    import logging

    trainer = _trainer(tmp_path, kl_max=-1.0, range_patience=2, total_episodes=16, kl_estimator="k3",
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


def test_stale_rollout_is_discarded_and_regenerated(tmp_path):
    trainer = _trainer(tmp_path, cls=StaleFirst, max_rollout_age=1)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert [h["rollout/stale_discarded"] for h in logs] == [1.0, 1.0]
    assert all(h["policy/lag"] == 0.0 for h in logs)
    assert trainer.state.global_step == 2 and trainer.state.halted_by is None


def test_adaptive_kl_coefficient_moves_and_is_logged(tmp_path):
    trainer = _trainer(tmp_path, adaptive_kl=True, kl_coef=0.1, kl_target=1e-6, kl_horizon=10, total_episodes=16,
                       kl_estimator="k3")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    coefs = [h["objective/kl_coef"] for h in logs]
    assert coefs[0] == pytest.approx(0.1)
    # update 1's KL is 0 (policy == reference): beta *= 1 + clip(0/target - 1, -.2, .2) * 4/10 = 0.92
    assert coefs[1] == pytest.approx(0.1 * 0.92, rel=1e-9)


def test_manifest_has_every_field(tmp_path):
    trainer = _trainer(tmp_path, total_episodes=4)
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


def test_heldout_evaluation_logs_user_metrics(tmp_path):
    def short(prompts, completions):
        return [float(len(c.split()) <= 3) for c in completions]

    trainer = _trainer(tmp_path, eval_dataset=lambda tok: prompt_dataset(tok, n=6, seed=5),
                       eval_metrics={"short": short}, eval_strategy="steps", eval_steps=1,
                       per_device_eval_batch_size=3)
    torch.manual_seed(123)
    state_before = torch.random.get_rng_state()
    metrics = trainer.evaluate_heldout()
    assert torch.equal(torch.random.get_rng_state(), state_before), "evaluation moved the training RNG"
    assert set(metrics) == {"eval/rm_score", "eval/response_length", "eval/kl", "eval/short"}
    assert metrics == trainer.evaluate_heldout()  # fixed seed: the same completions again
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert all(0.0 <= h["eval/short"] <= 1.0 and math.isfinite(h["eval/kl"]) for h in logs)


def test_corrupt_checkpoint_gives_a_clear_error(tmp_path):
    trainer = _trainer(tmp_path, total_episodes=4, save_strategy="steps", save_steps=1)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    (ckpt / "optimizer.pt").write_bytes(b"not a torch file")
    fresh = _trainer(tmp_path, total_episodes=8)
    with pytest.raises(ValueError, match=r"could not be read.*damaged"):
        fresh.train(resume_from_checkpoint=str(ckpt))
    os.remove(ckpt / "ppo_state.json")
    with pytest.raises(ValueError, match=r"incomplete: missing \['ppo_state.json'\]"):
        _trainer(tmp_path, total_episodes=8).train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        _trainer(tmp_path, total_episodes=8).train(resume_from_checkpoint=str(tmp_path / "nope"))


def test_save_total_limit_keeps_the_pre_ppo_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, total_episodes=16, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer.train()
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-0", "checkpoint-4"]
    resumed = _trainer(tmp_path, total_episodes=24, save_strategy="steps", save_steps=1, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-0", "checkpoint-6"], "a resumed run rotated the pre-PPO checkpoint away"


def _run(out, mode):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run([sys.executable, str(SCRIPT), str(out), mode], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
def test_sigkill_during_update_4_then_resume_matches_a_straight_run(tmp_path):
    straight, killed = _run(tmp_path, "straight"), _run(tmp_path, "killed")
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert killed.returncode == -9, killed.stderr[-4000:]  # SIGKILL
    assert (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").exists()
    resumed = _run(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = torch.load(tmp_path / "final_params_straight.pt")
    b = torch.load(tmp_path / "final_params_resume.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs_a = json.loads((tmp_path / "logs_straight.json").read_text())
    logs_b = json.loads((tmp_path / "logs_resume.json").read_text())
    assert len(logs_a) == len(logs_b) == 6
    for la, lb in zip(logs_a[3:], logs_b[3:]):
        assert {k: v for k, v in la.items() if k != "eps"} == {k: v for k, v in lb.items() if k != "eps"}
