"""Sampling filters (top_k, top_p, min_p, repetition_penalty): hand-computed filtered logits; what
transformers' generate samples with them on a tiny model whose next-token distribution is fixed; the
log-probs the rollout and the update read are those of the distribution sampled (first ratio 1); and
the values vLLM receives, colocated and from a server."""

import math
import sys
import types

import pytest
import torch

from trl_ppo_ext.generation.base import SamplingSettings
from trl_ppo_ext.generation.filters import (
    RepetitionPenaltyProcessor,
    SamplingFilters,
    filtered_logits,
    filtered_response_logits,
    generation_kwargs_dict,
    seen_tokens,
)
from trl_ppo_ext.generation.transformers_generate import generate_responses, sampling_config
from trl_ppo_ext.rollout import forward_responses, sequence_inputs
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

INF = math.inf


def test_top_k_keeps_the_k_largest_and_their_ties():
    logits = torch.tensor([[[3.0, 2.0, 2.0, 0.0]]])
    out = filtered_logits(logits, torch.tensor([[0]]), SamplingFilters(top_k=2))
    assert out.tolist() == [[[3.0, 2.0, 2.0, -INF]]]  # the tie with the 2nd largest stays


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().view(1, 1, 4)
    # sorted: 0.5, 0.3 (mass before it 0.5 < 0.7: kept), 0.15 (mass before 0.8: dropped)
    out = filtered_logits(logits, torch.tensor([[1]]), SamplingFilters(top_p=0.7))
    assert torch.isinf(out[0, 0, [0, 2]]).all() and torch.equal(out[0, 0, [1, 3]], logits[0, 0, [1, 3]])
    # 0.85: 0.15 joins (mass before it 0.8 < 0.85)
    out = filtered_logits(logits, torch.tensor([[1]]), SamplingFilters(top_p=0.85))
    assert torch.isinf(out[0, 0, 0]) and torch.isfinite(out[0, 0, 1:]).all()


def test_min_p_is_relative_to_the_most_likely_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # min_p 0.4: threshold 0.4 * 0.5 = 0.2, so 0.5 and 0.3 stay
    out = filtered_logits(probs.log().view(1, 1, 4), torch.tensor([[0]]), SamplingFilters(min_p=0.4))
    assert torch.isfinite(out[0, 0, :2]).all() and torch.isinf(out[0, 0, 2:]).all()


def test_filters_apply_in_order_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 leaves 0.4, 0.3, 0.2 renormalised to 4/9, 3/9, 2/9; top_p=0.7: mass before 2/9 is 7/9 >= 0.7
    out = filtered_logits(probs.log().view(1, 1, 4), torch.tensor([[0]]), SamplingFilters(top_k=3, top_p=0.7))
    assert torch.isfinite(out[0, 0, :2]).all() and torch.isinf(out[0, 0, 2:]).all()


def test_the_sampled_token_is_always_kept():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]]])
    out = filtered_logits(logits, torch.tensor([[3, 0]]), SamplingFilters(top_k=1))
    assert out[0, 0].tolist() == [3.0, -INF, -INF, 0.0]  # token 3 was sampled at t=0
    assert out[0, 1].tolist() == [3.0, -INF, -INF, -INF]


def test_neutral_filters_return_the_logits_themselves():
    logits = torch.randn(2, 3, 5)
    assert filtered_logits(logits, torch.zeros(2, 3, dtype=torch.long), SamplingFilters()) is logits
    assert filtered_logits(logits, torch.zeros(2, 3, dtype=torch.long), None) is logits


def test_seen_tokens_count_the_real_prompt_and_earlier_responses():
    prompt = torch.tensor([[0, 2]])  # 0 is left padding
    seen = seen_tokens(prompt, torch.tensor([[False, True]]), torch.tensor([[4, 1, 4]]), vocab_size=5)
    assert seen[0].int().tolist() == [
        [0, 0, 1, 0, 0],  # t=0: the prompt's 2 only (not the pad id 0)
        [0, 0, 1, 0, 1],  # t=1: and the 4 sampled at t=0
        [0, 1, 1, 0, 1],  # t=2: and the 1
    ]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[[4.0, -2.0, 4.0]]])
    seen = torch.tensor([[[True, True, False]]])
    out = filtered_logits(logits, torch.tensor([[0]]), SamplingFilters(repetition_penalty=2.0), seen)
    assert out.tolist() == [[[2.0, -4.0, 4.0]]]
    with pytest.raises(ValueError, match="needs `seen`"):
        filtered_logits(logits, torch.tensor([[0]]), SamplingFilters(repetition_penalty=2.0))


