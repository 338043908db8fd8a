"""The generation layer without vLLM: the vLLM config fields and their checks, the sampler-vs-trainer
mismatch and importance-weight math (by hand), the engine interface's helpers, and the policy's
weights as an engine loads them (full, merged LoRA, adapter folder; never a value adapter)."""

import json
import logging
import math
import os
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import HfArgumentParser

from trl_ppo_ext.generation import arguments as arguments_module
from trl_ppo_ext.generation import vllm_colocate
from trl_ppo_ext.generation.arguments import VLLMArguments
from trl_ppo_ext.generation.base import (
    EngineSamples,
    GenerationEngine,
    SamplingSettings,
    prompt_token_lists,
    request_seeds,
    sample_responses,
)
from trl_ppo_ext.generation.mismatch import (
    importance_sampling_stats,
    importance_sampling_weights,
    logp_difference_stats,
    sampling_correction,
)
from trl_ppo_ext.generation.weights import (
    adapter_sync_refusal,
    policy_weights,
    save_policy_adapter,
    write_checkpoint,
)
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

NAN = math.nan


# ---------------------------------------------------------------- VLLMArguments
def test_defaults_are_trl_grpos():
    args = VLLMArguments()
    assert (args.use_vllm, args.vllm_mode, args.vllm_gpu_memory_utilization, args.vllm_enable_sleep_mode) == (
        False, "colocate", 0.3, False)
    assert (args.vllm_tensor_parallel_size, args.vllm_max_model_length) == (1, None)
    assert (args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port, args.vllm_server_timeout) == (
        None, "0.0.0.0", 8000, 240.0)
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode) == (True, "sequence_mask")
    assert (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == (None, 3.0)


def test_arguments_parse_from_the_command_line():
    (args,) = HfArgumentParser(VLLMArguments).parse_args_into_dataclasses(
        ["--vllm_mode", "server", "--vllm_server_port", "8123", "--vllm_importance_sampling_mode", "token_truncate"])
    assert (args.vllm_mode, args.vllm_server_port, args.vllm_importance_sampling_mode) == (
        "server", 8123, "token_truncate")
    assert args.vllm_server_url == "http://0.0.0.0:8123"
    assert VLLMArguments(vllm_server_base_url="http://10.0.0.1:9000/").vllm_server_url == "http://10.0.0.1:9000"


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_memory_utilization_outside_the_unit_interval_is_refused(value):
    with pytest.raises(ValueError, match=rf"vllm_gpu_memory_utilization must be in \(0, 1\].*got {value}"):
        VLLMArguments(vllm_gpu_memory_utilization=value)


def test_memory_utilization_of_one_is_accepted():
    assert VLLMArguments(vllm_gpu_memory_utilization=1.0).vllm_gpu_memory_utilization == 1.0


@pytest.mark.parametrize("overrides, message", [
    ({"vllm_mode": "remote"}, r"vllm_mode must be one of \['colocate', 'server'\], got 'remote'"),
    ({"vllm_importance_sampling_mode": "token"}, r"vllm_importance_sampling_mode must be one of .*got 'token'"),
    ({"vllm_tensor_parallel_size": 0}, "vllm_tensor_parallel_size must be >= 1, got 0"),
    ({"vllm_server_timeout": 0}, "vllm_server_timeout must be > 0"),
    ({"vllm_server_port": 70000}, "vllm_server_port must be a TCP port"),
    ({"vllm_max_model_length": 0}, "vllm_max_model_length must be >= 1"),
    ({"vllm_importance_sampling_clip_min": 3.0}, r"clip_min \(3.0\) must be below .*clip_max \(3.0\)"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
     "truncates the ratios but both bounds are None"),
])
def test_bad_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        VLLMArguments(**overrides)


def test_mask_modes_may_have_no_bounds():
    args = VLLMArguments(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None)
    assert args.vllm_importance_sampling_clip_max is None


def test_the_deprecated_cap_sets_clip_max_with_a_warning():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        args = VLLMArguments(vllm_importance_sampling_cap=2.0)
    assert (args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_cap) == (2.0, None)


def test_use_vllm_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setattr(arguments_module, "vllm_installed", lambda: False)
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*pip install 'vllm>=0.22' requests"):
        VLLMArguments(use_vllm=True)
    VLLMArguments(use_vllm=False)  # the default path never needs it


# ---------------------------------------------------------------- mismatch math, by hand
# Two responses of T=3; row 0 counts all three tokens, row 1 its first two.
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -1.5, -9.0]])
ENGINE = torch.tensor([[-1.1, -1.7, -0.5], [-0.7, -1.5, -1.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_logp_difference_stats_by_hand():
    stats = logp_difference_stats(OLD, ENGINE, MASK)
    # |old - engine| on counted tokens: 0.1, 0.3, 0.0, 0.5, 0.0 (row 1's third, 8.0, is not counted)
    assert stats["sampling/sampling_logp_difference/mean"].item() == pytest.approx(0.9 / 5, abs=1e-6)
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(0.5, abs=1e-6)


def test_logp_difference_leaves_out_nan_and_empty_is_zero():
    engine = ENGINE.clone()
    engine[1, 0] = NAN  # the 0.5 is gone: 0.1, 0.3, 0.0, 0.0
    stats = logp_difference_stats(OLD, engine, MASK)
    assert stats["sampling/sampling_logp_difference/mean"].item() == pytest.approx(0.4 / 4, abs=1e-6)
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(0.3, abs=1e-6)
    empty = logp_difference_stats(OLD, ENGINE, torch.zeros_like(MASK))
    assert [v.item() for v in empty.values()] == [0.0, 0.0, 0.0]


def test_counted_tokens_without_an_engine_logprob_are_counted_so_a_hole_shows():
    engine = ENGINE.clone()
    engine[1, 0] = NAN  # counted: missing
    engine[1, 2] = NAN  # not counted (MASK is False there): not missing
    assert logp_difference_stats(OLD, engine, MASK)["sampling/missing_engine_logprobs"].item() == 1.0
    engine[0] = NAN  # a whole row without log-probs: 3 more; nothing left to take a difference of but 0.0
    stats = logp_difference_stats(OLD, engine, MASK)
    assert stats["sampling/missing_engine_logprobs"].item() == 4.0
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(0.0, abs=1e-6)
    assert logp_difference_stats(OLD, ENGINE, MASK)["sampling/missing_engine_logprobs"].item() == 0.0


def test_token_truncate_by_hand():
    w = importance_sampling_weights(OLD, ENGINE, MASK, "token_truncate", clip_min=None, clip_max=1.2)
    # log-ratios old - engine: row 0: 0.1, -0.3, 0; row 1: 0.5, 0, (uncounted -> 0)
    expected = torch.tensor([[math.exp(0.1), math.exp(-0.3), 1.0], [1.2, 1.0, 1.0]])  # exp(0.5)=1.649 -> 1.2
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)


def test_token_truncate_with_a_lower_bound():
    w = importance_sampling_weights(OLD, ENGINE, MASK, "token_truncate", clip_min=0.9, clip_max=None)
    # exp(-0.3) = 0.741 -> 0.9; exp(0.5) = 1.649 stays (no upper bound)
    expected = torch.tensor([[math.exp(0.1), 0.9, 1.0], [math.exp(0.5), 1.0, 1.0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)


def test_token_mask_by_hand():
    w = importance_sampling_weights(OLD, ENGINE, MASK, "token_mask", clip_min=0.8, clip_max=1.2)
    # exp(-0.3) = 0.741 < 0.8 -> 0; exp(0.5) = 1.649 > 1.2 -> 0; the rest inside
    expected = torch.tensor([[math.exp(0.1), 0.0, 1.0], [0.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)


def test_sequence_modes_by_hand():
    # per-sequence log-ratio sums: row 0: 0.1 - 0.3 + 0 = -0.2; row 1: 0.5 + 0 = 0.5
    truncated = importance_sampling_weights(OLD, ENGINE, MASK, "sequence_truncate", clip_max=1.5)
    torch.testing.assert_close(truncated, torch.tensor([[math.exp(-0.2)], [1.5]]), rtol=0, atol=1e-6)
    masked = importance_sampling_weights(OLD, ENGINE, MASK, "sequence_mask", clip_max=1.5)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(-0.2)], [0.0]]), rtol=0, atol=1e-6)
    kept = importance_sampling_weights(OLD, ENGINE, MASK, "sequence_mask", clip_max=None)
    torch.testing.assert_close(kept, torch.tensor([[math.exp(-0.2)], [math.exp(0.5)]]), rtol=0, atol=1e-6)


def test_sequence_weights_equal_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    old, engine = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    mask = torch.rand(4, 6, generator=g) > 0.3
    w = importance_sampling_weights(old, engine, mask, "sequence_truncate", clip_min=0.5, clip_max=2.0)
    for b in range(4):
        log_ratio = sum(float(old[b, t] - engine[b, t]) for t in range(6) if mask[b, t])
        assert w[b, 0].item() == pytest.approx(min(max(math.exp(log_ratio), 0.5), 2.0), rel=1e-5)


def test_nan_engine_logprobs_get_weight_one():
    engine = ENGINE.clone()
    engine[0, 1] = NAN
    w = importance_sampling_weights(OLD, engine, MASK, "token_truncate", clip_max=3.0)
    assert w[0, 1].item() == 1.0


def test_inputs_are_not_changed():
    old, engine, mask = OLD.clone(), ENGINE.clone(), MASK.clone()
    importance_sampling_weights(old, engine, mask, "sequence_mask")
    logp_difference_stats(old, engine, mask)
    assert torch.equal(old, OLD) and torch.equal(engine, ENGINE) and torch.equal(mask, MASK)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="got 'per_token'"):
        importance_sampling_weights(OLD, ENGINE, MASK, "per_token")


def test_importance_sampling_stats_by_hand():
    token = torch.tensor([[1.1, 0.0, 7.0], [1.2, 1.0, 9.0]])
    stats = importance_sampling_stats(token, MASK, "token_mask")
    # counted: 1.1, 0.0, 7.0, 1.2, 1.0 (row 1's third is not): min 0, mean 10.3 / 5, max 7
    assert [round(v.item(), 6) for v in stats.values()] == [0.0, pytest.approx(10.3 / 5), 7.0]
    sequence = torch.tensor([[0.8], [1.4]])
    stats = importance_sampling_stats(sequence, MASK, "sequence_truncate")
    assert [v.item() for v in stats.values()] == pytest.approx([0.8, 1.1, 1.4])
    assert list(stats) == ["sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                           "sampling/importance_sampling_ratio/max"]


def test_sampling_correction_gives_weights_and_stats_only_when_asked():
    weights, stats = sampling_correction(OLD, ENGINE, MASK, correction=False)
    assert weights is None
    assert list(stats) == ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                           "sampling/missing_engine_logprobs"]
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(0.5, abs=1e-6)
    weights, stats = sampling_correction(OLD, ENGINE, MASK, correction=True, mode="token_truncate", clip_max=1.2)
    # the by-hand weights of test_token_truncate_by_hand; stats over counted tokens:
    # e^0.1 = 1.10517, e^-0.3 = 0.74082, 1.0, 1.2, 1.0 -> min 0.74082, mean 5.04599 / 5, max 1.2
    torch.testing.assert_close(weights, torch.tensor([[math.exp(0.1), math.exp(-0.3), 1.0], [1.2, 1.0, 1.0]]),
                               rtol=0, atol=1e-6)
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(math.exp(-0.3), abs=1e-6)
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(
        (math.exp(0.1) + math.exp(-0.3) + 1.0 + 1.2 + 1.0) / 5, abs=1e-6)
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(1.2, abs=1e-6)
    assert stats["sampling/sampling_logp_difference/mean"].item() == pytest.approx(0.9 / 5, abs=1e-6)


# ---------------------------------------------------------------- the interface's helpers
def test_padded_cuts_pads_and_marks_missing_logprobs():
    samples = EngineSamples(completion_ids=[[5, 6, 3], [7], [8, 9, 10, 11]],
                            logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6, -0.7, -0.8]])
    responses, logprobs = samples.padded(response_length=3, pad_token_id=0)
    assert responses.tolist() == [[5, 6, 3], [7, 0, 0], [8, 9, 10]]
    expected = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, NAN, NAN], [-0.5, -0.6, -0.7]])
    torch.testing.assert_close(logprobs, expected, equal_nan=True, rtol=0, atol=0)
    no_logprobs = EngineSamples(completion_ids=[[5]], logprobs=None).padded(2, 0)[1]
    assert torch.isnan(no_logprobs).all()


