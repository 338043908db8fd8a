"""Episodes with turns: TRL 1.16 GRPO's ``rollout_func`` output, checked and padded.

A user who owns generation (a multi-turn loop, an agent server) returns one dict per rollout
batch; `rollout_outputs` checks it and `pad_episodes` turns it into the (B, T) tensors a PPO
rollout needs, with the action mask (True on the tokens the policy sampled; ``functional``'s
"episodes with turns"). Pure: no trainer, no model.

TRL 1.16's contract, as read from ``trl/trainer/grpo_trainer.py`` (G):

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

__all__ = [
    "REQUIRED_KEYS", "RolloutOutputs", "rollout_outputs", "pad_episodes", "padded_prompts", "episode_has_stop",
    "turn_statistics", "continuation_rows",
]

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


def _token_ids(key: str, row: int, tokens, vocab_size: int | None = None) -> list[int]:
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError as error:
        raise ValueError(f"rollout_func's {key!r}[{row}] must be a list of int token ids: {error}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"rollout_func's {key!r}[{row}] holds a negative token id: {min(ids)}")
    if vocab_size is not None and any(i >= vocab_size for i in ids):
        # the model would index past its embedding rows: an IndexError on the CPU, a device assert on CUDA
        bad = next(i for i in ids if i >= vocab_size)
        raise ValueError(
            f"rollout_func's {key!r}[{row}] holds token id {bad} at position {ids.index(bad)}, beyond the policy's "
            f"{vocab_size} embedding rows (ids 0..{vocab_size - 1}): tokenize with the trainer's processing_class, or "
            "resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)))"
        )
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


def rollout_outputs(output: Mapping[str, Any], num_prompts: int, response_length: int,
                    vocab_size: int | None = None) -> RolloutOutputs:
    """Check one ``rollout_func`` result against TRL 1.16's contract (module docstring).

    Args:
        output: the dict ``rollout_func(prompts, trainer)`` returned: ``prompt_ids``,
            ``completion_ids``, ``logprobs`` (the list may be None, a row or a token None for
            "no log-prob"), optionally ``env_mask``, and any other key with one value per row.
        num_prompts: B, the number of prompts the function received.
        response_length: T, the most completion tokens (environment tokens included) a row may hold.
        vocab_size: the policy's embedding rows; an id at or beyond it is refused (None: not checked).

    Returns:
        `RolloutOutputs` with B rows; ``env_mask`` all ones when the key is absent, token
        log-probs of None as NaN. The input is not modified.

    Raises:
        ValueError: naming the key (and row) for a missing required key, a negative token id or one
            at or beyond ``vocab_size`` (naming the id), a row count that is
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
    prompts = [_token_ids("prompt_ids", b, row, vocab_size)
               for b, row in enumerate(_rows(output, "prompt_ids", num_prompts))]
    completions = _rows(output, "completion_ids", num_prompts)
    completions = [_token_ids("completion_ids", b, row, vocab_size) for b, row in enumerate(completions)]
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


