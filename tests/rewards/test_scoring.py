"""Reward functions beside (or instead of) a reward model: the weighted sum and None on
hand-computed values, GRPO's calling convention (dataset columns, conversational completions),
an RM and functions together, concurrency of async functions, and every error."""

import asyncio
import functools
import math

import pytest
import torch
from datasets import Dataset

from trl_ppo_ext.data import PromptCollator
from trl_ppo_ext.rewards.scoring import (
    Reward,
    build_rewards,
    call_functions,
    check_outputs,
    combine_scores,
    evaluate_rewards,
    nonfinite_rewards,
    reward_name,
    values_and_mask,
)
from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer


def ones(completions, **kwargs):
    return [1.0] * len(completions)


# ---------------------------------------------------------------- pure parts
def test_weighted_sum_over_the_rewards_that_apply():
    # rows: both apply; only the first; none
    values, applies = values_and_mask([[1.0, 2.0, None], [10.0, None, None]], device="cpu")
    assert applies.tolist() == [[True, True], [True, False], [False, False]]
    scores = combine_scores(values, applies, torch.tensor([0.5, 2.0]))
    # 0.5 * 1 + 2 * 10 = 20.5; 0.5 * 2 = 1.0; nothing applies -> 0
    assert scores.tolist() == [20.5, 1.0, 0.0]


def test_nan_from_a_function_reaches_the_score():
    values, applies = values_and_mask([[float("nan"), 1.0]], device="cpu")
    assert applies.all()
    scores = combine_scores(values, applies, torch.tensor([1.0]))
    assert math.isnan(scores[0]) and scores[1] == 1.0


def test_evaluate_rewards_weights_a_model_and_a_function_over_what_applies():
    tok = build_tiny_tokenizer()
    rm = build_tiny_scorer(tok)

    def half_or_none(completions, **kwargs):
        return [0.5 if c == "ok" else None for c in completions]

    rewards = build_rewards(rm, [half_or_none], [2.0, 4.0])
    asked = []

    def model_scores(reward):
        asked.append(reward.name)
        return torch.tensor([1.0, -1.0], dtype=torch.float64)  # any dtype: made float32

    scores, values, applies = evaluate_rewards(
        rewards, model_scores, lambda: {"completions": ["ok", "no"]}, batch_size=2, update=1, device="cpu")
    # row 0: 2 * 1.0 + 4 * 0.5 = 4.0; row 1: the function does not apply -> 2 * -1.0 = -2.0
    assert scores.tolist() == [4.0, -2.0] and asked == [rewards[0].name]  # the model, once; not the function
    assert values.dtype == torch.float32 and values[0].tolist() == [1.0, 0.5] and math.isnan(values[1, 1])
    assert applies.tolist() == [[True, True], [True, False]]


def test_evaluate_rewards_warns_when_no_reward_applies_and_builds_no_kwargs_without_functions(caplog):
    rewards = build_rewards(None, [lambda completions, **kw: [None, 3.0]], None)
    with caplog.at_level("WARNING", logger="trl_ppo_ext.rewards.scoring"):
        scores, _, applies = evaluate_rewards(rewards, None, lambda: {"completions": ["a", "b"]}, 2, 1, "cpu")
    assert scores.tolist() == [0.0, 3.0] and applies.tolist() == [[False], [True]]
    assert any("1 of 2 completions got no reward" in r.getMessage() for r in caplog.records)

    def no_kwargs():
        raise AssertionError("reward-function arguments built for a batch without reward functions")

    rm = build_tiny_scorer(build_tiny_tokenizer())
    scores, _, _ = evaluate_rewards(build_rewards(rm, None, None), lambda r: torch.ones(3), no_kwargs, 3, 1, "cpu")
    assert scores.tolist() == [1.0, 1.0, 1.0]


