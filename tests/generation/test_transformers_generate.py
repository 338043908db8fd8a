"""transformers' ``generate`` as an engine: stop ids, the pad id handed to ``generate``, the
complete generation config (nothing inherited from a checkpoint), and the engine's interface."""

import pytest
import torch
from transformers import GenerationConfig

from trl_ppo_ext.generation.base import MIN_TEMPERATURE, SamplingSettings, effective_temperature
from trl_ppo_ext.generation.transformers_generate import (
    TransformersEngine,
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


def test_the_engine_samples_what_generate_samples_and_moves_no_weights():
    """``TransformersEngine.sample`` is ``generate_responses`` with the settings' config: the same ids
    for the same RNG state; loading a policy is keeping the module (no weight moves)."""
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    queries = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = queries != 0
    settings = SamplingSettings(max_tokens=5, temperature=0.7, stop_token_ids=(tok.eos_token_id,))
    engine = TransformersEngine(model, chunk_size=1)
    assert engine.load_policy(model, 3) is False and engine.policy_version == 3
    torch.manual_seed(0)
    raw, logprobs, sampled = engine.sample(queries, mask, settings, tok.pad_token_id)
    torch.manual_seed(0)
    config = sampling_config(5, (tok.eos_token_id,), tok.pad_token_id, 0.7)
    expected = generate_responses(model, queries, mask, config, 5, tok.pad_token_id, chunk_size=1)
    assert torch.equal(raw, expected) and logprobs is None and sampled is None


def test_the_list_form_ends_each_completion_at_its_first_stop():
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    eos = tok.eos_token_id
    settings = SamplingSettings(max_tokens=8, temperature=1.0, stop_token_ids=(eos,))
    torch.manual_seed(1)
    samples = TransformersEngine(model, chunk_size=4).generate([[5, 6], [7]], settings)
    assert len(samples.completion_ids) == 2 and samples.logprobs is None
    for ids in samples.completion_ids:
        assert 1 <= len(ids) <= 8 and eos not in ids[:-1]  # nothing after a stop token
