"""metrics.py without a trainer: update, reward and evaluation statistics on hand-made tensors."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_ppo_ext.advantages import PPOTargets
from trl_ppo_ext.metrics import (
    evaluation_row,
    reward_statistics,
    sampling_metrics,
    show_completions,
    update_metrics,
    update_statistics,
    user_metric_rows,
)
from trl_ppo_ext.rollout import Rollout


def identity(t):
    return t


def rollout(**changes):
    # row 0: 2 valid tokens, ended by a stop token; row 1: all 3 valid, no stop (truncated)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    fields = dict(
        queries=torch.ones(2, 1, dtype=torch.long), query_mask=torch.ones(2, 1, dtype=torch.bool),
        responses=torch.tensor([[7, 3, 0], [7, 8, 9]]), response_mask=mask,
        logprobs=torch.tensor([[-1.0, -2.0, -5.0], [-1.0, -1.0, -1.0]]), ref_logprobs=torch.zeros(2, 3),
        values=torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]), scores=torch.tensor([1.0, 3.0]),
        has_stop=torch.tensor([True, False]),
    )
    fields.update(changes)
    return Rollout(**fields)


def targets():
    return PPOTargets(
        scores=torch.tensor([1.0, 2.0]), kl=torch.tensor([[0.5, 0.5, 0.0], [1.0, 1.0, 1.0]]),
        non_score_rewards=torch.tensor([[-0.1, -0.1, 0.0], [-0.2, -0.2, -0.2]]),
        rewards=torch.tensor([[-0.1, 0.9, 0.0], [-0.2, -0.2, 1.8]]), advantages=torch.zeros(2, 3),
        returns=torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]),
        raw_advantage_mean=torch.tensor(0.25), raw_advantage_std=torch.tensor(0.75),
    )


STATS = {
    "pg_loss": torch.tensor([1.0, 3.0]), "vf_loss": torch.tensor([0.5, 1.5]), "entropy": torch.tensor([2.0, 4.0]),
    "approxkl": torch.tensor([0.1, 0.3]), "pg_clipfrac": torch.tensor([0.0, 0.5]),
    "vf_clipfrac": torch.tensor([0.25, 0.25]), "ratio_mean": torch.tensor([0.9, 1.1]),
    "ratio_max": torch.tensor([1.2, 1.4]), "grad_norm": torch.tensor([2.0, 6.0]),
}


def test_update_statistics_by_hand():
    m = {k: v.item() for k, v in update_statistics(rollout(), targets(), STATS).items()}
    assert m["objective/scores"] == 1.5 and m["objective/scores_before_penalty"] == 2.0
    assert m["objective/kl"] == pytest.approx((1.0 + 3.0) / 2)  # summed per response, mean over rows
    assert m["objective/non_score_reward"] == pytest.approx((-0.2 - 0.6) / 2)
    assert m["objective/rlhf_reward"] == pytest.approx((0.8 + 1.4) / 2)
    assert m["objective/entropy"] == pytest.approx((3.0 + 3.0) / 2)  # -logprob summed over valid tokens
    assert m["loss/policy_avg"] == 2.0 and m["loss/value_avg"] == 1.0 and m["policy/entropy_avg"] == 3.0
    assert m["val/ratio"] == pytest.approx(1.0) and m["val/ratio_var"] == pytest.approx(0.01)  # population var
    assert m["val/explained_variance"] == pytest.approx(1.0)  # values equal the returns
    assert m["val/response_length"] == 2.5 and m["val/eos_rate"] == 0.5
    assert m["val/num_eos_tokens"] == 1.0  # TRL's key: one of the two responses ended with its EOS
    assert m["val/truncation_rate"] == 0.5  # row 1: no stop and all 3 positions used
    assert m["val/advantage_mean"] == 0.25 and m["val/advantage_std"] == 0.75
    assert m["policy/grad_norm"] == 4.0


def test_update_metrics_averages_over_processes_and_takes_the_largest_ratio():
    # Two "processes": the second reports the same statistics doubled (a fake gather that appends it).
    def gather(t):
        return torch.cat([t, 2 * t])

    metrics = update_metrics(rollout(), targets(), STATS, gather=gather, device="cpu")
    assert metrics["loss/policy_avg"] == pytest.approx((2.0 + 4.0) / 2)
    assert metrics["val/ratio_max"] == pytest.approx(2.8)  # 2 * 1.4
    assert list(metrics)[-1] == "val/ratio_max"
    no_norm = update_metrics(rollout(), targets(), {k: v for k, v in STATS.items() if k != "grad_norm"},
                             gather=identity, device="cpu")
    assert math.isnan(no_norm["policy/grad_norm"])


def test_reward_statistics_counts_only_where_a_reward_applies():
    values = torch.tensor([[1.0, 9.0], [3.0, 9.0]])
    applies = torch.tensor([[True, False], [True, False]])
    stats = reward_statistics(values, applies, ["a", "b"], gather=identity)
    assert stats["a/mean"] == 2.0 and stats["a/std"] == 1.0  # population std of 1, 3
    assert math.isnan(stats["b/mean"]) and math.isnan(stats["b/std"])  # applied to none


def test_evaluation_row_sums_kl_and_names_each_reward_column():
    rewards = [SimpleNamespace(name="rm", is_model=True), SimpleNamespace(name="fmt", is_model=False)]
    r = rollout(reward_values=torch.tensor([[1.0, 0.5], [3.0, float("nan")]]),
                reward_applies=torch.tensor([[True, True], [True, False]]))
    row = evaluation_row(r, rewards, "k1")
    assert row["eval/kl"].tolist() == [-3.0, -3.0]  # k1 = logp - ref summed over valid tokens
    assert row["eval/response_length"].tolist() == [2, 3]
    assert row["eval/rm_score"].tolist() == [1.0, 3.0]
    assert row["eval/fmt"].tolist()[0] == 0.5 and math.isnan(row["eval/fmt"].tolist()[1])
    assert row["eval/rm"].tolist() == [1.0, 3.0]
    # a lone reward model is eval/rm_score already
    assert set(evaluation_row(r, rewards[:1], "k1")) == {"eval/rm_score", "eval/response_length", "eval/kl"}


def test_user_metric_rows_decode_prompts_and_completions(tok):
    words = tok.convert_tokens_to_ids(["w1", "w2", "w3"])
    r = rollout(queries=torch.tensor([[words[0]], [words[1]]]),
                responses=torch.tensor([[words[2], tok.eos_token_id, 0], [words[2]] * 3]))
    seen = {}

    def length(prompts, completions):
        seen["prompts"], seen["completions"] = prompts, completions
        return [len(c.split()) for c in completions]

    rows = user_metric_rows({"words": length}, tok, r)
    assert seen["prompts"] == ["w1", "w2"]
    assert seen["completions"] == ["w3 <eos>", "w3 w3 w3"]  # completions keep their special tokens
    assert rows["eval/words"].tolist() == [2.0, 3.0]
    assert user_metric_rows({}, tok, r) == {}


def test_show_completions_prints_the_first_five_rows(capsys):
    import pandas as pd

    df = pd.DataFrame({"query": [f"q{i}" for i in range(7)], "score": list(range(7))})
    show_completions(df, report_to=[])
    out = capsys.readouterr().out
    assert "q4" in out and "q5" not in out and "query" in out


def test_sampling_metrics_by_hand_over_two_processes():
    # this process: |old - engine| = 0.5, 0 (the third token is masked out) -> mean 0.25, max 0.5;
    # token_truncate weights exp(0.5) = 1.6487, exp(0) = 1 -> min 1, mean 1.3244, max 1.6487
    rollout = SimpleNamespace(logprobs=torch.tensor([[-1.0, -2.0, -3.0]]),
                              engine_logprobs=torch.tensor([[-1.5, -2.0, -9.0]]),
                              response_mask=torch.tensor([[True, True, False]]),
                              loss_mask=torch.tensor([[True, True, False]]))
    # the other process's difference mean, max, missing engine log-probs, then the weights' min, mean, max
    other = torch.tensor([[0.75, 0.9, 2.0, 0.2, 1.0, 2.5]])
    metrics = sampling_metrics(rollout, gather=lambda t: torch.cat([t, other]), device="cpu", correction=True,
                               mode="token_truncate", clip_max=3.0)
    e = math.exp(0.5)
    assert metrics == pytest.approx({
        "sampling/sampling_logp_difference/mean": (0.25 + 0.75) / 2,  # mean of the means
        "sampling/sampling_logp_difference/max": 0.9,  # max of the maxima
        "sampling/missing_engine_logprobs": 0.0 + 2.0,  # a count: summed (none here, two there)
        "sampling/importance_sampling_ratio/min": 0.2,  # min of the minima
        "sampling/importance_sampling_ratio/mean": ((e + 1) / 2 + 1.0) / 2,
        "sampling/importance_sampling_ratio/max": 2.5,
    }, abs=1e-6)
    without = sampling_metrics(rollout, gather=lambda t: t, device="cpu", correction=False)
    assert without == pytest.approx({"sampling/sampling_logp_difference/mean": 0.25,
                                     "sampling/sampling_logp_difference/max": 0.5,
                                     "sampling/missing_engine_logprobs": 0.0}, abs=1e-6)
    # a counted token without an engine log-prob is left out of the difference, and counted
    rollout.engine_logprobs = torch.tensor([[math.nan, -2.0, -9.0]])
    holed = sampling_metrics(rollout, gather=lambda t: t, device="cpu", correction=False)
    assert holed == pytest.approx({"sampling/sampling_logp_difference/mean": 0.0,
                                   "sampling/sampling_logp_difference/max": 0.0,
                                   "sampling/missing_engine_logprobs": 1.0}, abs=1e-6)
    rollout.engine_logprobs = None  # sampled by transformers: nothing to log
    assert sampling_metrics(rollout, gather=lambda t: t, device="cpu", correction=True) == {}


def test_completions_table_gathers_every_column_and_fills_missing_extras_with_none():
    from trl_ppo_ext.metrics import completions_table
    from trl_ppo_ext.rewards.logs import RewardLogs
    from trl_ppo_ext.rollout import SampledBatch
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # w0=6, w1=7, <eos>=3, <pad>=0
    logs = RewardLogs()

    def sample(batch):
        return SampledBatch(queries=torch.tensor([[0, batch["id"]]]), query_mask=torch.tensor([[False, True]]),
                            responses=torch.tensor([[7, 3, 0]]), response_mask=torch.tensor([[True, True, False]]),
                            has_stop=torch.tensor([True]))

    def score(rollout):
        if rollout.queries[0, 1] == 7:  # only the second batch logs an extra column
            logs.log_extra("verdict", ["ok"])
        return torch.tensor([float(rollout.queries[0, 1])])

    gather = lambda xs, use_gather_object=False: xs  # noqa: E731 -- one process
    df = completions_table([{"id": 6}, {"id": 7}], sample, score, tok, logs, gather=gather)
    assert df[["query", "model response", "score"]].to_dict("list") == {
        "query": ["w0", "w1"], "model response": ["w1 <eos>", "w1 <eos>"], "score": [6.0, 7.0]}
    assert df["verdict"].isna().tolist() == [True, False] and df["verdict"][1] == "ok"  # None: pandas' missing
    first = completions_table([{"id": 6}, {"id": 7}], sample, score, tok, logs, gather=gather, first_only=True)
    assert first["query"].tolist() == ["w0"]


def test_sampling_metrics_count_only_the_policys_tokens_of_an_episode():
    # a1 | o1 | b1: the environment token has no engine log-prob (NaN) and a trainer log-prob that would
    # dominate the difference; neither counts, and it is not a missing engine log-prob
    from trl_ppo_ext.rollout import Rollout

    act = torch.tensor([[True, False, True]])
    rollout = Rollout(queries=torch.ones(1, 1, dtype=torch.long), query_mask=torch.ones(1, 1, dtype=torch.bool),
                      responses=torch.ones(1, 3, dtype=torch.long), response_mask=torch.ones(1, 3, dtype=torch.bool),
                      action_mask=act, has_stop=torch.tensor([True]), logprobs=torch.tensor([[-1.0, -8.0, -2.0]]),
                      engine_logprobs=torch.tensor([[-1.25, float("nan"), -2.0]]), ref_logprobs=torch.zeros(1, 3),
                      values=torch.zeros(1, 3), scores=torch.zeros(1))
    metrics = sampling_metrics(rollout, gather=lambda t: t, device="cpu", correction=False)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(0.25)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0.125)
    assert metrics["sampling/missing_engine_logprobs"] == 0.0


def test_update_statistics_of_an_episode_count_model_tokens_and_turns():
    from trl_ppo_ext.advantages import compute_targets
    from trl_ppo_ext.metrics import update_statistics
    from trl_ppo_ext.rollout import Rollout

    # row 0: a a | o o | a (2 turns, 3 model tokens of 5); row 1: a a a | o o (1 turn, ends on the environment)
    act = torch.tensor([[True, True, False, False, True], [True, True, True, False, False]])
    rollout = Rollout(queries=torch.ones(2, 1, dtype=torch.long), query_mask=torch.ones(2, 1, dtype=torch.bool),
                      responses=torch.ones(2, 5, dtype=torch.long), response_mask=torch.ones(2, 5, dtype=torch.bool),
                      action_mask=act, has_stop=torch.tensor([True, False]),
                      logprobs=torch.full((2, 5), -1.0), ref_logprobs=torch.full((2, 5), -1.0),
                      values=torch.zeros(2, 5), scores=torch.tensor([1.0, 0.0]))
    targets = compute_targets(rollout, kl_coef=0.1, kl_estimator="k1", missing_eos_penalty=None,
                              whiten_rewards=False, whiten_advantages=False, gamma=1.0, lam=1.0)
    one = torch.ones(1)
    stats = {k: one for k in ("pg_loss", "vf_loss", "entropy", "approxkl", "pg_clipfrac", "vf_clipfrac",
                              "ratio_mean")}
    s = {k: float(v) for k, v in update_statistics(rollout, targets, stats).items()}
    assert s["val/response_length"] == 3.0  # model tokens, TRL's completions/*_length rule
    assert s["objective/entropy"] == 3.0  # -logprob summed over the model tokens
    assert s["val/truncation_rate"] == 0.5  # row 1 fills the budget without a stop
    assert s["rollout/turns_mean"] == 1.5 and s["rollout/env_token_frac"] == pytest.approx(0.4)  # 2 of 5 in each row
    assert s["rollout/ends_on_env_frac"] == 0.5


def test_update_metrics_add_the_figures_over_every_response_of_every_process():
    # process 1 is the rollout above; process 2 the same rows with the stop flags swapped and scores 5, 5
    other = rollout(has_stop=torch.tensor([False, True]), scores=torch.tensor([5.0, 5.0]))

    def gather(t):
        if t.ndim == 2 and t.shape[1] == 4:  # the per-response rows
            return torch.cat([t, update_rows(other)])
        return torch.cat([t, t])

    def update_rows(r):
        return torch.stack([r.loss_mask.sum(1).float(), r.has_stop.float(), r.scores.float(),
                            (r.query_mask.sum(1) + r.response_mask.sum(1)).float()], dim=1)

    m = update_metrics(rollout(), targets(), STATS, gather=gather, device="cpu")
    # lengths 2, 3 | 2, 3; stopped: rows 0 and 3 (lengths 2 and 3)
    assert (m["val/response_length_min"], m["val/response_length_max"]) == (2.0, 3.0)
    assert (m["val/terminated_length_mean"], m["val/terminated_length_min"], m["val/terminated_length_max"]) == (
        2.5, 2.0, 3.0)
    # scores 1, 3, 5, 5: mean 3.5, squared deviations 6.25 + 0.25 + 2.25 + 2.25 = 11, / 3
    assert m["objective/scores_std"] == pytest.approx(math.sqrt(11 / 3))
    assert m["val/num_tokens"] == (1 + 2) + (1 + 3) + (1 + 2) + (1 + 3)  # prompt + response tokens
    one = update_metrics(rollout(has_stop=torch.tensor([False, False])), targets(), STATS, gather=identity,
                         device="cpu")
    assert one["val/terminated_length_mean"] == 0.0  # none stopped: 0, as TRL


def test_completion_rows_read_as_the_question_the_completion_and_each_reward(capsys):
    from trl_ppo_ext.metrics import completion_rows, last_user_message, print_completion_rows
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # <eos>=3, w0=6, w1=7, w2=8
    conversation = [{"role": "system", "content": "answer in words"}, {"role": "user", "content": "w0 w1 ?"},
                    {"role": "assistant", "content": "w2"}, {"role": "user", "content": "and w2 ?"}]
    assert last_user_message(conversation) == "and w2 ?"
    assert last_user_message([{"role": "user", "content": [{"type": "text", "text": "look"}]}]) == "look"
    batch = rollout(extras={"prompt": [conversation, "w2 ?"]}, responses=torch.tensor([[7, 3, 0], [8, 8, 6]]),
                    reward_values=torch.tensor([[1.0, 0.5], [0.0, 9.0]]),
                    reward_applies=torch.tensor([[True, True], [True, False]]))
    df = completion_rows(batch, tok, ["accuracy", "format"], gather_object=lambda xs: xs + xs)  # two processes
    first, second = df.to_dict("records")[:2]
    assert first == {"prompt": "and w2 ?", "completion": "w1", "accuracy": 1.0, "format": 0.5}  # no EOS shown
    assert second.pop("format") != second.get("format") and second == {  # NaN: format does not apply
        "prompt": "w2 ?", "completion": "w2 w2 w0", "accuracy": 0.0}
    assert len(df) == 4
    print_completion_rows(df, step=3, num_to_print=2)
    assert capsys.readouterr().out.splitlines() == [
        "completions at update 3 (2 of 4):",
        "[0] prompt: and w2 ?", "    completion: w1", "    accuracy 1.000 | format 0.500",
        "[1] prompt: w2 ?", "    completion: w2 w2 w0", "    accuracy 0.000 | format -",
    ]
    no_column = completion_rows(rollout(queries=torch.tensor([[6], [7]])), tok, [])  # the decoded prompt ids
    assert no_column.to_dict("list") == {"prompt": ["w0", "w1"], "completion": ["w1", "w1 w2 w3"]}