def test_the_generate_processor_and_the_scoring_forward_penalize_the_same_tokens():
    # generation step 1 of a row with prompt [pad, 2] and first new token 4: the processor sees
    # input_ids [0, 2, 4]; the scoring forward's seen_tokens at t=1 must agree (the pad 0 not counted)
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    processor = RepetitionPenaltyProcessor(2.0, torch.tensor([[False, True]]))
    assert processor(torch.tensor([[0, 2, 4]]), scores.clone()).tolist() == [[1.0, 1.0, 0.5, 1.0, 0.5]]
    ids = torch.tensor([[0, 2, 4, 1]])
    mask = torch.tensor([[0, 1, 1, 1]])
    out = filtered_response_logits(torch.ones(1, 2, 5), ids, mask, SamplingFilters(repetition_penalty=2.0))
    assert out[0, 1].tolist() == [1.0, 1.0, 0.5, 1.0, 0.5]


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": -1}, "top_k must be an int >= 0"), ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"), ({"repetition_penalty": 0.0}, "repetition_penalty must be"),
])
def test_values_no_engine_samples_with_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingFilters(**kwargs)


def test_generation_kwargs_take_the_filters_and_refuse_the_rest():
    assert generation_kwargs_dict('{"top_k": 2}') == {"top_k": 2}
    with pytest.raises(ValueError, match=r"sets \['num_beams'\]: PPO takes only \['top_k', 'top_p'"):
        generation_kwargs_dict({"num_beams": 2, "top_p": 0.9})
    args = types.SimpleNamespace(top_k=5, top_p=0.9, min_p=None, repetition_penalty=1.0,
                                 generation_kwargs={"top_k": 1})
    assert SamplingFilters.from_config(args) == SamplingFilters(top_k=1, top_p=0.9)  # generation_kwargs win


# ---------------------------------------------------------------- transformers' generate on a fixed distribution
def _fixed_lm(next_token_logits: list[float]):
    """A tiny Llama whose next-token logits are ``next_token_logits`` at every position (a zero head
    with that bias), so the distribution sampled is known by hand. Vocabulary: 6 specials + 40 words."""
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    head = torch.nn.Linear(model.lm_head.in_features, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor(next_token_logits))
    model.lm_head = head
    return tok, model


def _logits_with(values: dict[int, float], vocab: int = 46, rest: float = -30.0) -> list[float]:
    out = [rest] * vocab
    for token, value in values.items():
        out[token] = value
    return out


