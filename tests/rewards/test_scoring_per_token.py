"""Per-token rewards (issue 22): a reward function's outputs placed on the response tokens, a
process reward model's step scores on the step separators, and returns at gamma = lam = 1 that
add up exactly the rewards named at and after each token. Every expected value is by hand."""

import math
from dataclasses import replace

import pytest
import torch

from trl_ppo_ext import functional as F
from trl_ppo_ext.rewards.process import process_rewards, separator_ends
from trl_ppo_ext.rewards.scoring import is_token_level, token_rewards

# rows of 4 tokens with 3, 2, 4 and 0 valid ones
MASK = torch.tensor([[True, True, True, False],
                     [True, True, False, False],
                     [True, True, True, True],
                     [False, False, False, False]])


def test_each_output_form_lands_on_the_tokens_it_names():
    outputs = [
        [(0, 0.5), (2, 1.0), (0, 0.25)],  # pairs; two on token 0 add up: 0.75
        2.0,                              # a sequence reward: the last valid token (index 1)
        [0.1, 0.2, 0.3, 0.4],             # dense: one per valid token
        None,                             # does not apply
    ]
    rewards, applies = token_rewards(outputs, MASK, name="r")
    assert rewards.dtype == torch.float32
    expected = torch.tensor([[0.75, 0.0, 1.0, 0.0],
                             [0.0, 2.0, 0.0, 0.0],
                             [0.1, 0.2, 0.3, 0.4],
                             [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=0)
    assert applies.tolist() == [True, True, True, False]


def test_indices_count_valid_tokens_when_the_mask_has_holes():
    # a mask that is not a prefix: valid positions 1 and 3; index 1 is position 3
    mask = torch.tensor([[False, True, False, True]])
    rewards, _ = token_rewards([[(1, 5.0)]], mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 5.0]]
    assert token_rewards([3.0], mask)[0].tolist() == [[0.0, 0.0, 0.0, 3.0]]
    assert token_rewards([torch.tensor([1.0, 2.0])], mask)[0].tolist() == [[0.0, 1.0, 0.0, 2.0]]


def test_a_sequence_reward_on_a_row_without_valid_tokens_is_dropped_as_shaped_rewards_does():
    rewards, applies = token_rewards([1.0, 1.0, 1.0, 7.0], MASK)
    assert rewards[3].tolist() == [0.0] * 4 and applies[3]
    shaped, _ = F.shaped_rewards(torch.zeros(4, 4), torch.zeros(4, 4), torch.tensor([1.0, 1.0, 1.0, 7.0]), MASK, 0.0)
    torch.testing.assert_close(rewards, shaped, rtol=0, atol=0)  # numbers land where the trainer puts scores


@pytest.mark.parametrize("outputs, message", [
    ([[(3, 1.0)], 0.0, 0.0, None], r"token index 3 of completion 0, which has 3 valid tokens.*use 0..2"),
    ([[(-1, 1.0)], 0.0, 0.0, None], r"token index -1 of completion 0"),
    ([0.0, [(0.5, 1.0)], 0.0, None], r"token index 0.5 of completion 1"),
    ([0.0, 0.0, [1.0, 2.0], None], r"2 per-token values for completion 2, which has 4 valid tokens"),
    ([0.0, 0.0, 0.0, [(0, 1.0)]], r"token index 0 of completion 3, which has 0 valid tokens"),
    (["high", 0.0, 0.0, None], r"'high' \(str\) for completion 0"),
    ([[(0, "x")], 0.0, 0.0, None], r"'x' \(str\) for completion 0"),
    ([0.0, True, 0.0, None], r"True \(bool\) for completion 1"),
    ([0.0, 0.0, 0.0], r"3 outputs for 4 completions"),
])
def test_errors_name_the_reward_the_completion_and_the_index(outputs, message):
    with pytest.raises(ValueError, match=rf"Reward 'prm'.*{message}"):
        token_rewards(outputs, MASK, name="prm")


def test_what_counts_as_token_level():
    assert is_token_level([]) and is_token_level((1.0,)) and is_token_level(torch.ones(3))
    assert not is_token_level(1.0) and not is_token_level(None) and not is_token_level(torch.tensor(1.0))


def test_returns_at_gamma_lam_one_add_up_the_rewards_from_each_token_on():
    """kl_coef = 0 and values 0: the return at t is the sum of the rewards at t and after."""
    mask = MASK[:3]
    # row 0: 1.0 at token 0, 2.0 at token 2; plus a sequence reward 10 on the last valid token (2)
    steps, _ = token_rewards([[(0, 1.0), (2, 2.0)], [(1, 4.0)], [0.5, 0.0, -1.0, 0.25]], mask)
    final, _ = token_rewards([10.0, 0.0, 0.0], mask)
    shaped, _ = F.shaped_rewards(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3), mask, 0.0)
    _, returns = F.masked_gae(shaped + steps + final, torch.zeros(3, 4), mask, gamma=1.0, gae_lambda=1.0)
    expected = torch.tensor([[1 + 2 + 10, 2 + 10, 2 + 10, 0.0],  # 13, 12, 12
                             [4.0, 4.0, 0.0, 0.0],
                             [0.5 + 0 - 1 + 0.25, 0 - 1 + 0.25, -1 + 0.25, 0.25]])  # -0.25, -0.75, -0.75, 0.25
    torch.testing.assert_close(torch.where(mask, returns, torch.zeros(())), expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- process reward models
def test_separator_ends_single_and_multi_token():
    ids = torch.tensor([[5, 9, 6, 9, 9],
                        [8, 7, 8, 7, 9]])
    mask = torch.tensor([[True, True, True, True, False],
                         [True, True, True, True, True]])
    # one-token separator 9: row 0 at 1 and 3 (position 4 is masked out); row 1 at 4
    assert separator_ends(ids, mask, [9]).nonzero().tolist() == [[0, 1], [0, 3], [1, 4]]
    # two-token separator (8, 7): ends at 1 and 3 of row 1
    assert separator_ends(ids, mask, [8, 7]).nonzero().tolist() == [[1, 1], [1, 3]]
    # (9, 9) would end at row 0's position 4, which does not count
    assert not separator_ends(ids, mask, [9, 9]).any()
    assert not separator_ends(ids[:, :1], mask[:, :1], [8, 7]).any()  # shorter than the separator
    with pytest.raises(ValueError, match="separator_ids is empty"):
        separator_ends(ids, mask, [])


def test_separator_ends_match_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (6, 12), generator=g)
    mask = torch.rand(6, 12, generator=g) > 0.2
    sep = [1, 2]
    expected = torch.zeros(6, 12, dtype=torch.bool)
    for b in range(6):
        for t in range(1, 12):
            expected[b, t] = ids[b, t - 1] == 1 and ids[b, t] == 2 and mask[b, t - 1] and mask[b, t]
    assert torch.equal(separator_ends(ids, mask, sep), expected)


