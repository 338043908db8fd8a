"""Tiny local models, tokenizers and prompt datasets shared by the trainer tests."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_threads():
    # The CI machine has 2 cores; oversubscription makes tiny-model tests slow and noisy.
    torch.set_num_threads(2)
    yield


def prompt_dataset(tokenizer, n=16, min_len=2, max_len=5, seed=0):
    """``n`` random prompts of ordinary words, tokenized (ids only), lengths in [min_len, max_len]."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    first_word_id = tokenizer.convert_tokens_to_ids("w0")
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(first_word_id, len(tokenizer), (length,), generator=g).tolist()
        rows.append(ids)
    return Dataset.from_dict({"input_ids": rows})


def tiny_config(tmp_path, **overrides):
    from trl_ppo_ext import PPOConfig

    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        total_episodes=8,
        response_length=6,
        num_ppo_epochs=1,
        num_mini_batches=1,
        local_rollout_forward_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
        num_sample_generations=0,
        save_strategy="no",
        logging_steps=1,
        stop_token="eos",
        seed=0,
        bf16=False,
    )
    kwargs.update(overrides)
    return PPOConfig(**kwargs)


def tiny_models(tokenizer, **config_kwargs):
    """``(policy, ref_policy, value_model, reward_model)``; the reference starts equal to the policy."""
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer

    policy = build_tiny_causal_lm(tokenizer, seed=0, **config_kwargs)
    ref = build_tiny_causal_lm(tokenizer, seed=0, **config_kwargs)
    value = build_tiny_scorer(tokenizer, seed=1, **config_kwargs)
    reward = build_tiny_scorer(tokenizer, seed=2, **config_kwargs)
    return policy, ref, value, reward


def record_optimizer_steps(trainer):
    """Count real optimizer steps: returns a list that gets, at each logged update, the number
    of times the wrapped torch optimizer actually stepped during that update."""
    inner = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
    counts, current = [], [0]
    step = inner.step

    def counting_step(*args, **kwargs):
        current[0] += 1
        return step(*args, **kwargs)

    inner.step = counting_step
    log_update = trainer.log_update

    def log_and_count(metrics):
        counts.append(current[0])
        current[0] = 0
        return log_update(metrics)

    trainer.log_update = log_and_count
    return counts


EXPECTED_METRICS = [
    "objective/scores", "objective/non_score_reward", "objective/rlhf_reward", "objective/kl",
    "objective/entropy", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
    "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/explained_variance", "val/ratio",
    "val/ratio_max", "val/advantage_mean", "val/advantage_std", "val/response_length", "val/eos_rate",
    "val/truncation_rate", "lr", "eps",
]


def assert_metrics(trainer, n_updates):
    """Every update of ``trainer`` logged every expected metric, all finite."""
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == n_updates
    for entry in logs:
        missing = [k for k in EXPECTED_METRICS if k not in entry]
        assert not missing, f"missing metrics {missing}"
        bad = {k: entry[k] for k in EXPECTED_METRICS if not math.isfinite(entry[k])}
        assert not bad, f"non-finite metrics {bad}"
