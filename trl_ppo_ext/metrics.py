"""What a PPO run logs, computed from a ``Rollout``, its ``PPOTargets`` and the update's loss
statistics; and the completions table it prints.

The functions take the cross-process ``gather`` as an argument (accelerate's
``Accelerator.gather``; an identity on one process), so every statistic is the same on every
process and each one can be checked on plain tensors without a trainer.

Shapes: ``B`` sequences, ``T`` response positions; ``response_mask`` ``(B, T)`` bool, True =
a response token that counts. Loss statistics are ``(n,)`` tensors, one value per
micro-batch (see ``PPOTrainer.ppo_update``).

Example (the per-reward columns of two rewards over three completions):

>>> import torch
>>> from trl_ppo_ext.metrics import reward_statistics
>>> values = torch.tensor([[1.0, 0.0], [3.0, 5.0], [5.0, 0.0]])
>>> applies = torch.tensor([[True, False], [True, True], [True, False]])
>>> reward_statistics(values, applies, ["accuracy", "format"], gather=lambda t: t)
{'accuracy/mean': 3.0, 'accuracy/std': 1.632993161855452, 'format/mean': 5.0, 'format/std': 0.0}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch

from . import functional as F
from .agents.tool_loop import ToolLoopStats
from .critic_epochs import critic_epoch_statistics
from .episodes import turn_statistics
from .estimators import group_reward_metrics
from .rollout import Rollout, SampledBatch, valid_token_ids

Gather = Callable[[torch.Tensor], torch.Tensor]

# The metrics a run without a critic does not log (see logged_update_metrics).
CRITIC_METRICS = ("loss/value_avg", "val/clipfrac_avg", "val/explained_variance")


def update_statistics(rollout: Rollout, targets, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This process's statistics of one update, as 0-dim tensors (TRL's metric names).

    ``targets`` is the update's ``advantages.PPOTargets``; ``stats`` the ``(n,)`` loss
    statistics (``pg_loss``, ``vf_loss``, ``entropy``, ``approxkl``, ``pg_clipfrac``,
    ``vf_clipfrac``, ``ratio_mean``, optionally ``grad_norm`` and the clip fraction by side,
    ``pg_clipfrac_lower`` / ``_upper`` / ``_dual``: logged as ``policy/clipfrac_lower_avg``
    (A < 0, ratio below ``1 - cliprange``), ``policy/clipfrac_upper_avg`` (A > 0, ratio above
    ``1 + cliprange_high``) and ``policy/clipfrac_dual_avg``, TRL GRPO's ``clip_ratio/low_mean``
    and ``clip_ratio/high_mean``). ``val/ratio_max`` is not here: it is a maximum, not a mean
    (see :func:`update_metrics`).

    Token statistics count the policy's own tokens (``rollout.loss_mask``; TRL GRPO's rule for
    ``completions/*_length`` in a tool episode): ``val/response_length`` is the model tokens per
    episode. An episode with turns (``rollout.action_mask`` set) adds ``rollout/turns_mean`` (policy
    turns per episode), ``rollout/env_token_frac`` (the share of response tokens the policy did not
    sample) and ``rollout/ends_on_env_frac`` (episodes whose last token is an environment's).
    With the explained-variance gate on (``targets.used_critic`` set): ``train/gate_used_critic``
    (1 the critic's advantages, 0 the baseline that does not read it) and
    ``train/gate_explained_variance`` (the explained variance the gate measured, every process's).
    With critic epochs (``num_critic_epochs``), their value-only steps' figures apart from the joint
    epochs' (``critic_epochs.critic_epoch_statistics``): ``loss/value_critic_epochs_avg``,
    ``val/clipfrac_critic_epochs_avg``, ``val/grad_norm_critic_epochs_avg``.
    """
    mask = rollout.loss_mask
    lengths = mask.sum(1).float()
    full_lengths = rollout.response_mask.sum(1)
    by_side = {f"policy/clipfrac_{side}_avg": stats[f"pg_clipfrac_{side}"].mean()
               for side in ("lower", "upper", "dual") if f"pg_clipfrac_{side}" in stats}
    per_token = {} if rollout.token_rewards is None else {
        "objective/token_rewards": rollout.token_rewards.masked_fill(~mask, 0.0).sum(1).mean()}
    gate = {}
    if getattr(targets, "used_critic", None) is not None:  # the explained-variance gate is on
        gate = {"train/gate_used_critic": targets.used_critic, "train/gate_explained_variance":
                targets.gate_explained_variance}  # both the same on every process (the EV is gathered)
    turns = {}
    if rollout.action_mask is not None:
        figures = turn_statistics(rollout.response_mask, rollout.action_mask)
        turns = {"rollout/turns_mean": figures["turns"].mean(),
                 "rollout/env_token_frac": figures["env_token_frac"].mean(),
                 "rollout/ends_on_env_frac": figures["ends_on_env"].mean()}
    return {
        **per_token,
        **turns,
        **gate,
        **critic_epoch_statistics(stats),
        "objective/scores": targets.scores.mean(),  # after missing_eos_penalty, as TRL; what GAE trains on
        "objective/scores_before_penalty": rollout.scores.mean(),
        "objective/non_score_reward": targets.non_score_rewards.sum(1).mean(),
        "objective/rlhf_reward": targets.rewards.sum(1).mean(),
        "objective/kl": targets.kl.sum(1).mean(),
        "objective/entropy": (-rollout.logprobs).masked_fill(~mask, 0.0).sum(1).mean(),
        "policy/approxkl_avg": stats["approxkl"].mean(),
        "policy/clipfrac_avg": stats["pg_clipfrac"].mean(),
        **by_side,
        "policy/entropy_avg": stats["entropy"].mean(),
        "loss/policy_avg": stats["pg_loss"].mean(),
        "loss/value_avg": stats["vf_loss"].mean(),
        "val/clipfrac_avg": stats["vf_clipfrac"].mean(),
        "val/explained_variance": F.masked_explained_variance(rollout.values, targets.returns, mask),
        "val/ratio": stats["ratio_mean"].mean(),
        "val/ratio_var": stats["ratio_mean"].var(unbiased=False),
        "val/advantage_mean": targets.raw_advantage_mean,
        "val/advantage_std": targets.raw_advantage_std,
        "val/response_length": lengths.mean(),
        "val/eos_rate": rollout.has_stop.float().mean(),
        # TRL's key: EOS tokens generated on one process. Each response is cut at its first stop
        # token, so that is the count of responses that stopped (averaged over processes below)
        "val/num_eos_tokens": rollout.has_stop.float().sum(),
        "val/truncation_rate": (~rollout.has_stop & (full_lengths == mask.shape[1])).float().mean(),
        "policy/grad_norm": stats["grad_norm"].mean() if "grad_norm" in stats else torch.tensor(float("nan")),
    }


