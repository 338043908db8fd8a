"""Issue 21, the parts that need the trainer: PPOConfig.loss_type (the mini-batch's sequence
count reduced in ``_minibatch_step``) and the critic warm-up (``critic_warmup_steps``,
``critic_warmup_explained_variance``; ``trl_ppo_ext.critic_warmup``)."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig
from transformers import HfArgumentParser, TrainerCallback

from trl_ppo_ext import PPOConfig
from trl_ppo_ext import functional as F
from trl_ppo_ext.critic_warmup import drop_policy_gradients, is_critic_parameter
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ---------------------------------------------------------------- config


def test_new_fields_default_to_todays_behaviour(make_config):
    args = make_config()
    assert (args.loss_type, args.critic_warmup_steps, args.critic_warmup_explained_variance) == ("dapo", 0, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(loss_type="bnpo"), r"loss_type must be one of \['dapo', 'grpo', 'dr_grpo'\], got 'bnpo'"),
        (dict(critic_warmup_steps=-1), r"critic_warmup_steps must be an int >= 0 .*got -1"),
        (dict(critic_warmup_steps=1.5), r"critic_warmup_steps must be an int >= 0 .*got 1.5"),
        (dict(critic_warmup_steps=2, critic_warmup_explained_variance=1.5),
         r"critic_warmup_explained_variance must be a number <= 1 .*got 1.5"),
        (dict(critic_warmup_steps=2, critic_warmup_explained_variance=float("nan")),
         r"critic_warmup_explained_variance must be a number <= 1 .*got nan"),
        (dict(critic_warmup_explained_variance=0.5),
         r"critic_warmup_explained_variance=0.5 needs critic_warmup_steps > 0 .*got critic_warmup_steps=0"),
    ],
)
def test_new_fields_are_checked_naming_field_and_value(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_new_fields_parse_from_the_command_line():
    parser = HfArgumentParser(PPOConfig)
    base = ["--output_dir", "unused", "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses(
        args=base + ["--loss_type", "dr_grpo", "--critic_warmup_steps", "5", "--critic_warmup_explained_variance",
                     "0.3"])
    assert (args.loss_type, args.critic_warmup_steps, args.critic_warmup_explained_variance) == ("dr_grpo", 5, 0.3)
    (args,) = parser.parse_args_into_dataclasses(
        args=base + ["--critic_warmup_steps", "5", "--critic_warmup_explained_variance", "None"])
    assert args.critic_warmup_explained_variance is None
    with pytest.raises(SystemExit):  # argparse refuses a loss type outside the choices
        parser.parse_args_into_dataclasses(args=base + ["--loss_type", "sum"])


def test_deepspeed_refuses_a_critic_warmup_naming_the_field(make_config):
    from trl_ppo_ext import critic_warmup

    with pytest.raises(ValueError, match=r"PPOConfig.critic_warmup_steps=3 is not supported under DeepSpeed"):
        critic_warmup.check_supported(make_config(critic_warmup_steps=3), deepspeed=True)
    critic_warmup.check_supported(make_config(), deepspeed=True)  # off: accepted
    critic_warmup.check_supported(make_config(critic_warmup_steps=3), deepspeed=False)  # no DeepSpeed: accepted


# ---------------------------------------------------------------- loss_type at trainer level


def _trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_type", F.LOSS_TYPES)
def test_the_step_does_not_depend_on_the_micro_batch_size_for_each_loss_type(make_trainer, make_models, loss_type):
    """Same rollout, same mini-batch: per-device 1 x 4 accumulation steps and per-device 4 x 1
    take the same SGD step, the sequence count being the whole mini-batch's."""
    runs = []
    for per_device, ga in ((1, 4), (4, 1)):
        tok = build_tiny_tokenizer()
        policy, ref, value, reward = make_models(tok)
        optimizer = torch.optim.SGD([p for m in (policy, value) for p in m.parameters()], lr=1.0)
        trainer = make_trainer(
            tok, model=policy, ref_model=ref, reward_model=reward, value_model=value, optimizers=(optimizer, None),
            per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, total_episodes=4,
            response_length=8, max_grad_norm=0, loss_type=loss_type, seed=1,  # seed 1: lengths 3 to 8
        )
        before = _trainable(trainer)
        trainer.train()
        lengths = [h["val/response_length"] for h in trainer.state.log_history if "val/response_length" in h]
        runs.append((_trainable(trainer), before, lengths))
    (a, start, len_a), (b, _, len_b) = runs
    assert len_a == len_b == [6.25]  # the same rollout in both runs, of unequal lengths
    moved = [n for n in a if not torch.equal(a[n], start[n])]
    assert moved
    for n in moved:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)


