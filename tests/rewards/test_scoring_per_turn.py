"""Per-turn rewards: ``TurnRewards`` (a reward function's per-completion output, or an environment's
``get_reward`` list) lands each value on the last token of its model turn, GAE carries it back
over the policy's own tokens, and everything that reads a number reads the sum. Every expected
value is by hand."""

import math
import pickle
from dataclasses import replace

import pytest
import torch

from trl_ppo_ext import functional as F
from trl_ppo_ext.advantages import compute_targets
from trl_ppo_ext.estimators import estimator_targets
from trl_ppo_ext.rewards.scoring import (
    Reward,
    TurnRewards,
    evaluate_rewards,
    evaluate_rewards_per_token,
    is_token_level,
    token_rewards,
    turn_positions,
)
from trl_ppo_ext.rollout import Rollout

# One episode of 3 model turns in 8 response tokens (the last one padding):
#   t:       0  1  2    3    4  5    6  7
#   action:  a  a  env  env  a  env  a  pad
# turn 0 = tokens 0-1 (ends at 1), turn 1 = token 4, turn 2 = token 6
RESPONSE = torch.tensor([[True] * 7 + [False]])
ACTION = torch.tensor([[True, True, False, False, True, False, True, False]])
ENDS = [1, 4, 6]


def test_turn_ends_are_the_last_token_of_each_run_of_actions():
    assert F.turn_ends(ACTION)[0].nonzero().flatten().tolist() == ENDS
    assert turn_positions(RESPONSE, ACTION) == [ENDS]
    assert turn_positions(RESPONSE) == [[6]]  # no turns: the whole completion is one, ending at its last token
    assert turn_positions(torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool)) == [[]]
    # a naive loop over random masks
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 9, generator=g) > 0.4
    ends = F.turn_ends(mask)
    for b in range(5):
        for t in range(9):
            assert bool(ends[b, t]) == bool(mask[b, t] and (t == 8 or not mask[b, t + 1]))
    with pytest.raises(TypeError, match="action_mask must be a bool tensor"):
        F.turn_ends(mask.long())


def test_turn_rewards_is_a_float_worth_its_sum():
    r = TurnRewards([0.5, -0.25, 1.0])
    assert isinstance(r, float) and r == 1.25 and r.turns == (0.5, -0.25, 1.0)
    assert TurnRewards(torch.tensor([1.0, 2.0])).turns == (1.0, 2.0) and TurnRewards() == 0.0
    assert pickle.loads(pickle.dumps(r)).turns == r.turns  # gathered across processes as its turns
    assert torch.tensor([r, 2.0]).tolist() == [1.25, 2.0]  # what TRL GRPO does with a reward list: the sum
    assert is_token_level(r) and not is_token_level(1.25)
    assert math.isnan(TurnRewards([1.0, math.nan]))  # NaN passes on to the non-finite guard
    with pytest.raises(ValueError, match=r"entry 1 is None .*Give 0.0 to a turn without reward"):
        TurnRewards([1.0, None])


def test_each_turn_reward_lands_on_its_turns_last_token():
    resp = torch.cat([RESPONSE, torch.tensor([[True, True, True, False, False, False, False, False]])])
    act = torch.cat([ACTION, torch.tensor([[True, True, True, False, False, False, False, False]])])
    rewards, applies = token_rewards([TurnRewards([0.5, -0.25, 1.0]), TurnRewards([2.0])], resp, "env", act)
    expected = torch.zeros(2, 8)
    expected[0, 1], expected[0, 4], expected[0, 6] = 0.5, -0.25, 1.0
    expected[1, 2] = 2.0  # a one-turn episode: its last action token
    torch.testing.assert_close(rewards, expected, rtol=0, atol=0)
    assert applies.tolist() == [True, True]
    # shorter than the turns: the later turns (an answer after the last tool call) get nothing
    short, _ = token_rewards([TurnRewards([0.5]), None], resp, "env", act)
    assert short[0].nonzero().flatten().tolist() == [1] and short[1].eq(0).all()
    # a completion without turns (no action mask) is one turn
    plain, _ = token_rewards([TurnRewards([3.0]), TurnRewards([])], resp)
    assert plain[0, 6] == 3.0 and plain[1, 2] == 0.0 and plain.sum() == 3.0


