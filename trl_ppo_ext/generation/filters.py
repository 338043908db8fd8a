"""Sampling filters: TRL GRPO's ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty``, the same on
every engine and in the log-probs the update uses.

PPO's ratio compares ``pi(a_t | s_t)`` under the current policy with the old one, and both must be the
distribution the rollout was actually sampled from. With a filter on, that distribution is the
truncated one: the tokens the filter removes have probability 0 and the rest are renormalised. So the
filters act in three places, from one :class:`SamplingFilters`:

* transformers' ``generate``: ``top_k``/``top_p``/``min_p`` as ``GenerationConfig`` fields
  (:meth:`SamplingFilters.generation_fields`), the repetition penalty as a logits processor over the
  real prompt tokens and the tokens generated so far (:class:`RepetitionPenaltyProcessor`: transformers'
  own would also count the left padding of a batched prompt);
* vLLM (colocated and server): the same four fields of ``SamplingParams`` / the request
  (:meth:`SamplingFilters.engine_fields`);
* the scoring and update forwards: :func:`filtered_logits` turns the logits at the sampling
  temperature into those of the filtered distribution, in transformers' order (penalty, temperature,
  top-k, top-p, min-p). The old log-probs and the new ones come from the same function, so the first
  ratio is exactly 1; the entropy reported is the filtered distribution's.

Each position keeps the token that was sampled there even when the filter, recomputed from the
forward's logits, would drop it: the sampler kept it, and logits a rounding error away from the
sampler's must not give ``log pi_old = -inf``. In the update, a token that the new policy's filter
would drop keeps its (small) probability the same way.

TRL 1.16's GRPO samples with these filters but computes its log-probs from ``log_softmax(logits / T)``
without them (the untruncated distribution); vLLM's ``processed_logprobs`` (its importance-sampling
denominator) are the filtered ones. Here both are the filtered distribution's, and so are the reference
model's (the KL penalty): the reference as it would sample, its own filter over its own logits, the
sampled token kept. A policy equal to its reference then has KL 0, as without filters; against an
unfiltered reference every token would pay ``-log`` of the probability mass the filter keeps (with
``top_k=1`` on a tiny model: 21 nats per 6-token response at the first update).

Notation: ``B`` sequences, ``T`` response positions, ``V`` vocabulary, ``P`` prompt positions.

Example:

>>> import torch
>>> from trl_ppo_ext.generation.filters import SamplingFilters, filtered_logits
>>> logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])                 # (B=1, T=1, V=4)
>>> filtered_logits(logits, tokens=torch.tensor([[0]]), filters=SamplingFilters(top_k=2))
tensor([[[3., 2., -inf, -inf]]])
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

# The knobs a config's ``generation_kwargs`` may set (it wins over the fields, as in TRL GRPO).
FILTER_KEYS = ("top_k", "top_p", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingFilters:
    """The sampling filters of a run; the defaults are neutral (plain sampling at the temperature).

    Attributes:
        top_k: keep the ``top_k`` most likely tokens (ties with the last one kept too); 0: off.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``; 1.0: off.
        min_p: keep the tokens at least ``min_p`` times as likely as the most likely one; None: off.
        repetition_penalty: a token already in the prompt or the response has its logit divided by
            this when positive, multiplied when negative (CTRL's penalty); 1.0: off.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        check_filter_values(self.top_k, self.top_p, self.min_p, self.repetition_penalty)

    @classmethod
    def from_config(cls, args) -> SamplingFilters:
        """The filters of a config (``PPOConfig`` or anything with its fields): the four fields,
        overridden by the same keys of ``args.generation_kwargs`` (a dict or JSON text)."""
        values = {key: getattr(args, key, default) for key, default in
                  (("top_k", 0), ("top_p", 1.0), ("min_p", None), ("repetition_penalty", 1.0))}
        values.update(generation_kwargs_dict(getattr(args, "generation_kwargs", None)))
        return cls(**values)

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p is not None

    @property
    def is_neutral(self) -> bool:
        """Plain sampling: no filter and no penalty."""
        return not self.truncates and self.repetition_penalty == 1.0

    def generation_fields(self) -> dict:
        """``GenerationConfig`` fields of transformers' ``generate`` (the penalty is not one: see
        :class:`RepetitionPenaltyProcessor`)."""
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "repetition_penalty": 1.0}

    def engine_fields(self) -> dict:
        """vLLM's ``SamplingParams`` fields (its "off" values: ``top_k=0``, ``min_p=0.0``)."""
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": 0.0 if self.min_p is None else self.min_p,
                "repetition_penalty": self.repetition_penalty}


