"""The rollout sampler on its own: prompts as every engine takes them, and the turns of an episode
sampled with the episode's settings passed as arguments (no call back into a trainer)."""

import functools

import pytest
import torch
from accelerate import Accelerator

from trl_ppo_ext.sampling import PolicySnapshot, RolloutSampler, TurnSettings, prompt_tensors


def test_prompts_are_left_padded_and_an_empty_one_is_refused():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    queries, mask = prompt_tensors({"input_ids": ids, "attention_mask": ids != 0}, 0, "cpu")
    assert queries.tolist() == [[0, 5, 6], [0, 0, 7]]
    assert mask.tolist() == [[False, True, True], [False, False, True]]
    queries, _ = prompt_tensors({"input_ids": ids}, 0, "cpu")  # no mask: the pad id marks padding
    assert queries.tolist() == [[0, 5, 6], [0, 0, 7]]
    with pytest.raises(ValueError, match="empty prompt"):
        prompt_tensors({"input_ids": torch.tensor([[5], [0]])}, 0, "cpu")


class _Args:
    response_length, temperature, use_vllm, ds3_gather_for_generation = 4, 0.7, False, False


class _Tok:
    pad_token_id = 0


class _Handed(Exception):
    pass


class _Tools:
    """A tool loop that records the generate callable it was handed."""

    def __init__(self):
        self.generate = None
        self.last_stats = None

    def run(self, rows, generate, slot=0):
        self.generate = generate
        raise _Handed  # enough: the callable was handed over


def _model():
    """The trainer's model as the sampler unwraps it: a ``.policy`` inside a module."""
    model = torch.nn.Module()
    model.policy = torch.nn.Linear(1, 1)
    model.is_gradient_checkpointing = False
    return model


def _sampler(**kw):
    return RolloutSampler(_Args(), _Tok(), Accelerator(cpu=True), (2,), **kw)


def test_the_tool_loop_gets_the_episodes_settings_bound_as_arguments():
    tools = _Tools()
    sampler = _sampler(agent_rollout=tools)
    model = _model()
    batch = {"input_ids": torch.tensor([[5]]), "prompt": [[{"role": "user", "content": "hi"}]]}
    with pytest.raises(_Handed):
        sampler.sample(batch, PolicySnapshot(model, version=3, weights_version=2), temperature=0.0)
    generate = tools.generate
    assert isinstance(generate, functools.partial) and generate.func == sampler._continue_checked
    # greedy as asked (0.0, not the config's 0.7); no log-prob forward without vLLM
    assert generate.keywords["turn"] == TurnSettings(model.policy, 0.0, logprobs=False, weights_version=2)
    assert sampler._local.episode is None  # nothing left behind after the batch


def test_a_subclass_turn_hook_replaces_the_samplers_own():
    tools = _Tools()
    hook = lambda prefixes, max_new_tokens: ([], [])  # noqa: E731
    sampler = _sampler(agent_rollout=tools, turns=hook)
    model = _model()
    with pytest.raises(_Handed):
        sampler.sample({"input_ids": torch.tensor([[5]]), "prompt": [[]]}, PolicySnapshot(model, 0, 0))
    assert tools.generate is hook


def test_continuing_outside_an_episode_needs_the_policy():
    with pytest.raises(ValueError, match="needs the policy"):
        _sampler().continue_prefixes([[5]], 2)
    with pytest.raises(ValueError, match="one max_new_tokens >= 1 per prefix"):
        _sampler().continue_prefixes([[5], []], 2, policy=PolicySnapshot(torch.nn.Module(), 0, 0))
