"""PPOConfig.num_critic_epochs: after the joint PPO epochs, value-only epochs over the same rollout
(``trl_ppo_ext.critic_epochs``). Checked on one update of the tiny models: the policy ends bit for bit
where a run without them ends, the critic does not; AdamW counts the critic's steps as
``num_critic_epochs * num_mini_batches``; the value-only steps skip the policy's pass where the layout has
a critic pass of its own; their figures are logged apart; a SIGTERM inside a critic epoch resumes exactly."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from peft import LoraConfig
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig, PPOTrainer
from trl_ppo_ext.critic_warmup import check_supported, is_critic_parameter
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.run.preemption import InflightUpdate, inflight_filename
from trl_ppo_ext.tiny import build_tiny_tokenizer

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
# one update of 4 rows: 2 mini-batches of 2 rows (one micro-batch each), 2 PPO epochs
ONE_UPDATE = dict(total_episodes=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
                  num_ppo_epochs=2, weight_decay=0.1)
CRITIC_METRICS = ("loss/value_critic_epochs_avg", "val/clipfrac_critic_epochs_avg", "val/grad_norm_critic_epochs_avg")


def _layout(name: str) -> dict:
    """The trainer keywords of a critic layout: a separate value model (the builder's default), a value
    adapter on the policy's base, or the shared value head."""
    if name == "separate":
        return {}
    return dict(ref_model=None, value_model=None, peft_config=LoraConfig(**LORA),
                use_value_adapter=name == "value_adapter")


# ---------------------------------------------------------------- config


def test_the_field_defaults_to_none_and_parses_from_the_command_line(make_config):
    assert make_config().num_critic_epochs is None
    parser = HfArgumentParser(PPOConfig)
    base = ["--output_dir", "unused", "--report_to", "none", "--num_ppo_epochs", "2"]
    (args,) = parser.parse_args_into_dataclasses(args=base + ["--num_critic_epochs", "3"])
    assert (args.num_critic_epochs, args.num_ppo_epochs) == (3, 2)
    (args,) = parser.parse_args_into_dataclasses(args=base + ["--num_critic_epochs", "None"])
    assert args.num_critic_epochs is None
    assert make_config(num_ppo_epochs=2, num_critic_epochs=2).num_critic_epochs == 2  # no value-only epoch


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_ppo_epochs=2, num_critic_epochs=1),
         r"num_critic_epochs=1 is below num_ppo_epochs=2: the critic trains in every PPO epoch.*e\.g\. 3"),
        (dict(num_critic_epochs=0), r"num_critic_epochs must be an int >= num_ppo_epochs or None.*got 0"),
        (dict(num_critic_epochs=True), r"num_critic_epochs must be an int >= num_ppo_epochs or None.*got True"),
        (dict(num_critic_epochs="two"), r"num_critic_epochs must be an int or None, got 'two'"),
        (dict(num_critic_epochs=2, advantage_estimator="grpo", num_generations=2),
         r"num_critic_epochs=2 with advantage_estimator='grpo', which trains no critic"),
    ],
)
def test_refusals_name_the_field_and_the_value(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


@pytest.mark.parametrize("where", ["deepspeed", "fsdp"])
def test_deepspeed_and_fsdp_refuse_value_only_epochs(make_config, where):
    flags = dict(deepspeed=where == "deepspeed", fsdp=where == "fsdp")
    name = "DeepSpeed" if where == "deepspeed" else "FSDP"
    with pytest.raises(ValueError, match=rf"num_critic_epochs=2 is not supported under {name}"):
        check_supported(make_config(num_critic_epochs=2), **flags)
    check_supported(make_config(num_critic_epochs=1), **flags)  # as many as the PPO epochs: nothing value-only
    check_supported(make_config(num_critic_epochs=2), deepspeed=False, fsdp=False)


# ---------------------------------------------------------------- one update, with and without critic epochs


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}


def _adam_steps(trainer) -> dict[str, int]:
    """AdamW's ``state['step']`` of every trainable parameter (0: never stepped)."""
    state = trainer.optimizer.optimizer.state
    return {n: int(state[p]["step"]) if p in state else 0
            for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}


def _lm_head_calls(trainer) -> list:
    """One entry per forward of the policy's LM head (the policy's pass), from now on."""
    calls = []
    trainer.unwrapped.policy.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls


def _one_update(make_trainer, layout, **overrides):
    trainer = make_trainer(**_layout(layout), **ONE_UPDATE, **overrides)
    calls = _lm_head_calls(trainer)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "objective/scores" in h]
    return trainer, log, len(calls)