@torch.no_grad()
def update_metrics(
    rollout: Rollout, targets, stats: dict[str, torch.Tensor], *, gather: Gather, device: torch.device | str,
) -> dict[str, float]:
    """:func:`update_statistics` averaged over every process (one ``gather`` for all of
    them), :func:`sequence_metrics` over every process's responses (a second one), and
    ``val/ratio_max``, the largest ratio of any process (a third)."""
    local = update_statistics(rollout, targets, stats)
    names = list(local)
    values = torch.stack([local[k].float().to(device) for k in names])
    means = gather(values[None]).reshape(-1, len(names)).mean(0)
    per_row = torch.stack([rollout.loss_mask.sum(1).float(), rollout.has_stop.float(), rollout.scores.float(),
                           (rollout.query_mask.sum(1) + rollout.response_mask.sum(1)).float()], dim=1)
    rows = gather(per_row.to(device))  # (world * B, 4): each process's rows in turn
    ratio_max = gather(stats["ratio_max"].max()[None].to(device)).max()
    metrics = {k: float(v) for k, v in zip(names, means.tolist())}
    metrics.update(sequence_metrics(rows[:, 0], rows[:, 1].bool(), rows[:, 2], rows[:, 3]))
    metrics["val/ratio_max"] = float(ratio_max)
    return metrics


