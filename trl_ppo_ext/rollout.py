"""The rollout: what the old policy generated, and everything measured on it without grad.

Two typed stages: sampling gives a :class:`SampledBatch` (prompts, responses, masks; the
sampler is ``sampling.RolloutSampler``, its engines are in ``generation/``, and
:func:`finalize_responses` turns an engine's ids into responses and masks); scoring -- old
log-probs and values (:func:`forward_responses`), reference log-probs
(:func:`reference_response_logprobs`) and reward-model scores (:func:`reward_model_scores`),
each per chunk of :func:`forward_chunks` -- turns it into a :class:`Rollout`
(:func:`scored_rollout`). The trainer orchestrates the stages (models, offloading,
reward functions) in thin overridable methods.

Notation: ``B`` sequences in the rollout batch, ``P`` prompt positions (left padded), ``T``
response positions (``response_length``), ``V`` vocabulary. The full sequence fed to every
model is ``cat(queries, responses)``, ``(B, P + T)``; the response token ``t`` is predicted
by the logits at position ``P - 1 + t``, and ``V(s_t)`` is read at that same position. Models
are asked for the logits of the last ``T + 1`` positions only (``logits_to_keep``): the
prompt's logits would be ``P / (T + 1)`` times more memory for nothing.

Example:

>>> import torch
>>> from trl_ppo_ext.rollout import finalize_responses
>>> responses, mask, has_stop = finalize_responses(torch.tensor([[5, 2, 7], [5, 6, 7]]), (2,), pad_token_id=0)
>>> responses.tolist(), mask.tolist(), has_stop.tolist()  # the stop token is kept; nothing after it
([[5, 2, 0], [5, 6, 7]], [[True, True, False], [True, True, True]], [True, False])
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, fields

import torch

from . import functional as F
from .batching import sorted_by_length
from .generation.filters import SamplingFilters, filtered_response_logits
from .models.policy_value import lm_logits, score_at


@dataclass(kw_only=True)
class SampledBatch:
    """What generation produced for one batch of prompts, before any model scored it.

    Every tensor lives on the training device. ``responses`` hold the pad id where
    ``response_mask`` is False (after the terminal token). :func:`forward_chunks` cuts it for
    the scoring forwards; :func:`scored_rollout` turns it, with those scores, into a
    :class:`Rollout`.
    """

    queries: torch.Tensor  # (B, P) long: prompt ids, left padded
    query_mask: torch.Tensor  # (B, P) bool: True on real prompt tokens
    responses: torch.Tensor  # (B, T) long: generated ids; pad id after the terminal token
    response_mask: torch.Tensor  # (B, T) bool: generated tokens up to and including the stop token
    has_stop: torch.Tensor  # (B,) bool: the response ended with the stop token
    policy_version: int = 0  # optimizer updates done when this batch was sampled (policy lag)
    # (B, T) float32: the sampling engine's log pi_engine(a_t | s_t) (vLLM), 0 where response_mask is
    # False, NaN where the engine gave none; None when transformers' generate sampled the batch
    engine_logprobs: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)  # other dataset columns, name -> list of B values
    # (B, T) bool, inside response_mask: True where the policy sampled the token; False on tokens that
    # came from elsewhere (a tool's or an environment's reply, template glue) in an episode with turns
    # (``rollout_func``'s ``env_mask``). None: every response token is the policy's (single turn)
    action_mask: torch.Tensor | None = None
    # (B, C) long: the critic's own prompt, left padded: a privileged context the policy never sees
    # (``critic_context_column``, ``critic_context.with_critic_context``) followed by the prompt's real
    # tokens; the critic reads ``cat(critic_queries, responses)`` where the policy reads ``cat(queries,
    # responses)`` (:func:`critic_sequence_inputs`). None: the critic reads the policy's sequence
    critic_queries: torch.Tensor | None = None
    critic_query_mask: torch.Tensor | None = None  # (B, C) bool: True on the critic's real prompt tokens

    @property
    def batch_size(self) -> int:
        return self.responses.shape[0]

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(B, T)`` bool: the tokens the update trains on and the statistics count, the policy's
        own (``action_mask``), or every response token (``response_mask``) when it has none.
        Attention still covers every real token (``response_mask``)."""
        return self.response_mask if self.action_mask is None else self.action_mask

    @property
    def valid_responses(self) -> torch.Tensor:
        """``(B, T)`` long: ``responses`` with 0 wherever ``response_mask`` is False -- an id every
        model has, for indexing logits (the pad id may lie past the vocabulary when a script
        added ``[PAD]`` without resizing), as ``sequence_inputs`` does for the model inputs."""
        return self.responses.masked_fill(~self.response_mask, 0)

    def select(self, index: torch.Tensor | slice):
        """The rows ``index`` (a ``(b,)`` long tensor or a slice) of every tensor field and
        extra column, as a new object of the same class. The index is read on the host only
        when there are extra columns to pick from (a device index would otherwise sync)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                value = value[index]
            elif f.name == "extras":
                rows = index if isinstance(index, slice) or not value else index.tolist()
                value = {k: list(column[rows]) if isinstance(rows, slice) else [column[i] for i in rows]
                         for k, column in value.items()}
            picked[f.name] = value
        return type(self)(**picked)


@dataclass(kw_only=True)
class Rollout(SampledBatch):
    """A scored rollout batch: the sampled batch and what the old policy, the value model, the
    reference and the rewards said about it. Every float field holds 0 where
    ``response_mask`` is False (prompt padding is separate; here: after the terminal token).
    """

    logprobs: torch.Tensor  # (B, T) float32: log pi_old(a_t | s_t), at the sampling temperature
    ref_logprobs: torch.Tensor  # (B, T) float32: log pi_ref(a_t | s_t), same temperature
    values: torch.Tensor  # (B, T) float32: V_old(s_t) from the value head at sampling time
    scores: torch.Tensor  # (B,) float32: weighted sum of the rewards (RM score at the last valid token)
    # (B, F) float32: each reward's raw value (NaN where it does not apply); F = number of rewards
    reward_values: torch.Tensor | None = None
    reward_applies: torch.Tensor | None = None  # (B, F) bool: False where a reward function returned None
    # (B, T) float32: per-token rewards of the reward functions that return them (weighted, 0 where
    # response_mask is False), added to the shaped rewards; None: every reward is a sequence score
    token_rewards: torch.Tensor | None = None


def scored_rollout(
    sample: SampledBatch, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, values: torch.Tensor,
    scores: torch.Tensor, reward_values: torch.Tensor | None = None, reward_applies: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
) -> Rollout:
    """``sample`` with its scores, as a :class:`Rollout`.

    Args:
        logprobs, ref_logprobs, values: ``(B, T)`` any float dtype; cast to float32 and set to 0
            where ``sample.response_mask`` is False (nothing is read there, and 0 keeps sums exact).
        scores: ``(B,)``; reward_values ``(B, F)``; reward_applies ``(B, F)`` bool.
        token_rewards: ``(B, T)`` or None; cast and masked as the token fields.
    Returns:
        a new ``Rollout``; ``sample`` is not changed.
    """
    keep = sample.response_mask
    token_fields = {"logprobs": logprobs, "ref_logprobs": ref_logprobs, "values": values}
    if token_rewards is not None:
        token_fields["token_rewards"] = token_rewards
    scored = {name: x.float().masked_fill(~keep, 0.0) for name, x in token_fields.items()}
    sampled = {f.name: getattr(sample, f.name) for f in fields(SampledBatch)}
    return Rollout(**sampled, **scored, scores=scores, reward_values=reward_values, reward_applies=reward_applies)


def left_pad(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end (left padding), whatever the input side.

    Generation appends after the last column, so a right-padded prompt would be continued
    after its padding. Stable: the order of real tokens is kept.

    Args:
        ids: ``(B, P)`` token ids.  mask: ``(B, P)`` bool, True on real tokens.
    Returns:
        ``(ids, mask)`` left padded, same shapes; padding holds ``pad_token_id``.
    """
    mask = mask.bool()
    # Sort key: padding (0) before real tokens (1); a stable sort keeps each group's order.
    order = torch.sort(mask.long(), dim=1, stable=True).indices
    new_mask = torch.gather(mask, 1, order)
    new_ids = torch.gather(ids, 1, order).masked_fill(~new_mask, pad_token_id)
    return new_ids, new_mask


