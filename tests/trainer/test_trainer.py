"""End-to-end and phase-level tests of trl_ppo_ext.PPOTrainer on tiny local models (CPU)."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trl_ppo_ext import PPOConfig, PPOTrainer
from trl_ppo_ext.rollout import Rollout, sequence_inputs
from trl_ppo_ext.scoring_plan import ScoringPlan
from trl_ppo_ext.tiny import build_tiny_tokenizer


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict, module: nn.Module) -> list[str]:
    return [k for k, v in module.state_dict().items() if not torch.equal(before[k], v)]


@pytest.mark.parametrize("pad_equals_eos,padding_side", [(False, "left"), (True, "left"), (True, "right")])
def test_train_moves_policy_and_value_only(make_trainer, make_models, assert_metrics, pad_equals_eos, padding_side):
    tok = build_tiny_tokenizer(pad_equals_eos=pad_equals_eos, padding_side=padding_side)
    policy, ref, value, reward = make_models(tok)
    ref_before, rm_before = _snapshot(ref), _snapshot(reward)
    policy_before, value_before = _snapshot(policy), _snapshot(value)
    trainer = make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    trainer.train()
    assert _changed(policy_before, policy), "policy weights did not move"
    assert _changed(value_before, value), "value weights did not move"
    assert not _changed(ref_before, ref), "reference model changed"
    assert not _changed(rm_before, reward), "reward model changed"
    assert_metrics(trainer, n_updates=2)


def test_train_with_peft_config_and_no_ref_model(tmp_path, make_trainer, make_models, assert_metrics):
    from peft import LoraConfig

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, _, value, reward = make_models(tok)
    base_before = _snapshot(policy)
    trainer = make_trainer(
        tok, model=policy, ref_model=None, reward_model=reward, value_model=value,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled
    lora_before = {k: v.clone() for k, v in trainer.policy_model.named_parameters() if "lora_B" in k}
    trainer.train()
    moved = [k for k, v in trainer.policy_model.named_parameters()
             if "lora_B" in k and not torch.equal(v, lora_before[k])]
    assert moved, "LoRA weights did not move"
    base_now = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                for k, v in trainer.policy_model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_now[k]) for k in base_before), "base weights changed under LoRA"
    assert_metrics(trainer, n_updates=2)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_config.json").exists()


class _RecordFirstRatio(PPOTrainer):
    """Records the masked log-ratio of the very first micro-batch of the first update."""

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if getattr(self, "first_log_ratio", None) is None:
            with torch.no_grad():
                inputs = sequence_inputs(mb.queries, mb.query_mask, mb.responses, mb.response_mask)
                new_logprobs, _ = self.policy_logprobs_and_values(self.model, mb, inputs)
                self.first_log_ratio = (new_logprobs - mb.logprobs)[mb.response_mask]
        return super().compute_loss_terms(mb, adv, num_tokens)


def test_first_ratio_is_one(make_trainer):
    """Old log-probs come from the same forward as the update's: ratio = 1 within 1e-5 (fp32)."""
    trainer = make_trainer(
        build_tiny_tokenizer(pad_equals_eos=True), cls=_RecordFirstRatio, total_episodes=4,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, local_rollout_forward_batch_size=3,
    )
    trainer.train()
    log_ratio = trainer.first_log_ratio
    assert log_ratio.numel() > 0
    assert torch.exp(log_ratio).sub(1).abs().max().item() < 1e-5


