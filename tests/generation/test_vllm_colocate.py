"""The colocated vLLM engine on tiny fp32 Llamas (head_dim 64: the CPU attention backend refuses 16),
checked against transformers: the engine's log-probs of its sampled tokens equal a transformers
forward's, before and after the policy changes and is synced (full weights; a LoRA policy merged,
the default, here one that also adapts lm_head; a LoRA adapter pushed as a vLLM LoRA); the same
seeds give the same samples; responses stop at the stop ids; the run's RNG is left as it was. One
engine per layout for the module.

Runs where vLLM is installed (CI's vLLM environment, docs/vllm.md); skipped elsewhere."""

import copy
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_ppo_ext.functional import logprobs_from_logits
from trl_ppo_ext.generation.arguments import vllm_installed
from trl_ppo_ext.generation.base import SamplingSettings, sample_responses
from trl_ppo_ext.generation.mismatch import sampling_correction
from trl_ppo_ext.models.policy_value import lm_logits
from trl_ppo_ext.rollout import finalize_responses, response_logits, sequence_inputs
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (see docs/vllm.md)")

if vllm_installed():
    # The CPU backend's settings (docs/vllm.md): one OpenMP thread, no core binding.
    for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)

# Small engines: eager (no compile at start), a 64-token context, a 64 MiB KV cache.
ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
PROMPTS = [[6, 7, 8], [9, 10], [6, 7, 8, 11, 12, 13], [20], [6, 7, 8], [30, 31, 32, 33]]
EXPECTED_LOGP_TOLERANCE = 1e-3  # the bound; measured ~5e-7 in fp32


def _tiny_policy(seed=0):
    return build_tiny_causal_lm(build_tiny_tokenizer(), seed=seed, hidden_size=128, num_heads=2, num_layers=2,
                                max_position_embeddings=64)


def _lora_policy(target_modules, seed=0):
    """A policy LoRA ("default", B non-zero so it matters) and a value LoRA ("value", also non-zero,
    on the same modules: it must never reach the engine), as the shared actor-critic holds them."""
    model = get_peft_model(_tiny_policy(seed), LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    model.add_adapter("value", LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    _randomize_lora_b(model, seed + 100, scale=0.3)
    return model


def _randomize_lora_b(model, seed, scale):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)


def transformers_logprobs(model, prompts, completions, temperature):
    """log pi(a_t | s_t) of each completion's tokens from a transformers forward, row by row (no
    padding, nothing shared with the engine): logits at the position before each token / T."""
    rows = []
    with torch.no_grad():
        for prompt, ids in zip(prompts, completions):
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # the reference in float64
            rows.append(logp.gather(1, torch.tensor(ids)[:, None])[:, 0])
    return rows


def max_difference(rows, engine_logprobs):
    return max((row - torch.tensor(e)).abs().max().item() for row, e in zip(rows, engine_logprobs))


@pytest.fixture(scope="module")
def versions():
    return itertools.count(1)


@pytest.fixture(scope="module")
def plain():
    """``(engine, policy, rng_kept)``: an engine built from an in-memory fp32 policy."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    policy = _tiny_policy()
    rng = torch.get_rng_state()
    engine = VLLMColocateEngine(policy, engine_kwargs=ENGINE_KWARGS)
    rng_kept = torch.equal(rng, torch.get_rng_state())
    yield engine, policy, rng_kept
    engine.close()


@pytest.fixture
def plain_engine(plain, versions):
    """The plain engine holding its original policy (a new version), whatever earlier tests pushed."""
    engine, policy, _ = plain
    engine.load_policy(policy, next(versions))
    return engine, policy


def test_engine_is_fp32_and_building_it_keeps_the_rng(plain):
    engine, _, rng_kept = plain
    assert engine.llm.llm_engine.model_config.dtype == torch.float32
    assert engine.sync_mode == "full"
    assert rng_kept


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_a_transformers_forward(plain_engine, temperature):
    engine, policy = plain_engine
    settings = SamplingSettings(max_tokens=12, temperature=temperature, stop_token_ids=(3,))
    samples = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(0))
    reference = transformers_logprobs(policy, PROMPTS, samples.completion_ids, temperature)
    difference = max_difference(reference, samples.logprobs)
    print(f"max |log pi_engine - log pi_transformers| at T={temperature}: {difference:.2e}")
    assert difference < EXPECTED_LOGP_TOLERANCE


def test_top_k_changes_what_the_engine_samples_and_its_logprobs_are_the_filtered_distributions(plain_engine):
    """GRPO's ``top_k`` on the engine: ``top_k=1`` samples the argmax (log-prob 0: the one token
    left); ``top_k=2`` samples one of the two likeliest tokens, and the engine's log-prob is that of
    the distribution renormalised over them (computed here from a transformers forward, row by row),
    which is what the trainer's forwards score (generation.filters)."""
    engine, policy = plain_engine
    for k in (1, 2):
        settings = SamplingSettings(max_tokens=8, temperature=1.0, stop_token_ids=(3,), top_k=k)
        samples = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(0))
        with torch.no_grad():
            for prompt, ids, engine_logp in zip(PROMPTS, samples.completion_ids, samples.logprobs):
                logits = policy(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
                top = logits.topk(k, dim=-1)
                assert all(token in row for token, row in zip(ids, top.indices.tolist()))
                kept = top.values.log_softmax(-1)  # log p over the k kept tokens
                expected = [kept[t, row.index(token)].item() for t, (token, row) in
                            enumerate(zip(ids, top.indices.tolist()))]
                assert max(abs(a - b) for a, b in zip(expected, engine_logp)) < EXPECTED_LOGP_TOLERANCE
                if k == 1:
                    assert all(abs(x) < 1e-6 for x in engine_logp)


def test_a_changed_policy_is_sampled_after_the_sync(plain_engine, versions):
    engine, policy = plain_engine
    new_policy = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in new_policy.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    assert engine.load_policy(new_policy, next(versions)) is True
    settings = SamplingSettings(max_tokens=12, temperature=1.0)
    samples = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(0))
    new = transformers_logprobs(new_policy, PROMPTS, samples.completion_ids, 1.0)
    old = transformers_logprobs(policy, PROMPTS, samples.completion_ids, 1.0)
    assert max_difference(new, samples.logprobs) < EXPECTED_LOGP_TOLERANCE
    assert max_difference(old, samples.logprobs) > 0.05  # the engine no longer samples the old policy


