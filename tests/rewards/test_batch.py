"""``rewards.batch``: a batch's rewards read once, the reward model through the hook's two-argument
form (the run's ``reward_model``) or with its model named, and the functions' arguments built once."""

from types import SimpleNamespace

import torch
from torch import nn

from trl_ppo_ext.rewards.batch import RewardReader, model_scores, score_batch_rewards
from trl_ppo_ext.rewards.scoring import Reward


class Chunks(list):
    """Two chunks of one row each, merged in order (``rollout.ScoringChunks`` without reordering)."""

    def merge(self, results):
        return torch.cat(list(results))


def _reader(primary=None):
    return RewardReader(None, torch.device("cpu"), None, 2, None, offload=False, primary=primary)


def test_the_primary_model_is_read_through_the_two_argument_form_and_another_is_named():
    primary, other = nn.Linear(1, 1), nn.Linear(1, 1)
    calls = []

    def chunk_scores(part, inputs, *model):
        calls.append(len(model))
        return torch.tensor([float(part)])

    chunks = Chunks([(1, None), (2, None)])
    for source in (primary, other):
        scores = model_scores(Reward("rm", source, 1.0), dict, sample=None, chunks=chunks, reader=_reader(primary),
                              chunk_scores=chunk_scores)
        assert scores.tolist() == [1.0, 2.0]
    assert calls == [0, 0, 1, 1]  # two chunks each: primary without its model, the other with it


def test_reward_functions_get_the_batch_arguments_built_once():
    built = []

    def function_kwargs(sample):
        built.append(sample)
        return {"completions": ["a", "b"]}

    rewards = [Reward("one", lambda completions, **kw: [1.0, 2.0], 1.0),
               Reward("two", lambda completions, **kw: [0.5, 0.5], 2.0)]
    sample = SimpleNamespace(response_mask=torch.ones(2, 3, dtype=torch.bool), action_mask=None)
    scores, values, applies, token = score_batch_rewards(rewards, sample, Chunks(), _reader(), chunk_scores=None,
                                                         function_kwargs=function_kwargs, update=1)
    assert len(built) == 1
    assert scores.tolist() == [2.0, 3.0]  # 1 * 1.0 + 2 * 0.5, 1 * 2.0 + 2 * 0.5
    assert values.tolist() == [[1.0, 0.5], [2.0, 0.5]] and applies.all()
    assert token.tolist() == [[0.0] * 3] * 2  # no token-level output: zeros