@torch.no_grad()
def logged_update_metrics(
    rollout: Rollout, targets, stats: dict[str, torch.Tensor], args, *, gather: Gather, device: torch.device | str,
    reference: bool, reward_names: Sequence[str], counters, reward_logs: Callable[[], dict[str, float]],
    tool_stats: ToolLoopStats | None = None,
) -> dict[str, float]:
    """What one update logs, the same on every process: :func:`update_metrics`, less the critic's
    figures (:data:`CRITIC_METRICS`) without a critic (``args.trains_critic``) and the KL where no
    reference ran (``reference`` False, as GRPO logs ``kl`` only where ``beta != 0``); TRL GRPO's
    group figures with ``args.num_generations > 1``; :func:`rollout_reward_metrics` of ``reward_names``;
    ``rewards/unscored``; :func:`sampling_metrics`; what reward functions logged (``reward_logs()``,
    taken now); :func:`tool_loop_metrics` of ``tool_stats`` (None: a run without tools); and the run's
    ``counters`` (``run.state.RunCounters``). Every process makes the same collectives in this order."""
    metrics = update_metrics(rollout, targets, stats, gather=gather, device=device)
    if not args.trains_critic:  # a critic-free estimator: no value loss, values or returns to report
        for key in CRITIC_METRICS:
            metrics.pop(key, None)
    if not reference:
        metrics.pop("objective/kl", None)
    if args.num_generations > 1:
        metrics.update({k: float(v) for k, v in group_reward_metrics(rollout.scores, args.num_generations).items()})
    metrics.update(rollout_reward_metrics(rollout, reward_names, gather=gather))
    if rollout.reward_applies is not None and rollout.reward_applies.shape[1]:  # TRL's unscorable rows
        unscored = (~rollout.reward_applies.any(dim=1)).sum().reshape(1).float().to(device)
        metrics["rewards/unscored"] = float(gather(unscored).sum())
    metrics.update(sampling_metrics(
        rollout, gather=gather, device=device, correction=args.vllm_importance_sampling_correction,
        mode=args.vllm_importance_sampling_mode, clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
    ))
    metrics.update(reward_logs())
    if tool_stats is not None:
        metrics.update(tool_loop_metrics(tool_stats, gather=gather, device=device))
    metrics["policy/lag"] = float(counters.rollout_age)
    metrics["rollout/stale_discarded"] = float(counters.stale_discarded)
    metrics["train/nonfinite_steps"] = float(counters.nonfinite_steps)
    return metrics


