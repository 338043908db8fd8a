"""Scoring forwards run in chunks of ``PPOConfig.scoring_chunk_size`` rows (``scoring_batch_size``,
else the training micro-batch at most ``local_rollout_forward_batch_size``), while generation keeps
``local_rollout_forward_batch_size`` rows per ``generate`` call: the row counts each model sees are
recorded by forward hooks and counted against the sizes the config asks for."""

import pytest
import torch

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.tiny import build_tiny_tokenizer


def _row_counts(module, calls):
    return module.register_forward_hook(lambda mod, args, kwargs, out: calls.append(_rows(args, kwargs)),
                                        with_kwargs=True)


def _backbone(model):
    """The reward model's backbone: its scores are read from the backbone's hidden states, not its own forward."""
    return getattr(model, model.base_model_prefix)


def _rows(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[0])


@pytest.mark.parametrize(
    ("overrides", "expected_chunks", "expected_generate_calls"),
    [
        # B = 2 * 3 = 6 rows; default: chunks of the micro-batch (2), one generate call of 6
        ({"local_rollout_forward_batch_size": 64}, [2, 2, 2], [6]),
        # an explicit scoring size; the last chunk holds the rest
        ({"local_rollout_forward_batch_size": 64, "scoring_batch_size": 4}, [4, 2], [6]),
        # local_rollout_forward_batch_size below the micro-batch caps both
        ({"local_rollout_forward_batch_size": 1}, [1] * 6, [1] * 6),
        # generation in calls of 3, scoring in chunks of the micro-batch
        ({"local_rollout_forward_batch_size": 3}, [2, 2, 2], [3, 3]),
    ],
)
def test_scoring_and_generation_chunk_sizes(make_trainer, overrides, expected_chunks, expected_generate_calls):
    trainer = make_trainer(build_tiny_tokenizer(pad_equals_eos=True), per_device_train_batch_size=2,
                           gradient_accumulation_steps=3, total_episodes=6, **overrides)
    ref_calls, reward_calls, generate_calls = [], [], []
    hooks = [_row_counts(trainer.ref_model, ref_calls), _row_counts(_backbone(trainer.reward_model), reward_calls)]
    policy = trainer.unwrapped.policy
    original = policy.generate

    def counting_generate(*args, **kwargs):
        generate_calls.append(_rows(args, kwargs))
        return original(*args, **kwargs)

    policy.generate = counting_generate
    try:
        sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
        trainer.score_rollout(sample)
    finally:
        for hook in hooks:
            hook.remove()
        del policy.generate
    assert generate_calls == expected_generate_calls
    assert ref_calls == expected_chunks
    assert reward_calls == expected_chunks


def test_scoring_chunks_give_the_whole_batch_forward(make_trainer):
    """Chunks of 2 (the default here) against one forward of all 6 rows: the same rollout within float noise."""
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    rollouts = []
    for size in (None, 6):
        trainer = make_trainer(tok, per_device_train_batch_size=2, gradient_accumulation_steps=3, total_episodes=6,
                               local_rollout_forward_batch_size=64, scoring_batch_size=size)
        torch.manual_seed(0)
        sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
        rollouts.append(trainer.score_rollout(sample))
    chunked, whole = rollouts
    assert torch.equal(chunked.responses, whole.responses)
    mask = chunked.response_mask
    for name in ("logprobs", "ref_logprobs", "values"):
        torch.testing.assert_close(getattr(chunked, name)[mask], getattr(whole, name)[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_scoring_batch_size_refuses_a_non_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match="scoring_batch_size"):
        PPOConfig(output_dir=str(tmp_path), scoring_batch_size=bad)


def test_scoring_chunk_size_property(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, local_rollout_forward_batch_size=64)
    assert args.scoring_chunk_size == 8
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, local_rollout_forward_batch_size=5)
    assert args.scoring_chunk_size == 5
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, scoring_batch_size=32)
    assert args.scoring_chunk_size == 32