def check_filter_values(top_k, top_p, min_p, repetition_penalty, owner: str = "PPOConfig") -> None:
    """Refuse values no engine samples with, naming the field and the range."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{owner}.top_k must be an int >= 0 (0: no top-k filter), got {top_k!r}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{owner}.top_p must be in (0, 1] (1.0: no nucleus filter), got {top_p!r}.")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"{owner}.min_p must be in [0, 1] or None (no min-p filter), got {min_p!r}.")
    if not 0.0 < repetition_penalty < math.inf:
        raise ValueError(
            f"{owner}.repetition_penalty must be a finite number > 0 (1.0: none; > 1 discourages repeats), "
            f"got {repetition_penalty!r}."
        )


def generation_kwargs_dict(generation_kwargs, owner: str = "PPOConfig") -> dict:
    """``generation_kwargs`` (None, a dict, or JSON text from the command line) as a dict of filter
    values; any other key is refused: its effect on the sampled distribution would be missing from
    the log-probs the update uses."""
    if generation_kwargs is None:
        return {}
    if isinstance(generation_kwargs, str):
        try:
            generation_kwargs = json.loads(generation_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"{owner}.generation_kwargs={generation_kwargs!r} is not JSON: {err}.") from err
    if not isinstance(generation_kwargs, dict):
        kind = type(generation_kwargs).__name__
        raise TypeError(f"{owner}.generation_kwargs must be a dict or JSON text, got {kind}.")
    other = sorted(set(generation_kwargs) - set(FILTER_KEYS))
    if other:
        raise ValueError(
            f"{owner}.generation_kwargs sets {other}: PPO takes only {list(FILTER_KEYS)} there (the settings "
            "whose distribution the update's log-probs reproduce; any other one would make the samples come "
            "from a distribution the ratio does not know). Set temperature and response_length as fields."
        )
    return dict(generation_kwargs)


def seen_tokens(context_ids: torch.Tensor, context_mask: torch.Tensor, responses: torch.Tensor,
                vocab_size: int) -> torch.Tensor:
    """``(B, T, V)`` bool: token ``v`` appears in the real context or in ``responses[:, :t]``.

    Args:
        context_ids: ``(B, P)`` prompt ids; context_mask: ``(B, P)`` bool, True on real tokens.
        responses: ``(B, T)`` sampled ids; the penalty at ``t`` counts the tokens before ``t``.
    Equivalent to ``seen[b, t, v] = v in prompt[b] or v in responses[b, :t]``.
    """
    B, T = responses.shape
    in_prompt = torch.zeros(B, vocab_size, device=responses.device)
    in_prompt.scatter_add_(1, context_ids, context_mask.float())  # masked positions add 0
    # first position of each token in the response (T where it never appears)
    first = torch.full((B, vocab_size), T, device=responses.device, dtype=torch.long)
    positions = torch.arange(T, device=responses.device).expand(B, T)
    first.scatter_reduce_(1, responses, positions, reduce="amin")
    steps = torch.arange(T, device=responses.device).view(1, T, 1)
    return (in_prompt > 0).unsqueeze(1) | (first.unsqueeze(1) < steps)


def penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty: seen tokens' logits divided by ``penalty`` when positive, multiplied
    when negative. ``logits`` and ``seen`` of one shape; a new tensor."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def truncation_keep(logits: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
    """Bool mask over ``(..., V)``: the tokens top-k, then top-p, then min-p keep (transformers'
    order), each on the distribution the previous one left. At least one token stays."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    scores = logits.float()
    if filters.top_k > 0:
        kth = scores.topk(min(filters.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        keep &= scores >= kth
    if filters.top_p < 1.0:
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        mass_before = ordered.cumsum(-1) - ordered  # the mass of the more likely tokens
        # a token stays while the tokens before it have not yet reached top_p; the first always stays
        keep_sorted = mass_before < filters.top_p
        keep_sorted[..., 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    if filters.min_p is not None:
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1)
        keep &= probs >= filters.min_p * probs.amax(-1, keepdim=True)
    return keep


def filtered_logits(logits: torch.Tensor, tokens: torch.Tensor, filters: SamplingFilters | None,
                    seen: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the filtered distribution the sampler drew ``tokens`` from: penalty, then -inf on the
    tokens the truncation drops, except the sampled token of each position.

    Args:
        logits: ``(B, T, V)`` at the sampling temperature (divided by it already).
        tokens: ``(B, T)`` the sampled ids (any id where nothing was sampled: never read).
        filters: None or neutral: ``logits`` returned as they are.
        seen: ``(B, T, V)`` bool from :func:`seen_tokens`; needed when ``repetition_penalty != 1``.
    Returns:
        ``(B, T, V)``, differentiable through ``logits`` on the kept tokens. The penalty is applied
        after the temperature, which gives transformers' value: dividing by ``T > 0`` keeps each sign.
    """
    if filters is None or filters.is_neutral:
        return logits
    if filters.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("filtered_logits with a repetition_penalty needs `seen` (seen_tokens(...)).")
        logits = penalized(logits, seen, filters.repetition_penalty)
    if not filters.truncates:
        return logits
    with torch.no_grad():
        keep = truncation_keep(logits.detach(), filters)
        keep.scatter_(-1, tokens.unsqueeze(-1), True)
    return logits.masked_fill(~keep, -math.inf)


def filtered_response_logits(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             filters: SamplingFilters | None) -> torch.Tensor:
    """:func:`filtered_logits` for the response logits of one forward, reading the prompt and the
    responses from the forward's inputs.

    Args:
        logits: ``(B, T, V)`` response logits at the temperature (``rollout.response_logits``).
        input_ids, attention_mask: ``(B, P + T)``, the forward's inputs: ``cat(queries, responses)``.
    """
    if filters is None or filters.is_neutral:
        return logits
    T = logits.shape[1]
    responses = input_ids[:, -T:]
    seen = None
    if filters.repetition_penalty != 1.0:
        seen = seen_tokens(input_ids[:, :-T], attention_mask[:, :-T].bool(), responses, logits.shape[-1])
    return filtered_logits(logits, responses, filters, seen)


class RepetitionPenaltyProcessor(LogitsProcessor):
    """transformers logits processor: :func:`penalized` over the real prompt tokens and the tokens
    generated so far, as :func:`filtered_response_logits` scores them (transformers' own processor
    also counts the ids of the prompt's left padding).

    Args:
        penalty: the repetition penalty (> 0).
        prompt_mask: ``(b, P)`` bool, True on the real prompt tokens of the ``b`` rows generated.
    """

    def __init__(self, penalty: float, prompt_mask: torch.Tensor):
        self.penalty, self.prompt_mask = penalty, prompt_mask.bool()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        b, P = self.prompt_mask.shape
        generated = torch.ones(b, input_ids.shape[1] - P, dtype=torch.bool, device=input_ids.device)
        real = torch.cat([self.prompt_mask.to(input_ids.device), generated], dim=1)
        seen = torch.zeros_like(scores).scatter_add_(1, input_ids, real.to(scores.dtype)) > 0
        return penalized(scores, seen, self.penalty)