def rollout_reward_metrics(rollout: Rollout, reward_names: Sequence[str], *, gather: Gather) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each reward of ``reward_names`` (the order of the
    rollout's ``reward_values`` columns; :func:`reward_statistics`); none for a rollout that keeps no
    per-reward columns (a ``score_rollout`` override)."""
    if rollout.reward_values is None:
        return {}
    return reward_statistics(rollout.reward_values, rollout.reward_applies, [f"rewards/{n}" for n in reward_names],
                             gather=gather)


def tool_loop_metrics(stats: ToolLoopStats, *, gather: Gather, device: torch.device | str) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` and ``tools/failure_frequency``, and ``tools/loop_exhausted_frac``,
    ``tools/timed_out_frac`` and ``rollout/turns_max``, of this process's tool-loop counts ``stats`` summed
    over every process (one gather; ``turns_max`` the largest). ``rollout/turns_mean`` is left out: the
    action mask's figure is logged already (:func:`update_statistics`)."""
    local = torch.tensor([[stats.rollouts, stats.calls, stats.failures, stats.turns, stats.exhausted,
                           stats.timed_out, stats.turns_max]], dtype=torch.float64, device=device)
    rows = gather(local).reshape(-1, 7)
    sums = rows.sum(0).tolist()
    total = ToolLoopStats(rollouts=int(sums[0]), calls=int(sums[1]), failures=int(sums[2]), turns=int(sums[3]),
                          exhausted=int(sums[4]), timed_out=int(sums[5]), turns_max=int(rows[:, 6].max()))
    metrics = total.metrics()
    metrics.pop("rollout/turns_mean")
    return metrics


def sequence_metrics(lengths: torch.Tensor, stopped: torch.Tensor, scores: torch.Tensor,
                     tokens: torch.Tensor) -> dict[str, float]:
    """Figures over every response of the update, the ones TRL GRPO logs beside the means.

    Args:
        lengths: ``(N,)`` the policy's tokens per response (``rollout.loss_mask``). stopped:
            ``(N,)`` bool, the response ended with a stop token. scores: ``(N,)`` the combined
            score before ``missing_eos_penalty``. tokens: ``(N,)`` prompt + response tokens.
    Returns:
        ``val/response_length_min`` / ``_max``; ``val/terminated_length_mean`` / ``_min`` /
        ``_max`` over the responses that stopped (0 when none did, as TRL); ``objective/scores_std``
        (unbiased, TRL GRPO's ``reward_std``, which ``estimators.group_reward_metrics`` logs under
        that name with groups; 0 for one response); ``val/num_tokens`` (their sum).

    Example:
        >>> out = sequence_metrics(torch.tensor([2., 3., 4., 3.]), torch.tensor([True, False, True, True]),
        ...                        torch.tensor([1., 1., 1., 1.]), torch.tensor([5., 6., 7., 8.]))
        >>> out["val/terminated_length_mean"], out["objective/scores_std"], out["val/num_tokens"]
        (3.0, 0.0, 26.0)
    """
    terminated = lengths[stopped] if bool(stopped.any()) else torch.zeros(1, dtype=lengths.dtype)
    out = {
        "val/response_length_min": float(lengths.min()),
        "val/response_length_max": float(lengths.max()),
        "val/terminated_length_mean": float(terminated.mean()),
        "val/terminated_length_min": float(terminated.min()),
        "val/terminated_length_max": float(terminated.max()),
        "objective/scores_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "val/num_tokens": float(tokens.sum()),
    }
    return out


@torch.no_grad()
def sampling_metrics(rollout: Rollout, *, gather: Gather, device: torch.device | str, correction: bool,
                     mode: str = "sequence_mask", clip_min: float | None = None,
                     clip_max: float | None = 3.0) -> dict[str, float]:
    """TRL GRPO's ``sampling/*`` keys for a rollout sampled by an engine (``rollout.engine_logprobs``
    set; ``{}`` otherwise): ``sampling/sampling_logp_difference/mean|max`` and, with ``correction``,
    ``sampling/importance_sampling_ratio/min|mean|max`` (``generation.mismatch.sampling_correction``
    on this process's rollout), combined over processes as mean of the means, max of the maxima,
    min of the minima (one gather); ``sampling/missing_engine_logprobs``, the response tokens
    without an engine log-prob, summed over the processes. Only the policy's own tokens
    (``rollout.loss_mask``) count: an environment token has no sampler log-prob."""
    from .generation.mismatch import MISSING_LOGPROBS_KEY, sampling_correction

    if rollout.engine_logprobs is None:
        return {}
    _, stats = sampling_correction(rollout.logprobs, rollout.engine_logprobs, rollout.loss_mask,
                                   correction=correction, mode=mode, clip_min=clip_min, clip_max=clip_max)
    names = list(stats)
    values = gather(torch.stack([stats[k].float().to(device) for k in names])[None]).reshape(-1, len(names))
    combined = {}
    for i, name in enumerate(names):
        column = values[:, i]
        combined[name] = float(column.max() if name.endswith("/max") else column.min() if name.endswith("/min")
                               else column.sum() if name == MISSING_LOGPROBS_KEY else column.mean())
    return combined


def reward_statistics(
    values: torch.Tensor, applies: torch.Tensor, names: Sequence[str], *, gather: Gather
) -> dict[str, float]:
    """``<name>/mean`` and ``<name>/std`` of each reward over the completions it applies to,
    on every process.

    Args:
        values: ``(B, F)`` each reward's value per completion (``Rollout.reward_values``).
        applies: ``(B, F)`` bool, whether reward ``f`` applies to completion ``b``.
        names: the ``F`` reward names.
        gather: concatenates a tensor's rows over the processes.

    Population std; NaN for a reward that applied to no completion.
    """
    values = gather(values).double()  # (B_all, F)
    applies = gather(applies)
    count = applies.sum(0)  # (F,); 0 / 0 below is the NaN of a reward that applied to none
    mean = torch.where(applies, values, 0.0).sum(0) / count
    std = (torch.where(applies, (values - mean).square(), 0.0).sum(0) / count).sqrt()
    metrics = {}
    for name, m, sd in zip(names, mean.tolist(), std.tolist()):  # one host copy for all rewards
        metrics[f"{name}/mean"], metrics[f"{name}/std"] = m, sd
    return metrics


def evaluation_row(rollout: Rollout, rewards: Sequence, kl_estimator: str) -> dict[str, torch.Tensor]:
    """The held-out statistics of one batch, ``(B,)`` per name: ``eval/rm_score``,
    ``eval/response_length``, ``eval/kl`` (``kl_estimator`` summed over each response; both over
    the policy's own tokens, ``rollout.loss_mask``) and,
    when the rollout keeps per-reward columns, ``eval/<reward name>`` for each reward (NaN
    where it does not apply; a lone reward model is ``eval/rm_score`` already).

    ``rewards``: the run's rewards in column order (objects with ``name`` and ``is_model``).
    """
    row = {
        "eval/rm_score": rollout.scores,
        "eval/response_length": rollout.loss_mask.sum(1),
        "eval/kl": F.kl_penalty(rollout.logprobs, rollout.ref_logprobs, kl_estimator)
        .masked_fill(~rollout.loss_mask, 0.0).sum(1),
    }
    for k, reward in enumerate(rewards if rollout.reward_values is not None else []):
        if len(rewards) > 1 or not reward.is_model:
            row[f"eval/{reward.name}"] = rollout.reward_values[:, k]
    return row


def heldout_metrics(rollouts: Iterable[Rollout], rewards: Sequence, kl_estimator: str, *, reference: bool,
                    eval_metrics: dict, tokenizer, gather: Gather) -> dict[str, float]:
    """The held-out figures of scored ``rollouts``: each column of :func:`evaluation_row` (``eval/kl``
    only where a reference ran, ``reference``) and of :func:`user_metric_rows`, its mean (NaN rows left
    out) over every rollout's rows ``gather``-ed over processes (each prompt once:
    ``gather_for_metrics``)."""
    columns = defaultdict(list)  # name -> per-rollout (b,) tensors, gathered over processes
    for rollout in rollouts:
        row = evaluation_row(rollout, rewards, kl_estimator)
        if not reference:  # no reference ran: no KL to report
            row.pop("eval/kl", None)
        row.update(user_metric_rows(eval_metrics, tokenizer, rollout))
        for key, values in row.items():
            columns[key].append(gather(values.double()))
    return {key: float(torch.cat(parts).nanmean()) for key, parts in columns.items()}


def user_metric_rows(eval_metrics: dict, tokenizer, rollout: Rollout) -> dict[str, torch.Tensor]:
    """``eval/<name>`` ``(B,)`` for each ``eval_metrics`` callable ``(prompts, completions) ->
    list[float]``: prompts decoded without special tokens; completions with them (whether one
    ended with EOS is often what a held-out metric checks)."""
    if not eval_metrics:
        return {}
    prompt_ids, completion_ids = valid_token_ids(rollout)
    prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    completions = tokenizer.batch_decode(completion_ids)
    return {f"eval/{name}": torch.tensor([float(v) for v in fn(prompts, completions)])
            for name, fn in eval_metrics.items()}


def show_completions(df, report_to: Sequence[str] = ()) -> None:
    """Print the first 5 rows of a completions table (a rich table when rich is installed,
    else plain text); log the whole table to wandb when ``"wandb"`` is in ``report_to`` and a
    wandb run is active."""
    head = df.iloc[:5]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(head.to_string())
    else:
        table = Table(show_lines=True)
        for column in head.columns:
            table.add_column(str(column))
        for row in head.itertuples(index=False):
            table.add_row(*[str(x) for x in row])
        Console().print(table)
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(dataframe=df)})