def padded_prompts(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(queries (B, P) int64, query_mask (B, P) bool)``: B token-id lists left padded with
    ``pad_token_id`` to the longest (``P``), as the trainer's prompts are.

    Example:
        >>> padded_prompts([[5, 6], [7]], pad_token_id=0)
        (tensor([[5, 6],
                [0, 7]]), tensor([[ True,  True],
                [False,  True]]))
    """
    width = max(len(row) for row in prompt_ids)
    queries = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompt_ids), width, dtype=torch.bool)
    for b, row in enumerate(prompt_ids):
        if row:
            queries[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[b, width - len(row):] = True
    return queries, mask


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` long: the position of each row's last True of a (B, T) bool mask, -1 for none."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=1)


def episode_has_stop(completion_ids: torch.Tensor, action_mask: torch.Tensor, stop_ids: tuple) -> torch.Tensor:
    """``(B,)`` bool: the episode's last policy token is a stop token (its last turn ended, rather
    than being cut by the length budget) -- what ``has_stop`` means for a single-turn response,
    whose last token is its last action. Environment tokens after it do not change the answer.

    Args:
        completion_ids: (B, T) int64. action_mask: (B, T) bool, at least one True per row.
        stop_ids: the ids that end a turn; empty: no episode counts as stopped.

    Example:
        >>> ids = torch.tensor([[4, 3, 9, 9], [4, 4, 3, 8]])
        >>> act = torch.tensor([[True, True, False, False], [True, True, False, True]])
        >>> episode_has_stop(ids, act, (3,))
        tensor([ True, False])
    """
    if not stop_ids:
        return torch.zeros(completion_ids.shape[0], dtype=torch.bool, device=completion_ids.device)
    last = _last_true(action_mask).clamp(min=0)
    final = completion_ids.gather(1, last[:, None])[:, 0]
    stops = torch.tensor(list(stop_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    return torch.isin(final, stops) & action_mask.any(dim=1)


def turn_statistics(response_mask: torch.Tensor, action_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-episode turn figures, each ``(B,)`` float32.

    ``turns``: the runs of consecutive action tokens (policy turns); ``env_token_frac``: the
    share of the episode's response tokens that the policy did not sample (0 for an empty
    row); ``ends_on_env``: 1 where the last response token is not an action (the episode ended
    on a tool's or environment's reply).

    Args:
        response_mask: (B, T) bool, the real response tokens (a prefix of each row).
        action_mask: (B, T) bool, inside ``response_mask``.

    Example:
        >>> resp = torch.tensor([[True] * 7, [True, True, False, False, False, False, False]])
        >>> act = torch.tensor([[True, True, False, False, True, False, False], [True, True] + [False] * 5])
        >>> {k: v.tolist() for k, v in turn_statistics(resp, act).items()}
        {'turns': [2.0, 1.0], 'env_token_frac': [0.5714285969734192, 0.0], 'ends_on_env': [1.0, 0.0]}
    """
    starts = action_mask.clone()
    starts[:, 1:] &= ~action_mask[:, :-1]
    lengths = response_mask.sum(dim=1)
    environment = (response_mask & ~action_mask).sum(dim=1)
    last = (lengths - 1).clamp(min=0)
    ends_on_env = (lengths > 0) & ~action_mask.gather(1, last[:, None])[:, 0]
    return {
        "turns": starts.sum(dim=1).float(),
        "env_token_frac": environment.float() / lengths.clamp(min=1).float(),
        "ends_on_env": ends_on_env.float(),
    }


def continuation_rows(responses: torch.Tensor, response_mask: torch.Tensor, logprobs: torch.Tensor,
                      budgets: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Sampled continuations as lists, each cut to its row's budget.

    Args:
        responses: (B, T) int64 sampled ids; response_mask: (B, T) bool, a prefix per row (up to
            and including the stop token); logprobs: (B, T) float, the sampler's log-prob of each id.
        budgets: B ints, the most new tokens row b may keep (<= T).

    Returns:
        ``(ids, logprobs)``: B lists each, ``min(valid length, budget)`` entries per row.

    Example:
        >>> ids, lps = continuation_rows(torch.tensor([[5, 6, 3], [7, 3, 0]]),
        ...                              torch.tensor([[True, True, True], [True, True, False]]),
        ...                              torch.tensor([[-0.5, -1.0, -0.25], [-2.0, -0.5, 0.0]]), [2, 3])
        >>> ids, lps
        ([[5, 6], [7, 3]], [[-0.5, -1.0], [-2.0, -0.5]])
    """
    lengths = response_mask.sum(dim=1).tolist()
    ids_rows, logprob_rows = responses.tolist(), logprobs.float().tolist()
    keep = [min(int(n), int(budget)) for n, budget in zip(lengths, budgets)]
    return ([row[:n] for row, n in zip(ids_rows, keep)], [row[:n] for row, n in zip(logprob_rows, keep)])
