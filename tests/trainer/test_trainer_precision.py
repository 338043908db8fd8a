"""One GPU for real, checked on the CPU: gradient checkpointing is applied when the config asks
(TRL's default), bf16 from the config reaches the accelerator and the manifest, value and
reward heads compute in fp32 under autocast, half-precision trainable weights are warned about."""

import json
import logging

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.models.policy_value import scalar_head
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def test_gradient_checkpointing_follows_the_config(tmp_path, make_trainer):
    on = make_trainer(output_dir=str(tmp_path / "on" / "out"), gradient_checkpointing=True)
    assert on.unwrapped.policy.is_gradient_checkpointing and on.unwrapped.value_model.is_gradient_checkpointing
    off = make_trainer(output_dir=str(tmp_path / "off" / "out"), gradient_checkpointing=False)
    assert not off.unwrapped.policy.is_gradient_checkpointing


def test_gradient_checkpointing_on_the_shared_actor_critic_trains(make_trainer, tok):
    trainer = make_trainer(tok, model=build_tiny_causal_lm(tok), ref_model=None, reward_model=build_tiny_scorer(tok),
                           value_model=None, peft_config=LoraConfig(**LORA), gradient_checkpointing=True,
                           total_episodes=4)
    assert trainer.unwrapped.is_gradient_checkpointing
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
    trainer.train()
    now = dict(trainer.unwrapped.named_parameters())
    assert any("lora_B" in n and not torch.equal(p, now[n]) for n, p in before.items())


def test_reentrant_checkpointing_with_a_value_adapter_is_refused_with_its_reason(make_trainer, tok, caplog):
    """The default (non-reentrant) checkpointing holds with a value adapter (tests/trainer/test_trainer_dropin.py);
    reentrant checkpointing cannot recompute under the right adapter: the run goes on without it."""
    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=LoraConfig(**LORA),
                              value_lora_config=LoraConfig(**LORA))
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext"):  # said by models.assembly
        trainer = make_trainer(tok, model=model, ref_model=None, reward_model=build_tiny_scorer(tok),
                               value_model=None, gradient_checkpointing=True,
                               gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not trainer.unwrapped.is_gradient_checkpointing
    assert any("gradient_checkpointing=True is not applied" in r.getMessage() and "use_reentrant=True" in r.getMessage()
               for r in caplog.records)


def test_bf16_in_the_config_is_the_precision_in_effect_and_in_the_manifest(tmp_path, make_trainer):
    trainer = make_trainer(bf16=True, use_cpu=True, total_episodes=4)
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    manifest = json.loads((tmp_path / "out" / "run_manifest.json").read_text())
    assert json.dumps(manifest).count('"mixed_precision": "bf16"') >= 1


def test_value_head_is_fp32_under_autocast():
    tok = build_tiny_tokenizer()
    value = build_tiny_scorer(tok)
    hidden = torch.randn(2, 3, value.score.in_features)
    expected = hidden @ value.score.weight.T.double().float()  # fp32 reference, no bias on Llama's score
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scalar_head(value, hidden)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected.squeeze(-1), rtol=1e-6, atol=1e-6)


