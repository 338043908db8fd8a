"""PPOTrainer(use_vllm=True) on the CPU: rollouts sampled by a colocated vLLM engine train the
separate-models layout and the shared LoRA actor-critic; at every update the sampler's log-probs
agree with the trainer's (``sampling/sampling_logp_difference/max`` < 1e-3, fp32) while the policy
moves; a run SIGKILLed mid-update and resumed ends with the unbroken run's weights.

Tiny fp32 Llamas with head_dim 64 (vLLM's CPU attention refuses 16). Runs where vLLM is installed
(CI's vLLM environment, docs/vllm.md); skipped elsewhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.generation.arguments import vllm_installed
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (see docs/vllm.md)")

if vllm_installed():
    for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)

SCRIPTS = Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from tiny_setup import (  # noqa: E402
    VLLM_SHAPES,
    VllmTrainer,
    prompt_dataset,
    tiny_config,
    tiny_models,
    two_turn_rollout,
)

LOGP_BOUND = 1e-3  # the bound for fp32


def _policy_params(trainer):
    """The policy's trainable weights (a value adapter, head or model left out)."""
    return {k: v.detach().clone() for k, v in trainer.unwrapped.policy.named_parameters()
            if v.requires_grad and ".value." not in k}


def _check_run(trainer, updates):
    before = _policy_params(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == updates
    diffs = [h["sampling/sampling_logp_difference/max"] for h in logs]
    assert all(d < LOGP_BOUND for d in diffs), diffs
    for h in logs:  # the correction's weights stay within the measured mismatch: exp(+-sum of diffs) ~ 1
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2, h
        assert h["sampling/sampling_logp_difference/mean"] <= h["sampling/sampling_logp_difference/max"]
    after = _policy_params(trainer)
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4, "the policy did not move"
    assert trainer.engine is None  # train() closed it
    return diffs


def test_separate_models_train_with_vllm(tmp_path):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok, **VLLM_SHAPES)
    args = tiny_config(tmp_path, use_vllm=True, total_episodes=12, temperature=1.0)
    trainer = VllmTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                          train_dataset=prompt_dataset(tok, n=12), value_model=value)
    assert trainer.engine is not None and trainer.engine.sync_mode == "full"
    diffs = _check_run(trainer, updates=3)
    print("separate layout, logp difference max per update:", diffs)


def test_shared_lora_actor_critic_trains_with_vllm(tmp_path):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    ac = SharedActorCritic(build_tiny_causal_lm(tok, seed=0, **VLLM_SHAPES),
                           lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    reward = build_tiny_scorer(tok, seed=2, **VLLM_SHAPES)
    args = tiny_config(tmp_path, use_vllm=True, total_episodes=12, temperature=1.0, learning_rate=1e-2)
    trainer = VllmTrainer(args=args, processing_class=tok, model=ac, ref_model=None, reward_model=reward,
                          train_dataset=prompt_dataset(tok, n=12))
    assert trainer.engine.sync_mode == "merged" and trainer.engine.adapter == ac.policy_adapter
    diffs = _check_run(trainer, updates=3)
    print("shared LoRA actor-critic, logp difference max per update:", diffs)


def test_episodes_of_a_rollout_func_sample_their_turns_on_the_engine(tmp_path):
    # generate_continuations samples each turn on the vLLM engine: the engine's log-probs on the
    # policy's tokens agree with the trainer's forward; the environment's tokens have none and count nowhere
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok, **VLLM_SHAPES)
    args = tiny_config(tmp_path, use_vllm=True, total_episodes=12, temperature=1.0)
    trainer = VllmTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                          train_dataset=prompt_dataset(tok, n=12), value_model=value,
                          rollout_func=two_turn_rollout(tok))
    samples = []
    engine_generate = trainer.engine.generate
    trainer.engine.generate = lambda *a, **k: samples.append(1) or engine_generate(*a, **k)
    _check_run(trainer, updates=3)
    assert len(samples) == 2 * 3  # two turns per rollout, every one on the engine
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert all(h["sampling/missing_engine_logprobs"] == 0 and 0 < h["rollout/env_token_frac"] < 1 for h in logs)


def test_an_engine_context_shorter_than_prompt_plus_response_is_refused_at_construction(tmp_path):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok, **VLLM_SHAPES)
    args = tiny_config(tmp_path, use_vllm=True, vllm_max_model_length=9, response_length=10)
    with pytest.raises(ValueError, match=r"vllm_max_model_length=9 cannot hold the longest prompt of `train_dataset` "
                                         r"\(4 tokens\) plus response_length=10: 14 positions; 8 prompt\(s\)"):
        VllmTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                    train_dataset=prompt_dataset(tok, n=8, min_len=4, max_len=4), value_model=value)