def last_user_message(prompt) -> str:
    """What a person reads as the question: the content of the last ``user`` message of a
    conversation (a list of ``{"role", "content"}`` dicts; content parts' texts joined), or the
    prompt itself when it is text.

    Example:
        >>> last_user_message([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
        '2+2?'
    """
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return str(prompt[-1].get("content", "")) if prompt and isinstance(prompt[-1], dict) else str(prompt)
    content = users[-1].get("content", "")
    if isinstance(content, list):  # multimodal parts: their texts
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def completion_rows(rollout: SampledBatch, tokenizer, reward_names: Sequence[str], *,
                    reward_values: torch.Tensor | None = None, reward_applies: torch.Tensor | None = None,
                    gather_object: Callable = lambda xs: xs):
    """A ``pandas.DataFrame`` of a training rollout's completions, one row each, as TRL GRPO's
    ``log_completions`` shows them: ``prompt`` (the last user message of the dataset's ``prompt``
    column, or the decoded prompt ids without special tokens), ``completion`` (decoded without
    special tokens) and one column per reward (NaN where it does not apply).

    Args:
        rollout: the rollout (its ``extras["prompt"]`` when the dataset had that column).
        reward_names: the rewards' names, in the order of ``reward_values``' columns.
        reward_values, reward_applies: ``(B, K)`` each reward's raw value and where it applies;
            default: ``rollout.reward_values`` / ``rollout.reward_applies`` (None: no reward columns).
        gather_object: accelerate's ``gather_object``, to take every process's rows.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> tok = build_tiny_tokenizer()  # w0=6, w1=7, <eos>=3
        >>> batch = SampledBatch(queries=torch.tensor([[6]]), query_mask=torch.tensor([[True]]),
        ...                      responses=torch.tensor([[7, 3]]), response_mask=torch.tensor([[True, True]]),
        ...                      has_stop=torch.tensor([True]),
        ...                      extras={"prompt": [[{"role": "user", "content": "w0"}]]})
        >>> completion_rows(batch, tok, ["accuracy"], reward_values=torch.tensor([[1.0]]),
        ...                 reward_applies=torch.tensor([[True]])).to_dict("records")
        [{'prompt': 'w0', 'completion': 'w1', 'accuracy': 1.0}]
    """
    import pandas as pd

    prompt_ids, completion_ids = valid_token_ids(rollout)
    given = rollout.extras.get("prompt")
    prompts = ([last_user_message(p) for p in given] if given is not None
               else tokenizer.batch_decode(prompt_ids, skip_special_tokens=True))
    table = {"prompt": gather_object(list(prompts)),
             "completion": gather_object(tokenizer.batch_decode(completion_ids, skip_special_tokens=True))}
    values = getattr(rollout, "reward_values", None) if reward_values is None else reward_values
    applies = getattr(rollout, "reward_applies", None) if reward_applies is None else reward_applies
    if values is not None:
        values, applies = values.float().cpu(), applies.bool().cpu()
        for k, name in enumerate(reward_names):
            column = [float(v) if a else None for v, a in zip(values[:, k].tolist(), applies[:, k].tolist())]
            table[name] = gather_object(column)
    return pd.DataFrame(table)