def test_generation_gives_a_sampled_batch_and_scoring_reads_each_model_on_it(make_trainer):
    """The two typed stages through the trainer: generation returns a ``SampledBatch`` (nothing
    to score yet); scoring fills each field from its own model, checked here against each model
    called directly on the whole batch (the trainer scores in chunks of 3)."""
    from trl_ppo_ext import functional as F
    from trl_ppo_ext.models.policy_value import backbone_hidden, lm_logits, scalar_head, score_at
    from trl_ppo_ext.rollout import SampledBatch

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    trainer = make_trainer(tok, local_rollout_forward_batch_size=3)
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    assert type(sample) is SampledBatch and not hasattr(sample, "logprobs")
    rollout = trainer.score_rollout(sample)
    assert isinstance(rollout, Rollout) and torch.equal(rollout.responses, sample.responses)
    mask, T = sample.response_mask, sample.responses.shape[1]
    inputs = sequence_inputs(sample.queries, sample.query_mask, sample.responses, mask)
    with torch.no_grad():
        ref = lm_logits(trainer.ref_model, *inputs)[:, -(T + 1):-1] / trainer.temperature
        expected_ref = F.logprobs_from_logits(ref, sample.valid_responses)
        value_model = trainer.unwrapped.value_model
        expected_values = scalar_head(value_model, backbone_hidden(value_model, *inputs))[:, -(T + 1):-1]
        last = sample.queries.shape[1] + mask.long().cumsum(1).argmax(1)  # index of each row's last valid token
        expected_scores = score_at(trainer.reward_model, *inputs, index=last)
    torch.testing.assert_close(rollout.ref_logprobs[mask], expected_ref[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollout.values[mask], expected_values[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(rollout.ref_logprobs[~mask] == 0) and torch.all(rollout.values[~mask] == 0)
    torch.testing.assert_close(rollout.scores, expected_scores, rtol=1e-5, atol=1e-5)


def test_loss_ignores_everything_outside_the_response_mask():
    """Gradients of the PPO loss w.r.t. logits and values are exactly 0 off the response mask."""
    B, P, T, V = 2, 2, 4, 5
    torch.manual_seed(0)

    class StubModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = nn.Parameter(torch.randn(B, P + T, V))
            self.values = nn.Parameter(torch.randn(B, P + T))

        def forward(self, **kwargs):
            return self.logits, self.values

    model = StubModel()
    response_mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    mb = Rollout(
        queries=torch.ones(B, P, dtype=torch.long), query_mask=torch.ones(B, P, dtype=torch.bool),
        responses=torch.randint(0, V, (B, T)), response_mask=response_mask,
        logprobs=torch.randn(B, T).masked_fill(~response_mask, 0), ref_logprobs=torch.zeros(B, T),
        values=torch.randn(B, T), scores=torch.zeros(B), has_stop=torch.tensor([True, False]),
    )
    adv = SimpleNamespace(advantages=torch.randn(B, T), returns=torch.randn(B, T))
    args = SimpleNamespace(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.01,
                           cliprange_high=None, dual_clip=None, loss_type="dapo", response_length=T,
                           trains_critic=True)
    class FakeTrainer(SimpleNamespace):
        response_forward = PPOTrainer.response_forward

    fake = FakeTrainer(model=model, args=args, temperature=1.0, accelerator=SimpleNamespace(autocast=nullcontext),
                       scoring=ScoringPlan(reference=True, old_logprobs=True))  # the rollout's old log-probs
    loss, stats = PPOTrainer.compute_loss_terms(fake, mb, adv)
    loss.backward()
    # response token t is predicted at position P - 1 + t; positions predicting masked tokens get no gradient
    predicting = torch.zeros(B, P + T, dtype=torch.bool)
    predicting[:, P - 1 : P - 1 + T] = response_mask
    assert torch.all(model.logits.grad[~predicting] == 0)
    assert torch.all(model.values.grad[~predicting] == 0)
    assert model.values.grad[predicting].abs().sum() > 0
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_missing_eos_penalty_uses_the_configured_stop_token():
    from trl_ppo_ext.rollout import finalize_responses

    tok = build_tiny_tokenizer()
    stop, eos, w = tok.convert_tokens_to_ids("w0"), tok.eos_token_id, tok.convert_tokens_to_ids
    raw = torch.tensor([[w("w5"), stop, w("w6")], [w("w5"), eos, w("w6")]])
    responses, mask, has_stop = finalize_responses(raw, (stop,), tok.pad_token_id)
    assert has_stop.tolist() == [True, False]  # row 1 has the EOS but not the configured stop token
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert responses[0, 2].item() == tok.pad_token_id
    rollout = Rollout(
        queries=torch.ones(2, 1, dtype=torch.long), query_mask=torch.ones(2, 1, dtype=torch.bool),
        responses=responses, response_mask=mask, logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3),
        values=torch.zeros(2, 3), scores=torch.tensor([1.0, 1.0]), has_stop=has_stop,
    )
    args = SimpleNamespace(missing_eos_penalty=0.5, kl_estimator="k1", kl_coef=0.1, whiten_rewards=False,
                           gamma=1.0, lam=1.0, whiten_advantages=False, value_lam=None, lam_length_alpha=None)
    from trl_ppo_ext.kl_control import FixedKLController

    adv = PPOTrainer.compute_advantages(SimpleNamespace(args=args, kl_controller=FixedKLController(0.1)), rollout)
    assert adv.scores.tolist() == [1.0, 0.5]
    # score lands on the last valid token: index 1 (the stop token) for row 0, index 2 for row 1
    assert adv.rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]]


# ---------------------------------------------------------------- bad input
def test_error_dataset_without_input_ids(make_trainer):
    from datasets import Dataset

    # a `prompt` column is rendered by the trainer (tests/end_to_end/test_grpo_script.py); anything else is named
    with pytest.raises(ValueError, match=r"`train_dataset` has neither an `input_ids` column nor a prompt column .*"
                                         r"its columns: \['text'\]"):
        make_trainer(train_dataset=Dataset.from_dict({"text": ["a", "b"]}))