def test_responses_the_engine_ends_for_length_are_truncated_at_what_it_sampled(tmp_path, monkeypatch):
    """The issue's run: separate models, vllm_max_model_length=9, response_length=10, 4-token
    prompts, pad == EOS. With the construction check switched off, the engine stops every request
    at 5 new tokens; the rollout counts exactly those (not 10, not a pad read as a sampled EOS),
    and the update logs no engine log-prob missing from a counted token."""
    import trl_ppo_ext.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "check_engine_context", lambda *a, **k: None, raising=False)
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok, **VLLM_SHAPES)
    args = tiny_config(tmp_path, use_vllm=True, vllm_max_model_length=9, response_length=10, total_episodes=4,
                       temperature=1.0)
    trainer = VllmTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                          train_dataset=prompt_dataset(tok, n=4, min_len=4, max_len=4), value_model=value)
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    mask, responses = sample.response_mask, sample.responses
    eos = tok.eos_token_id
    # what the engine sampled: at most 9 - 4 = 5 tokens, ending at the first sampled EOS if any
    first_eos = [next((j for j in range(5) if responses[b, j] == eos), None) for b in range(4)]
    expected = [5 if j is None else j + 1 for j in first_eos]
    print("valid lengths:", mask.sum(1).tolist(), "expected:", expected)
    assert mask.sum(1).tolist() == expected
    assert not mask[:, 5:].any()
    assert sample.has_stop.tolist() == [j is not None for j in first_eos]
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert log["sampling/missing_engine_logprobs"] == 0.0
    assert log["sampling/sampling_logp_difference/max"] < LOGP_BOUND


def _run(out, mode):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, str(SCRIPTS / "ppo_resume.py"), str(out), mode, "--use_vllm"],
                          env=env, capture_output=True, text=True, timeout=900)


def test_killed_and_resumed_vllm_run_ends_equal_to_the_unbroken_run(tmp_path):
    """SIGKILL inside update 4, resume from the checkpoint of update 3: the engine is rebuilt, gets
    the policy pushed, and its request seeds come from the restored RNG, so the samples, and the
    final weights, are the unbroken run's."""
    straight = _run(tmp_path / "a", "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _run(tmp_path / "b", "killed")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run(tmp_path / "b", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "a" / "final_params_straight.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "final_params_resume.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    logs_a = json.loads((tmp_path / "a" / "logs_straight.json").read_text())
    logs_b = json.loads((tmp_path / "b" / "logs_resume.json").read_text())
    key = "sampling/sampling_logp_difference/max"
    assert [h[key] for h in logs_a][3:] == [h[key] for h in logs_b][-3:]


def test_the_verifiable_example_runs_with_use_vllm(tmp_path):
    """`examples/ppo_verifiable.py --use_vllm`, reduced: the demo model gets head_dim 32, the
    summary records use_vllm, and every update's sampler mismatch stays below the bound (the
    learning figures, with and without vLLM, are in the README)."""
    root = Path(__file__).parents[2]
    out = tmp_path / "verifiable"
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--num_values", "8", "--num_sft_pairs", "16", "--num_held_out_pairs", "8", "--max_ppo_pairs", "32",
            "--sft_steps", "5", "--total_episodes", "32", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "2", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
            "--num_train_pairs_evaluated", "8", "--output_dir", str(out), "--use_vllm",
            "--logging_steps", "1"]  # every update's mismatch (the example logs every 4)
    proc = subprocess.run([sys.executable, str(root / "examples" / "ppo_verifiable.py"), *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["ppo"]["use_vllm"] is True
    assert summary["settings"]["policy"]["hidden_size"] == 128
    history = json.loads((out / "log_history.json").read_text())
    diffs = [h["sampling/sampling_logp_difference/max"] for h in history if "objective/scores" in h]
    assert len(diffs) == 2 and all(d < LOGP_BOUND for d in diffs), diffs


def test_the_tools_example_runs_with_use_vllm(tmp_path):
    """`examples/ppo_tools.py --use_vllm`, reduced: the tool loop's turns (the tool call, then the
    answer after the tool's reply) sampled on the engine; the demo model gets head_dim 32, the run
    ends with finite metrics, the policy called the tool, and every update's sampler mismatch stays
    below the bound."""
    import math

    root = Path(__file__).parents[2]
    out = tmp_path / "tools"
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--num_sft_pairs", "64", "--sft_steps", "120", "--sft_call_fraction", "1.0", "--num_ppo_pairs", "64",
            "--num_held_out_pairs", "16", "--total_episodes", "64", "--logging_steps", "1", "--output_dir", str(out),
            "--use_vllm", "--disable_tqdm", "true"]  # a short warm-up on calls only, so that episodes call the tool
    proc = subprocess.run([sys.executable, str(root / "examples" / "ppo_tools.py"), *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["ppo"]["use_vllm"] is True
    assert summary["settings"]["policy"]["hidden_size"] == 128
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "objective/scores" in h]
    assert len(history) == 2
    for h in history:
        assert all(math.isfinite(v) for v in h.values() if isinstance(v, float)), h
        assert h["sampling/sampling_logp_difference/max"] < LOGP_BOUND, h
    assert sum(h["tools/call_frequency"] for h in history) > 0 and summary["call_rate_before"] > 0


def test_two_processes_each_sample_with_their_own_engine(tmp_path):
    """`accelerate launch --num_processes 2` (gloo, CPU): each process builds its own colocated engine
    (vLLM's external launcher, as TRL GRPO does), samples its shard of the prompts, and the trainer
    keeps the processes' weights equal; the gathered mismatch stays below the bound at every update."""
    import math
    import shutil

    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPTS / "vllm_ppo_two_process.py"),
           str(tmp_path)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), str(SCRIPTS)])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP kept the two processes' weights equal
    for r in ranks:
        assert len(r["logs"]) == 2  # 16 episodes, 8 per update over both processes
        diffs = [log["sampling/sampling_logp_difference/max"] for log in r["logs"]]
        assert all(math.isfinite(d) and d < LOGP_BOUND for d in diffs), diffs