def test_half_precision_trainable_weights_are_warned_about(make_trainer, make_models, tok, caplog):
    policy, ref, value, reward = make_models(tok)
    policy.to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.models.actor_critic"):
        make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    assert any("torch.bfloat16" in r.getMessage() and "torch_dtype=torch.float32" in r.getMessage()
               for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs bf16 CUDA")
@pytest.mark.parametrize("shared", [False, True])
def test_bf16_old_and_reference_logprobs_agree_exactly_when_the_models_do(make_trainer, shared):
    """Under bf16 autocast on CUDA, the old policy and a reference equal to it (a separate copy,
    or the disabled LoRA adapter, whose B starts at 0) give the same log-probs to the bit: one
    precision context for every forward, so the initial KL is 0, not bf16 noise."""
    tok = build_tiny_tokenizer()
    if shared:
        trainer = make_trainer(tok, model=build_tiny_causal_lm(tok), ref_model=None,
                               reward_model=build_tiny_scorer(tok), value_model=None, peft_config=LoraConfig(**LORA),
                               bf16=True, total_episodes=4)
    else:
        trainer = make_trainer(bf16=True, total_episodes=4)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.device.type == "cuda"
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    mask = rollout.response_mask
    assert mask.any()
    assert torch.equal(rollout.logprobs[mask], rollout.ref_logprobs[mask])
    # and bf16 really was in effect: fp32 log-probs of the same tokens differ, a little
    with torch.autocast("cuda", enabled=False):
        from trl_ppo_ext.rollout import sequence_inputs

        inputs = sequence_inputs(rollout.queries, rollout.query_mask, rollout.responses, mask)
        logits, _ = trainer.unwrapped(*inputs[:2], position_ids=inputs[2], logits_to_keep=mask.shape[1] + 1)
    fp32 = torch.log_softmax(logits[:, :-1].float() / trainer.temperature, -1).gather(
        -1, rollout.valid_responses.unsqueeze(-1)).squeeze(-1)
    gap = (fp32[mask] - rollout.logprobs[mask]).abs().max().item()
    assert 0 < gap < 0.5, gap


class OverflowOnce(PPOTrainer):
    """Update 1's first micro-batch overflows, as an fp16 loss does (inf loss -> inf gradients)."""

    calls = 0

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        loss, stats = super().compute_loss_terms(mb, adv, num_tokens)
        self.calls += 1
        return (loss * float("inf") if self.calls == 1 else loss), stats


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_fp16_skipped_step_keeps_the_grad_scaler_consistent_and_backs_the_scale_off(make_trainer, monkeypatch,
                                                                                   max_grad_norm):
    """Issue 23. accelerate's fp16 path, driven on the CPU with torch's own GradScaler state
    machine: backward scales the loss, clipping unscales, the optimizer wrapper's step runs
    ``scaler.step`` + ``update``. A skipped step left the scaler 'unscaled' without ``update()``,
    so the next step's unscale raised "unscale_() has already been called", and the scale never
    shrank. Now: one overflow halves the scale (backoff 0.5), nothing else changes it (growth
    needs 2000 good steps), and every other step is taken. The real-GPU run is in
    benchmarks/gpu_check.sh."""
    from contextlib import nullcontext

    from accelerate.optimizer import AcceleratedOptimizer

    trainer = make_trainer(cls=OverflowOnce, num_ppo_epochs=2, num_mini_batches=2, per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, total_episodes=8, max_grad_norm=max_grad_norm)
    acc = trainer.accelerator
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monkeypatch.setattr(acc, "scaler", scaler)
    monkeypatch.setattr(acc, "native_amp", True)
    monkeypatch.setattr(type(acc), "mixed_precision", property(lambda self: "fp16"))
    monkeypatch.setattr(acc, "autocast", lambda *a, **k: nullcontext())  # CPU: fp32 compute, the scaler's logic
    inner, taken = trainer.optimizer.optimizer, []
    step = inner.step
    inner.step = lambda *a, **k: (taken.append(1), step(*a, **k))[1]  # counts the steps the scaler lets through
    trainer.optimizer = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)

    trainer.train()  # before the fix: RuntimeError at update 1's second mini-batch

    assert trainer.state.global_step == 2 and trainer.counters.nonfinite_steps == 1
    assert scaler.get_scale() == 2.0**9  # 1024 * backoff 0.5, once
    assert len(taken) == 2 * 2 * 2 - 1  # 2 updates x 2 epochs x 2 mini-batches, the overflowed one skipped
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    # the grad norm logged is the true (unscaled) one: finite and far below the 1024x scaled norm
    assert all(0 < h["policy/grad_norm"] < 1e3 for h in logs[1:])


@pytest.mark.gpu
def test_fp16_overflow_on_cuda_skips_one_step_backs_the_scale_off_and_trains_on(make_trainer):
    """The real thing (benchmarks/gpu_check.sh runs it): fp16=True, accelerate's own CUDA
    GradScaler, one injected overflow. The run finishes, one step is skipped, the scale halves."""
    trainer = make_trainer(cls=OverflowOnce, fp16=True, bf16=False, num_ppo_epochs=2, num_mini_batches=2,
                           per_device_train_batch_size=2, gradient_accumulation_steps=2, total_episodes=8)
    scaler = trainer.accelerator.scaler
    assert scaler is not None and scaler.is_enabled(), "fp16 on CUDA should come with accelerate's GradScaler"
    initial = scaler.get_scale()
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.counters.nonfinite_steps == 1
    assert scaler.get_scale() == initial * scaler.get_backoff_factor()
    now = dict(trainer.unwrapped.named_parameters())
    assert any(not torch.equal(p, now[n]) for n, p in before.items()), "no step was taken after the overflow"