@pytest.mark.parametrize("layout", ["separate", "value_adapter", "shared"])
def test_an_extra_critic_epoch_leaves_the_policy_bit_for_bit_and_moves_the_critic(make_trainer, layout):
    """num_ppo_epochs=2 with num_critic_epochs=3 against None, one update: every policy parameter (the
    policy adapter, the shared trunk's included) torch.equal; the critic's (value model, value adapter and
    head, or the shared head alone) moved further. The joint epochs' figures are the same as without."""
    plain, plain_log, plain_calls = _one_update(make_trainer, layout)
    extra, log, calls = _one_update(make_trainer, layout, num_critic_epochs=3)
    before, after = _trainable(plain), _trainable(extra)
    critic = {n for n in before if is_critic_parameter(extra.unwrapped, n)}
    assert critic and len(critic) < len(before)
    for name in before:
        if name in critic:
            continue
        assert torch.equal(before[name], after[name]), f"the policy's {name} moved in a critic epoch"
    assert all(not torch.equal(before[n], after[n]) for n in critic), "a critic parameter did not move"
    for key in ("loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "policy/grad_norm", "val/explained_variance",
                "lr"):
        assert log[key] == plain_log[key], key  # not mixed with the value-only steps
    assert all(k in log and k not in plain_log for k in CRITIC_METRICS)
    assert log["loss/value_critic_epochs_avg"] >= 0 and 0 <= log["val/clipfrac_critic_epochs_avg"] <= 1
    assert (extra.loop_state.policy_version, plain.loop_state.policy_version) == (1, 1)
    assert extra.lr_scheduler.last_epoch == plain.lr_scheduler.last_epoch == 1  # one scheduler step per update
    # the value-only steps skip the policy's pass (its LM head) where the critic has a pass of its own;
    # the shared head reads the policy's pass: one per value-only mini-batch (2)
    assert calls - plain_calls == (2 if layout == "shared" else 0)


@pytest.mark.parametrize("layout", ["separate", "shared"])
def test_adamw_counts_the_critics_steps_as_critic_epochs_times_mini_batches(make_trainer, layout):
    """One update, 2 mini-batches: the critic's parameters 3 x 2 = 6 AdamW steps, the policy's 2 x 2 = 4."""
    trainer, _, _ = _one_update(make_trainer, layout, num_critic_epochs=3)
    steps = _adam_steps(trainer)
    critic = {n: s for n, s in steps.items() if is_critic_parameter(trainer.unwrapped, n)}
    policy = {n: s for n, s in steps.items() if n not in critic}
    assert critic and policy
    assert set(critic.values()) == {3 * 2} and set(policy.values()) == {2 * 2}


def test_critic_epochs_during_a_warmup_hold_the_policy_and_count_the_critics_steps(make_trainer):
    """A warm-up update holds the policy in every epoch; the critic takes all of them."""
    trainer, log, _ = _one_update(make_trainer, "separate", num_critic_epochs=3, critic_warmup_steps=1)
    steps = _adam_steps(trainer)
    assert log["train/critic_warmup"] == 1.0 and trainer.loop_state.policy_version == 0
    assert all(s == (6 if is_critic_parameter(trainer.unwrapped, n) else 0) for n, s in steps.items())


# ---------------------------------------------------------------- preemption inside a critic epoch


class SigtermInValueStep(PPOTrainer):
    """Sends itself SIGTERM during value-only step ``at_step`` (1-based) of update 1 (one micro-batch per
    mini-batch here). A test sets ``at_step`` on its trainer, never on the class."""

    at_step, value_steps = 1, 0  # defaults; each trainer counts its own

    def compute_value_loss_terms(self, mb, adv, num_tokens=None, num_sequences=None):
        if self.state.global_step == 0:
            self.value_steps += 1
            if self.value_steps == self.at_step:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().compute_value_loss_terms(mb, adv, num_tokens, num_sequences)


def _logs(trainer):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history
            if "objective/scores" in h]


@pytest.mark.parametrize("at_step, resume_at", [(1, (2, 1)), (2, (3, 0))])
def test_a_sigterm_inside_a_critic_epoch_resumes_exactly(tmp_path, make_trainer, make_prompts, at_step, resume_at):
    """2 updates, 2 PPO epochs + 2 critic epochs of 2 mini-batches. A SIGTERM in the first critic epoch's
    first step resumes at its second mini-batch with the epoch's order (1), one in its last step at the
    next critic epoch, shuffled afresh (2); both runs end torch.equal to the unbroken run, logs equal."""
    settings = dict(ONE_UPDATE, total_episodes=8, num_critic_epochs=4, on_sigterm="save_and_return",
                    adaptive_kl=True, kl_target=0.01, kl_horizon=100)
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    straight = make_trainer(tok, train_dataset=make_prompts(tok, n=10), output_dir=str(tmp_path / "straight"),
                            **settings)
    straight.train()
    stopped = make_trainer(tok, cls=SigtermInValueStep, train_dataset=make_prompts(tok, n=10),
                           output_dir=str(tmp_path / "run"), **settings)
    stopped.at_step = at_step
    stopped.train()
    assert stopped.state.stop_reason == "preempted" and stopped.state.global_step == 0
    saved = InflightUpdate.load(str(tmp_path / "run" / "checkpoint-0-preempted" / inflight_filename(0)),
                                torch.device("cpu"))
    assert (saved.epoch, saved.mini_batch) == resume_at and (saved.order is None) == (resume_at[1] == 0)
    assert len(saved.stats["critic_epochs/vf_loss"]) == at_step and len(saved.stats["pg_loss"]) == 4
    resumed = make_trainer(tok, train_dataset=make_prompts(tok, n=10), output_dir=str(tmp_path / "run"), **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    final, again = _trainable(straight), _trainable(resumed)
    assert final.keys() == again.keys() and all(torch.equal(final[n], again[n]) for n in final)
    assert _logs(resumed) == _logs(straight)