def test_names_and_weights():
    tok = build_tiny_tokenizer()
    rm = build_tiny_scorer(tok)
    rm.config._name_or_path = "org/my-rm"
    rewards = build_rewards(rm, [ones, functools.partial(ones), lambda completions, **kw: [0.0]], [1.0, 2.0, 3.0, 4.0])
    assert [r.name for r in rewards] == ["my-rm", "ones_1", "ones_2", "<lambda>"]
    assert [r.weight for r in rewards] == [1.0, 2.0, 3.0, 4.0]
    assert [r.is_model for r in rewards] == [True, False, False, False]
    assert reward_name(ones) == "ones"


@pytest.mark.parametrize("outputs, message", [
    ([1.0], r"'f' returned 1 values at update 7, expected 2"),
    ("ab", r"'f' returned 'a' \(str\) for completion 0 at update 7"),
    (3.0, r"'f' returned 3.0 \(float\) at update 7; it must return a list of 2 floats"),
    ([1.0, {"x": 1}], r"returned \{'x': 1\} \(dict\) for completion 1 at update 7"),
])
def test_bad_outputs_name_the_function_what_it_returned_and_the_update(outputs, message):
    with pytest.raises(ValueError, match=message):
        check_outputs("f", outputs, expected=2, update=7)


def test_outputs_accept_numbers_of_any_kind_and_none():
    import numpy as np

    assert check_outputs("f", [np.float32(0.5), 1, None, True], expected=4, update=1) == [0.5, 1.0, None, 1.0]
    assert check_outputs("f", torch.tensor([0.25, 2.0]), expected=2, update=1) == [0.25, 2.0]


def test_a_function_that_raises_is_named():
    def broken(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match=r"Reward function 'broken' raised KeyError at update 3: 'answer'"):
        call_functions([Reward("broken", broken, 1.0)], {"completions": ["a"]}, expected=1, update=3)


def test_async_functions_run_concurrently():
    """Each function waits for the other's signal: run one after the other, neither would finish."""
    a_started, b_started = _LazyEvent(), _LazyEvent()

    async def waiting_for_b(completions, **kwargs):
        await asyncio.wait_for(b_started.wait(), timeout=5)
        a_started.set()
        return [1.0] * len(completions)

    async def waiting_for_a(completions, **kwargs):
        b_started.set()
        await asyncio.wait_for(a_started.wait(), timeout=5)
        return [2.0] * len(completions)

    outputs = call_functions([Reward("a", waiting_for_b, 1.0), Reward("b", waiting_for_a, 1.0)],
                             {"completions": ["x", "y"]}, expected=2, update=1)
    assert outputs == [[1.0, 1.0], [2.0, 2.0]]


class _LazyEvent:
    """An asyncio.Event created on first use, inside the event loop that call_functions runs."""

    def __init__(self):
        self._event = None

    def _get(self):
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def set(self):
        self._get().set()

    def wait(self):
        return self._get().wait()


def test_errors_before_training(make_trainer, make_models, make_prompts, tok):
    policy, ref, value, reward = make_models(tok)
    common = dict(model=policy, ref_model=ref, value_model=value, train_dataset=make_prompts(tok))
    with pytest.raises(ValueError, match=r"reward_weights has 1 weights \[1.0\] but there are 2 rewards"):
        make_trainer(tok, reward_weights=[1.0], reward_model=reward, reward_funcs=[ones], **common)
    with pytest.raises(ValueError, match="No reward: pass `reward_model`"):
        make_trainer(tok, reward_model=None, **common)
    with pytest.raises(ValueError, match=r"reward_funcs\[0\]='accuracy': a string is a reward model's id or "
                                         r"folder \(GRPO's rule\), and it could not be loaded"):
        make_trainer(tok, reward_model=None, reward_funcs=["accuracy"], **common)  # no such model here
    with pytest.raises(ValueError, match=r"reward_funcs\[0\] is a int"):
        make_trainer(tok, reward_model=None, reward_funcs=[3], **common)


