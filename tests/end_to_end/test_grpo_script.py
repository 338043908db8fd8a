"""A TRL GRPO user's script, with the import and the class changed and nothing else: a model given
by its folder (as a hub id would be), no tokenizer, a conversational ``prompt`` + ``answer``
dataset the trainer renders itself, two reward functions with ``reward_weights``, GRPO's
``max_completion_length``, ``max_steps`` and ``logging_steps``.

GRPO's ``num_generations`` (a ``PPOConfig`` field with GRPO's meaning, tests/test_config_estimators.py)
is left at its default, 1: this script keeps PPO's critic (``advantage_estimator="gae"``)."""

import pytest
import torch
from datasets import Dataset

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer, default_words


@pytest.fixture
def saved_model(tmp_path):
    tok = build_tiny_tokenizer(words=default_words(12))
    build_tiny_causal_lm(tok, seed=0).save_pretrained(tmp_path / "sft")
    tok.save_pretrained(tmp_path / "sft")
    return str(tmp_path / "sft")


def _dataset(n: int = 12) -> Dataset:
    words = default_words(12)
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"{words[i % 12]} {words[(i + 3) % 12]}"}] for i in range(n)],
        "answer": [words[(i + 3) % 12] for i in range(n)],
    })


def exact_answer(completions, answer, **kwargs):
    """GRPO-style: conversational completions are lists of messages."""
    return [float(c[0]["content"].strip().split(" ")[:1] == [a]) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [-0.1 * len(c[0]["content"].split()) for c in completions]


def test_a_grpo_script_runs_with_the_import_and_the_class_changed(tmp_path, saved_model):
    # before: from trl import GRPOConfig, GRPOTrainer
    from trl_ppo_ext import PPOConfig, PPOTrainer

    training_args = PPOConfig(  # GRPOConfig(...) before, same arguments
        output_dir=str(tmp_path / "out"), max_completion_length=8, max_steps=4, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, reward_weights=[1.0, 0.5], report_to="none",
        bf16=False, save_strategy="no", disable_tqdm=True,
    )
    trainer = PPOTrainer(  # GRPOTrainer(...) before, same arguments
        model=saved_model, reward_funcs=[exact_answer, short], args=training_args, train_dataset=_dataset(),
    )
    before = {k: v.detach().clone() for k, v in trainer.unwrapped.policy.named_parameters()}
    trainer.train()

    assert trainer.state.global_step == 4  # max_steps updates, not the 12 episodes' worth of epochs
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 4  # logging_steps=1
    assert {"rewards/exact_answer/mean", "rewards/short/mean", "val/num_eos_tokens"} <= set(logs[-1])
    assert trainer.args.response_length == 8
    moved = [k for k, v in trainer.unwrapped.policy.named_parameters() if not torch.equal(v, before[k])]
    assert moved  # the policy trained
    assert trainer.processing_class.name_or_path == saved_model  # the tokenizer came from the model's folder


def test_logging_steps_thins_the_log_and_keeps_the_last_update(tmp_path, saved_model):
    from trl_ppo_ext import PPOConfig, PPOTrainer

    args = PPOConfig(output_dir=str(tmp_path / "out"), max_completion_length=4, max_steps=5, logging_steps=2,
                     per_device_train_batch_size=4, report_to="none", bf16=False, save_strategy="no",
                     disable_tqdm=True)
    trainer = PPOTrainer(model=saved_model, reward_funcs=short, args=args, train_dataset=_dataset())
    trainer.train()
    steps = [h["step"] for h in trainer.state.log_history if "objective/scores" in h]
    assert steps == [2, 4, 5]


def test_a_grpo_script_logs_grpos_keys_samples_through_its_filters_and_prints_its_completions(
        tmp_path, saved_model, caplog, capsys):
    """The same script with GRPO's sampling and logging knobs: ``top_k=1`` samples the argmax, so
    every sampled token has log-probability 0 under the filtered distribution the update scores
    (the ratio is exactly 1 and the KL to the equally filtered reference 0); GRPO's metric names
    reach ``log_history`` and TensorBoard; ``log_completions`` prints the rollout's rows; the
    GRPO-style configuration gets its one warning about PPO's defaults."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trl_ppo_ext import PPOConfig, PPOTrainer

    args = PPOConfig(
        output_dir=str(tmp_path / "out"), max_completion_length=6, max_steps=2, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, report_to="tensorboard",
        bf16=False, save_strategy="no", disable_tqdm=True, top_k=1, log_completions=True, num_completions_to_print=2,
    )
    with caplog.at_level("WARNING", logger="trl_ppo_ext.trainer"):
        trainer = PPOTrainer(model=saved_model, reward_funcs=[exact_answer], args=args, train_dataset=_dataset())
    assert sum("GRPO" in r.getMessage() for r in caplog.records) == 1
    output = trainer.train()

    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    grpo_keys = {"reward", "reward_std", "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio", "entropy", "grad_norm", "learning_rate",
                 "loss", "num_tokens", "step_time", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl"}
    assert grpo_keys <= set(logs[-1]), grpo_keys - set(logs[-1])
    for log in logs:
        assert log["val/ratio"] == 1.0  # argmax sampled, argmax scored: log pi = 0 before and after the step
        assert log["kl"] == 0.0 and log["objective/kl"] == 0.0
        assert log["reward"] == log["objective/scores_before_penalty"]
    assert logs[1]["num_tokens"] > logs[0]["num_tokens"] > 0  # tokens so far, as GRPO counts them
    assert output.global_step == 2 and output.metrics["train_loss"] == output.training_loss

    (run,) = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"train/{key}" for key in ("reward", "entropy", "completions/mean_length", "num_tokens")} <= tags

    printed = capsys.readouterr().out
    for update in (1, 2):  # num_completions_to_print of the rollout's 4 rows, each with its reward
        block = printed.split(f"completions at update {update} (2 of 4):")[1].split("completions at update")[0]
        assert block.count("completion: ") == 2 and block.count("\n    exact_answer ") == 2, block
