"""benchmarks/throughput.py end to end on the tiny size: every phase it times is still where it
shadows it (the update's gradient clipping moved once and the benchmark broke without a test), and
it prints a ratio per contender. Figures are printed, never asserted."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tiny_run_times_every_phase_of_each_contender():
    contenders = ["shared", "shared_grpo", "shared_vlora_kl0", "shared_branch_mid_kl0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "tiny", "--repeats", "1",
         "--updates", "1", "--contenders", ",".join(contenders)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [line for line in proc.stdout.splitlines() if "grad clip" in line and "optimizer step" in line]
    assert len(phases) == len(contenders)  # backward, clipping and the step timed for each
    for name in contenders[1:]:  # against ours with separate models, or TRL's PPO trainer where it has one
        assert re.search(rf"throughput ratio {name}/(separate|upstream): \d", proc.stdout), name


def _throughput_module():
    spec = importlib.util.spec_from_file_location("throughput_under_test", ROOT / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_reward_counts_distinct_ids_and_replaces_the_reward_model():
    module = _throughput_module()
    # [5, 5, 7]: 2 distinct ids -> 0.02; [9]: 1 -> 0.01; []: 0
    assert module.cheap_reward(["p"] * 3, ["c"] * 3, [[5, 5, 7], [9], []]) == [0.02, 0.01, 0.0]
    assert module.reward_inputs() == {}  # --reward model: the caller passes the reward model
    module.REWARD = "python"
    assert module.reward_inputs() == {"reward_model": None, "reward_funcs": [module.cheap_reward]}


@pytest.mark.slow
def test_b16_in_micro_batches_of_4_at_t64_runs_with_a_python_reward_and_whole_batch_generation(needs_trl_grpo):
    """B=16 in micro-batches of 4, T=64, early stop, one generate call for the batch (``--rollout-chunk 16``),
    the Python reward: ours' grpo arm and TRL's GRPO, with the shape in the table's title."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--sizes", "tiny", "--repeats", "1",
         "--updates", "1", "--batch", "16", "--micro", "4", "--rollout-chunk", "16", "--response-length", "64",
         "--workload", "early_stop", "--reward", "python", "--contenders", "shared_grpo,trl_grpo"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "B=16 in micro-batches of 4, rollout chunks of 16, T=64, workload early_stop, reward python" in proc.stdout
    assert re.search(r"throughput ratio trl_grpo/separate: \d", proc.stdout)


def test_a_rollout_chunk_of_the_batch_samples_in_one_call_and_scores_in_micro_batches(tmp_path, monkeypatch):
    """``--rollout-chunk 16``: B=16 prompts in one ``generate`` call per update and scoring forwards of
    the micro-batch (4 rows, ``scoring_batch_size``'s default); ``--rollout-chunk 4`` samples in calls of 4."""
    from transformers import GenerationMixin

    from trl_ppo_ext.tiny import build_tiny_tokenizer, default_words, random_word_prompts

    module = _throughput_module()
    module.BATCH, module.MICRO, module.RESPONSE_LENGTH, module.REWARD = 16, 4, 8, "python"
    spec = dict(module.SIZES["tiny"], max_position_embeddings=64)
    tokenizer = build_tiny_tokenizer(words=default_words(spec.pop("words")))
    dataset = random_word_prompts(tokenizer, 32, 12, 12, seed=0)
    models = module.PristineModels(tokenizer, spec)
    rows_per_call = []
    original = GenerationMixin.generate

    def counting(self, *args, **kwargs):
        rows_per_call.append(kwargs["input_ids"].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counting)
    seen = {}
    for chunk in (4, 16):
        module.CHUNK = chunk
        rows_per_call.clear()
        trainer = module.build_trainer("shared", tokenizer, dataset, models,
                                       module.config_kwargs(str(tmp_path / str(chunk)), 1, 1), module.Clock())
        trainer.train()  # 2 updates
        seen[chunk] = (list(rows_per_call), trainer.args.scoring_chunk_size)
    assert seen == {4: ([4] * 8, 4), 16: ([16, 16], 4)}