# ---------------------------------------------------------------- in the trainer
def _answer_dataset(tok, n=8):
    """Prompts with an `answer` column: the word the completion should start with."""
    w = tok.convert_tokens_to_ids
    rows = {"input_ids": [], "answer": [], "prompt": []}
    for i in range(n):
        words = [f"w{(i + k) % 10}" for k in range(3)]
        rows["input_ids"].append([w(x) for x in words])
        rows["prompt"].append(" ".join(words))
        rows["answer"].append(f"w{i % 10}")
    return Dataset.from_dict(rows)


def test_columns_reach_the_functions_and_an_rm_combines_with_them(make_trainer, tok):
    seen = []

    def starts_with_answer(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.append({"prompts": list(prompts), "answer": list(answer), "ids": completion_ids,
                     "completions": list(completions), "step": trainer_state.global_step})
        return [1.0 if c.split()[:1] == [a] else None for c, a in zip(completions, answer)]

    trainer = make_trainer(tok, reward_funcs=[starts_with_answer], train_dataset=_answer_dataset(tok),
                           total_episodes=8, reward_weights=[0.5, 2.0])
    data = _answer_dataset(tok)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    call = seen[-1]
    by_prompt = dict(zip(data["prompt"], data["answer"]))
    assert [by_prompt[p] for p in call["prompts"]] == call["answer"]  # columns travel with their row
    assert call["step"] == 0
    for ids, text, r, m in zip(call["ids"], call["completions"], rollout.responses, rollout.response_mask):
        assert ids == r[m].tolist() and text == tok.decode(ids, skip_special_tokens=True)
    # combined: 0.5 * RM + 2.0 * function, the function only where it applied
    rm, fn = rollout.reward_values[:, 0], rollout.reward_values[:, 1]
    applies = rollout.reward_applies[:, 1]
    expected = 0.5 * rm + torch.where(applies, 2.0 * fn, torch.zeros(()))
    torch.testing.assert_close(rollout.scores, expected, rtol=0, atol=0)
    trainer.train()
    log = [h for h in trainer.state.log_history if "objective/scores" in h][-1]
    assert {"rewards/starts_with_answer/mean", "rewards/starts_with_answer/std"} <= set(log)
    assert math.isfinite(log[f"rewards/{trainer.rewards[0].name}/mean"])


def test_reward_metrics_are_each_rewards_mean_and_std_over_where_it_applied(make_trainer, tok):
    from trl_ppo_ext.rollout import SampledBatch, scored_rollout

    trainer = make_trainer(tok, reward_funcs=[ones, ones])
    B, T = 4, 2
    ones_like = dict(dtype=torch.bool)
    sample = SampledBatch(queries=torch.ones(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, **ones_like),
                          responses=torch.ones(B, T, dtype=torch.long), response_mask=torch.ones(B, T, **ones_like),
                          has_stop=torch.zeros(B, dtype=torch.bool))
    nan = float("nan")
    values = torch.tensor([[1.0, 2.0, nan], [2.0, nan, nan], [3.0, 4.0, nan], [4.0, nan, nan]])
    applies = ~values.isnan()
    zeros = torch.zeros(B, T)
    rollout = scored_rollout(sample, logprobs=zeros, ref_logprobs=zeros, values=zeros, scores=torch.zeros(B),
                             reward_values=values, reward_applies=applies)
    metrics = trainer._reward_metrics(rollout)
    names = [r.name for r in trainer.rewards]
    # RM: mean(1, 2, 3, 4) = 2.5, population var = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    assert metrics[f"rewards/{names[0]}/mean"] == 2.5 and math.isclose(metrics[f"rewards/{names[0]}/std"],
                                                                        math.sqrt(1.25), rel_tol=1e-12)
    # the first function applied to rows 0 and 2: mean(2, 4) = 3, std 1; the second to none: NaN
    assert metrics[f"rewards/{names[1]}/mean"] == 3.0 and metrics[f"rewards/{names[1]}/std"] == 1.0
    assert math.isnan(metrics[f"rewards/{names[2]}/mean"]) and math.isnan(metrics[f"rewards/{names[2]}/std"])
    # a Rollout without per-reward columns (a score_rollout override may build one) logs none
    from dataclasses import replace

    assert trainer._reward_metrics(replace(rollout, reward_values=None, reward_applies=None)) == {}


