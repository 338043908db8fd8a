"""The rollout module on its own: response finalisation and the scoring stage (chunks, the
positions each forward is read at, the scored rollout)."""

import math
from contextlib import contextmanager
from dataclasses import fields
from types import SimpleNamespace

import torch

from trl_ppo_ext.generation.transformers_generate import generate_responses, generation_pad_id, sampling_config
from trl_ppo_ext.rollout import (
    Rollout,
    SampledBatch,
    finalize_responses,
    forward_chunks,
    forward_responses,
    reference_response_logprobs,
    reward_model_scores,
    scored_rollout,
    sequence_inputs,
    valid_token_ids,
)
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer


# ---------------------------------------------------------------- scoring stage
def _sample(B=5, P=3, T=4, seed=0) -> SampledBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 1, 3, 2, 4][:B])
    response_mask = torch.arange(T)[None] < lengths[:, None]
    query_mask = torch.ones(B, P, dtype=torch.bool)
    query_mask[0, 0] = False  # one left-padded prompt
    return SampledBatch(
        queries=torch.randint(1, 20, (B, P), generator=g), query_mask=query_mask,
        responses=torch.randint(1, 20, (B, T), generator=g).masked_fill(~response_mask, 99),
        response_mask=response_mask, has_stop=lengths < T, policy_version=3,
        extras={"answer": [f"a{i}" for i in range(B)]},
    )


def test_forward_chunks_cover_every_row_once_in_order_with_its_inputs():
    sample = _sample()
    chunks = forward_chunks(sample, 2)
    assert [p.batch_size for p, _ in chunks] == [2, 2, 1]
    assert torch.equal(torch.cat([p.responses for p, _ in chunks]), sample.responses)
    assert [a for p, _ in chunks for a in p.extras["answer"]] == ["a0", "a1", "a2", "a3", "a4"]
    assert all(p.policy_version == 3 and type(p) is SampledBatch for p, _ in chunks)
    whole = sequence_inputs(sample.queries, sample.query_mask, sample.responses, sample.response_mask)
    for k in range(3):  # each chunk's inputs are the whole batch's inputs for its rows
        assert torch.equal(torch.cat([inputs[k] for _, inputs in chunks]), whole[k])


def test_valid_token_ids_keep_real_prompt_tokens_and_responses_through_the_stop():
    sample = SampledBatch(
        queries=torch.tensor([[0, 7, 8], [4, 5, 6]]), query_mask=torch.tensor([[False, True, True], [True] * 3]),
        responses=torch.tensor([[9, 2, 0], [3, 3, 3]]), response_mask=torch.tensor([[True, True, False], [True] * 3]),
        has_stop=torch.tensor([True, False]),
    )
    assert valid_token_ids(sample) == ([[7, 8], [4, 5, 6]], [[9, 2], [3, 3, 3]])


def test_a_sampled_batch_carries_no_scores_and_scoring_makes_a_rollout_of_it():
    sample = _sample()
    scoring = {"logprobs", "ref_logprobs", "values", "scores", "reward_values", "reward_applies"}
    assert not scoring & {f.name for f in fields(SampledBatch)}  # no placeholders to forget to fill
    mask = sample.response_mask
    lp = torch.full((5, 4), -1.5, dtype=torch.float64)
    values = torch.arange(20, dtype=torch.bfloat16).reshape(5, 4)
    rollout = scored_rollout(sample, logprobs=lp, ref_logprobs=lp * 2, values=values, scores=torch.ones(5))
    assert isinstance(rollout, Rollout) and isinstance(rollout, SampledBatch)
    for name in ("logprobs", "ref_logprobs", "values"):
        x = getattr(rollout, name)
        assert x.dtype == torch.float32 and torch.all(x[~mask] == 0)
    assert torch.all(rollout.logprobs[mask] == -1.5) and torch.all(rollout.ref_logprobs[mask] == -3.0)
    # row 1 keeps one token: value 4 (position (1, 0) of arange(20).reshape(5, 4)); 5, 6, 7 masked
    assert rollout.values[1].tolist() == [4.0, 0.0, 0.0, 0.0]
    assert rollout.responses is sample.responses and rollout.extras is sample.extras
    assert rollout.policy_version == 3 and rollout.reward_values is None
    assert lp.dtype == torch.float64 and torch.all(lp == -1.5)  # the caller's tensors are untouched
    assert type(rollout.select(torch.tensor([4, 0]))) is Rollout


class _PositionModel(torch.nn.Module):
    """``forward`` -> ``(logits, values)`` with ``logits[b, l, v] = 100 b + 10 l + v`` and
    ``values[b, l] = l`` for the full length ``L``; only the last ``logits_to_keep`` positions
    of the logits are returned, as transformers does."""

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0, **kwargs):
        B, L = input_ids.shape
        b = torch.arange(B)[:, None, None]
        pos = torch.arange(L)[None, :, None]
        v = torch.arange(6)[None, None, :]
        logits = (100 * b + 10 * pos + v).float()
        return logits[:, -logits_to_keep:] if logits_to_keep else logits, torch.arange(L).float().expand(B, L)


