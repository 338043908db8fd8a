"""Episodes with turns: TRL 1.16 GRPO's ``rollout_func`` output, checked and padded.

A user who owns generation (a multi-turn loop, an agent server) returns one dict per rollout
batch; `rollout_outputs` checks it and `pad_episodes` turns it into the (B, T) tensors a PPO
rollout needs, with the action mask of SPEC "Episodes with turns". Pure: no trainer, no model.

TRL 1.16's contract, as read from ``trl/trainer/grpo_trainer.py`` (G) in
``../shared/notes/agentic-ppo.md`` (section A3):

- ``rollout_func(prompts, trainer) -> dict`` (type G:130, doc G:258-265, argument G:321,
  experimental warning G:609-616), called with a deepcopy of the process's prompts, already
  repeated ``num_generations`` times, after the vLLM weights are synced (G:2200-2219).
- The dict holds, one row per incoming prompt: ``prompt_ids: list[list[int]]``,
  ``completion_ids: list[list[int]]``, ``logprobs: list[list[float]]`` (the sampler's, one per
  completion token; None -> NaN), and optionally ``env_mask: list[list[int]]`` of
  ``completion_ids``' lengths, 1 = a token the model sampled (popped into ``tool_mask`` when no
  ``tools`` are set, G:2268-2272).
- Every other key reaches the reward functions as a keyword, one value per row (G:2741-2748);
  in 1.16 that includes ``logprob_token_ids``, though it is documented otherwise.
- Downstream ``tool_mask`` is right-padded with 1 (G:2479-2483) and always multiplied by the
  completion mask (G:2497); here ``action_mask = response_mask & env_mask`` from the start.
- Tool/environment tokens carry a sampler log-prob of 0.0 in TRL's own loop (G:2156), not a
  real one; `pad_episodes` stores NaN at every position the policy did not sample.

Example:
    >>> out = rollout_outputs(
    ...     {"prompt_ids": [[1, 2], [3]], "completion_ids": [[5, 6, 7, 8], [9]],
    ...      "logprobs": [[-0.1, 0.0, 0.0, -0.2], [None]], "env_mask": [[1, 0, 0, 1], [1]],
    ...      "answer": ["4", "7"]},
    ...     num_prompts=2, response_length=5)
    >>> out.extra
    {'answer': ['4', '7']}
    >>> ids, response_mask, action_mask, sampler_logprobs = pad_episodes(out, pad_token_id=0)
    >>> ids
    tensor([[5, 6, 7, 8, 0],
            [9, 0, 0, 0, 0]])
    >>> action_mask
    tensor([[ True, False, False,  True, False],
            [ True, False, False, False, False]])
    >>> sampler_logprobs
    tensor([[-0.1000,     nan,     nan, -0.2000,     nan],
            [    nan,     nan,     nan,     nan,     nan]])
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

__all__ = ["REQUIRED_KEYS", "RolloutOutputs", "rollout_outputs", "pad_episodes"]

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")  # what TRL's rollout_func must return
_MASK_KEY = "env_mask"


@dataclass
class RolloutOutputs:
    """One checked ``rollout_func`` result; B rows, one per prompt, lists not yet padded."""

    prompt_ids: list[list[int]]  # (B, prompt length_b): the prompt tokens the completion continues
    completion_ids: list[list[int]]  # (B, L_b), 1 <= L_b <= response_length: every completion token
    logprobs: Optional[list[list[float]]]  # (B, L_b): the sampler's log p of each token, NaN = none; None = none at all
    env_mask: list[list[int]]  # (B, L_b): 1 = the policy sampled the token, 0 = it came from elsewhere
    extra: dict[str, list] = field(default_factory=dict)  # key -> B values: keywords for the reward functions
    response_length: int = 0  # T, the width `pad_episodes` pads to


def _rows(output: Mapping[str, Any], key: str, num_prompts: int) -> list:
    rows = output[key]
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__"):
        raise ValueError(f"rollout_func's {key!r} must be a list with one entry per prompt, got {type(rows).__name__}")
    if len(rows) != num_prompts:
        raise ValueError(
            f"rollout_func's {key!r} has {len(rows)} rows for {num_prompts} prompts: return one row per prompt "
            "(the prompts it receives are already repeated num_generations times)"
        )
    return list(rows)


def _token_ids(key: str, row: int, tokens) -> list[int]:
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError as error:
        raise ValueError(f"rollout_func's {key!r}[{row}] must be a list of int token ids: {error}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"rollout_func's {key!r}[{row}] holds a negative token id: {min(ids)}")
    return ids


def _logprob_row(row: int, values, length: int) -> list[float]:
    if values is None:
        return [math.nan] * length
    if len(values) != length:
        raise ValueError(
            f"rollout_func's 'logprobs'[{row}] has {len(values)} values but 'completion_ids'[{row}] has "
            f"{length} tokens: give one log-prob per completion token (None where the sampler has none)"
        )
    return [math.nan if v is None else float(v) for v in values]


def _env_mask_row(row: int, values, length: int) -> list[int]:
    if len(values) != length:
        raise ValueError(
            f"rollout_func's 'env_mask'[{row}] has {len(values)} values but 'completion_ids'[{row}] has "
            f"{length} tokens: give one 0/1 per completion token"
        )
    bad = [(i, v) for i, v in enumerate(values) if v not in (0, 1)]  # nan is not in (0, 1) either
    if bad:
        index, value = bad[0]
        raise ValueError(
            f"rollout_func's 'env_mask'[{row}][{index}] is {value!r}: env_mask holds 1 (a token the policy "
            "sampled) or 0 (a tool result, an environment reply, template glue)"
        )
    return [int(v) for v in values]


def _check_extra(output: Mapping[str, Any], num_prompts: int) -> dict[str, list]:
    extra = {}
    for key in output:
        if key in REQUIRED_KEYS or key == _MASK_KEY:
            continue
        values = output[key]
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != num_prompts:
            got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
            raise ValueError(
                f"rollout_func's extra key {key!r} must hold one value per prompt ({num_prompts}), got {got}: "
                "every key other than prompt_ids, completion_ids, logprobs and env_mask reaches the reward "
                "functions as a keyword, one value per row"
            )
        extra[key] = list(values)
    return extra


def rollout_outputs(output: Mapping[str, Any], num_prompts: int, response_length: int) -> RolloutOutputs:
    """Check one ``rollout_func`` result against TRL 1.16's contract (module docstring).

    Args:
        output: the dict ``rollout_func(prompts, trainer)`` returned: ``prompt_ids``,
            ``completion_ids``, ``logprobs`` (the list may be None, a row or a token None for
            "no log-prob"), optionally ``env_mask``, and any other key with one value per row.
        num_prompts: B, the number of prompts the function received.
        response_length: T, the most completion tokens (environment tokens included) a row may hold.

    Returns:
        `RolloutOutputs` with B rows; ``env_mask`` all ones when the key is absent, token
        log-probs of None as NaN. The input is not modified.

    Raises:
        ValueError: naming the key (and row) for a missing required key, a row count that is
            not ``num_prompts``, lengths that disagree within a row, an ``env_mask`` value
            that is not 0/1, a completion longer than ``response_length``, a completion with
            no policy token, an extra key without one value per row.
    """
    if not isinstance(output, Mapping):
        raise TypeError(f"rollout_func must return a dict with keys {list(REQUIRED_KEYS)}, got {type(output).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func's result lacks {missing}: it must return {list(REQUIRED_KEYS)} (logprobs may be None), "
            f"got keys {list(output)}"
        )
    if num_prompts < 1 or response_length < 1:
        raise ValueError(f"num_prompts and response_length must be >= 1, got {num_prompts} and {response_length}")
    prompts = [_token_ids("prompt_ids", b, row) for b, row in enumerate(_rows(output, "prompt_ids", num_prompts))]
    completions = _rows(output, "completion_ids", num_prompts)
    completions = [_token_ids("completion_ids", b, row) for b, row in enumerate(completions)]
    for b, (prompt, completion) in enumerate(zip(prompts, completions)):
        if not prompt:
            raise ValueError(f"rollout_func's 'prompt_ids'[{b}] is empty: a completion continues at least one token")
        if len(completion) > response_length:
            raise ValueError(
                f"rollout_func's 'completion_ids'[{b}] has {len(completion)} tokens, more than response_length="
                f"{response_length}: stop the episode within the budget (environment tokens count) or raise it"
            )
    logprobs = None
    if output["logprobs"] is not None:
        rows = _rows(output, "logprobs", num_prompts)
        logprobs = [_logprob_row(b, row, len(c)) for b, (row, c) in enumerate(zip(rows, completions))]
    if output.get(_MASK_KEY) is None:
        env_mask = [[1] * len(c) for c in completions]
    else:
        rows = _rows(output, _MASK_KEY, num_prompts)
        env_mask = [_env_mask_row(b, row, len(c)) for b, (row, c) in enumerate(zip(rows, completions))]
    for b, row in enumerate(env_mask):
        if not any(row):
            raise ValueError(
                f"rollout_func's row {b} has no policy token ('env_mask'[{b}] is all 0 over {len(row)} tokens): "
                "PPO needs at least one token the policy sampled in every completion"
            )
    return RolloutOutputs(prompts, completions, logprobs, env_mask, _check_extra(output, num_prompts), response_length)


def pad_episodes(
    outputs: RolloutOutputs, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad the completions of `rollout_outputs` to ``T = outputs.response_length``.

    Args:
        outputs: a checked `RolloutOutputs` with B rows.
        pad_token_id: the id written after each completion (never read: the masks say what is real).

    Returns:
        ``(completion_ids, response_mask, action_mask, sampler_logprobs)``:
        completion_ids int64 (B, T), right-padded with ``pad_token_id``;
        response_mask bool (B, T), True on the L_b completion tokens;
        action_mask bool (B, T), ``response_mask & env_mask``: the tokens the policy sampled;
        sampler_logprobs float32 (B, T), the sampler's log-probs on the action tokens, NaN where
        there is none (padding, environment tokens, None, or no ``logprobs`` at all).
    """
    batch, length = len(outputs.completion_ids), outputs.response_length
    ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(batch, length, dtype=torch.bool)
    action_mask = torch.zeros(batch, length, dtype=torch.bool)
    sampler_logprobs = torch.full((batch, length), math.nan, dtype=torch.float32)
    for b, completion in enumerate(outputs.completion_ids):
        n = len(completion)
        ids[b, :n] = torch.tensor(completion, dtype=torch.long)
        response_mask[b, :n] = True
        action_mask[b, :n] = torch.tensor(outputs.env_mask[b], dtype=torch.bool)
        if outputs.logprobs is not None:
            sampler_logprobs[b, :n] = torch.tensor(outputs.logprobs[b], dtype=torch.float32)
    # TRL writes 0.0 at tool tokens (G:2156): not a log-prob, so it must not look like one
    sampler_logprobs = torch.where(action_mask, sampler_logprobs, math.nan)
    return ids, response_mask, action_mask, sampler_logprobs