def sequence_inputs(
    queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each ``(B, P + T)``, for a full sequence.

    Attention covers real prompt tokens and valid response tokens only; position ids count
    attended tokens from 0 (left padding does not shift positions). Ids at unattended
    positions are replaced by 0: a pad id added to the tokenizer after the model was built
    may lie outside the embedding matrix, and those positions are never read anyway.
    """
    attention_mask = torch.cat([query_mask.bool(), response_mask.bool()], dim=1)
    input_ids = torch.cat([queries, responses], dim=1).masked_fill(~attention_mask, 0)
    position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    return input_ids, attention_mask.long(), position_ids


def response_logits(logits: torch.Tensor, response_length: int, temperature: float) -> torch.Tensor:
    """Logits that predict the response tokens, divided by the sampling temperature.

    Args:
        logits: ``(B, L, V)`` with ``L >= T + 1``: the full sequence ``P + T``, or only its last
            ``T + 1`` positions (``logits_to_keep=T + 1``). Position ``L - T - 1 + t``
            predicts response token ``t``; the last position predicts nothing we sampled.
    Returns:
        ``(B, T, V)``.
    """
    return logits[:, -(response_length + 1) : -1] / temperature


def response_values(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """``V(s_t)`` for the response tokens: ``(B, L)`` -> ``(B, T)`` float32, same positions as
    ``response_logits`` (the state before token ``t`` is generated)."""
    return values[:, -(response_length + 1) : -1].float()


def valid_token_ids(sample: SampledBatch) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt_ids, completion_ids)``: each row's real prompt tokens and valid response tokens
    (through the stop token), as Python lists for decoding. The four tensors are copied to the
    host once, not row by row."""
    queries, query_mask, responses, response_mask = (
        t.cpu() for t in (sample.queries, sample.query_mask, sample.responses, sample.response_mask)
    )
    prompt_ids = [q[m].tolist() for q, m in zip(queries, query_mask)]
    completion_ids = [r[m].tolist() for r, m in zip(responses, response_mask)]
    return prompt_ids, completion_ids


# The (B, T) fields of a SampledBatch / Rollout / PPOTargets, cut and padded together by
# trimmed_to_extent / the scatter of ScoringChunks.merge. Per-sequence ((B,), (B, F)) and
# scalar fields are never cut.
TOKEN_FIELDS = frozenset({
    "responses", "response_mask", "action_mask", "engine_logprobs", "logprobs", "ref_logprobs", "values",
    "token_rewards", "kl", "non_score_rewards", "rewards", "advantages", "returns",
})
PROMPT_FIELDS = frozenset({"queries", "query_mask"})
# The critic's own prompt (a privileged context before the prompt): cut to its own extent, apart from the policy's
CRITIC_PROMPT_FIELDS = frozenset({"critic_queries", "critic_query_mask"})


def row_extents(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_lengths (B,), response_lengths (B,))`` long: how many columns each row needs.

    A prompt needs its columns from its first real token to the end (prompts are left padded,
    see :func:`left_pad`); a response its columns up to its last valid token (0 for an
    empty one). Equivalent to ``P - first_true(query_mask)`` and ``last_true(response_mask) + 1``.
    """
    P, T = query_mask.shape[1], response_mask.shape[1]
    columns_p = torch.arange(P, device=query_mask.device)
    first = torch.where(query_mask.bool(), columns_p, P).amin(dim=1)
    columns_t = torch.arange(1, T + 1, device=response_mask.device)
    last = torch.where(response_mask.bool(), columns_t, 0).amax(dim=1)
    return P - first, last


def trimmed_to_extent(batch, prompt_width: int | None = None, response_width: int | None = None):
    """``batch`` (a ``SampledBatch``, ``Rollout`` or ``PPOTargets``) cut to the columns its rows use.

    Prompt fields (``(b, P)``) keep their last ``prompt_width`` columns (default: the longest
    real prompt of the rows), token fields (``(b, T)``, :data:`TOKEN_FIELDS`) their first
    ``response_width`` (default: the longest response). Only padding is dropped: a causal
    model's outputs on the kept positions do not depend on it (right padding is never
    attended; left padding never attended either, and :func:`sequence_inputs` counts
    positions from the first real token), so a forward on the trimmed batch equals the
    full-width one on those positions. The critic's own prompt (:data:`CRITIC_PROMPT_FIELDS`, when
    set) keeps the last columns its longest real row needs, whatever ``prompt_width`` is: it is longer
    than the policy's by its context. A new object; ``batch`` is not changed.
    """
    critic_mask, critic_width = getattr(batch, "critic_query_mask", None), None
    if prompt_width is None or response_width is None or critic_mask is not None:
        lengths = list(row_extents(batch.query_mask, batch.response_mask))
        if critic_mask is not None:  # the critic's prompt: its own extent, from the same host sync
            lengths.append(row_extents(critic_mask, batch.response_mask)[0])
        widths = torch.stack([x.max() for x in lengths]).tolist() if lengths[0].numel() else [0] * len(lengths)
        # at least one column each: a forward needs a real first token and a position to read
        prompt_width = max(widths[0], 1) if prompt_width is None else prompt_width
        response_width = max(widths[1], 1) if response_width is None else response_width
        critic_width = max(widths[2], 1) if critic_mask is not None else None
    picked = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if torch.is_tensor(value) and f.name in PROMPT_FIELDS:
            value = value[:, value.shape[1] - prompt_width:]
        elif torch.is_tensor(value) and f.name in CRITIC_PROMPT_FIELDS:
            value = value[:, value.shape[1] - critic_width:]
        elif torch.is_tensor(value) and f.name in TOKEN_FIELDS and value.dim() > 1:
            value = value[:, :response_width]
        picked[f.name] = value
    return type(batch)(**picked)


def trimmed_together(batch, *others) -> tuple:
    """``(batch, *others)`` each cut by :func:`trimmed_to_extent` to ``batch``'s extent (e.g.
    a micro-batch's ``Rollout`` and its ``PPOTargets``, which has no masks of its own)."""
    batch = trimmed_to_extent(batch)
    widths = batch.queries.shape[1], batch.responses.shape[1]
    return (batch, *(trimmed_to_extent(o, *widths) for o in others))