def test_each_loss_type_takes_its_own_step(make_trainer):
    """On a rollout of unequal response lengths the three normalisations weigh tokens
    differently: the policy steps differ; the value model (token mean in all three) does not.
    Plain SGD, no clipping: a step is lr times the gradient."""
    policies, values, lengths = {}, {}, None
    for loss_type in F.LOSS_TYPES:
        trainer = make_trainer(total_episodes=4, response_length=8, max_grad_norm=0, loss_type=loss_type,
                               optim="sgd", learning_rate=1.0, seed=1)
        trainer.train()
        (log,) = [h for h in trainer.state.log_history if "val/eos_rate" in h]
        lengths = lengths or (log["val/response_length"], log["val/eos_rate"])
        assert (log["val/response_length"], log["val/eos_rate"]) == lengths  # the same rollout
        weights = _trainable(trainer)
        policies[loss_type] = {n: w for n, w in weights.items() if n.startswith("policy.")}
        values[loss_type] = {n: w for n, w in weights.items() if not n.startswith("policy.")}
    assert 0 < lengths[1] < 1  # some responses stopped early: lengths differ
    for other in ("grpo", "dr_grpo"):
        assert any(not torch.equal(policies["dapo"][n], policies[other][n]) for n in policies["dapo"])
        for n in values["dapo"]:
            torch.testing.assert_close(values[other][n], values["dapo"][n], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- critic warm-up


class _Snapshots(TrainerCallback):
    """The trainable weights after every update (``on_step_end``), and the optimizer's state keys."""

    def __init__(self):
        self.trainer, self.weights, self.with_state = None, [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.append(_trainable(self.trainer))
        opt = self.trainer.optimizer
        names = {id(p): n for n, p in self.trainer.unwrapped.named_parameters()}
        self.with_state.append({names[id(p)] for p in opt.state if opt.state[p]})


def _warmup_run(make_trainer, **overrides):
    snapshots = _Snapshots()
    trainer = make_trainer(callbacks=[snapshots], **overrides)
    snapshots.trainer = trainer
    start = _trainable(trainer)
    trainer.train()
    warm = [h["train/critic_warmup"] for h in trainer.state.log_history if "train/critic_warmup" in h]
    return trainer, start, snapshots, warm


def _split(trainer, weights):
    critic = {n: w for n, w in weights.items() if is_critic_parameter(trainer.unwrapped, n)}
    return {n: w for n, w in weights.items() if n not in critic}, critic


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("layout", ["separate", "shared"])
def test_warmup_holds_the_policy_still_while_the_critic_trains_then_releases_it(make_trainer, layout):
    """Two warm-up updates of three: the policy (and in the shared layout its LoRA adapter) is
    torch.equal to its start, with no AdamW state, although weight decay is on; the critic
    moves; the third update moves the policy. Adaptive KL holds its coefficient while warming."""
    extra = dict(ref_model=None, value_model=None, peft_config=LoraConfig(**LORA)) if layout == "shared" else {}
    trainer, start, snaps, warm = _warmup_run(
        make_trainer, total_episodes=12, critic_warmup_steps=2, weight_decay=0.1, adaptive_kl=True, kl_target=1e-4,
        kl_horizon=10, **extra)
    assert warm == [1.0, 1.0, 0.0]
    policy_start, critic_start = _split(trainer, start)
    assert policy_start and critic_start
    for update in (0, 1):
        policy, critic = _split(trainer, snaps.weights[update])
        assert _same(policy, policy_start), f"the policy moved during warm-up update {update + 1}"
        assert not _same(critic, critic_start)
        assert snaps.with_state[update] and all(is_critic_parameter(trainer.unwrapped, n)
                                                for n in snaps.with_state[update])
    policy, _ = _split(trainer, snaps.weights[2])
    assert not _same(policy, policy_start)
    kl_coefs = [h["objective/kl_coef"] for h in trainer.state.log_history if "objective/kl_coef" in h]
    assert kl_coefs[0] == kl_coefs[1] == kl_coefs[2] == trainer.args.kl_coef  # no controller update while warming
    assert trainer.counters.critic_warmup_updates == 2 and trainer.counters.critic_warmup_over
    assert trainer.state.episode == 12  # warm-up updates count their episodes


def test_warmup_ends_early_when_the_explained_variance_is_reached(make_trainer):
    # a threshold every update reaches ends the warm-up after its first update; 1.0 is never
    # reached by a critic short of perfect, so the warm-up takes all its steps
    trainer, start, _, warm = _warmup_run(make_trainer, total_episodes=12, critic_warmup_steps=5,
                                          critic_warmup_explained_variance=-1e9)
    assert warm == [1.0, 0.0, 0.0]
    assert trainer.counters.critic_warmup_updates == 1 and trainer.counters.critic_warmup_over
    evs = [h["val/explained_variance"] for h in trainer.state.log_history if "val/explained_variance" in h]
    assert max(evs) < 1.0
    _, _, _, warm = _warmup_run(make_trainer, total_episodes=12, critic_warmup_steps=5,
                                critic_warmup_explained_variance=1.0)
    assert warm == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("checkpoint", [1, 2])
def test_resume_across_the_warmup_boundary_is_exact(make_trainer, tmp_path, checkpoint):
    """Warm-up of 2 in a 3-update run, checkpointed after every update: resuming inside the
    warm-up (1) or at its boundary (2) ends torch.equal to the unbroken run."""
    settings = dict(total_episodes=12, critic_warmup_steps=2, save_strategy="steps", save_steps=1)
    straight = make_trainer(output_dir=str(tmp_path / "straight"), **settings)
    straight.train()
    saved = tmp_path / f"checkpoint-{checkpoint}"
    shutil.copytree(tmp_path / "straight" / f"checkpoint-{checkpoint}", saved)
    resumed = make_trainer(output_dir=str(tmp_path / "resumed"), **settings)
    resumed.train(resume_from_checkpoint=str(saved))
    final, again = _trainable(straight), _trainable(resumed)
    assert final.keys() == again.keys() and _same(final, again)
    warm = [h["train/critic_warmup"] for h in resumed.state.log_history if "train/critic_warmup" in h]
    assert warm == [1.0, 1.0, 0.0]
    assert (resumed.counters.critic_warmup_updates, resumed.counters.critic_warmup_over) == (2, True)


def test_critic_parameters_of_a_shared_model_with_a_value_adapter(tok):
    """The value head and the value adapter are the critic's; the policy adapter is not;
    drop_policy_gradients clears exactly the policy's gradients (to None)."""
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=LoraConfig(**LORA),
                              value_lora_config=LoraConfig(**LORA))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    critic = {n for n, _ in trainable if is_critic_parameter(model, n)}
    assert any(n.startswith("value_head.") for n in critic)
    assert any(".value." in n and "lora" in n for n in critic)
    assert not any(".default." in n for n in critic)
    assert any(".default." in n for n, _ in trainable)
    for _, p in trainable:
        p.grad = torch.ones_like(p)
    dropped = drop_policy_gradients(model)
    assert dropped == len(trainable) - len(critic)
    assert all((p.grad is not None) == (n in critic) for n, p in trainable)