def test_a_completion_the_engine_ended_for_length_is_a_truncated_response_of_its_sampled_tokens():
    from trl_ppo_ext.rollout import finalize_responses

    # T = 4, pad id 3 = the stop id (pad == EOS): row 0 stopped at a sampled 3; row 1 was ended for
    # length after 2 tokens (the engine's context ran out); row 2 ran to T; row 3 came back short with
    # no reason given and no stop id (an engine that says nothing is read the same way)
    samples = EngineSamples(completion_ids=[[5, 3], [5, 6], [5, 6, 7, 8], [9]],
                            logprobs=[[-0.1, -0.2], [-0.3, -0.4], [-0.5] * 4, [-0.6]],
                            finish_reasons=["stop", "length", "length", None])
    assert samples.sampled_mask(4).tolist() == [[True, True, False, False], [True, True, False, False],
                                                [True] * 4, [True, False, False, False]]
    assert samples.cut_short(4) == 1  # row 1 only: row 2 reached max_tokens, row 3 gave no reason
    responses, _ = samples.padded(response_length=4, pad_token_id=3)
    assert responses.tolist() == [[5, 3, 3, 3], [5, 6, 3, 3], [5, 6, 7, 8], [9, 3, 3, 3]]
    # from the ids alone the first pad of rows 1 and 3 reads as a sampled stop (the defect)
    _, blind, blind_stop = finalize_responses(responses, (3,), pad_token_id=3)
    assert blind.sum(1).tolist() == [2, 3, 4, 2] and blind_stop.tolist() == [True, True, False, True]
    # with what the engine sampled: rows 1 and 3 are truncated at 2 and 1 tokens
    _, mask, has_stop = finalize_responses(responses, (3,), pad_token_id=3, sampled=samples.sampled_mask(4))
    assert mask.tolist() == [[True, True, False, False], [True, True, False, False], [True] * 4,
                             [True, False, False, False]]
    assert has_stop.tolist() == [True, False, False, False]