def test_a_tool_episode_samples_on_the_engine_and_matches_the_transformers_path(tmp_path):
    # one episode per prompt: a scripted tool call (the tiny policy never writes one), the tool's reply as
    # environment tokens, then the real policy's answer sampled on the engine. The same script through
    # transformers' generate gives the same prompt ids, tool-call ids, suffix ids and masks up to the answer.
    from tiny_setup import TOOL_CALL as CALL
    from tiny_setup import multiply
    from tiny_setup import tool_config as _config
    from tiny_setup import tool_dataset as _data

    from trl_ppo_ext import PPOTrainer
    from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

    class FirstTurnScripted:
        def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
            tok = self.processing_class
            if all("<tool_response>" in tok.decode(p) for p in prefixes):
                return super().generate_continuations(prefixes, max_new_tokens, temperature)
            ids = [tok(CALL.format(name="multiply", args='{"a": 6, "b": 7}'), add_special_tokens=False).input_ids
                   for _ in prefixes]
            return ids, [[float("nan")] * len(row) for row in ids]  # scripted: no sampler log-prob

    tok = build_tiny_chat_tokenizer()
    shapes = {**VLLM_SHAPES, "max_position_embeddings": 1024}
    samples = {}
    for engine in ("vllm", "generate"):
        cls = type("Scripted", (FirstTurnScripted, VllmTrainer if engine == "vllm" else PPOTrainer), {})
        args = _config(tmp_path / engine, use_vllm=engine == "vllm", temperature=1.0, total_episodes=2,
                       vllm_max_model_length=1024 if engine == "vllm" else None)
        trainer = cls(model=build_tiny_causal_lm(tok, seed=0, **shapes), processing_class=tok,
                      reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                      train_dataset=_data(2), tools=[multiply])
        rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
        samples[engine] = rollout
        if engine == "vllm":
            trainer.close_engine()
    a, b = samples["vllm"], samples["generate"]
    assert torch.equal(a.queries, b.queries) and torch.equal(a.query_mask, b.query_mask)
    for r in (a, b):
        env = r.response_mask & ~r.action_mask
        assert env.any(1).all()
    # everything up to the end of the tool suffix is the same on both engines
    first_env_end = (a.response_mask & ~a.action_mask).int().cumsum(1).argmax(1)
    for row, end in enumerate(first_env_end.tolist()):
        assert torch.equal(a.responses[row, :end + 1], b.responses[row, :end + 1])
        assert torch.equal(a.action_mask[row, :end + 1], b.action_mask[row, :end + 1])
    # the engine's log-probs on its own tokens agree with the trainer's forward; the scripted ones are missing
    answer = a.action_mask & ~torch.isnan(a.engine_logprobs)
    assert answer.any() and (a.engine_logprobs[answer] - a.logprobs[answer]).abs().max() < LOGP_BOUND