def test_conversational_prompts_give_message_completions(make_trainer, tok):
    w = tok.convert_tokens_to_ids
    data = Dataset.from_dict({
        "input_ids": [[w("w1"), w("w2")]] * 4,
        "prompt": [[{"role": "user", "content": "w1 w2"}]] * 4,
    })
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append((prompts, completions))
        return [0.0] * len(completions)

    trainer = make_trainer(tok, reward_model=None, reward_funcs=record, train_dataset=data, total_episodes=4)
    trainer.train()
    prompts, completions = seen[0]
    assert prompts[0] == [{"role": "user", "content": "w1 w2"}]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)


def test_nan_from_a_reward_function_is_caught_by_the_nonfinite_guard(make_trainer):
    trainer = make_trainer(reward_model=None, reward_funcs=lambda completions, **kw: [float("nan")] * len(completions),
                           total_episodes=16, nonfinite_halt_after=2)
    trainer.train()
    assert trainer.state.halted_by == "nonfinite"


def test_nonfinite_rewards_names_the_function_its_values_and_rows():
    nan, inf = float("nan"), float("inf")
    values = torch.tensor([[1.0, 0.5], [nan, 0.5], [2.0, -inf], [nan, inf]])
    applies = torch.tensor([[True, True], [True, True], [True, True], [True, False]])  # row 3's inf: not applying
    assert nonfinite_rewards(values, applies, ["acc", "judge"]) == (
        "reward 'acc' returned nan for completions [1, 3]; reward 'judge' returned -inf for completion [2]")
    assert nonfinite_rewards(values.nan_to_num(), applies, ["acc", "judge"]) is None


def test_nan_rewards_name_the_function_the_rows_and_the_update_and_skip_the_whole_update(make_trainer, caplog):
    # issue 40 case 7: before, only "Update 1: skipped an optimizer step with a non-finite loss or gradient." and
    # a guard message naming no reward. The skip stays (documented): all 4 completions of the update are lost.
    def flaky(completions, **kwargs):
        return [float("nan") if i in (1, 2) else 1.0 for i in range(len(completions))]

    trainer = make_trainer(reward_model=None, reward_funcs=[flaky], total_episodes=4, nonfinite_halt_after=1)
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    with caplog.at_level("WARNING", logger="trl_ppo_ext.trainer"):
        trainer.train()
    said = "reward 'flaky' returned nan for completions [1, 2]"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"Update 1: {said} (of 4 completions on this process)") and "whole update's 4" in m
               for m in messages)
    assert any(m.startswith("Update 1: skipped an optimizer step") and said in m for m in messages)
    assert trainer.state.halted_by == "nonfinite" and said in trainer.state.stop_reason
    assert all(torch.equal(p, before[n]) for n, p in trainer.unwrapped.named_parameters())  # the skip


