"""A privileged critic (``PPOConfig.critic_context_column``): the critic reads a dataset column the policy
never sees, e.g. the reference ``answer`` (SWEET-RL, BPCO), through an input of its own.

Each row's value of the column, a string, is rendered with :data:`CONTEXT_TEMPLATE` (the string and a
newline), tokenized with the policy's tokenizer without special tokens, and put before the row's prompt
in the critic's sequence only::

    policy, reference, reward models:  [left pad ..., prompt tokens,                  response tokens]
    critic:                            [left pad ..., context tokens, prompt tokens,  response tokens]

The critic's prompt is carried beside the policy's on the batch (``SampledBatch.critic_queries`` and
``critic_query_mask``, ``(B, C)``, left padded; :func:`with_critic_context`), so it follows every row
wherever the row goes: scoring chunks, mini- and micro-batches (trimmed to its own extent), the copies
of a prompt, an update's checkpoint, other processes. Both sequences end with the same ``T`` response
columns, so the critic's values are read at the same states (the last ``T + 1`` positions,
``rollout.response_values``). Only a critic with a pass of its own can take other input ids: a separate
value model (``PolicyAndValue``) or a value adapter (``SharedActorCritic(value_lora_config=...)``); the
shared value head and the branch critic read the policy's own pass (:func:`check_layout`).

Notation: ``B`` rows, ``P`` prompt columns, ``K`` context columns, ``C`` critic prompt columns (``<= K + P``).

Example (the context ids ``[7, 8]`` before the prompt ``[3, 4]``; the second row has no context):

>>> import torch
>>> ids, mask = critic_queries([[7, 8], []], torch.tensor([[0, 3, 4], [5, 6, 9]]),
...                            torch.tensor([[False, True, True], [True, True, True]]), pad_token_id=0)
>>> ids.tolist(), mask.int().tolist()
([[7, 8, 3, 4], [0, 5, 6, 9]], [[1, 1, 1, 1], [0, 1, 1, 1]])
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .models.values import has_values_alone

# How a row's context value becomes the text before its prompt: the raw string, then a newline
CONTEXT_TEMPLATE = "{context}\n"


def check_layout(column: str | None, model) -> None:
    """Refuse a privileged critic where the critic cannot read an input of its own: ``model`` (the
    trainer's policy/value module) must compute its values with a pass of its own, a value model or a
    value adapter (``models.values.has_values_alone``), and not a branch critic (whose upper layers read
    the policy's own pass). Raises ``ValueError`` naming the field and what to use."""
    if column is None:
        return
    branch = getattr(model, "value_branch_layer", None)
    if not has_values_alone(model) or branch is not None:
        what = (f"the branch critic (value_branch_layer={branch}) shares the policy's layers below the branch"
                if branch is not None else "the shared value head reads the policy's own last hidden state")
        raise ValueError(
            f"PPOConfig.critic_context_column={column!r} gives the critic an input the policy never sees, and {what}: "
            "its values come from the policy's pass. Give the critic a pass of its own: use_value_adapter=True (with "
            "value_branch_layer=None), or a separate value_model; or set critic_context_column=None."
        )


def check_context_column(dataset, column: str | None, name: str) -> None:
    """Refuse a ``dataset`` (``train_dataset`` or ``eval_dataset``, as ``name`` says) without the column
    ``column`` (the critic's context), naming the columns it has. A dataset that does not list its
    columns (a torch ``Dataset``) is checked at its first batch instead (:func:`context_token_ids`)."""
    if column is None or dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and column not in columns:
        raise ValueError(
            f"PPOConfig.critic_context_column={column!r} is not a column of `{name}` (columns: {list(columns)}). "
            f"Add the column the critic reads to every row (e.g. dataset.add_column({column!r}, [...])), or set "
            "critic_context_column=None."
        )


def context_token_ids(tokenizer, values, column: str) -> list[list[int]]:
    """Each row's context ids: ``CONTEXT_TEMPLATE`` of its value, tokenized without special tokens.

    Args:
        tokenizer: the policy's tokenizer (the critic shares its vocabulary).
        values: the column's ``B`` values, one string per row.
        column: the column's name (for errors).
    Returns:
        ``B`` lists of token ids.
    Raises:
        TypeError: a value that is not a string, naming the row and its type.
    """
    texts = []
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(
                f"critic_context_column={column!r}: row {row} holds a {type(value).__name__} ({value!r}); the critic's "
                f"context is a string. Convert the column first, e.g. dataset.map(lambda r: {{{column!r}: "
                f"str(r[{column!r}])}})."
            )
        texts.append(CONTEXT_TEMPLATE.format(context=value))
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def critic_queries(context_ids: list[list[int]], queries: torch.Tensor, query_mask: torch.Tensor,
                   pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's prompts: each row's context ids, then its real prompt tokens, left padded.

    Args:
        context_ids: ``B`` lists of ids (:func:`context_token_ids`), possibly empty.
        queries: ``(B, P)`` long, the policy's prompts, left padded.
        query_mask: ``(B, P)`` bool, True on real prompt tokens.
        pad_token_id: the id written on padding.
    Returns:
        ``(critic_queries (B, C) long, critic_query_mask (B, C) bool)`` on ``queries``' device, ``C`` the
        longest row's context plus prompt. Equivalent to, per row ``b``: ``ids = context_ids[b] +
        queries[b][query_mask[b]]`` left padded to ``C``.
    """
    B, device = queries.shape[0], queries.device
    K = max((len(ids) for ids in context_ids), default=0)
    context = torch.full((B, K), pad_token_id, dtype=queries.dtype)
    context_mask = torch.zeros((B, K), dtype=torch.bool)
    for b, ids in enumerate(context_ids):  # right-aligned: the context ends where the prompt starts
        if ids:
            context[b, K - len(ids):] = torch.tensor(ids, dtype=queries.dtype)
            context_mask[b, K - len(ids):] = True
    ids = torch.cat([context.to(device), queries], dim=1)
    mask = torch.cat([context_mask.to(device), query_mask.bool()], dim=1)
    # real tokens to the right, in order (a stable sort of padding before real tokens), then the columns
    # no row uses dropped from the left
    order = torch.sort(mask.long(), dim=1, stable=True).indices
    mask = torch.gather(mask, 1, order)
    ids = torch.gather(ids, 1, order).masked_fill(~mask, pad_token_id)
    width = int(mask.sum(1).max()) if B else 0
    return ids[:, ids.shape[1] - width:], mask[:, mask.shape[1] - width:]


def with_critic_context(sample, tokenizer, column: str):
    """``sample`` (a ``SampledBatch``) with ``critic_queries`` / ``critic_query_mask`` built from its
    ``extras[column]`` (:func:`context_token_ids`, :func:`critic_queries`); a new object, ``sample`` is
    not changed. Raises ``KeyError`` naming the column when the batch does not carry it (a data
    collator that drops dataset columns)."""
    if column not in sample.extras:
        raise KeyError(
            f"critic_context_column={column!r}: the batch carries no such column (its columns: "
            f"{sorted(sample.extras)}). The trainer's default collator carries every dataset column; a custom "
            "data_collator must keep this one."
        )
    ids = context_token_ids(tokenizer, sample.extras[column], column)
    queries, mask = critic_queries(ids, sample.queries, sample.query_mask, tokenizer.pad_token_id)
    return replace(sample, critic_queries=queries, critic_query_mask=mask)