def test_error_tokenizer_without_pad_token(make_trainer, tok):
    tok.pad_token = None
    with pytest.raises(ValueError, match=r"no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        make_trainer(tok)


def test_error_unknown_kl_estimator(make_config):
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \['k1', 'k2', 'k3'\], got 'k4'"):
        make_config(kl_estimator="k4")


def test_error_stop_token_and_stop_token_id(make_config):
    with pytest.raises(ValueError, match=r"stop_token='eos' and stop_token_id=3 are both set"):
        make_config(stop_token="eos", stop_token_id=3)


def test_error_batch_sizes_that_do_not_divide(make_trainer):
    with pytest.raises(ValueError, match=r"num_mini_batches=3 does not divide the per-process rollout batch.* = 4\."):
        make_trainer(num_mini_batches=3)


def test_error_dataset_smaller_than_a_batch(make_trainer, make_prompts, tok):
    with pytest.raises(ValueError, match=r"has 2 prompts, fewer than one rollout batch"):
        make_trainer(tok, train_dataset=make_prompts(tok, n=2))


def test_trl_config_is_accepted(tmp_path, make_trainer):
    """A TRL PPOConfig passed to our trainer gets our fields' defaults."""
    from trl_ppo_ext._compat import upstream_ppo_config

    TRLPPOConfig = upstream_ppo_config()
    if TRLPPOConfig is None:
        pytest.skip("the installed TRL has no PPOConfig (1.13 removed PPO)")
    trl_args = TRLPPOConfig(output_dir=str(tmp_path), bf16=False, report_to=[], total_episodes=4,
                            per_device_train_batch_size=4, num_sample_generations=0, kl_coef=0.123)
    from dataclasses import fields

    from trl_ppo_ext.config import as_ppo_config

    converted = as_ppo_config(trl_args)  # built by PPOConfig's own constructor: every TRL value carries over
    changed = [f.name for f in fields(trl_args) if f.init and getattr(converted, f.name) != getattr(trl_args, f.name)]
    assert changed == []
    trainer = make_trainer(args=trl_args)
    assert trainer.args.kl_coef == 0.123
    assert isinstance(trainer.args, PPOConfig)
    assert trainer.args.entropy_coef == 0.0 and trainer.args.whiten_advantages is True


def test_error_args_of_another_type(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match=r"`args` must be a trl_ppo_ext.PPOConfig.*got TrainingArguments\. Build it"):
        PPOTrainer(args=TrainingArguments(output_dir=str(tmp_path)), processing_class=None, model=None,
                   ref_model=None, reward_model=None, train_dataset=None)


def test_error_empty_prompt(make_trainer):
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"`train_dataset` holds 1 empty prompt\(s\)"):
        make_trainer(train_dataset=Dataset.from_dict({"input_ids": [[7, 8], [], [9, 10], [11], [12, 13]]}))


def test_error_prompt_longer_than_positions_minus_response_length(make_trainer):
    from datasets import Dataset

    # tiny models have max_position_embeddings=256; response_length=6 leaves 250 for the prompt
    rows = [[7] * 3, [8] * 251, [9] * 250, [10] * 4]
    with pytest.raises(ValueError, match=r"1 prompt\(s\) longer than 250 tokens.*longest prompt: 251"):
        make_trainer(train_dataset=Dataset.from_dict({"input_ids": rows}))


def test_response_length_zero_is_refused(make_config):
    with pytest.raises(ValueError, match=r"response_length must be >= 1.*got 0"):
        make_config(response_length=0)


def test_all_eos_responses_train(make_trainer, make_models, assert_metrics):
    """A policy that only ever emits EOS: one-token responses, still finite metrics."""
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = make_models(tok)
    eos_bonus = 1e4 * torch.nn.functional.one_hot(torch.tensor(tok.eos_token_id), len(tok)).float()
    policy.lm_head.register_forward_hook(lambda module, inputs, out: out + eos_bonus)  # EOS at every step
    trainer = make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    trainer.train()
    last = trainer.state.log_history[-1]
    assert last["val/response_length"] == 1.0 and last["val/eos_rate"] == 1.0
    assert_metrics(trainer, n_updates=2)


def test_mixed_precision_reads_the_config_then_the_launcher():
    from trl_ppo_ext.config import mixed_precision

    launcher = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert mixed_precision(SimpleNamespace(fp16=True, bf16=False), environ={}) == "fp16"
    assert mixed_precision(SimpleNamespace(fp16=False, bf16=True), environ=launcher) == "bf16"  # the config wins
    assert mixed_precision(SimpleNamespace(fp16=False, bf16=False), environ=launcher) == "fp16"
    assert mixed_precision(SimpleNamespace(), environ={}) == "no"


def test_as_ppo_config_returns_ours_as_it_is_and_names_a_wrong_type(make_config):
    from trl_ppo_ext.config import as_ppo_config

    args = make_config()
    assert as_ppo_config(args) is args
    with pytest.raises(TypeError, match=r"`args` must be a trl_ppo_ext.PPOConfig.*got dict"):
        as_ppo_config({})


def test_the_offload_flags_warn_once_under_deepspeed(make_trainer, monkeypatch):
    # issue 40: under DeepSpeed the frozen models become DeepSpeed engines and the flags did nothing, silently
    import warnings

    import trl_ppo_ext.distributed as distributed_module

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = make_trainer(offload_ref_model=True, offload_reward_model=True)
    assert not [w for w in seen if "under DeepSpeed" in str(w.message)]  # without DeepSpeed: not said
    monkeypatch.setattr(distributed_module, "prepare_frozen_model", lambda model, accelerator, prepare: model)
    trainer.is_deepspeed_enabled = True
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer._place_frozen_models()
    said = [str(w.message) for w in seen if "under DeepSpeed" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "offload_ref_model=True and offload_reward_model=True has no effect under DeepSpeed")