def test_a_reward_function_as_the_held_out_metric(make_trainer, make_prompts, tok):
    def length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    trainer = make_trainer(
        tok, reward_funcs=[length], eval_dataset=make_prompts(tok, n=4, seed=1), total_episodes=8,
        eval_strategy="steps", eval_steps=1, reward_hacking_metric="length", reward_weights=[1.0, 0.0],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert all(h["eval/length"] == h["eval/response_length"] for h in logs)  # same rows, same lengths


def test_prompt_collator_pads_ids_and_carries_columns():
    tok = build_tiny_tokenizer()
    batch = PromptCollator(tok)([{"input_ids": [5, 6, 7], "answer": "x"}, {"input_ids": [8], "answer": "y"}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [tok.pad_token_id] * 2 + [8]]  # left padding
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["answer"] == ["x", "y"]



def test_trl_ready_made_reward_functions_work_as_is(make_trainer, tok):
    rewards = pytest.importorskip("trl.rewards", reason="this TRL has no trl.rewards")
    w = tok.convert_tokens_to_ids
    data = Dataset.from_dict({"input_ids": [[w("w1"), w("w2")]] * 4,
                              "prompt": [[{"role": "user", "content": "w1 w2"}]] * 4})
    funcs = [rewards.think_format_reward, rewards.get_soft_overlong_punishment(6, 2),
             rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)]
    trainer = make_trainer(tok, reward_model=None, reward_funcs=funcs, train_dataset=data, total_episodes=4)
    trainer.train()
    log = [h for h in trainer.state.log_history if "objective/scores" in h][-1]
    assert log["rewards/think_format_reward/mean"] == 0.0  # no <think> tags from a random tiny model
    assert all(math.isfinite(log[f"rewards/{r.name}/mean"]) for r in trainer.rewards)


# ---------------------------------------------------------------- what the trainer hands the rewards
def test_reward_function_kwargs_take_the_prompt_column_and_answer_conversations_as_messages():
    from trl_ppo_ext.rewards.scoring import reward_function_kwargs
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # w0=6, w1=7, <eos>=3
    chat = [[{"role": "user", "content": "w0"}]]
    kwargs = reward_function_kwargs(tok, [[4, 6, 3, 5]], [[7, 3]], {"prompt": chat, "answer": ["w1"],
                                                                 "completion": ["dropped"]},
                                    trainer_state="state", logged={"log_metric": print})
    assert kwargs["prompts"] is chat and kwargs["completions"] == [[{"role": "assistant", "content": "w1"}]]
    assert kwargs["completion_ids"] == [[7, 3]] and kwargs["answer"] == ["w1"] and "completion" not in kwargs
    assert kwargs["trainer_state"] == "state" and kwargs["log_metric"] is print


def test_check_reward_heads_names_the_reward_funcs_entry_with_a_wide_head():
    from transformers import LlamaForSequenceClassification

    from trl_ppo_ext.rewards.scoring import check_reward_heads
    from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer, tiny_llama_config

    tok = build_tiny_tokenizer()
    good, wide = build_tiny_scorer(tok), LlamaForSequenceClassification(tiny_llama_config(tok, num_labels=3))
    check_reward_heads(build_rewards(good, [len], None), good)
    with pytest.raises(ValueError, match=r"`reward_funcs\[1\]`'s score head has 3 outputs"):
        check_reward_heads(build_rewards(good, [len, wide], None), good)
    with pytest.raises(ValueError, match="`reward_model`'s score head has 3 outputs"):
        check_reward_heads(build_rewards(wide, None, None), wide)


def test_rewards_per_token_builds_the_kwargs_once_and_gives_zeros_without_token_outputs():
    from trl_ppo_ext.rewards.scoring import rewards_per_token

    calls = []

    def kwargs():
        calls.append(1)
        return {"completions": ["a", "b"]}

    model = torch.nn.Linear(1, 1)
    rewards = [Reward("rm", model, 1.0), Reward("length", lambda completions, **kw: [1.0, 2.0], 0.5)]
    # the model reads the kwargs too (a reward model of another vocabulary reads the text)
    scores, values, applies, token = rewards_per_token(
        rewards, lambda reward, fk: torch.tensor([float(len(fk()["completions"]))] * 2), kwargs,
        torch.ones(2, 3, dtype=torch.bool), update=1)
    assert calls == [1]
    torch.testing.assert_close(scores, torch.tensor([2.0 + 0.5, 2.0 + 1.0]), rtol=0, atol=0)  # 2 + 0.5 * (1, 2)
    assert torch.equal(token, torch.zeros(2, 3))  # a function ran: zeros, not None
    only_model = rewards_per_token(rewards[:1], lambda reward, fk: torch.ones(2), kwargs,
                                   torch.ones(2, 3, dtype=torch.bool), update=1)
    assert only_model[3] is None and calls == [1]
