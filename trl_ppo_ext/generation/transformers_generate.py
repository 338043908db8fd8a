"""transformers' ``generate`` as a generation engine: the policy module samples itself.

The engine of every run without vLLM (and of a near-greedy sample with it): the same
``GenerationEngine`` interface as the vLLM engines, taking the padded prompt tensors directly
(:meth:`TransformersEngine.sample`). It holds the policy module itself, so "loading" a new
policy version moves no weight. Beside it: the stop ids every rollout ends at
(:func:`stop_token_ids`, :func:`generation_stop_ids`), the pad id ``generate`` may embed
(:func:`generation_pad_id`) and the complete, checkpoint-free generation settings
(:func:`sampling_config`, :func:`isolated_generation_config`).

Notation: ``B`` prompts, ``P`` prompt positions (left padded), ``T`` response positions.

Example:

>>> from trl_ppo_ext.generation.transformers_generate import generation_pad_id
>>> generation_pad_id(pad_token_id=10, stop_ids=(2,), num_embeddings=10)  # a [PAD] past the embedding: the EOS
2
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers import GenerationConfig

from ..models.prepare import embedding_rows
from .base import EngineSamples, GenerationEngine, SamplingSettings, effective_temperature
from .filters import RepetitionPenaltyProcessor, SamplingFilters

logger = logging.getLogger(__name__)

_BOOKKEEPING_FIELDS = frozenset({
    "transformers_version", "_from_model_config", "bos_token_id", "eos_token_id", "pad_token_id",
    "decoder_start_token_id", "max_length", "max_new_tokens", "min_new_tokens", "do_sample", "temperature",
    "top_k", "top_p", "use_cache", "cache_implementation", "cache_config", "return_dict_in_generate",
    "output_scores", "output_logits", "output_attentions", "output_hidden_states", "num_return_sequences",
})

def stop_token_ids(stop_token: str | None, stop_token_id: int | None, tokenizer, generation_config=None) -> tuple:
    """The ids that end a response, as generation and the response mask both use them.

    ``stop_token="eos"``: the tokenizer's EOS. ``stop_token_id``: that id alone. Neither
    (TRL's default): generation stops where ``transformers`` would have stopped it, at the
    checkpoint's ``generation_config.eos_token_id`` (an int or a list) and the tokenizer's
    EOS; the response mask then ends at that token too, so no token after it is trained on.
    An empty tuple means responses always run to ``response_length``.
    """
    if stop_token == "eos":
        return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    if stop_token_id is not None:
        return (int(stop_token_id),)
    ids = []
    checkpoint_eos = getattr(generation_config, "eos_token_id", None)
    for i in (checkpoint_eos if isinstance(checkpoint_eos, (list, tuple)) else [checkpoint_eos]):
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


def generation_pad_id(pad_token_id: int, stop_ids: tuple, num_embeddings: int) -> int:
    """A pad id ``generate`` may write into finished rows and then embed on the next step.

    The tokenizer's pad id if the embedding has a row for it; else the first stop id (an
    EOS is always in range); else 0. A ``[PAD]`` added to the tokenizer without resizing
    the embeddings (GPT-2, Llama-2 and TRL's own scripts do this) is out of range, and
    ``generate`` would index past the embedding matrix. Only masked positions get this id.
    """
    if 0 <= pad_token_id < num_embeddings:
        return int(pad_token_id)
    for i in stop_ids:
        if 0 <= i < num_embeddings:
            return int(i)
    return 0


def sampling_config(response_length: int, stop_ids: tuple, pad_id: int, temperature: float,
                    filters: SamplingFilters | None = None, cache_implementation: str | None = None,
                    ) -> GenerationConfig:
    """The complete generation settings of a rollout: sampling at ``temperature`` of up to
    ``response_length`` tokens, stopping at ``stop_ids``, through the run's ``filters`` (top-k,
    top-p, min-p; the repetition penalty is :func:`generate_responses`'s processor). Every other
    setting that shapes the sampling distribution is neutral, so the samples come from the
    distribution that ``log pi_old`` is computed under (see :func:`isolated_generation_config`).
    ``cache_implementation``: transformers' KV-cache kind (TRL GRPO's field; no effect on the samples)."""
    filters = filters or SamplingFilters()
    return GenerationConfig(
        max_new_tokens=response_length,
        min_new_tokens=0,
        do_sample=True,
        temperature=effective_temperature(temperature),
        **filters.generation_fields(),  # top_k, top_p, min_p; repetition_penalty=1.0
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        no_repeat_ngram_size=0,
        num_beams=1,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=pad_id,
        use_cache=True,
        cache_implementation=cache_implementation,
    )


def ignored_generation_fields(generation_config) -> dict:
    """The fields of a checkpoint's ``generation_config`` that a rollout ignores (they would
    change the sampling distribution), with their values; ``{}`` for None."""
    if generation_config is None:
        return {}
    return {k: v for k, v in generation_config.to_diff_dict().items() if k not in _BOOKKEEPING_FIELDS}


@contextmanager
def isolated_generation_config(model: torch.nn.Module):
    """Inside the block, every ``generation_config`` attribute of ``model`` and its submodules
    is a fresh ``GenerationConfig()``, so ``generate`` merges nothing from the checkpoint
    (``transformers`` fills every unset field from the model's own config; peft copies its
    own onto the base model). Restored on exit."""
    saved = [(m, vars(m)["generation_config"]) for m in model.modules() if "generation_config" in vars(m)]
    try:
        for m, _ in saved:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in saved:
            m.generation_config = config


@torch.no_grad()
def generate_responses(
    policy, queries: torch.Tensor, query_mask: torch.Tensor, generation_config: GenerationConfig,
    response_length: int, pad_token_id: int, chunk_size: int, filters: SamplingFilters | None = None,
) -> torch.Tensor:
    """Sample responses in chunks of ``chunk_size`` prompts; ``(B, T)`` padded with the pad id.

    Generation may stop before ``T`` tokens when every row of a chunk has finished; the
    missing columns are filled with ``pad_token_id`` (they are masked out later anyway).
    ``filters``: its ``repetition_penalty`` (the other filters are ``generation_config``'s, see
    :func:`sampling_config`), over each row's real prompt tokens and its new tokens.
    """
    penalty = 1.0 if filters is None else filters.repetition_penalty
    context_length = queries.shape[1]
    out = torch.full((queries.shape[0], response_length), pad_token_id, dtype=queries.dtype, device=queries.device)
    for start in range(0, queries.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        mask = query_mask[rows]
        with isolated_generation_config(policy):
            processors = [RepetitionPenaltyProcessor(penalty, mask)] if penalty != 1.0 else None
            seq = policy.generate(
                input_ids=queries[rows].masked_fill(~mask, 0), attention_mask=mask.long(),
                generation_config=generation_config, logits_processor=processors,
            )
        new = seq[:, context_length : context_length + response_length]
        out[rows, : new.shape[1]] = new
    return out


def configured_stop_token_id(args, tokenizer) -> int | None:
    """The one stop id the config names (``stop_token="eos"``: the tokenizer's EOS; else
    ``stop_token_id``, None when unset): what ``missing_eos_penalty`` tests."""
    if args.stop_token == "eos":
        return tokenizer.eos_token_id
    return args.stop_token_id


def generation_stop_ids(args, tokenizer, policy) -> tuple:
    """The stop ids of every rollout (:func:`stop_token_ids`); says once which of the checkpoint's
    generation settings are ignored, and that temperature 0 samples near-greedily. A negative
    temperature is refused here, before training."""
    checkpoint = getattr(policy, "generation_config", None)
    ignored = ignored_generation_fields(checkpoint)
    if ignored:
        logger.warning(
            "The policy's generation_config sets %s; PPO ignores these: the samples must come from the "
            "distribution the log-probs are computed under (PPOConfig.temperature, top_k, top_p, min_p and "
            "repetition_penalty; set those to sample with them). Remove them from generation_config.json to "
            "silence this.",
            ", ".join(f"{k}={v!r}" for k, v in sorted(ignored.items())),
        )
    if args.temperature == 0:
        logger.warning("PPOConfig.temperature=0: sampling at temperature %g (near-greedy), as TRL does.",
                       effective_temperature(0.0))
    effective_temperature(args.temperature)
    return stop_token_ids(args.stop_token, args.stop_token_id, tokenizer, checkpoint)


class TransformersEngine(GenerationEngine):
    """transformers' ``generate`` on the policy module itself, ``chunk_size`` prompts at a time,
    under ``autocast`` (the trainer's precision); draws from torch's global RNG, the run's.

    Args:
        policy: the causal LM (or ``PeftModel``) that samples; :meth:`load_policy` replaces it.
        chunk_size: prompts per ``generate`` call (``local_rollout_forward_batch_size``).
        cache_implementation: transformers' KV-cache kind (no effect on the samples).
        autocast: a context factory for the precision ``generate`` runs in.
    """

    def __init__(self, policy: nn.Module, *, chunk_size: int, cache_implementation: str | None = None,
                 autocast=nullcontext):
        self.policy, self.chunk_size = policy, chunk_size
        self.cache_implementation, self.autocast = cache_implementation, autocast

    def load_policy(self, policy: nn.Module, version: int) -> bool:
        """Sample with ``policy`` from now on: it is the module itself, so no weight moves (False)."""
        self.policy, self.policy_version = policy, version
        return False

    def _push_policy(self, policy: nn.Module, version: int) -> None:
        self.policy = policy

    def sample(self, queries: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings,
               pad_token_id: int) -> tuple[torch.Tensor, None, None]:
        """``(responses (B, T), None, None)``, ``T = settings.max_tokens``: ``generate``'s ids padded
        with ``pad_token_id``; no log-probs (the trainer's forward gives the policy's) and no
        sampled mask (every position up to the stop token was sampled).

        Args:
            queries: ``(B, P)`` left-padded prompt ids; query_mask: ``(B, P)`` bool.
            settings: its ``temperature`` as asked (0: near-greedy, see ``effective_temperature``).
        """
        filters = settings.filters()
        pad_id = generation_pad_id(pad_token_id, settings.stop_token_ids, embedding_rows(self.policy))
        config = sampling_config(settings.max_tokens, settings.stop_token_ids, pad_id, settings.temperature,
                                 filters, self.cache_implementation)
        with self.autocast():
            raw = generate_responses(self.policy, queries, query_mask, config, settings.max_tokens, pad_token_id,
                                     self.chunk_size, filters=filters)
        return raw, None, None

    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 generator: torch.Generator | None = None) -> EngineSamples:
        """The list form of :meth:`sample` (prompts left padded with id 0, masked): completions
        through the first stop id, no log-probs. ``generator`` is unused: ``generate`` draws from
        the global RNG."""
        width = max(len(p) for p in prompts)
        query_mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
        queries = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        device = next(self.policy.parameters()).device
        raw, _, _ = self.sample(queries.to(device), query_mask.to(device), settings, pad_token_id=0)
        completions = []
        for row in raw.tolist():
            ends = [i for i, t in enumerate(row) if t in settings.stop_token_ids]
            completions.append(row[: ends[0] + 1] if ends else row)
        return EngineSamples(completions, None)