def _sample(model, filters, B=64, T=3, seed=0):
    queries = torch.tensor([[0, 10], [11, 12]]).repeat(B // 2, 1)  # row 0 left padded
    mask = queries != 0
    config = sampling_config(T, (), 0, 1.0, filters)
    torch.manual_seed(seed)
    return queries, mask, generate_responses(model, queries, mask, config, T, 0, chunk_size=B, filters=filters)


def test_top_k_one_samples_the_argmax():
    # probabilities 0.4 / 0.35 / 0.25 on tokens 20, 21, 22: unfiltered, every token appears
    tok, model = _fixed_lm(_logits_with({20: math.log(0.4), 21: math.log(0.35), 22: math.log(0.25)}))
    _, _, plain = _sample(model, SamplingFilters())
    assert set(plain.flatten().tolist()) == {20, 21, 22}
    _, _, top1 = _sample(model, SamplingFilters(top_k=1))
    assert (top1 == 20).all()


def test_top_p_samples_from_the_nucleus_only():
    # 0.5 / 0.3 / 0.15 / 0.05 on tokens 20..23; top_p=0.7 keeps {20, 21}
    tok, model = _fixed_lm(_logits_with({20: math.log(0.5), 21: math.log(0.3), 22: math.log(0.15),
                                         23: math.log(0.05)}))
    _, _, out = _sample(model, SamplingFilters(top_p=0.7))
    assert set(out.flatten().tolist()) == {20, 21}
    _, _, out = _sample(model, SamplingFilters(min_p=0.5))  # 0.5 * 0.5 = 0.25: only 20 and 21 reach it
    assert set(out.flatten().tolist()) == {20, 21}


def test_repetition_penalty_makes_the_next_token_the_other_one():
    # tokens 20 and 21 at logit 20 each; a penalty of 100 divides a seen one's to 0.2, so once 20 is
    # sampled, 21 follows with probability 1 / (1 + e^-19.8) ~ 1 - 2.5e-9, and the reverse
    tok, model = _fixed_lm(_logits_with({20: 20.0, 21: 20.0}))
    _, _, plain = _sample(model, SamplingFilters(), T=2)
    assert (plain[:, 0] == plain[:, 1]).any()  # 50% per row without the penalty
    _, _, out = _sample(model, SamplingFilters(repetition_penalty=100.0), T=2)
    assert (out[:, 0] != out[:, 1]).all() and set(out.flatten().tolist()) == {20, 21}


class _PolicyValue(torch.nn.Module):
    """``forward -> (logits, values)`` of a causal LM, as ``PolicyAndValue`` gives them."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         logits_to_keep=logits_to_keep).logits
        return logits, torch.zeros(logits.shape[:2])


def test_the_log_probs_are_the_filtered_distributions_and_the_first_ratio_is_one():
    # top_p=0.7 over 0.5 / 0.3 / 0.15 / 0.05: the sampler draws 20 with 0.5 / 0.8 and 21 with 0.3 / 0.8
    tok, model = _fixed_lm(_logits_with({20: math.log(0.5), 21: math.log(0.3), 22: math.log(0.15),
                                         23: math.log(0.05)}))
    filters = SamplingFilters(top_p=0.7)
    queries, mask, responses = _sample(model, filters, B=8)
    inputs = sequence_inputs(queries, mask, responses, torch.ones_like(responses, dtype=torch.bool))
    old_logits, _ = forward_responses(_PolicyValue(model), inputs, 3, 1.0, filters=filters)
    old = torch.log_softmax(old_logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    expected = torch.where(responses == 20, math.log(0.5 / 0.8), math.log(0.3 / 0.8))
    torch.testing.assert_close(old, expected, rtol=0, atol=1e-5)
    new_logits, _ = forward_responses(_PolicyValue(model), inputs, 3, 1.0, filters=filters)  # the update's forward
    new = torch.log_softmax(new_logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    assert torch.equal((new - old).exp(), torch.ones_like(old))


def test_the_penalized_log_probs_follow_the_earlier_tokens():
    tok, model = _fixed_lm(_logits_with({20: 2.0, 21: 2.0}))
    filters = SamplingFilters(repetition_penalty=2.0)
    queries, mask = torch.tensor([[0, 20]]), torch.tensor([[False, True]])  # the prompt holds 20 (and a pad)
    responses = torch.tensor([[21, 20]])
    inputs = sequence_inputs(queries, mask, responses, torch.ones_like(responses, dtype=torch.bool))
    logits, _ = forward_responses(_PolicyValue(model), inputs, 2, 1.0, filters=filters)
    logp = torch.log_softmax(logits.float(), -1)
    # t=0: 20 seen (logit 1), 21 not (2): p(21) = e^2 / (e^2 + e^1 + 44 e^-30)
    torch.testing.assert_close(logp[0, 0, 21], torch.tensor(2 - math.log(math.e**2 + math.e)), rtol=0, atol=1e-5)
    # t=1: both seen (1 and 1): p(20) = 1/2; the pad id 0 is not penalized (-30 stays -30, not -60)
    torch.testing.assert_close(logp[0, 1, 20], torch.tensor(math.log(0.5)), rtol=0, atol=1e-5)
    assert logits[0, 1, 0].item() == pytest.approx(-30.0)


# ---------------------------------------------------------------- the values vLLM receives
def test_the_colocated_engine_sends_the_filters_to_sampling_params(monkeypatch):
    sent = []

    class FakeParams:
        def __init__(self, **kwargs):
            sent.append(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=FakeParams))
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    engine = object.__new__(VLLMColocateEngine)
    engine.policy_version, engine._weights_discarded, engine._asleep, engine._lora_request = 0, False, False, None
    answer = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5], finish_reason="stop",
                                                                  logprobs=[{5: types.SimpleNamespace(logprob=-0.1)}])])
    engine.llm = types.SimpleNamespace(generate=lambda prompts, **kw: [answer] * len(prompts))
    filters = SamplingFilters(top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.2)
    settings = SamplingSettings(max_tokens=4, temperature=0.9, stop_token_ids=(3,), **filters.engine_fields())
    engine.generate([[1, 2]], settings, torch.Generator().manual_seed(0))
    assert {k: sent[0][k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")} == {
        "temperature": 0.9, "top_k": 3, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.2}


def test_the_server_request_carries_the_filters_and_neutral_values_by_default():
    from trl_ppo_ext.generation.vllm_server import VLLMServerEngine

    engine = object.__new__(VLLMServerEngine)
    engine.model_name = "tiny"
    settings = SamplingSettings(max_tokens=4, temperature=1.0, **SamplingFilters(top_k=1, min_p=None).engine_fields())
    payload = engine.completion_payload([1], settings, seed=0)
    assert (payload["top_k"], payload["top_p"], payload["min_p"], payload["repetition_penalty"]) == (1, 1.0, 0.0, 1.0)
    plain = engine.completion_payload([1], SamplingSettings(max_tokens=4, temperature=1.0), seed=0)
    assert (plain["top_k"], plain["top_p"], plain["min_p"], plain["repetition_penalty"]) == (0, 1.0, 0.0, 1.0)
