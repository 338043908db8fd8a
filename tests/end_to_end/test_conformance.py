"""Drop-in conformance across the model set-ups users bring (issue 18).

The matrix (``slow``): every row of ``tests/scripts/conformance_setups.ROWS`` -- Llama, GPT-2,
OPT, Qwen2, a policy of one family with critic and RM of others, custom ``PreTrainedModel``
critics and RMs that cannot checkpoint, a value model loaded from the RM path as TRL's docs
show -- under TRL's default ``PPOConfig`` and its common variations, trains 2 updates, saves
the policy and reloads it. Each row runs under this package and, where TRL still has a PPO
trainer (<= 1.12), under TRL's own; this package must pass every row. A row TRL itself fails
would be listed in ``TRL_FAILS`` (an xfail on TRL's side only); TRL 1.12 trains them all.

The fast tests pin the skip-and-warn rule for models that cannot checkpoint, on every path
that turns checkpointing on: the trainer's set-up, TRL's generation context (which re-enables
it after each rollout -- the crash of the issue), and a second enable without kwargs.
"""

import dataclasses
import logging

import pytest
import torch
from conformance_setups import (
    ROWS,
    SETUPS,
    FeatureConfig,
    FeatureScorer,
    LlamaBackboneCritic,
    family_config,
    run,
)
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from trl_ppo_ext import _compat
from trl_ppo_ext.models.policy_value import (
    PolicyAndValue,
    backbone_hidden,
    checkpointing_unsupported_reason,
    enable_checkpointing,
    is_checkpointing,
)
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer

TRL_HAS_PPO = _compat.trl_has_ppo()
# (set-up, variation) -> why TRL's own trainer fails there. Empty: TRL 1.12 trains every row.
TRL_FAILS: dict[tuple[str, str], str] = {}
LOGGER = "trl_ppo_ext.models.policy_value"


def _checkpointing_warnings(messages):
    return [m for m in messages if "gradient_checkpointing=True is not applied" in m]


# ---------------------------------------------------------------- skip and warn (fast)
def test_a_model_without_checkpointing_support_is_skipped_with_one_warning_naming_it(tok, caplog):
    critic = LlamaBackboneCritic(family_config("llama", tok))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert enable_checkpointing(critic, {"use_reentrant": False}, role="value model") is False
        assert enable_checkpointing(critic, None, role="value model") is False  # again: no second warning
    assert not is_checkpointing(critic)
    warned = _checkpointing_warnings(r.getMessage() for r in caplog.records)
    assert len(warned) == 1
    assert "value model (LlamaBackboneCritic)" in warned[0] and "supports_gradient_checkpointing" in warned[0]


def test_a_model_with_support_checkpoints_without_warning(tok, caplog):
    policy = build_tiny_causal_lm(tok)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert enable_checkpointing(policy, {"use_reentrant": False}, role="policy") is True
    assert is_checkpointing(policy)
    assert not _checkpointing_warnings(r.getMessage() for r in caplog.records)


def test_why_a_model_cannot_checkpoint():
    class Flagless(FeatureScorer):  # claims support, but no module has a flag to set
        supports_gradient_checkpointing = True

    config = FeatureConfig(vocab_size=8)
    assert "supports_gradient_checkpointing" in checkpointing_unsupported_reason(FeatureScorer(config))
    assert "gradient_checkpointing` flag" in checkpointing_unsupported_reason(Flagless(config))
    assert "no gradient_checkpointing_enable" in checkpointing_unsupported_reason(nn.Linear(2, 1))


