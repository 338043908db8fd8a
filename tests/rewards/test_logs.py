"""What reward functions report beside their rewards (TRL GRPO's ``log_metric`` / ``log_extra``):
kept apart per phase (training, held-out evaluation, completions table), averaged as GRPO
does, reduced over processes in one order. Expected values are computed in the tests from what
the reward functions saw."""

import math

import pytest
import torch

from trl_ppo_ext.rewards.logs import RewardLogs
from trl_ppo_ext.tiny import build_tiny_tokenizer


# ---------------------------------------------------------------- the bookkeeping
def test_metrics_are_the_mean_of_the_values_logged_since_the_last_take():
    logs = RewardLogs()
    log = logs.kwargs()["log_metric"]
    log("a", 1.0)
    log("a", torch.tensor([2.5]))  # a one-element tensor is one number
    log("b", True)
    assert logs.take_metrics() == {"a": 1.75, "b": 1.0}
    assert logs.take_metrics() == {}  # taken: forgotten


def test_two_processes_reduce_the_union_of_names_in_one_order():
    # process 0 logged a: 1, 3 and c: 10; process 1 logged b: 4 and a: 5
    rank0, rank1 = RewardLogs(), RewardLogs()
    for name, value in [("a", 1.0), ("c", 10.0), ("a", 3.0)]:
        rank0.log_metric(name, value)
    for name, value in [("b", 4.0), ("a", 5.0)]:
        rank1.log_metric(name, value)
    names = sorted(rank0._metrics) + sorted(rank1._metrics)  # what gather_object collects

    # rank 1's rows, as its take builds them below: a, b, c in sorted order, [0, 0] for c
    rows1 = torch.tensor([[5.0, 1], [4.0, 1], [0.0, 0]], dtype=torch.float64)
    out = rank0.take_metrics(lambda mine: names, lambda rows: rows + rows1)  # the all-reduce's sum
    assert out == {"a": (1 + 3 + 5) / 3, "b": 4.0, "c": 10.0}
    captured = {}
    rank1.take_metrics(lambda mine: names, lambda rows: captured.setdefault("rows", rows))
    assert torch.equal(captured["rows"], rows1)


def test_a_name_nobody_gave_a_value_is_nan_and_bad_values_are_refused():
    logs = RewardLogs()
    out = logs.take_metrics(lambda mine: ["ghost"], lambda rows: rows)
    assert list(out) == ["ghost"] and math.isnan(out["ghost"])
    logs.log_metric("wild", math.inf)
    logs.log_metric("wild", -math.inf)
    assert math.isnan(logs.take_metrics()["wild"])  # left to the guards, as a NaN, not an exception
    with pytest.raises(TypeError, match=r"log_metric\('x', \[1, 2\]\): the value must be one number"):
        logs.log_metric("x", [1, 2])
    with pytest.raises(ValueError, match="non-empty string"):
        logs.log_metric("", 1.0)
    with pytest.raises(TypeError, match="one per completion; got str"):
        logs.log_extra("col", "abc")


def test_columns_must_match_the_completions_and_not_shadow_the_tables_own():
    logs = RewardLogs()
    logs.log_extra("judge", ["ok", "bad"])
    logs.log_extra("judge", ["ok"])
    assert logs.take_columns(3) == {"judge": ["ok", "bad", "ok"]}
    logs.log_extra("judge", [1, 2])
    with pytest.raises(ValueError, match=r"\{'judge': 2\} got that many values for 3 completions"):
        logs.take_columns(3)
    logs.log_extra("score", [1.0])
    with pytest.raises(ValueError, match=r"\['score'\] are the completions table's own"):
        logs.take_columns(1, reserved=("query", "score"))


# ---------------------------------------------------------------- in the trainer
class Judge:
    """A GRPO-style reward function: reward = characters of the completion; it logs, per call, the
    mean and the max of its rewards (``log_metric``) and the rewards again as a column
    (``log_extra``). ``calls`` keeps each call's rewards."""

    __name__ = "judge"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, log_metric, log_extra, **kwargs):
        rewards = [float(len(c)) for c in completions]
        self.calls.append(rewards)
        log_metric("judge/mean_chars", sum(rewards) / len(rewards))
        log_metric("judge/mean_chars", max(rewards))  # two values per call: the log is their mean
        log_extra("judge_copy", rewards)
        return rewards


def test_training_updates_log_what_the_functions_reported_in_them(make_trainer, make_prompts):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    judge = Judge()
    trainer = make_trainer(tok, reward_model=None, reward_funcs=[judge], total_episodes=12,
                           eval_dataset=make_prompts(tok, n=4, seed=5), eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 3
    # the updates' calls and the one held-out evaluation (after update 2) alternate in `calls`:
    # training 1, training 2, eval, training 3
    train_calls = [judge.calls[0], judge.calls[1], judge.calls[3]]
    eval_call = judge.calls[2]
    assert len(judge.calls) == 4
    for entry, rewards in zip(logs, train_calls):
        expected = (sum(rewards) / len(rewards) + max(rewards)) / 2
        assert entry["judge/mean_chars"] == pytest.approx(expected, rel=1e-12)
        assert entry["rewards/judge/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    # the evaluation's reports are eval/<name>, on the update it ran in, never in the training value
    assert "eval/judge/mean_chars" not in logs[0] and "eval/judge/mean_chars" not in logs[2]
    assert logs[1]["eval/judge/mean_chars"] == pytest.approx(
        (sum(eval_call) / len(eval_call) + max(eval_call)) / 2, rel=1e-12)


def test_the_completions_table_gets_the_logged_columns_row_for_row(make_trainer, make_prompts):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    judge = Judge()
    trainer = make_trainer(tok, reward_model=None, reward_funcs=[judge],
                           eval_dataset=make_prompts(tok, n=6, seed=5), per_device_eval_batch_size=4)
    df = trainer.generate_completions()
    assert list(df.columns) == ["query", "model response", "score", "judge_copy"]
    # the column is the function's own rewards, and the score column is those rewards (one function)
    assert df["judge_copy"].tolist() == [r for call in judge.calls for r in call]
    assert df["judge_copy"].tolist() == pytest.approx(df["score"].tolist())
    # nothing reported for the table reaches the next training update's metrics
    assert trainer._take_reward_logs() == {}
