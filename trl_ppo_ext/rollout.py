"""The rollout: what the old policy generated, and everything measured on it without grad.

Notation: ``B`` sequences in the rollout batch, ``P`` prompt positions (left padded), ``T``
response positions (``response_length``), ``V`` vocabulary. The full sequence fed to every
model is ``cat(queries, responses)``, ``(B, P + T)``; the response token ``t`` is predicted
by the logits at position ``P - 1 + t``, and ``V(s_t)`` is read at that same position. Models
are asked for the logits of the last ``T + 1`` positions only (``logits_to_keep``): the
prompt's logits would be ``P / (T + 1)`` times more memory for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig

from . import functional as F


@dataclass
class Rollout:
    """One rollout batch. Every tensor lives on the training device.

    Positions where ``response_mask`` is False (prompt padding is separate; here: after the
    terminal token) hold 0 in every float field and the pad id in ``responses``.
    """

    queries: torch.Tensor  # (B, P) long: prompt ids, left padded
    query_mask: torch.Tensor  # (B, P) bool: True on real prompt tokens
    responses: torch.Tensor  # (B, T) long: generated ids; pad id after the terminal token
    response_mask: torch.Tensor  # (B, T) bool: generated tokens up to and including the stop token
    logprobs: torch.Tensor  # (B, T) float32: log pi_old(a_t | s_t), at the sampling temperature
    ref_logprobs: torch.Tensor  # (B, T) float32: log pi_ref(a_t | s_t), same temperature
    values: torch.Tensor  # (B, T) float32: V_old(s_t) from the value head at sampling time
    scores: torch.Tensor  # (B,) float32: raw reward-model score at the last valid response token
    has_stop: torch.Tensor  # (B,) bool: the response ended with the stop token
    policy_version: int = 0  # optimizer updates done when this batch was sampled (policy lag)

    @property
    def batch_size(self) -> int:
        return self.responses.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """The rows ``index`` ((b,) long) of every tensor field, as a new Rollout."""
        picked = {
            f.name: getattr(self, f.name)[index] if torch.is_tensor(getattr(self, f.name)) else getattr(self, f.name)
            for f in fields(self)
        }
        return Rollout(**picked)


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


def sampling_config(args, stop_token_id: int | None, pad_token_id: int, temperature: float) -> GenerationConfig:
    """The generation settings of a rollout: pure sampling, ``response_length`` new tokens."""
    return GenerationConfig(
        max_new_tokens=args.response_length,
        min_new_tokens=0,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )


@torch.no_grad()
def generate_responses(
    policy, queries: torch.Tensor, query_mask: torch.Tensor, generation_config: GenerationConfig,
    response_length: int, pad_token_id: int, chunk_size: int,
) -> torch.Tensor:
    """Sample responses in chunks of ``chunk_size`` prompts; ``(B, T)`` padded with the pad id.

    Generation may stop before ``T`` tokens when every row of a chunk has finished; the
    missing columns are filled with ``pad_token_id`` (they are masked out later anyway).
    """
    context_length = queries.shape[1]
    out = torch.full((queries.shape[0], response_length), pad_token_id, dtype=queries.dtype, device=queries.device)
    for start in range(0, queries.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        mask = query_mask[rows]
        seq = policy.generate(
            input_ids=queries[rows].masked_fill(~mask, 0), attention_mask=mask.long(),
            generation_config=generation_config,
        )
        new = seq[:, context_length : context_length + response_length]
        out[rows, : new.shape[1]] = new
    return out


def finalize_responses(
    responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int, eos_token_id: int | None = None
):
    """``(responses, response_mask, has_stop)``: everything after the first stop token set to pad.

    ``response_mask`` keeps the stop token itself (see ``functional.response_mask``).
    ``has_stop`` (B,) is True where the response contains the stop token; when no stop token
    is configured (responses then always run to ``T``), it falls back to ``eos_token_id``, so
    ``missing_eos_penalty`` and the EOS rate keep TRL's meaning in that set-up.
    """
    mask = F.response_mask(responses, stop_token_id)
    end_id = stop_token_id if stop_token_id is not None else eos_token_id
    if end_id is None:
        has_stop = torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
    else:
        has_stop = ((responses == end_id) & mask).any(dim=1)
    return responses.masked_fill(~mask, pad_token_id), mask, has_stop