def test_more_turn_rewards_than_turns_names_the_function():
    bad = [Reward("guess_env", lambda completions, **kw: [TurnRewards([1.0, 2.0, 3.0, 4.0])], 1.0)]
    with pytest.raises(ValueError, match=r"Reward 'guess_env' returned 4 per-turn rewards \[1.0, 2.0, 3.0, 4.0\] for "
                                         r"completion 0, which has 3 model turns"):
        evaluate_rewards_per_token(bad, None, lambda: {"completions": ["a"]}, RESPONSE, 1, ACTION)


def test_weights_apply_to_every_turn_and_the_sequence_path_reads_the_sum():
    rewards = [Reward("turns", lambda completions, **kw: [TurnRewards([0.5, -0.25, 1.0]), None], 2.0),
               Reward("final", lambda completions, **kw: [1.0, 1.0], 1.0)]
    resp = torch.cat([RESPONSE, RESPONSE])
    act = torch.cat([ACTION, ACTION])

    def kwargs():
        return {"completions": ["a", "b"]}

    scores, values, applies, tokens = evaluate_rewards_per_token(rewards, None, kwargs, resp, 1, act)
    assert scores.tolist() == [1.0, 1.0]  # the per-turn reward is in the token rewards, not the score
    assert tokens[0, ENDS].tolist() == [1.0, -0.5, 2.0] and tokens[0].sum() == 2.5  # weight 2 on each turn
    assert tokens[1].eq(0).all() and applies.tolist() == [[True, True], [False, True]]
    assert values[0].tolist() == [1.25, 1.0] and math.isnan(values[1, 0])  # metrics: the sum, unweighted
    # without a response mask (a sequence-only evaluation) a TurnRewards is the number it is: its sum
    scores, values, _ = evaluate_rewards(rewards, None, kwargs, 2, 1, "cpu")
    assert scores.tolist() == [2 * 1.25 + 1.0, 1.0]


# ---------------------------------------------------------------- GAE over a 3-turn episode
def _episode(token_rewards, scores=0.0, has_stop=True, rows=1):
    t = RESPONSE.shape[1]
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 9.0, 0.4, 9.0]])  # 9.0 on environment tokens: never read
    return Rollout(queries=torch.ones(rows, 1, dtype=torch.long), query_mask=torch.ones(rows, 1, dtype=torch.bool),
                   responses=torch.ones(rows, t, dtype=torch.long), response_mask=RESPONSE.expand(rows, t),
                   action_mask=ACTION.expand(rows, t), logprobs=torch.full((rows, t), -1.0),
                   ref_logprobs=torch.full((rows, t), -1.0), values=values.expand(rows, t),
                   scores=torch.full((rows,), scores), has_stop=torch.full((rows,), has_stop),
                   token_rewards=token_rewards)


GAE = dict(kl_coef=0.1, kl_estimator="k1", whiten_rewards=False, whiten_advantages=False, gamma=0.9, lam=0.8)