def test_process_rewards_are_the_positive_class_probability_at_each_separator():
    # one row, 4 tokens; separator id 9 at positions 1 and 3; two classes (0 wrong, 1 right)
    ids = torch.tensor([[4, 9, 5, 9]])
    mask = torch.tensor([[True, True, True, True]])
    logits = torch.tensor([[[0.0, 5.0], [0.0, math.log(3.0)], [2.0, 0.0], [math.log(4.0), 0.0]]])
    rewards = process_rewards(logits, ids, mask, separator_ids=[9])
    # position 1: e^log3 / (1 + 3) = 0.75; position 3: 1 / (4 + 1) = 0.2; elsewhere 0
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.75, 0.0, 0.2]]), rtol=0, atol=1e-7)
    # the "wrong" class's probability when it is the one asked for: 0.25 and 0.8
    torch.testing.assert_close(process_rewards(logits, ids, mask, [9], positive_label=0),
                               torch.tensor([[0.0, 0.25, 0.0, 0.8]]), rtol=0, atol=1e-7)
    # they enter token_rewards as pairs, and the returns at gamma = lam = 1 add them up: 0.95, 0.95, 0.2, 0.2
    pairs = [[(t, rewards[0, t].item()) for t in rewards[0].nonzero().flatten().tolist()]]
    steps, _ = token_rewards(pairs, mask)
    _, returns = F.masked_gae(steps, torch.zeros(1, 4), mask, 1.0, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.95, 0.95, 0.2, 0.2]]), rtol=0, atol=1e-6)