def test_the_same_version_is_not_pushed_again(plain_engine):
    engine, policy = plain_engine
    assert engine.load_policy(policy, engine.policy_version) is False


def test_same_seeds_same_samples_and_the_rng_is_left_alone(plain_engine):
    engine, _ = plain_engine
    settings = SamplingSettings(max_tokens=12, temperature=1.0)
    rng = torch.get_rng_state()
    first = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(7))
    assert torch.equal(rng, torch.get_rng_state())  # an explicit generator: the global RNG is not drawn
    again = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(7))
    other = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(8))
    assert again.completion_ids == first.completion_ids and again.logprobs == first.logprobs
    assert other.completion_ids != first.completion_ids
    # rows 0 and 4 repeat a prompt: their own seeds make them independent samples
    assert first.completion_ids[0] != first.completion_ids[4]
    torch.manual_seed(3)  # no generator: the run's global RNG, as a resumed run restores it
    from_global = engine.generate(PROMPTS, settings)
    torch.manual_seed(3)
    assert engine.generate(PROMPTS, settings).completion_ids == from_global.completion_ids


def test_a_fresh_engine_samples_what_a_used_one_samples(plain_engine):
    """What resuming a run relies on: a new engine (the resumed run's) with the same weights and
    seeds samples what the old one (prefix cache warm, other policies pushed before) samples,
    and a request's sample does not depend on the rest of its batch."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    engine, policy = plain_engine
    settings = SamplingSettings(max_tokens=12, temperature=1.0, stop_token_ids=(3,))
    used = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(21))
    alone = engine.generate(PROMPTS[:1], settings, torch.Generator().manual_seed(21))
    assert alone.completion_ids[0] == used.completion_ids[0]  # the first seed drawn is the same
    fresh = VLLMColocateEngine(copy.deepcopy(policy), engine_kwargs=ENGINE_KWARGS)
    try:
        fresh.load_policy(policy, 0)
        again = fresh.generate(PROMPTS, settings, torch.Generator().manual_seed(21))
    finally:
        fresh.close()
    assert again.completion_ids == used.completion_ids
    assert max(abs(a - b) for x, y in zip(again.logprobs, used.logprobs) for a, b in zip(x, y)) < 1e-6


def test_near_greedy_temperatures_are_refused(plain_engine):
    """Below 0.01 vLLM's log-probs stop matching log_softmax(logits / T) (measured: 7e-6 at 0.01,
    19 at 0.001): the engine refuses rather than feed PPO a meaningless ratio."""
    engine, policy = plain_engine
    with pytest.raises(ValueError, match=r"temperature=0.001 is below 0.01"):
        engine.generate(PROMPTS, SamplingSettings(max_tokens=4, temperature=0.001))
    settings = SamplingSettings(max_tokens=8, temperature=0.01)
    samples = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(0))
    # a float64 forward: at T = 0.01 the fp32 logits alone would round by ~1e-5
    reference = transformers_logprobs(copy.deepcopy(policy).double(), PROMPTS, samples.completion_ids, 0.01)
    assert max_difference(reference, samples.logprobs) < EXPECTED_LOGP_TOLERANCE


def test_responses_end_at_the_first_stop_id(plain_engine):
    engine, _ = plain_engine
    stop_ids = tuple(range(6, 20))  # 14 of 46 ids stop: most responses end early
    settings = SamplingSettings(max_tokens=10, temperature=1.0, stop_token_ids=stop_ids)
    samples = engine.generate(PROMPTS * 3, settings, torch.Generator().manual_seed(0))
    stopped = 0
    for ids in samples.completion_ids:
        assert 1 <= len(ids) <= 10
        assert not any(i in stop_ids for i in ids[:-1])  # nothing after a stop id
        if len(ids) < 10:
            assert ids[-1] in stop_ids
        stopped += ids[-1] in stop_ids
    assert stopped >= 3
    # the rollout's own finalisation of the padded tensors keeps exactly those tokens
    responses, logprobs = samples.padded(response_length=10, pad_token_id=0)
    _, mask, has_stop = finalize_responses(responses, stop_ids, pad_token_id=0)
    assert mask.sum(1).tolist() == [len(ids) for ids in samples.completion_ids]
    assert has_stop.sum().item() == stopped
    assert not torch.isnan(logprobs[mask]).any() and torch.isnan(logprobs[~mask]).all()


def test_the_trainers_batched_forward_agrees_with_the_engine(plain_engine):
    """The path the trainer will take: a left-padded batch through the engine
    (``sample_responses``), finalised as generate's output is, scored by the rollout's own
    batched forward; the logged mismatch (TRL's keys) is below the issue's bound and the
    importance weights are ~1."""
    engine, policy = plain_engine
    queries = torch.tensor([[0, 0, 0, 6, 7, 8], [0, 0, 0, 0, 9, 10], [6, 7, 8, 11, 12, 13], [0, 0, 0, 0, 0, 20]])
    query_mask = queries != 0
    stop_ids = (3, 10, 11, 12)
    settings = SamplingSettings(max_tokens=8, temperature=0.7, stop_token_ids=stop_ids)
    raw, engine_logprobs, sampled = sample_responses(engine, queries, query_mask, settings, pad_token_id=0,
                                                     generator=torch.Generator().manual_seed(0))
    responses, mask, _ = finalize_responses(raw, stop_ids, pad_token_id=0, sampled=sampled)
    inputs = sequence_inputs(queries, query_mask, responses, mask)
    with torch.no_grad():
        logits = lm_logits(policy, *inputs, logits_to_keep=responses.shape[1] + 1)
    old = logprobs_from_logits(response_logits(logits, responses.shape[1], 0.7), responses.masked_fill(~mask, 0))
    weights, stats = sampling_correction(old, engine_logprobs, mask, correction=True, mode="token_truncate")
    print({k: round(v.item(), 8) for k, v in stats.items()})
    assert stats["sampling/sampling_logp_difference/max"].item() < EXPECTED_LOGP_TOLERANCE
    assert (weights[mask] - 1).abs().max().item() < 2e-3


def test_an_engine_context_shorter_than_prompt_plus_response_ends_rows_as_truncated_responses():
    """An engine of 9 positions asked for 10 tokens after 4-token prompts stops each request at 5
    new tokens (finish_reason "length"); those rows are truncated responses of exactly the tokens
    it sampled, even with the pad id equal to the stop id (where the first pad read as a sampled
    stop before)."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    policy = _tiny_policy(seed=3)
    engine = VLLMColocateEngine(policy, max_model_length=9, engine_kwargs=ENGINE_KWARGS)
    try:
        engine.load_policy(policy, 1)
        queries = torch.tensor([[6, 7, 8, 9], [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
        stop = 3  # <eos>, also the pad id here; few samples hit it among 46 ids in 5 draws
        settings = SamplingSettings(max_tokens=10, temperature=1.0, stop_token_ids=(stop,))
        samples = engine.generate(queries.tolist(), settings, torch.Generator().manual_seed(0))
        lengths = [len(ids) for ids in samples.completion_ids]
        print("tokens sampled per row:", lengths, samples.finish_reasons)
        for ids, reason in zip(samples.completion_ids, samples.finish_reasons):
            assert len(ids) <= 5  # 9 - 4
            assert reason == ("stop" if ids[-1] == stop else "length")
        cut = [reason == "length" for reason in samples.finish_reasons]
        assert sum(cut) >= 2
        raw, logprobs, sampled = sample_responses(engine, queries, queries != 0, settings, pad_token_id=stop,
                                                  generator=torch.Generator().manual_seed(0))
        responses, mask, has_stop = finalize_responses(raw, (stop,), pad_token_id=stop, sampled=sampled)
        assert mask.sum(1).tolist() == lengths  # exactly the sampled tokens, never the pad after them
        assert has_stop.tolist() == [not c for c in cut]  # a row cut for length is truncated, not finished
        assert not torch.isnan(logprobs[mask]).any()
    finally:
        engine.close()


# ---------------------------------------------------------------- LoRA policies
@pytest.fixture(scope="module")
def adapter_engine():
    """A LoRA policy on q/v (vLLM takes these), pushed as a vLLM LoRA adapter (asked for: the
    default is merged)."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    policy = _lora_policy(["q_proj", "v_proj"])
    engine = VLLMColocateEngine(policy, lora_sync="adapter", engine_kwargs=ENGINE_KWARGS)
    yield engine, policy
    engine.close()


@pytest.fixture(scope="module")
def merged_engine():
    """A LoRA policy that also adapts lm_head (vLLM would refuse it as a LoRA): pushed merged."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    policy = _lora_policy(["q_proj", "lm_head"])
    engine = VLLMColocateEngine(policy, engine_kwargs=ENGINE_KWARGS)
    yield engine, policy
    engine.close()


@pytest.mark.parametrize("layout, mode", [("adapter_engine", "adapter"), ("merged_engine", "merged")])
def test_lora_policy_is_sampled_as_transformers_and_peft_compute_it(request, versions, layout, mode):
    engine, policy = request.getfixturevalue(layout)
    assert engine.sync_mode == mode
    settings = SamplingSettings(max_tokens=12, temperature=0.7)
    for step in range(2):  # the policy as built, then after its adapter moved (a training update)
        if step == 1:
            _randomize_lora_b(policy, seed=7, scale=0.3)
        engine.load_policy(policy, next(versions))
        samples = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(step))
        with_policy_adapter = transformers_logprobs(policy, PROMPTS, samples.completion_ids, 0.7)
        assert max_difference(with_policy_adapter, samples.logprobs) < EXPECTED_LOGP_TOLERANCE
        with policy.disable_adapter():  # the base alone is far from what the engine sampled
            base = transformers_logprobs(policy, PROMPTS, samples.completion_ids, 0.7)
        assert max_difference(base, samples.logprobs) > 0.05
    # the value adapter, active, gives other log-probs: the engine did not take it
    policy.set_adapter("value")
    try:
        with_value_adapter = transformers_logprobs(policy, PROMPTS, samples.completion_ids, 0.7)
    finally:
        policy.set_adapter("default")
    assert max_difference(with_value_adapter, samples.logprobs) > 0.05


@pytest.mark.slow
def test_two_processes_each_run_their_own_engine(tmp_path):
    """torchrun, 2 CPU processes: one engine each through vLLM's external launcher; each samples
    with its own seeds, syncs a changed policy, and leaves the trainer's process group working."""
    script = Path(__file__).parents[1] / "scripts" / "vllm_two_process.py"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()), str(script),
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["launcher"] for r in ranks)
    assert ranks[0]["samples"] != ranks[1]["samples"]
    assert all(r["difference_after_sync"] < EXPECTED_LOGP_TOLERANCE for r in ranks)
    assert all(r["all_reduce"] == 3.0 for r in ranks)  # 1 + 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_model_vllm_cannot_run_is_refused_before_the_engine_is_built():
    """head_dim 16 (hidden 32, 2 heads): the CPU attention backend has no kernel for it (an eager
    engine would build and then fail at its first generation)."""
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    if torch.cuda.is_available():
        pytest.skip("the CPU backend's head_dim limit")
    small_heads = build_tiny_causal_lm(build_tiny_tokenizer(), hidden_size=32, num_heads=2,
                                       max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"vLLM's CPU attention has no kernel for this policy's head_dim=16 .*"
                                         r"use_vllm=False"):
        VLLMColocateEngine(small_heads, engine_kwargs=ENGINE_KWARGS)


def test_a_folder_vllm_cannot_load_is_named_and_leaves_no_files(tmp_path, monkeypatch):
    import tempfile

    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(RuntimeError, match=rf"vLLM could not load the policy from '{missing}'.*use_vllm=False"):
        VLLMColocateEngine(missing, engine_kwargs=ENGINE_KWARGS)
    assert list(tmp_path.iterdir()) == []  # its working folder went with it