def test_sample_responses_hands_on_what_the_engine_sampled_and_warns_once_about_length_stops(caplog):
    from trl_ppo_ext.generation import base

    class Fixed(GenerationEngine):
        def generate(self, prompts, settings, generator=None):
            # a prompt of 3 tokens in a context of 5: 2 new tokens, ended for length
            return EngineSamples([[7, 8] if len(p) == 3 else [7, 3] for p in prompts],
                                 [[-1.0, -2.0]] * len(prompts),
                                 ["length" if len(p) == 3 else "stop" for p in prompts])

        def _push_policy(self, policy, version):
            pass

    queries = torch.tensor([[6, 6, 6], [0, 6, 6]])
    settings = SamplingSettings(max_tokens=4, temperature=1.0, stop_token_ids=(3,))
    base._warned_cut_short.clear()
    with caplog.at_level("WARNING", logger="trl_ppo_ext.generation.base"):
        responses, logprobs, sampled = sample_responses(Fixed(), queries, queries != 0, settings, pad_token_id=3)
        sample_responses(Fixed(), queries, queries != 0, settings, pad_token_id=3)
    assert responses.tolist() == [[7, 8, 3, 3], [7, 3, 3, 3]]
    assert sampled.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert torch.isnan(logprobs[~sampled]).all() and not torch.isnan(logprobs[sampled]).any()
    assert caplog.text.count("ended 1 of 2 responses for length before response_length=4") == 1