def test_process_rewards_check_their_shapes_and_label():
    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"logits \(1, 2, 2\) must be \(B, T, C\)"):
        process_rewards(torch.zeros(1, 2, 2), ids, mask, [0])
    with pytest.raises(ValueError, match="positive_label=2 is not a class of the PRM's 2 labels"):
        process_rewards(torch.zeros(1, 3, 2), ids, mask, [0], positive_label=2)


# ---------------------------------------------------------------- several rewards, some per token
def test_token_level_functions_go_to_token_rewards_and_the_rest_to_scores():
    from trl_ppo_ext.rewards.scoring import Reward, evaluate_rewards, evaluate_rewards_per_token
    from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer

    rm = build_tiny_scorer(build_tiny_tokenizer())
    rewards = [Reward("rm", rm, 2.0),
               Reward("num", lambda completions, **kw: [1.0, None], 1.0),
               Reward("steps", lambda completions, **kw: [[(0, 4.0)], 6.0], 0.5)]
    mask = torch.tensor([[True, True, True], [True, True, False]])

    def kwargs():
        return {"completions": ["a", "b"]}

    scores, values, applies, tokens = evaluate_rewards_per_token(
        rewards, lambda r: torch.tensor([1.0, -1.0]), kwargs, mask, update=1)
    # scores: row 0 = 2 * 1 + 1 * 1 = 3; row 1 = 2 * -1 (num does not apply) = -2; "steps" is not in them
    assert scores.tolist() == [3.0, -2.0]
    # values: steps' column is each row's sum over tokens (4; 6)
    assert values[0].tolist() == [1.0, 1.0, 4.0] and values[1, 0] == -1.0 and values[1, 2] == 6.0
    assert math.isnan(values[1, 1]) and applies.tolist() == [[True, True, True], [True, False, True]]
    # token rewards: 0.5 * 4 on row 0's token 0; 0.5 * 6 on row 1's last valid token (1)
    assert tokens.tolist() == [[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]

    # without any token-level output: the same three tensors as evaluate_rewards, and no token rewards
    plain = rewards[:2]
    got = evaluate_rewards_per_token(plain, lambda r: torch.tensor([0.3, -0.7]), kwargs, mask, update=1)
    want = evaluate_rewards(plain, lambda r: torch.tensor([0.3, -0.7]), kwargs, 2, 1, "cpu")
    assert got[3] is None
    for a, b in zip(got[:3], want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_bad_per_token_output_names_the_function():
    from trl_ppo_ext.rewards.scoring import Reward, evaluate_rewards_per_token

    bad = [Reward("steps", lambda completions, **kw: [[(5, 1.0)]], 1.0)]
    with pytest.raises(ValueError, match=r"Reward 'steps' placed a reward on token index 5 of completion 0, which has "
                                         r"2 valid tokens"):
        evaluate_rewards_per_token(bad, None, lambda: {"completions": ["a"]}, torch.tensor([[True, True]]), 1)


# ---------------------------------------------------------------- in the update's targets and a trainer run
def _hand_rollout(mask, scores, steps, has_stop):
    from trl_ppo_ext.rollout import Rollout

    b, t = mask.shape
    return Rollout(queries=torch.ones(b, 1, dtype=torch.long), query_mask=torch.ones(b, 1, dtype=torch.bool),
                   responses=torch.ones(b, t, dtype=torch.long), response_mask=mask, has_stop=has_stop,
                   logprobs=torch.full((b, t), -1.0), ref_logprobs=torch.full((b, t), -2.0),
                   values=torch.zeros(b, t), scores=scores, token_rewards=steps)


def test_compute_targets_adds_token_rewards_to_the_tokens_they_name():
    from trl_ppo_ext.advantages import compute_targets

    mask = MASK[:3]
    steps, _ = token_rewards([[(0, 1.0), (2, 2.0)], [(1, 4.0)], [0.5, 0.0, -1.0, 0.25]], mask)
    steps[0, 3] = 100.0  # off the mask: never read
    rollout = _hand_rollout(mask, torch.tensor([10.0, 0.0, 3.0]), steps, has_stop=torch.tensor([True, True, False]))
    t = compute_targets(rollout, kl_coef=0.0, kl_estimator="k1", missing_eos_penalty=1.0, whiten_rewards=False,
                        whiten_advantages=False, gamma=1.0, lam=1.0)
    # row 2 has no stop token: its score 3 - 1 = 2 (the penalty on the score, not the token rewards)
    expected = torch.tensor([[1 + 2 + 10, 2 + 10, 2 + 10, 0.0],  # 13, 12, 12
                             [4.0, 4.0, 0.0, 0.0],
                             [0.5 + 0 - 1 + 0.25 + 2, 0 - 1 + 0.25 + 2, -1 + 0.25 + 2, 0.25 + 2]])  # 1.75, 1.25 ...
    torch.testing.assert_close(t.returns, expected, rtol=0, atol=1e-6)
    assert t.scores.tolist() == [10.0, 0.0, 2.0] and t.rewards[0, 3] == 0.0
    # without token rewards: the same targets as the sequence-only rollout minus the steps
    plain = compute_targets(_hand_rollout(mask, rollout.scores, None, rollout.has_stop), kl_coef=0.0,
                            kl_estimator="k1", missing_eos_penalty=1.0, whiten_rewards=False,
                            whiten_advantages=False, gamma=1.0, lam=1.0)
    torch.testing.assert_close(t.rewards - plain.rewards, steps.masked_fill(~mask, 0.0), rtol=0, atol=0)


def test_a_trainer_run_with_a_reward_function_returning_pairs(make_trainer, tok):
    """A reward function names tokens 0 and 1 of every completion (pairs), a second one gives a
    number; at gamma = lam = 1, kl_coef = 0, values 0 the trainer's returns are the suffix sums."""
    named = {}

    def steps(completion_ids, **kwargs):
        out = [[(0, 0.5), (min(1, len(c) - 1), 2.0)] if c else [] for c in completion_ids]
        named["out"] = out
        return out

    def final(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = make_trainer(tok, reward_model=None, reward_funcs=[steps, final], reward_weights=[2.0, 1.0],
                           gamma=1.0, lam=1.0, kl_coef=0.0, whiten_rewards=False, missing_eos_penalty=None,
                           total_episodes=8)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    texts = trainer.reward_function_kwargs(rollout)["completions"]
    assert rollout.scores.tolist() == [float(len(t)) for t in texts]  # the pairs are not in the sequence score
    rollout = replace(rollout, values=torch.zeros_like(rollout.values))
    targets = trainer.compute_advantages(rollout)
    for b, (m, pairs) in enumerate(zip(rollout.response_mask, named["out"])):
        n = int(m.sum())
        per_token = [0.0] * n
        for k, r in pairs:
            per_token[k] += 2.0 * r  # the reward's weight
        per_token[n - 1] += float(rollout.scores[b])  # the number on the last valid token
        suffix = [sum(per_token[k:]) for k in range(n)]
        torch.testing.assert_close(targets.returns[b, m], torch.tensor(suffix), rtol=0, atol=1e-5)
    assert rollout.token_rewards is not None and rollout.token_rewards.masked_fill(rollout.response_mask, 0).eq(0).all()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    # every completion: 0.5 + 2.0 weighted by 2 (a one-token completion gets both on token 0)
    assert len(logs) == 2 and all(h["objective/token_rewards"] == pytest.approx(5.0) for h in logs)


def test_token_rewards_of_an_episode_place_numbers_on_the_last_action():
    from trl_ppo_ext.rewards.scoring import token_rewards as place

    resp = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
    act = torch.tensor([[True, False, True, False, False], [True, True, False, False, False]])
    # a number -> the last action token (index 2 in row 0, 1 in row 1), not the last response token
    rewards, applies = place([1.5, 2.0], resp, "outcome", act)
    assert rewards.tolist() == [[0, 0, 1.5, 0, 0], [0, 2.0, 0, 0, 0]] and applies.tolist() == [True, True]
    # pairs index every response token (completion_ids' indices); actions are fine
    rewards, _ = place([[(0, 0.5), (2, 0.25)], None], resp, "steps", act)
    assert rewards.tolist() == [[0.5, 0, 0.25, 0, 0], [0, 0, 0, 0, 0]]


EPISODE_RESPONSE = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
EPISODE_ACTIONS = torch.tensor([[True, False, True, False, False], [True, True, False, False, False]])


@pytest.mark.parametrize(("outputs", "message"), [
    ([None, [(2, 0.5)]], r"reward 'steps' is 0\.5 at row 1, index 2"),  # row 1's token 2 is an environment token
    ([[0.0, 0.0, 0.0, 0.75], [0.0, 0.0, 0.0]], r"reward 'steps' is 0\.75 at row 0, index 3"),
])
def test_a_reward_on_an_environment_token_names_the_function_among_several(outputs, message):
    from trl_ppo_ext.rewards.scoring import Reward, evaluate_rewards_per_token

    # "fine" puts its rewards on action tokens only (row 0: t0 and t2; row 1: t1); "steps" is the offender
    rewards = [Reward("fine", lambda completions, **kw: [[(0, 1.0), (2, 1.0)], [(1, 1.0)]], 1.0),
               Reward("steps", lambda completions, **kw: outputs, 1.0)]
    with pytest.raises(ValueError, match=message):
        evaluate_rewards_per_token(rewards, None, lambda: {"completions": ["a", "b"]}, EPISODE_RESPONSE, 1,
                                   action_mask=EPISODE_ACTIONS)


def test_the_environment_token_check_runs_once_per_batch(monkeypatch):
    from trl_ppo_ext.advantages import compute_targets
    from trl_ppo_ext.rewards.scoring import Reward, evaluate_rewards_per_token

    calls = []
    check = F.check_rewards_on_actions
    monkeypatch.setattr(F, "check_rewards_on_actions", lambda *a, **kw: calls.append(a[3]) or check(*a, **kw))
    rewards = [Reward("first", lambda completions, **kw: [[(0, 1.0)], [(0, 1.0)]], 1.0),
               Reward("second", lambda completions, **kw: [[(2, 0.5)], [(1, 0.5)]], 2.0)]
    _, _, _, tokens = evaluate_rewards_per_token(rewards, None, lambda: {"completions": ["a", "b"]},
                                                 EPISODE_RESPONSE, 1, action_mask=EPISODE_ACTIONS)
    # first: 1 on t0 of each row; second: 2 * .5 on row 0's t2 and row 1's t1
    assert tokens.tolist() == [[1.0, 0, 1.0, 0, 0], [1.0, 1.0, 0, 0, 0]]
    assert calls == [["first", "second"]]  # both functions in one check, each by name
    rollout = replace(_hand_rollout(EPISODE_RESPONSE, torch.zeros(2), tokens, torch.ones(2, dtype=torch.bool)),
                      action_mask=EPISODE_ACTIONS)
    compute_targets(rollout, kl_coef=0.0, kl_estimator="k1", missing_eos_penalty=None, whiten_rewards=False,
                    whiten_advantages=False, gamma=1.0, lam=1.0)
    assert len(calls) == 1  # the update's targets read the checked sum without checking it again