def test_the_wrapper_checkpoints_the_policy_and_names_the_critic_it_skips(tok, caplog):
    """The trainer's set-up path: ``PolicyAndValue.gradient_checkpointing_enable``."""
    wrapper = PolicyAndValue(build_tiny_causal_lm(tok), LlamaBackboneCritic(family_config("llama", tok)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        wrapper.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert is_checkpointing(wrapper.policy) and not is_checkpointing(wrapper.value_model)
    assert wrapper.is_gradient_checkpointing
    warned = _checkpointing_warnings(r.getMessage() for r in caplog.records)
    assert len(warned) == 1 and "value model (LlamaBackboneCritic)" in warned[0]


def test_a_policy_that_cannot_checkpoint_is_named_as_the_policy(tok, caplog):
    class NoSupportLM(type(build_tiny_causal_lm(tok))):
        supports_gradient_checkpointing = False

    policy = NoSupportLM(family_config("llama", tok))
    wrapper = PolicyAndValue(policy, build_tiny_scorer(tok))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        wrapper.gradient_checkpointing_enable()
    assert not is_checkpointing(policy) and is_checkpointing(wrapper.value_model)
    warned = _checkpointing_warnings(r.getMessage() for r in caplog.records)
    assert len(warned) == 1 and "policy (NoSupportLM)" in warned[0]


def test_a_shared_actor_critic_on_a_base_that_cannot_checkpoint_warns_instead_of_raising(tok, caplog):
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    class NoSupportLM(type(build_tiny_causal_lm(tok))):
        supports_gradient_checkpointing = False

    model = SharedActorCritic(NoSupportLM(family_config("llama", tok)),
                              lora_config=LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model.gradient_checkpointing_enable()
    assert not model.is_gradient_checkpointing
    warned = _checkpointing_warnings(r.getMessage() for r in caplog.records)
    assert len(warned) == 1 and "shared actor-critic backbone (NoSupportLM)" in warned[0]


def test_trls_generation_context_re_enables_without_raising_or_warning_again(tok, caplog):
    """TRL's ``unwrap_model_for_generation`` switches checkpointing off for ``generate`` and back
    on at exit, without kwargs: this raised on a custom critic (the issue's crash). Now the
    critic is skipped silently, and the policy gets back the kwargs the trainer gave."""
    from accelerate import Accelerator

    wrapper = PolicyAndValue(build_tiny_causal_lm(tok), LlamaBackboneCritic(family_config("llama", tok)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        wrapper.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        for _ in range(2):  # two rollouts
            with _compat.unwrap_model_for_generation(wrapper, Accelerator(cpu=True)) as unwrapped:
                assert not is_checkpointing(unwrapped.policy)  # generation keeps its KV cache
    assert is_checkpointing(wrapper.policy)
    layers = [m for m in wrapper.policy.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers and all(m._gradient_checkpointing_func.keywords == {"use_reentrant": True} for m in layers)
    assert len(_checkpointing_warnings(r.getMessage() for r in caplog.records)) == 1


def test_backbone_hidden_reads_hidden_states_when_the_backbone_fills_only_those():
    class OnlyHiddenStates(nn.Module):
        def forward(self, input_ids, **kwargs):
            h = input_ids.float()[..., None].expand(-1, -1, 2)  # (B, L, 2), h[b, t] = [id, id]
            return BaseModelOutput(hidden_states=(h * 0, h))

    class Empty(nn.Module):
        def forward(self, input_ids, **kwargs):
            return BaseModelOutput()

    class Scorer(nn.Module):
        base_model_prefix = "body"

        def __init__(self, body):
            super().__init__()
            self.body = body

    ids = torch.tensor([[3, 4]])
    hidden = backbone_hidden(Scorer(OnlyHiddenStates()), ids, torch.ones_like(ids), None)
    assert hidden.tolist() == [[[3.0, 3.0], [4.0, 4.0]]]  # the last of hidden_states
    with pytest.raises(ValueError, match=r"Scorer\.body returned BaseModelOutput without"):
        backbone_hidden(Scorer(Empty()), ids, torch.ones_like(ids), None)


# ---------------------------------------------------------------- the matrix (slow)
def _needs_a_skip_warning(setup_name: str, variation: str) -> list[str]:
    """The value models of a row that gradient checkpointing must skip, as the warning names them."""
    if variation == "no-checkpointing":
        return []
    value = SETUPS[setup_name].value
    names = {"custom-llama": "LlamaBackboneCritic", "custom-features": "FeatureScorer"}
    return [f"value model ({names[value]})"] if value in names else []


def _rows(side: str):
    for setup_name, variation in ROWS:
        marks = [pytest.mark.slow]
        if side == "trl" and (setup_name, variation) in TRL_FAILS:
            marks.append(pytest.mark.xfail(strict=True, reason=f"TRL itself: {TRL_FAILS[setup_name, variation]}"))
        yield pytest.param(setup_name, variation, id=f"{setup_name}-{variation}", marks=marks)


@pytest.mark.parametrize(("setup_name", "variation"), list(_rows("ours")))
def test_this_package_trains_saves_and_reloads(setup_name, variation, tmp_path):
    outcome = run("ours", setup_name, variation, tmp_path)
    assert outcome.error is None, outcome.error
    assert outcome.updates == 2 and outcome.policy_moved and outcome.value_moved
    assert outcome.reload_matches, "the reloaded policy's logits differ from the trained policy's"
    # every policy here can checkpoint: on after training (re-enabled after each rollout) iff asked
    assert outcome.policy_checkpointing == (variation != "no-checkpointing")
    warned = _checkpointing_warnings(outcome.warnings)
    expected = _needs_a_skip_warning(setup_name, variation)
    assert len(warned) == len(expected) and all(name in w for name, w in zip(expected, warned)), warned


@pytest.mark.skipif(not TRL_HAS_PPO, reason=f"trl=={_compat.installed_trl_version()} has no PPO trainer")
@pytest.mark.parametrize(("setup_name", "variation"), list(_rows("trl")))
def test_trls_own_trainer_on_the_same_row(setup_name, variation, tmp_path):
    """The reference side of the matrix: what TRL's PPO trainer does with the same row."""
    outcome = run("trl", setup_name, variation, tmp_path)
    assert outcome.error is None, outcome.error
    assert outcome.updates == 2 and outcome.policy_moved and outcome.reload_matches


# ---------------------------------------------------------------- the other paths (slow)
@pytest.mark.slow
def test_a_resumed_run_with_a_custom_critic_trains_on_and_warns_once(tmp_path, make_trainer, tok, caplog):
    """Resuming builds the trainer again (set-up path) and re-enters TRL's generation context."""

    def critic():
        torch.manual_seed(1)
        return LlamaBackboneCritic(family_config("llama", tok))

    first = make_trainer(tok, value_model=critic(), total_episodes=4, save_strategy="steps", save_steps=1)
    first.train()
    caplog.clear()  # the first run warned about its own critic
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        resumed = make_trainer(tok, value_model=critic(), total_episodes=12, save_strategy="steps", save_steps=1)
        resumed.train(resume_from_checkpoint=True)
    assert first.state.global_step == 1 and resumed.state.global_step == 3
    assert is_checkpointing(resumed.unwrapped.policy) and not is_checkpointing(resumed.unwrapped.value_model)
    warned = _checkpointing_warnings(r.getMessage() for r in caplog.records)
    assert len(warned) == 1 and "value model (LlamaBackboneCritic)" in warned[0]


# The ZeRO-3 path (a custom critic on 2 processes, one warning for the run) is
# tests/end_to_end/test_deepspeed.py::test_deepspeed_zero3_with_a_custom_critic_trains_and_warns_once: the row
# runs inside that file's ZeRO-3 launch, which saves a launch of its own.


# ---------------------------------------------------------------- sampling filters on every family
@pytest.mark.parametrize("setup_name", ["gpt2", "opt", "qwen2", "llama+custom-critic"])
def test_the_scoring_forward_filters_as_the_sampler_did_on_every_family(setup_name, tmp_path, make_trainer):
    """``top_k=1`` after a repetition penalty: generate samples the argmax of the penalized logits,
    so a scoring forward that penalizes and filters the same tokens gives every sampled token log-prob
    exactly 0 (one token kept). A family whose logits, prompt or padding the filters read differently
    from ``generate`` shows up here as a negative log-prob."""
    from conformance_setups import build_row_models

    tok, (policy, ref, value, reward) = build_row_models(setup_name, tmp_path / "models")
    trainer = make_trainer(tok, model=policy, ref_model=ref, value_model=value, reward_model=reward,
                           top_k=1, repetition_penalty=1.5, temperature=0.7)
    trainer.scoring = dataclasses.replace(trainer.scoring, old_logprobs=True)  # the scoring forward runs
    sample = trainer.generate_rollout(trainer.repeated_prompts(next(iter(trainer.dataloader))))
    rollout = trainer.score_rollout(sample)
    kept = rollout.response_mask
    assert kept.sum() > 0
    torch.testing.assert_close(rollout.logprobs[kept], torch.zeros(int(kept.sum())), rtol=0, atol=1e-5)
