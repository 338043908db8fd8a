"""`rollout_outputs` and `pad_episodes`: TRL 1.16 GRPO's ``rollout_func`` contract (issue 31).

Every error message is asserted; the padded tensors are written out by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trl_ppo_ext.episodes import REQUIRED_KEYS, RolloutOutputs, pad_episodes, rollout_outputs

NAN = float("nan")


def two_rows(**overrides):
    """Row 0: a1 | o1 o2 | b1 (an answer, an environment reply, an answer); row 1: one answer."""
    output = {
        "prompt_ids": [[1, 2], [3]],
        "completion_ids": [[5, 6, 7, 8], [9, 10]],
        "logprobs": [[-0.5, 0.0, 0.0, -0.25], [-1.0, None]],
        "env_mask": [[1, 0, 0, 1], [1, 1]],
        "answer": ["4", "7"],
    }
    output.update(overrides)
    return output


# --------------------------------------------------------------------------- what comes out


def test_a_valid_output_is_kept_row_by_row():
    output = two_rows()
    before = copy.deepcopy(output)
    out = rollout_outputs(output, num_prompts=2, response_length=6)
    assert isinstance(out, RolloutOutputs)
    assert out.prompt_ids == [[1, 2], [3]]
    assert out.completion_ids == [[5, 6, 7, 8], [9, 10]]
    assert out.logprobs[0] == [-0.5, 0.0, 0.0, -0.25]
    assert out.logprobs[1][0] == -1.0 and math.isnan(out.logprobs[1][1])  # None -> NaN
    assert out.env_mask == [[1, 0, 0, 1], [1, 1]]
    assert out.extra == {"answer": ["4", "7"]}  # every other key, for the reward functions
    assert out.response_length == 6
    assert output == before  # not modified


def test_env_mask_absent_means_every_token_is_the_policys():
    output = two_rows()
    del output["env_mask"]
    assert rollout_outputs(output, 2, 6).env_mask == [[1, 1, 1, 1], [1, 1]]
    assert rollout_outputs(two_rows(env_mask=None), 2, 6).env_mask == [[1, 1, 1, 1], [1, 1]]


def test_logprobs_may_be_none_as_a_whole_or_per_row():
    assert rollout_outputs(two_rows(logprobs=None), 2, 6).logprobs is None
    out = rollout_outputs(two_rows(logprobs=[None, [NAN, -2.0]]), 2, 6)
    assert all(math.isnan(v) for v in out.logprobs[0]) and len(out.logprobs[0]) == 4
    assert math.isnan(out.logprobs[1][0]) and out.logprobs[1][1] == -2.0


def test_tensors_and_tuples_are_accepted_as_rows():
    out = rollout_outputs(
        two_rows(completion_ids=(torch.tensor([5, 6, 7, 8]), (9, 10)), env_mask=[[True, False, False, True], [1, 1]]),
        2,
        6,
    )
    assert out.completion_ids == [[5, 6, 7, 8], [9, 10]]
    assert out.env_mask == [[1, 0, 0, 1], [1, 1]]


# --------------------------------------------------------------------------- every refusal


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_a_missing_required_key(key):
    output = two_rows()
    del output[key]
    with pytest.raises(ValueError, match=rf"lacks \['{key}'\]: it must return \['prompt_ids', 'completion_ids'"):
        rollout_outputs(output, 2, 6)


def test_not_a_dict():
    with pytest.raises(TypeError, match="rollout_func must return a dict with keys"):
        rollout_outputs([[5, 6]], 1, 6)


@pytest.mark.parametrize("key", ["prompt_ids", "completion_ids", "logprobs", "env_mask"])
def test_a_row_count_that_is_not_num_prompts(key):
    output = two_rows()
    output[key] = output[key][:1]
    with pytest.raises(ValueError, match=rf"'{key}' has 1 rows for 2 prompts: return one row per prompt"):
        rollout_outputs(output, 2, 6)


def test_a_string_where_rows_belong():
    with pytest.raises(ValueError, match=r"'completion_ids' must be a list with one entry per prompt, got str"):
        rollout_outputs(two_rows(completion_ids="hello"), 2, 6)


def test_logprobs_of_another_length():
    with pytest.raises(ValueError, match=r"'logprobs'\[1\] has 1 values but 'completion_ids'\[1\] has 2 tokens"):
        rollout_outputs(two_rows(logprobs=[[-0.5, 0.0, 0.0, -0.25], [-1.0]]), 2, 6)


def test_env_mask_of_another_length():
    with pytest.raises(ValueError, match=r"'env_mask'\[0\] has 3 values but 'completion_ids'\[0\] has 4 tokens"):
        rollout_outputs(two_rows(env_mask=[[1, 0, 1], [1, 1]]), 2, 6)


@pytest.mark.parametrize("value", [2, -1, 0.5, NAN, "1"])
def test_an_env_mask_value_that_is_not_0_or_1(value):
    with pytest.raises(ValueError, match=r"'env_mask'\[1\]\[1\] is .*: env_mask holds 1 \(a token"):
        rollout_outputs(two_rows(env_mask=[[1, 0, 0, 1], [1, value]]), 2, 6)


def test_a_completion_longer_than_response_length():
    with pytest.raises(ValueError, match=r"'completion_ids'\[0\] has 4 tokens, more than response_length=3"):
        rollout_outputs(two_rows(), 2, 3)


def test_a_completion_with_no_policy_token():
    with pytest.raises(ValueError, match=r"row 1 has no policy token \('env_mask'\[1\] is all 0 over 2 tokens\)"):
        rollout_outputs(two_rows(env_mask=[[1, 0, 0, 1], [0, 0]]), 2, 6)
    empty = two_rows(completion_ids=[[5, 6, 7, 8], []], logprobs=None, env_mask=None)
    with pytest.raises(ValueError, match=r"row 1 has no policy token \('env_mask'\[1\] is all 0 over 0 tokens\)"):
        rollout_outputs(empty, 2, 6)


def test_an_extra_key_without_one_value_per_row():
    with pytest.raises(ValueError, match=r"extra key 'answer' must hold one value per prompt \(2\), got 3 values"):
        rollout_outputs(two_rows(answer=["4", "7", "9"]), 2, 6)
    with pytest.raises(ValueError, match=r"extra key 'answer' must hold one value per prompt \(2\), got int"):
        rollout_outputs(two_rows(answer=4), 2, 6)


def test_token_ids_that_are_not_ints():
    with pytest.raises(ValueError, match=r"'completion_ids'\[1\] must be a list of int token ids"):
        rollout_outputs(two_rows(completion_ids=[[5, 6, 7, 8], [9.0, 10]]), 2, 6)
    with pytest.raises(ValueError, match=r"'prompt_ids'\[0\] holds a negative token id: -1"):
        rollout_outputs(two_rows(prompt_ids=[[-1, 2], [3]]), 2, 6)


def test_token_ids_beyond_the_vocabulary_are_refused_naming_key_row_and_id():
    # issue 40 case 4: with 11 embedding rows the ids are 0..10; 11 would crash the model's embedding lookup
    with pytest.raises(ValueError, match=r"'completion_ids'\[1\] holds token id 11 at position 1, beyond the "
                                         r"policy's 11 embedding rows \(ids 0..10\)"):
        rollout_outputs(two_rows(completion_ids=[[5, 6, 7, 8], [9, 11]]), 2, 6, vocab_size=11)
    with pytest.raises(ValueError, match=r"'prompt_ids'\[0\] holds token id 12 at position 0"):
        rollout_outputs(two_rows(prompt_ids=[[12, 2], [3]]), 2, 6, vocab_size=12)
    assert rollout_outputs(two_rows(), 2, 6, vocab_size=11).completion_ids == two_rows()["completion_ids"]


def test_an_empty_prompt():
    with pytest.raises(ValueError, match=r"'prompt_ids'\[1\] is empty"):
        rollout_outputs(two_rows(prompt_ids=[[1, 2], []]), 2, 6)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="num_prompts and response_length must be >= 1, got 2 and 0"):
        rollout_outputs(two_rows(), 2, 0)


# --------------------------------------------------------------------------- padding, by hand


def test_pad_episodes_by_hand():
    ids, response_mask, action_mask, sampler_logprobs = pad_episodes(rollout_outputs(two_rows(), 2, 6), pad_token_id=0)
    assert ids.dtype == torch.long and ids.shape == (2, 6)
    assert ids.tolist() == [[5, 6, 7, 8, 0, 0], [9, 10, 0, 0, 0, 0]]
    assert response_mask.dtype == torch.bool
    assert response_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    # action = response & env_mask: a1 | o1 o2 | b1 ; row 1 both tokens
    assert action_mask.tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    # the sampler's log-probs on actions only: TRL's 0.0 at o1, o2 becomes NaN; None -> NaN; padding NaN
    expected = torch.tensor([[-0.5, NAN, NAN, -0.25, NAN, NAN], [-1.0, NAN, NAN, NAN, NAN, NAN]])
    assert sampler_logprobs.dtype == torch.float32
    torch.testing.assert_close(sampler_logprobs, expected, equal_nan=True, rtol=0, atol=0)


def test_pad_episodes_with_no_logprobs_and_pad_equal_to_a_token():
    out = rollout_outputs(two_rows(logprobs=None, env_mask=None), 2, 4)
    ids, response_mask, action_mask, sampler_logprobs = pad_episodes(out, pad_token_id=9)
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 9, 9]]  # the masks, not the pad id, say what is real
    assert response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert torch.equal(action_mask, response_mask)
    assert sampler_logprobs.isnan().all()


# ---------------------------------------------------------------- what the trainer builds from them
from trl_ppo_ext.episodes import continuation_rows, episode_has_stop, padded_prompts, turn_statistics  # noqa: E402


def test_padded_prompts_left_pads_each_row():
    queries, mask = padded_prompts([[4], [5, 6, 7], [8, 9]], pad_token_id=1)
    assert queries.tolist() == [[1, 1, 4], [5, 6, 7], [1, 8, 9]]
    assert mask.tolist() == [[False, False, True], [True, True, True], [False, True, True]]


def test_has_stop_reads_the_last_policy_token_not_the_last_token():
    # row 0 ends its last turn with the stop id 3, then environment tokens; row 1's last action is not a
    # stop (cut by the budget) although a stop id sits on an earlier action and on an environment token
    ids = torch.tensor([[4, 3, 8, 8, 0], [3, 4, 3, 4, 0]])
    act = torch.tensor([[True, True, False, False, False], [True, False, False, True, False]])
    assert episode_has_stop(ids, act, (3,)).tolist() == [True, False]
    assert episode_has_stop(ids, act, ()).tolist() == [False, False]
    assert episode_has_stop(ids, act, (9, 4)).tolist() == [False, True]


def test_turn_statistics_by_hand():
    # a1 a2 | o1 | b1 | o2 o3 (ends on the environment), a1 a2 a3 (single turn), then a padded row
    resp = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    act = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    stats = turn_statistics(resp, act)
    assert stats["turns"].tolist() == [2.0, 1.0, 2.0]
    assert stats["env_token_frac"].tolist() == pytest.approx([3 / 6, 0.0, 2 / 4])
    assert stats["ends_on_env"].tolist() == [1.0, 0.0, 0.0]


def test_continuation_rows_cut_each_row_to_its_budget_and_its_stop():
    responses = torch.tensor([[5, 6, 7, 3], [8, 3, 0, 0], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logprobs = torch.arange(12, dtype=torch.float32).reshape(3, 4) / -4
    ids, lps = continuation_rows(responses, mask, logprobs, [4, 4, 2])
    assert ids == [[5, 6, 7, 3], [8, 3], [9, 9]]
    assert lps == [[0.0, -0.25, -0.5, -0.75], [-1.0, -1.25], [-2.0, -2.25]]