def test_gae_carries_each_turn_reward_from_its_turn():
    placed, _ = token_rewards([TurnRewards([0.5, -0.25, 1.0])], RESPONSE, "env", ACTION)
    t = compute_targets(_episode(placed), missing_eos_penalty=None, **GAE)
    # the action steps: tokens 0, 1, 4, 6 with r = [0, 0.5, -0.25, 1.0], V = [0.1, 0.2, 0.3, 0.4] (KL 0)
    # deltas  d = r + 0.9 * V_next - V:  0.08, 0.57, -0.19, 0.6
    # A3 = 0.6; A2 = -0.19 + 0.72 * 0.6 = 0.242; A1 = 0.57 + 0.72 * 0.242 = 0.74424;
    # A0 = 0.08 + 0.72 * 0.74424 = 0.6158528;  returns = A + V
    adv = torch.tensor([[0.6158528, 0.74424, 0.0, 0.0, 0.242, 0.0, 0.6, 0.0]])
    ret = torch.tensor([[0.7158528, 0.94424, 0.0, 0.0, 0.542, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(t.advantages, adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.returns, ret, rtol=0, atol=1e-6)
    # an independent loop over the action tokens, back to front
    steps = [k for k in range(8) if ACTION[0, k]]
    r, v = t.rewards[0], _episode(placed).values[0]
    gae, want = 0.0, {}
    for i in reversed(range(len(steps))):
        k = steps[i]
        nxt = float(v[steps[i + 1]]) if i + 1 < len(steps) else 0.0
        gae = float(r[k]) + 0.9 * nxt - float(v[k]) + 0.9 * 0.8 * gae
        want[k] = gae
    assert all(abs(float(t.advantages[0, k]) - a) < 1e-6 for k, a in want.items())


def test_one_reward_per_episode_is_unchanged_and_the_turns_differ_from_it():
    # TRL GRPO's shape: 1.25 as the sequence score, on the last action token (6)
    episode = compute_targets(_episode(None, scores=1.25), missing_eos_penalty=None, **GAE)
    assert episode.rewards[0].nonzero().flatten().tolist() == [6] and episode.rewards[0, 6] == 1.25
    # deltas 0.08, 0.07, 0.06, 0.85: A3 = 0.85, A2 = 0.06 + 0.72 * 0.85 = 0.672,
    # A1 = 0.07 + 0.72 * 0.672 = 0.55384, A0 = 0.08 + 0.72 * 0.55384 = 0.4787648
    torch.testing.assert_close(episode.advantages[0, [0, 1, 4, 6]],
                               torch.tensor([0.4787648, 0.55384, 0.672, 0.85]), rtol=0, atol=1e-6)
    # per turn (the test above) token 1 gets 0.74424 here 0.55384: its turn's 0.5 arrives at its own end


def test_missing_eos_penalty_stays_on_the_score_at_the_last_turn():
    placed, _ = token_rewards([TurnRewards([0.5, -0.25, 1.0])], RESPONSE, "env", ACTION)
    t = compute_targets(_episode(placed, has_stop=False), missing_eos_penalty=0.25, **GAE)
    assert t.scores.tolist() == [-0.25]
    assert t.rewards[0, ENDS].tolist() == [0.5, -0.25, 0.75]  # 1.0 - 0.25 on the last turn's end


def test_an_unscorable_row_keeps_advantage_zero():
    placed, applies = token_rewards([None], RESPONSE, "env", ACTION)
    rollout = replace(_episode(placed), reward_applies=applies[:, None])
    t = compute_targets(rollout, missing_eos_penalty=None, **GAE)
    assert t.advantages.eq(0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_critic_free_estimators_read_the_sum(estimator):
    # two samples of one prompt: per-turn [0.5, -0.25, 1.0] (sum 1.25) and [0.0] (sum 0)
    placed, _ = token_rewards([TurnRewards([0.5, -0.25, 1.0]), TurnRewards([0.0])],
                              RESPONSE.expand(2, 8), "env", ACTION.expand(2, 8))
    settings = dict(GAE, kl_coef=0.0, missing_eos_penalty=None, advantage_estimator=estimator, num_generations=2)
    turns = estimator_targets(_episode(placed, rows=2), **settings)
    summed = estimator_targets(replace(_episode(None, rows=2), scores=torch.tensor([1.25, 0.0])), **settings)
    torch.testing.assert_close(turns.advantages, summed.advantages, rtol=0, atol=1e-6)
    if estimator == "rloo":  # leave-one-out: 1.25 - 0 and 0 - 1.25 on every action token
        assert turns.advantages[:, 0].tolist() == [1.25, -1.25] and turns.advantages[:, 2].eq(0).all()