def print_completion_rows(df, *, step: int, num_to_print: int | None = None,
                          report_to: Sequence[str] = ()) -> None:
    """Print the first ``num_to_print`` rows of :func:`completion_rows` (None: all), one block per
    row that reads top to bottom (question, completion, each reward), under the update's number;
    the whole table goes to wandb (``"wandb"`` in ``report_to``, a run active) as ``completions``."""
    shown = df if num_to_print is None else df.iloc[:num_to_print]
    lines = [f"completions at update {step} ({len(shown)} of {len(df)}):"]
    rewards = [c for c in df.columns if c not in ("prompt", "completion")]
    for i, (prompt, completion, *values) in enumerate(shown.itertuples(index=False)):
        lines.append(f"[{i}] prompt: {prompt}")
        lines.append(f"    completion: {completion}")
        if rewards:
            lines.append("    " + " | ".join(f"{name} {_reward_text(v)}" for name, v in zip(rewards, values)))
    print("\n".join(lines))
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(dataframe=df.assign(step=step))})


def _reward_text(value) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"  # value != value: NaN


def completions_table(batches: Iterable, sample: Callable[[dict], SampledBatch],
                      score: Callable[[SampledBatch], torch.Tensor], tokenizer, logs, *,
                      gather: Callable, gather_object: Callable = lambda xs: xs, first_only: bool = False):
    """A ``pandas.DataFrame`` of completions: ``query``, ``model response``, ``score`` and every
    ``log_extra`` column the reward functions reported (None where a row has no value).

    Args:
        batches: collated prompt batches (the eval dataloader); ``first_only``: stop after one.
        sample: ``batch -> SampledBatch`` (the trainer samples near-greedily);
            score: ``SampledBatch -> (B,)`` scores.
        tokenizer: decodes the prompts (without special tokens) and the responses (with them).
        logs: the ``RewardLogs`` the reward functions log into while scoring.
        gather: accelerate's ``gather_for_metrics`` (``use_gather_object=True`` for lists), one
            rule for every column: rows that accelerate repeated to even out the last batch are
            dropped in each. gather_object: accelerate's, for the column names.

    Example:
        >>> from trl_ppo_ext.rewards.logs import RewardLogs
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> tok = build_tiny_tokenizer()  # w0=6, w1=7, <eos>=3
        >>> batch = SampledBatch(queries=torch.tensor([[6]]), query_mask=torch.tensor([[True]]),
        ...                      responses=torch.tensor([[7, 3]]), response_mask=torch.tensor([[True, True]]),
        ...                      has_stop=torch.tensor([True]))
        >>> df = completions_table([{}], lambda b: batch, lambda s: torch.tensor([0.5]), tok, RewardLogs(),
        ...                        gather=lambda xs, use_gather_object=False: xs)
        >>> df.to_dict("records")
        [{'query': 'w0', 'model response': 'w1 <eos>', 'score': 0.5}]
    """
    import pandas as pd

    table = defaultdict(list)
    for batch in batches:
        rollout = sample(batch)
        scores = score(rollout)
        texts = tokenizer.batch_decode(valid_token_ids(rollout)[1])
        queries = tokenizer.batch_decode(rollout.queries, skip_special_tokens=True)
        start = len(table["query"])
        table["query"].extend(gather(queries, use_gather_object=True))
        table["model response"].extend(gather(texts, use_gather_object=True))
        table["score"].extend(gather(scores).float().cpu().tolist())
        # the batch's log_extra columns (reward_logs); None where a column has no value
        extra = logs.take_columns(len(texts), reserved=("query", "model response", "score"))
        for column in sorted(set(gather_object(sorted(extra)))):
            table[column].extend([None] * (start - len(table[column])))
            table[column].extend(gather(list(extra.get(column, [None] * len(texts))), use_gather_object=True))
        if first_only:
            break
    rows = len(table["query"])
    return pd.DataFrame({k: v + [None] * (rows - len(v)) for k, v in table.items()})


def checked_eval_metrics(eval_metrics: dict | None) -> dict:
    """The trainer's ``eval_metrics`` (name -> ``(prompts, completions) -> list[float]``) as a
    new dict, each logged as ``eval/<name>`` beside the rewards' own ``eval/<reward name>`` (a name
    both use is refused where the rewards are built: ``rewards.building.check_eval_metric_names``).

    Raises:
        TypeError: an entry is not callable, naming it.

    Example:
        >>> sorted(checked_eval_metrics({"length": lambda prompts, completions: [0.0]}))
        ['length']
    """
    metrics = dict(eval_metrics or {})
    for name, fn in metrics.items():
        if not callable(fn):
            raise TypeError(f"eval_metrics[{name!r}] must be a callable (prompts, completions) -> list[float].")
    return metrics
