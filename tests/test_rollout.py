"""The rollout module on its own: stop ids, the pad id handed to ``generate``, the complete
generation config (nothing inherited from a checkpoint), response finalisation."""

import logging

import pytest
import torch
from transformers import GenerationConfig

from trl_ppo_ext.rollout import (
    MIN_TEMPERATURE,
    effective_temperature,
    finalize_responses,
    generate_responses,
    generation_pad_id,
    ignored_generation_fields,
    isolated_generation_config,
    sampling_config,
    stop_token_ids,
)
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer


def test_stop_token_ids_follow_the_config():
    tok = build_tiny_tokenizer()
    eos = tok.eos_token_id
    assert stop_token_ids("eos", None, tok) == (eos,)
    assert stop_token_ids(None, 7, tok) == (7,)
    # TRL's default (neither): where transformers stops, i.e. the checkpoint's EOS ids, plus the tokenizer's
    assert stop_token_ids(None, None, tok, GenerationConfig(eos_token_id=[9, eos])) == (9, eos)
    assert stop_token_ids(None, None, tok, GenerationConfig()) == (eos,)
    tok.eos_token = None
    assert stop_token_ids(None, None, tok, None) == ()


def test_generation_pad_id_stays_inside_the_embedding():
    assert generation_pad_id(pad_token_id=3, stop_ids=(2,), num_embeddings=10) == 3  # in range: kept
    assert generation_pad_id(pad_token_id=10, stop_ids=(2,), num_embeddings=10) == 2  # [PAD] added: the EOS
    assert generation_pad_id(pad_token_id=10, stop_ids=(), num_embeddings=10) == 0


def test_sampling_config_is_complete_and_neutral():
    config = sampling_config(response_length=5, stop_ids=(2, 9), pad_id=2, temperature=0.7)
    assert (config.max_new_tokens, config.do_sample, config.temperature, config.top_k, config.top_p) == (
        5, True, 0.7, 0, 1.0)
    assert (config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams) == (1.0, 0, 1)
    assert (config.eos_token_id, config.pad_token_id) == ([2, 9], 2)
    assert sampling_config(5, (), 0, 1.0).eos_token_id is None


def test_temperature_zero_samples_near_greedily_and_negative_is_refused():
    assert effective_temperature(0.0) == MIN_TEMPERATURE == 1e-7
    assert effective_temperature(0.5) == 0.5
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        effective_temperature(-1)


def test_ignored_generation_fields_lists_what_would_change_sampling():
    config = GenerationConfig(repetition_penalty=1.05, suppress_tokens=[4, 5], temperature=0.7, top_p=0.8,
                              eos_token_id=2, pad_token_id=0)
    assert ignored_generation_fields(config) == {"repetition_penalty": 1.05, "suppress_tokens": [4, 5]}
    assert ignored_generation_fields(None) == {}


def test_a_checkpoint_generation_config_does_not_reach_the_samples():
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    only = tok.convert_tokens_to_ids("w3")
    # merged into generate, this would make every sampled token w3
    model.generation_config.suppress_tokens = [i for i in range(len(tok)) if i != only]
    queries = torch.tensor([[tok.convert_tokens_to_ids("w1"), tok.convert_tokens_to_ids("w2")]] * 4)
    torch.manual_seed(0)
    out = generate_responses(model, queries, torch.ones_like(queries, dtype=torch.bool),
                             sampling_config(6, (), 0, 1.0), 6, tok.pad_token_id, chunk_size=4)
    assert (out != only).any()
    assert model.generation_config.suppress_tokens[0] == 0  # restored after generation


def test_isolated_generation_config_restores_on_error():
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok)
    original = model.generation_config
    with pytest.raises(RuntimeError), isolated_generation_config(model):
        assert model.generation_config is not original
        raise RuntimeError("boom")
    assert model.generation_config is original


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


def test_the_trainer_warns_once_about_ignored_checkpoint_fields(make_trainer, make_models, tok, caplog):
    policy, ref, value, reward = make_models(tok)
    policy.generation_config.repetition_penalty = 1.05
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.trainer"):
        make_trainer(tok, model=policy, ref_model=ref, reward_model=reward, value_model=value)
    messages = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
    assert len(messages) == 1 and "repetition_penalty=1.05" in messages[0]