def pad_response_columns(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """``(b, t, ...)`` -> ``(b, width, ...)``: ``x`` followed by ``value`` (the masked fill of
    a rollout's token fields) in the columns a trimmed forward did not compute."""
    if x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def length_order(query_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` long: the rows sorted longest first by response length, then prompt length
    (stable: equal rows keep their order), so consecutive rows have similar extents."""
    return sorted_by_length(*row_extents(query_mask, response_mask))


class ScoringChunks(list):
    """The scoring forwards' chunks, ``[(part, (input_ids, attention_mask, position_ids)), ...]``
    (iterate it as a list), and how their per-chunk results go back into batch order and width.

    ``order`` ``(B,)`` long: the rollout rows the concatenated chunks hold, in that order
    (None: the batch's own order). ``width``: ``T``, the rollout's response columns.
    """

    def __init__(self, chunks, order: torch.Tensor | None, width: int):
        super().__init__(chunks)
        self.order, self.width = order, width

    def merge(self, results) -> torch.Tensor:
        """One ``(b_i, ...)`` result per chunk -> ``(B, ...)`` in the rollout's row order; a token
        result ``(b_i, t_i)`` of a trimmed chunk is first padded with 0 to ``(b_i, T)``.

        Equivalent to ``out[order[rows_i]] = pad(results[i])`` for every chunk ``i``.
        """
        results = list(results)
        if results and results[0].dim() > 1:
            results = [pad_response_columns(r, self.width) for r in results]
        merged = torch.cat(results)
        if self.order is None:
            return merged
        return merged.index_select(0, torch.argsort(self.order))  # the inverse permutation


def forward_chunks(sample: SampledBatch, chunk_size: int, *, trim: bool = False,
                   group_by_length: bool = False) -> ScoringChunks:
    """``sample`` cut into row chunks of at most ``chunk_size``, each with its
    :func:`sequence_inputs`: ``[(part, (input_ids, attention_mask, position_ids)), ...]``.

    Every scoring forward runs per chunk, so no ``(B, T, V)`` tensor exists for the batch.
    ``group_by_length``: the chunks are cut from the rows sorted by :func:`length_order`
    (long rows together, short rows together); ``trim``: each chunk is cut to its rows'
    own extent (:func:`trimmed_to_extent`), so a forward's cost follows the tokens that
    exist. Per-chunk results go back to ``(B, T)`` / ``(B,)`` in batch order with
    :meth:`ScoringChunks.merge`; with neither flag, that is ``torch.cat``.
    """
    order = length_order(sample.query_mask, sample.response_mask) if group_by_length else None
    ordered = sample if order is None else sample.select(order)
    parts = [ordered.select(slice(s, s + chunk_size)) for s in range(0, sample.batch_size, chunk_size)]
    if trim:
        parts = [trimmed_to_extent(p) for p in parts]
    chunks = [(p, sequence_inputs(p.queries, p.query_mask, p.responses, p.response_mask)) for p in parts]
    return ScoringChunks(chunks, order, sample.responses.shape[1])


def critic_sequence_inputs(part: SampledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The critic's own :func:`sequence_inputs`, ``cat(critic_queries, responses)`` each ``(b, C + T)``, or
    None when ``part`` has no privileged context (the critic reads the policy's sequence). The responses
    are the same ``T`` columns at the end of both sequences, so the last ``T + 1`` positions, where
    :func:`response_values` reads ``V(s_t)``, are the same states in both."""
    if part.critic_queries is None:
        return None
    return sequence_inputs(part.critic_queries, part.critic_query_mask, part.responses, part.response_mask)


def forward_responses(model, inputs: tuple, response_length: int, temperature: float, autocast=nullcontext,
                      filters: SamplingFilters | None = None, value_inputs: tuple | None = None):
    """One forward of a policy/value module (``forward(...) -> (logits, values)``) on a chunk.

    Args:
        model: ``PolicyAndValue`` or ``SharedActorCritic`` (or anything with their forward).
        inputs: ``(input_ids, attention_mask, position_ids)``, each ``(b, P + T)``.
        response_length: ``T``. temperature: the sampling temperature the logits are divided by.
        autocast: a context factory the forward runs in (the accelerator's mixed precision).
        filters: the run's sampling filters (``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``):
            the logits become the filtered distribution's (``generation.filters``); None: plain.
        value_inputs: the critic's own ``(input_ids, attention_mask, position_ids)``, each ``(b, C + T)``
            (:func:`critic_sequence_inputs`), passed to the model as ``value_inputs``; None: the
            critic reads ``inputs`` (and the model is called without the keyword).
    Returns:
        ``(logits (b, T, V), values (b, T) float32)``: the logits predicting each response token
        (of the distribution sampled from) and ``V(s_t)`` read at the same positions. The rollout
        and the update both use this, so the first PPO ratio is exactly 1.
    """
    input_ids, attention_mask, position_ids = inputs
    critic = {} if value_inputs is None else {"value_inputs": value_inputs}
    with autocast():
        logits, values = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               logits_to_keep=response_length + 1, **critic)
    logits = filtered_response_logits(response_logits(logits, response_length, temperature), input_ids,
                                      attention_mask, filters)
    return logits, response_values(values, response_length)


def reference_response_logprobs(model, part: SampledBatch, inputs: tuple, temperature: float,
                                autocast=nullcontext, filters: SamplingFilters | None = None) -> torch.Tensor:
    """``log pi_ref(a_t | s_t)`` ``(b, T)`` from a causal LM (a reference model, or the policy
    with its adapter disabled by the caller), at the sampling temperature; any value where
    ``part.response_mask`` is False (the caller masks). ``filters``: the run's sampling filters
    (``generation.filters``), for a reference as for the sampler's own log-probs; None: plain."""
    T = part.responses.shape[1]
    with autocast():
        logits = lm_logits(model, *inputs, logits_to_keep=T + 1)
    logits = filtered_response_logits(response_logits(logits, T, temperature), inputs[0], inputs[1], filters)
    return F.logprobs_from_logits(logits, part.valid_responses)


def reward_model_scores(model, part: SampledBatch, inputs: tuple, autocast=nullcontext) -> torch.Tensor:
    """Raw score ``(b,)`` float32 of a reward model read at each row's last valid response
    token (the stop token when there is one; the last generated token of a truncated row)."""
    index = part.queries.shape[1] + F.last_valid_index(part.response_mask)
    with autocast():
        return score_at(model, *inputs, index=index)


# Generation settings a checkpoint may carry that are neither the sampling settings below nor
# bookkeeping: each changes which tokens are sampled (or how many), which the log-prob forward
# would not know about. They are reset to neutral values for every rollout.
def finalize_responses(responses: torch.Tensor, stop_ids: tuple, pad_token_id: int,
                       sampled: torch.Tensor | None = None):
    """``(responses, response_mask, has_stop)``: everything after the first stop token set to pad.

    Args:
        responses: ``(B, T)`` sampled ids. stop_ids: the ids that end a response (see
            :func:`stop_token_ids`); empty: responses run to ``T``. pad_token_id: the
            tokenizer's pad id, written after the stop token.
        sampled: ``(B, T)`` bool, where the sampler produced a token (an engine that stopped a
            row early for length, ``generation.base.EngineSamples.sampled_mask``); None: every
            position up to the stop token was sampled (``generate``'s output).
    Returns:
        ``responses`` ``(B, T)``, ``response_mask`` ``(B, T)`` bool, keeping the stop token
        itself (see ``functional.response_mask``) and never reaching past ``sampled``, and
        ``has_stop`` ``(B,)`` bool: the response ended with a sampled stop token (a row cut
        short by the engine is truncated, even where its padding holds a stop id).
    """
    mask = F.response_mask(responses, stop_ids or None)
    if sampled is not None:
        mask = mask & sampled.to(mask.device, torch.bool)
    if stop_ids:
        has_stop = (torch.isin(responses, torch.tensor(stop_ids, device=responses.device)) & mask).any(dim=1)
    else:
        has_stop = torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
    return responses.masked_fill(~mask, pad_token_id), mask, has_stop
