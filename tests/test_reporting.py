"""What people read: which updates are logged (logging_steps), the names report_to backends show
(TensorBoard's event files read back), and the console line."""

from pathlib import Path

import pytest

from trl_ppo_ext.reporting import (
    UpdateProgress,
    backend_keys,
    console_line,
    log_due,
    update_progress,
    with_backend_keys,
)


@pytest.mark.parametrize("every, first, expected", [
    (1, False, [1, 2, 3, 4, 5, 6, 7]),
    (3, False, [3, 6, 7]),  # multiples of 3, and the last update
    (3, True, [1, 3, 6, 7]),  # logging_first_step adds the first
    (10, False, [7]),  # more than the run: the last update only
])
def test_log_due_follows_logging_steps_and_always_logs_the_last(every, first, expected):
    assert [step for step in range(1, 8) if log_due(step, 7, every, first)] == expected


def test_backend_keys_follow_transformers_convention():
    logs = {"eval/true_reward": 1.0, "train/nonfinite_steps": 2.0, "objective/kl": 0.5, "episode": 8}
    assert backend_keys(logs) == {"eval_true_reward": 1.0, "nonfinite_steps": 2.0, "objective/kl": 0.5, "episode": 8}
    assert logs["eval/true_reward"] == 1.0  # the caller's dict is not changed
    assert backend_keys(None) is None


def test_tensorboard_shows_eval_and_train_without_a_doubled_prefix(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import TensorBoardCallback

    cls = with_backend_keys(TensorBoardCallback)
    assert issubclass(cls, TensorBoardCallback) and cls.__name__ == "TensorBoardCallback"
    args = TrainingArguments(output_dir=str(tmp_path / "tb"), report_to=[])  # events under output_dir/runs/
    state, control = TrainerState(), TrainerControl()
    callback = cls()
    callback.on_train_begin(args, state, control)
    state.global_step = 1
    callback.on_log(args, state, control, logs={"eval/true_reward": 1.5, "train/nonfinite_steps": 0.0,
                                                "objective/kl": 0.25})
    callback.on_train_end(args, state, control)
    (run,) = [p for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    events = EventAccumulator(str(run.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/true_reward", "train/nonfinite_steps", "train/objective/kl"} <= tags
    assert not any(t.startswith(("train/eval/", "train/train/")) for t in tags)
    assert events.Scalars("eval/true_reward")[0].value == 1.5


def test_console_line_leaves_out_what_a_run_does_not_log():
    line = console_line({"objective/scores": -0.5, "objective/kl": 0.125}, update=1, total=2, seconds=12.0)
    assert line == "update 1/2 | score -0.500 | kl 0.125 | 12.00 s/update"


def test_console_line_shows_the_per_token_entropy():
    """The entropy GRPO users read (3.8 per token), not the per-response sum (22.8 over 6 tokens)."""
    line = console_line({"objective/entropy": 22.8, "policy/entropy_avg": 3.8}, update=1, total=1, seconds=1.0)
    assert line == "update 1/1 | entropy 3.800 | 1.00 s/update"


def _state(zero=True):
    from transformers import TrainerState

    return TrainerState(max_steps=3, is_world_process_zero=zero)


def test_the_console_gets_no_metrics_dict_and_no_bar_off_a_terminal(capsys):
    """A log file (stderr not a terminal) gets the update lines alone: no tqdm redraws, no dict."""
    callback = UpdateProgress()
    callback.on_train_begin(None, _state(), None)  # pytest's stderr is no terminal
    assert callback.training_bar is None
    callback.on_step_end(None, _state(), None)
    callback.on_log(None, _state(), None, logs={"objective/kl": 0.5, "lr": 1e-5})
    callback.on_train_end(None, _state(), None)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_the_metrics_dict_is_printed_when_asked(capsys):
    callback = update_progress(type("Args", (), {"disable_tqdm": True, "print_metrics_dict": True})())
    assert (callback.show_bar, callback.print_dicts) == (False, True)
    callback.on_train_begin(None, _state(), None)
    callback.on_log(None, _state(), None, logs={"objective/kl": 0.5, "total_flos": 0.0})
    callback.on_log(None, _state(zero=False), None, logs={"objective/kl": 9.0})  # other processes print nothing
    assert capsys.readouterr().out == "{'objective/kl': 0.5}\n"


def test_console_line_shows_each_reward_and_the_held_out_figures():
    metrics = {"objective/scores": 1.0, "rewards/exact_answer/mean": 0.75, "rewards/exact_answer/std": 0.5,
               "eval/true_reward": 1.25}
    assert console_line(metrics, update=4, total=4, seconds=0.5) == (
        "update 4/4 | score 1.000 | exact_answer 0.750 | eval/true_reward 1.250 | 0.50 s/update")


def test_a_run_reported_to_tensorboard_shows_eval_and_train_without_doubled_prefixes(make_trainer, make_prompts,
                                                                                     tmp_path):
    """The trainer's own report_to: held-out metrics under eval/, the counters under train/ once,
    read back from TensorBoard's event files; log_history keeps the package's names."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    trainer = make_trainer(tok, ref_model=None, report_to=["tensorboard"], eval_dataset=make_prompts(tok, n=4),
                           eval_metrics={"short": lambda prompts, completions: [1.0] * len(completions)},
                           eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer.train()
    assert "eval/short" in trainer.state.log_history[0] and "train/nonfinite_steps" in trainer.state.log_history[0]
    (events_file,) = list(Path(trainer.args.output_dir).rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(events_file.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/short", "eval/kl", "train/nonfinite_steps", "train/objective/scores"} <= tags
    assert not any(t.startswith(("train/eval/", "train/train/")) for t in tags)