@pytest.mark.parametrize("limit, lengths, refused", [
    (14, [4, 3, 4], False),  # 4 + 10 = 14 fits exactly
    (13, [4, 3, 4], True),
    (None, [4, 100], False),  # the model's own limit: the trainer checks max_position_embeddings
])
def test_an_engine_context_shorter_than_the_longest_prompt_plus_response_is_refused(limit, lengths, refused):
    from types import SimpleNamespace

    from trl_ppo_ext.generation.base import check_engine_context

    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=limit, response_length=10)
    if not refused:
        check_engine_context(args, lengths)
        return
    with pytest.raises(ValueError, match=r"vllm_max_model_length=13 cannot hold the longest prompt of `eval_dataset` "
                                         r"\(4 tokens\) plus response_length=10: 14 positions; 2 prompt\(s\) do not "
                                         r"fit.*at least 14.*longer than 3 tokens"):
        check_engine_context(args, lengths, "eval_dataset")
    # nothing to check without a colocated engine (a server has its own --max-model-len)
    check_engine_context(SimpleNamespace(**{**vars(args), "vllm_mode": "server"}), lengths)
    check_engine_context(SimpleNamespace(**{**vars(args), "use_vllm": False}), lengths)


def test_prompt_token_lists_keep_real_tokens_only():
    queries = torch.tensor([[0, 0, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[False, False, True, True], [False, True, True, True]])
    assert prompt_token_lists(queries, mask) == [[7, 8], [9, 10, 11]]


def test_request_seeds_follow_the_rng():
    a = request_seeds(5, torch.Generator().manual_seed(3))
    assert a == request_seeds(5, torch.Generator().manual_seed(3))
    assert a != request_seeds(5, torch.Generator().manual_seed(4))
    assert len(set(a)) == 5 and all(0 <= s < 2**31 - 1 for s in a)
    torch.manual_seed(11)  # None: the global RNG, which a checkpoint saves
    first = request_seeds(3)
    torch.manual_seed(11)
    assert request_seeds(3) == first


class _CountingEngine(GenerationEngine):
    def __init__(self):
        self.pushed = []

    def generate(self, prompts, settings, generator=None):
        raise NotImplementedError

    def _push_policy(self, policy, version):
        self.pushed.append(version)


def test_load_policy_pushes_only_when_the_version_changes():
    engine, model = _CountingEngine(), torch.nn.Linear(2, 2)
    assert [engine.load_policy(model, v) for v in (0, 0, 1, 1, 1, 2)] == [True, False, True, False, False, True]
    assert engine.pushed == [0, 1, 2] and engine.policy_version == 2


def test_sleep_mode_unavailable_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(vllm_colocate, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=vllm_colocate.__name__):
        assert vllm_colocate.resolve_sleep_mode(True, available=False) is False
        assert vllm_colocate.resolve_sleep_mode(True, available=False) is False
    assert sum("vllm_enable_sleep_mode=True is ignored" in r.message for r in caplog.records) == 1
    assert vllm_colocate.resolve_sleep_mode(True, available=True) is True
    assert vllm_colocate.resolve_sleep_mode(False, available=True) is False


# ---------------------------------------------------------------- the policy's weights
def _lora_policy(target_modules, seed=0, value_adapter=True):
    """A tiny Llama with a policy LoRA ("default", B made non-zero so it changes the weights) and
    a value LoRA ("value", also non-zero), as the shared actor-critic holds them."""
    tok = build_tiny_tokenizer()
    base = build_tiny_causal_lm(tok, seed=seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    if value_adapter:
        model.add_adapter("value", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_plain_policy_weights_are_its_parameters():
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    weights = dict(policy_weights(model))
    assert weights.keys() == dict(model.named_parameters()).keys()
    assert all(weights[n].data_ptr() == p.data_ptr() for n, p in model.named_parameters())  # no copies


def test_merged_weights_equal_peft_merge_and_never_the_value_adapter():
    model = _lora_policy(["q_proj", "v_proj", "lm_head"])
    before = {n: p.clone() for n, p in model.named_parameters()}
    merged = dict(policy_weights(model, "default"))
    # the reference: an independent copy merged by peft, with the value adapter deleted first
    reference = _lora_policy(["q_proj", "v_proj", "lm_head"])
    reference.delete_adapter("value")
    expected = reference.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base_q)  # the adapter is in
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged in place


def test_base_weights_of_a_peft_policy_have_no_adapter():
    model = _lora_policy(["q_proj"])
    base = dict(policy_weights(model, None))
    q = model.get_base_model().model.layers[1].self_attn.q_proj.base_layer.weight
    assert torch.equal(base["model.layers.1.self_attn.q_proj.weight"], q)
    assert not any("lora" in n for n in base)


def test_unknown_adapter_is_named():
    with pytest.raises(ValueError, match=r"adapter='policy' is not an adapter.*\['default', 'value'\]"):
        list(policy_weights(_lora_policy(["q_proj"]), "policy"))


def test_adapter_sync_refusals():
    assert adapter_sync_refusal(_lora_policy(["q_proj", "v_proj", "down_proj"]), "default") is None
    assert "['lm_head']" in adapter_sync_refusal(_lora_policy(["q_proj", "lm_head"]), "default")
    tok = build_tiny_tokenizer()
    dora = get_peft_model(build_tiny_causal_lm(tok), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert adapter_sync_refusal(dora, "default") == "the adapter uses DoRA"


def test_saved_adapter_holds_the_policy_adapter_only(tmp_path):
    model = _lora_policy(["q_proj", "v_proj"])
    folder = save_policy_adapter(model, "default", str(tmp_path / "adapter"))
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 4
    # 2 layers x 2 modules x (A, B); the value adapter's r=2 tensors are not there
    assert len(tensors) == 8 and all(t.shape[0] == 4 or t.shape[1] == 4 for t in tensors.values())
    q_b = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"], q_b)


def test_written_checkpoint_loads_back_as_the_base(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _lora_policy(["q_proj"])
    folder = write_checkpoint(model, str(tmp_path / "ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in policy_weights(model, None):
        assert torch.equal(dict(loaded.named_parameters())[name], tensor), name


def test_a_4bit_policy_goes_only_as_an_adapter_on_its_own_folder(tmp_path):
    """vLLM must quantize the base from its folder itself (the packed 4-bit weights cannot be
    written or pushed): the engine's choice of model source, without building an engine."""
    engine = object.__new__(vllm_colocate.VLLMColocateEngine)
    engine._workdir = str(tmp_path / "work")
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    model.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes 4-bit load
    for mode in ("full", "merged", "adapter"):  # no folder: nothing works
        engine.sync_mode = mode
        with pytest.raises(ValueError, match=rf"4-bit policy .* sync='{mode}', base folder=''"):
            engine._model_source(model)
    model.save_pretrained(tmp_path / "base")
    model.name_or_path = str(tmp_path / "base")
    engine.sync_mode = "full"
    with pytest.raises(ValueError, match="only as a LoRA adapter"):
        engine._model_source(model)
    engine.sync_mode = "adapter"
    assert engine._model_source(model) == str(tmp_path / "base")
    assert not (tmp_path / "work").exists()  # nothing written: vLLM reads the original


def test_a_lora_policy_goes_merged_unless_the_adapter_is_asked_for_or_the_base_is_4bit():
    engine = object.__new__(vllm_colocate.VLLMColocateEngine)
    engine.adapter = "default"
    attention, with_head = _lora_policy(["q_proj", "v_proj"]), _lora_policy(["q_proj", "lm_head"])
    assert engine._choose_sync_mode(attention, "auto") == "merged"  # measured faster on the CPU
    assert engine._choose_sync_mode(attention, "adapter") == "adapter"
    assert engine._choose_sync_mode(with_head, "auto") == "merged"
    with pytest.raises(ValueError, match=r"vLLM cannot take it: it adapts \['lm_head'\]"):
        engine._choose_sync_mode(with_head, "adapter")
    attention.is_loaded_in_4bit = True  # a 4-bit base: only the adapter can travel
    assert engine._choose_sync_mode(attention, "auto") == "adapter"
    engine.adapter = None
    assert engine._choose_sync_mode(build_tiny_causal_lm(build_tiny_tokenizer()), "auto") == "full"


def test_an_own_folder_is_used_only_while_its_shapes_match(tmp_path):
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    model.save_pretrained(tmp_path / "base")
    assert vllm_colocate.folder_matches(model.config, str(tmp_path / "base"))
    model.resize_token_embeddings(model.config.vocab_size + 1)  # a script added [PAD] after loading
    assert not vllm_colocate.folder_matches(model.config, str(tmp_path / "base"))
    engine = object.__new__(vllm_colocate.VLLMColocateEngine)
    engine._workdir, engine.sync_mode = str(tmp_path / "work"), "full"
    model.name_or_path = str(tmp_path / "base")
    assert engine._model_source(model) == str(tmp_path / "work" / "model")  # a fresh copy instead


def test_sampling_weights_are_the_configured_importance_weights_or_none():
    from trl_ppo_ext.generation.mismatch import sampling_weights

    old = torch.tensor([[0.0, -1.0], [-2.0, -0.5]])
    engine = torch.tensor([[-1.0, -1.0], [-2.0, -2.5]])
    mask = torch.tensor([[True, True], [True, False]])
    from types import SimpleNamespace

    args = SimpleNamespace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                           vllm_importance_sampling_clip_min=0.1, vllm_importance_sampling_clip_max=3.0)
    expected = importance_sampling_weights(old, engine, mask, "sequence_mask", 0.1, 3.0)
    assert torch.equal(sampling_weights(old, engine, mask, args), expected) and expected.shape == (2, 1)
    assert sampling_weights(old, None, mask, args) is None  # sampled by transformers' generate
    args.vllm_importance_sampling_correction = False
    assert sampling_weights(old, engine, mask, args) is None