def test_forward_responses_reads_the_positions_that_predict_each_response_token():
    P, T = 3, 2
    sample = _sample(B=2, P=P, T=T)
    inputs = sequence_inputs(sample.queries, sample.query_mask, sample.responses, sample.response_mask)
    entered = []

    @contextmanager
    def autocast():
        entered.append(True)
        yield

    logits, values = forward_responses(_PositionModel(), inputs, T, temperature=2.0, autocast=autocast)
    assert logits.shape == (2, T, 6) and values.shape == (2, T) and entered == [True]
    # response token t is predicted at position P - 1 + t = 2, 3; row 1, t = 1: (100 + 30 + v) / 2
    assert logits[1, 1].tolist() == [(130 + v) / 2 for v in range(6)]
    assert logits[0, 0].tolist() == [(20 + v) / 2 for v in range(6)]
    assert values.tolist() == [[2.0, 3.0], [2.0, 3.0]] and values.dtype == torch.float32


def test_reference_logprobs_are_a_log_softmax_at_the_predicting_positions():
    P, T, V = 2, 3, 4
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, P + T, V, generator=g)
    model = lambda **kw: SimpleNamespace(logits=full[:, -kw["logits_to_keep"]:])  # noqa: E731
    responses = torch.tensor([[1, 3, 2], [0, 2, 99]])  # 99: a pad id past the vocabulary, masked
    mask = torch.tensor([[True, True, True], [True, True, False]])
    part = SampledBatch(queries=torch.ones(2, P, dtype=torch.long), query_mask=torch.ones(2, P, dtype=torch.bool),
                        responses=responses, response_mask=mask, has_stop=torch.tensor([False, True]))
    inputs = sequence_inputs(part.queries, part.query_mask, responses, mask)
    got = reference_response_logprobs(model, part, inputs, temperature=0.5)
    for b in range(2):
        for t in range(T):
            if not mask[b, t]:
                continue
            row = [float(x) / 0.5 for x in full[b, P - 1 + t]]  # the logits predicting token t
            expected = row[int(responses[b, t])] - math.log(sum(math.exp(x) for x in row))
            assert math.isclose(float(got[b, t]), expected, rel_tol=1e-6, abs_tol=1e-6)


class _ScoreIsTheTokenRead(torch.nn.Module):
    """A reward model whose score at a position is the id of the token there (one-hot
    hidden states, a head with weights 0, 1, 2, ...)."""

    base_model_prefix = "body"

    def __init__(self, vocab_size):
        super().__init__()
        self.body = _OneHot(vocab_size)
        self.score = torch.nn.Linear(vocab_size, 1, bias=False)
        self.score.weight.data = torch.arange(vocab_size, dtype=torch.float32)[None]


class _OneHot(torch.nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(last_hidden_state=torch.nn.functional.one_hot(input_ids, self.vocab_size).float())


def test_reward_model_scores_read_the_stop_token_or_the_last_generated_one():
    eos = 2
    part = SampledBatch(
        queries=torch.tensor([[eos, 5, 6], [7, 8, 9]]), query_mask=torch.tensor([[False, True, True], [True] * 3]),
        # pad == eos: row 0 stops at its first eos (index 1), the eos after it are padding
        responses=torch.tensor([[10, eos, eos, eos], [11, 12, 13, 14]]),
        response_mask=torch.tensor([[True, True, False, False], [True] * 4]), has_stop=torch.tensor([True, False]),
    )
    inputs = sequence_inputs(part.queries, part.query_mask, part.responses, part.response_mask)
    scores = reward_model_scores(_ScoreIsTheTokenRead(16), part, inputs)
    assert scores.tolist() == [float(eos), 14.0]  # row 1 is truncated: its last generated token


def test_a_chunk_where_one_row_stops_early_with_an_out_of_range_pad_id():
    """The policy's embedding has exactly len(tokenizer) rows and the script adds [PAD] afterwards
    (GPT-2, Llama-2, TRL's tiny models): generate must not embed the [PAD] id for a finished row."""
    from trl_ppo_ext.tiny import default_words

    tok = build_tiny_tokenizer(default_words(5))  # a small vocabulary: EOS is sampled often enough
    model = build_tiny_causal_lm(tok, seed=0)  # vocab_size == len(tok)
    first_word = tok.convert_tokens_to_ids("w0")
    tok.add_special_tokens({"pad_token": "[PAD]"})
    assert tok.pad_token_id == model.get_input_embeddings().num_embeddings  # one past the last row
    stops = (tok.eos_token_id,)
    queries = torch.randint(first_word, first_word + 5, (16, 3), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    pad_id = generation_pad_id(tok.pad_token_id, stops, model.get_input_embeddings().num_embeddings)
    raw = generate_responses(model, queries, torch.ones_like(queries, dtype=torch.bool),
                             sampling_config(12, stops, pad_id, 1.0), 12, tok.pad_token_id, chunk_size=16)
    responses, mask, has_stop = finalize_responses(raw, stops, tok.pad_token_id)
    lengths = mask.sum(1)
    assert has_stop.any() and (lengths < 12).any() and (lengths == 12).any()  # one chunk, rows end apart
    assert (responses[~mask] == tok.pad_token_id).all()  # after the EOS: the tokenizer's pad id
    assert (responses[has_stop, :][mask[has_stop] & (responses[has_stop] == tok.eos_token_id)]).numel() == int(
        has_stop.sum())  # each stopped row keeps exactly one EOS, inside its mask


def test_finalize_responses_with_several_stop_ids():
    raw = torch.tensor([[5, 9, 6, 7], [5, 6, 2, 8], [5, 6, 7, 8]])
    responses, mask, has_stop = finalize_responses(raw, (2, 9), pad_token_id=0)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, False], [True] * 4]
    assert has_stop.tolist() == [True, True, False]
    assert responses.tolist() == [[5, 9, 0, 0], [5, 6, 2, 0], [5, 6, 7, 8]]
