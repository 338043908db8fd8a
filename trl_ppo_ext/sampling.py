"""The rollout sampler: prompts -> ``SampledBatch``, the pipeline's first phase.

:class:`RolloutSampler` turns a batch of prompts (the collator's ``input_ids`` and
``attention_mask``, plus the dataset's other columns) into a :class:`~trl_ppo_ext.rollout.SampledBatch`
in one of three ways:

* one engine (``generation/``): the vLLM engine with ``use_vllm`` (and a temperature it samples
  at faithfully), else transformers' ``generate`` (``generation.transformers_generate``);
* a user's ``rollout_func`` (TRL GRPO's contract), whose turns sample through
  :meth:`RolloutSampler.continue_prefixes`;
* the tool loop (``agents.AgentRollout``), whose ``generate`` callable is
  :meth:`RolloutSampler.continue_prefixes` with the episode's policy, temperature and log-prob mode
  bound as arguments: it never calls back into the trainer.

What it samples with is passed in: a :class:`PolicySnapshot` (the trainer's model, the update the
batch belongs to and the version of its weights) and the temperature. ``rollout.py`` then scores
the batch (``SampledBatch -> Rollout``).

Asynchronous rollouts (``max_staleness > 0``, docs/async.md): :meth:`RolloutSampler.next_sample`
replaces ``sample`` as the trainer's one call per rollout. A ``RolloutProducer`` samples the next
batches on the vLLM server in a background thread, reading prompts ahead through a
``PromptFeed`` (the trainer's data cursor stays at the batch it trains next); each batch carries
the ``policy_version`` that sampled it (never more than ``max_staleness`` behind).
:meth:`RolloutSampler.end_update` stages the new weights after each update and announces them
(at a checkpoint it also discards the batches in flight, which are sampled again from the saved
weights: exact resume needs nothing saved but the step); :meth:`RolloutSampler.async_metrics` gives
the ``async/*`` (and ``off_policy/*``) figures. Request seeds come from the batch's index, not the
run's RNG, which the trainer's thread draws from meanwhile. Episodes (a ``rollout_func``, the tool
loop) are sampled whole on the producer's thread, every turn at the batch's version, environments
from a pool slot of their own; with several processes process 0 pushes each version and the others
follow it after a barrier on the trainer's thread (:meth:`RolloutSampler.end_update`).

Notation: ``B`` prompts, ``P`` prompt positions (left padded), ``T`` response positions.

Example:

>>> import torch
>>> from trl_ppo_ext.sampling import prompt_tensors
>>> ids = torch.tensor([[5, 6, 0], [7, 0, 0]])                  # right padded by a collator
>>> queries, query_mask = prompt_tensors({"input_ids": ids, "attention_mask": ids != 0}, 0, "cpu")
>>> queries.tolist(), query_mask.tolist()                        # left padded, as every engine takes them
([[0, 5, 6], [0, 0, 7]], [[False, True, True], [False, False, True]])
"""

from __future__ import annotations

import copy
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from ._compat import unwrap_model_for_generation
from .agents.tool_loop import ToolLoopStats
from .async_rollouts import PromptFeed, ReadAheadPrompts, RolloutProducer, VersionedBatch
from .data import PromptCollator
from .episodes import continuation_rows, episode_has_stop, pad_episodes, padded_prompts, rollout_outputs
from .generation import SamplingSettings, build_vllm_engine, sample_responses
from .generation.base import VLLM_MIN_TEMPERATURE, GenerationEngine, effective_temperature
from .generation.filters import SamplingFilters
from .generation.transformers_generate import TransformersEngine
from .models.prepare import embedding_rows
from .off_policy import behaviour_weights, off_policy_stats
from .rollout import SampledBatch, finalize_responses, left_pad, reference_response_logprobs, sequence_inputs

__all__ = ["PolicySnapshot", "PromptFeed", "RolloutSampler", "TurnSettings", "ahead_seed", "build_agent_rollout",
           "prompt_tensors", "vllm_policy_engine"]


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy a batch is sampled with, as of the moment sampling starts."""

    model: nn.Module  # the trainer's model as prepared (DDP/DeepSpeed wrapped); its ``.policy`` samples
    version: int  # the update the batch is sampled for (the global step): ``SampledBatch.policy_version``
    weights_version: int  # the global step its weights are from: an engine holding another version gets them


@dataclass(frozen=True)
class TurnSettings:
    """How the turns of the episodes being sampled continue their prefixes."""

    policy: nn.Module | None  # the causal LM that samples (unwrapped; gathered under ZeRO-3); None ahead
    temperature: float  # as asked; 0: near-greedy (``effective_temperature``)
    logprobs: bool  # whether the sampler's log-probs are computed where ``generate`` samples
    weights_version: int  # see PolicySnapshot; ahead: the staged version every turn samples from
    ahead: torch.Generator | None = None  # sampled ahead (producer thread): the batch's request-seed stream


def prompt_tensors(batch, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(queries (B, P), query_mask (B, P) bool)`` left padded, from a collated batch's
    ``input_ids`` and ``attention_mask`` (without a mask, the pad id marks padding).

    Raises:
        ValueError: a row without any attended token.
    """
    ids = batch["input_ids"].to(device)
    if "attention_mask" in batch:
        mask = batch["attention_mask"].to(device).bool()
    else:  # a custom collator without a mask: the only remaining signal is the pad id
        mask = ids != pad_token_id
    if ids.shape[1] == 0 or not mask.any(dim=1).all():
        raise ValueError(
            "A batch holds an empty prompt (no attended token). Every prompt needs at least one token: drop "
            "empty rows from the dataset, and check that the data_collator returns an `attention_mask`."
        )
    return left_pad(ids, mask, pad_token_id)


def vllm_policy_engine(args, unwrapped: nn.Module, *, is_peft: bool, adapter_name: str | None,
                       engine_kwargs: dict | None = None) -> GenerationEngine:
    """The vLLM engine of ``use_vllm``, built from the policy itself (the causal LM, or the
    ``PeftModel`` whose policy adapter it samples with; never the value model or value adapter):
    ``unwrapped`` is the trainer's model without DDP/DeepSpeed wrapping. Leaves the RNG as it was."""
    policy = unwrapped.policy
    adapter = None
    if is_peft:
        adapter = getattr(unwrapped, "policy_adapter", None) or adapter_name or policy.active_adapter
    return build_vllm_engine(args, policy, adapter=adapter, seed=args.seed, engine_kwargs=engine_kwargs)


def build_agent_rollout(args, tokenizer, tools, environment_factory, model, train_dataset):
    """The tool loop of a run with ``tools`` or an ``environment_factory`` (``agents.AgentRollout``: TRL's
    checks of the chat template and the environments run here), or None without either. Its context is
    vLLM's ``vllm_max_model_length`` with ``use_vllm``, else the model's ``max_position_embeddings``; an
    environment's ``reset`` is probed with the dataset's first row."""
    if not tools and environment_factory is None:
        return None
    from .agents import AgentRollout

    max_model_len = args.vllm_max_model_length if args.use_vllm else None
    if max_model_len is None:
        max_model_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    sample_row = None
    if environment_factory is not None and train_dataset is not None and len(train_dataset):
        sample_row = {k: v for k, v in train_dataset[0].items() if k not in PromptCollator.TOKEN_KEYS}
    return AgentRollout(
        tokenizer, tools=tools, environment_factory=environment_factory, response_length=args.response_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations, chat_template_kwargs=args.chat_template_kwargs,
        tool_timeout=args.tool_timeout, max_model_len=max_model_len, sample_row=sample_row)


class RolloutSampler:
    """Prompts -> ``SampledBatch`` through one engine, a ``rollout_func`` or the tool loop.

    Args:
        args: the run's config, read at every call (``response_length``, ``temperature``,
            ``use_vllm``, the sampling filters, ``local_rollout_forward_batch_size``, ...).
        tokenizer: the policy's tokenizer (its pad id; prompts decoded for a ``rollout_func``).
        accelerator: the trainer's ``Accelerator`` (device, precision, unwrapping for generation).
        stop_token_ids: the ids that end a response (``generation.transformers_generate.generation_stop_ids``).
        rollout_func: ``prompts -> dict`` (TRL GRPO's ``rollout_func`` with its trainer bound), or None.
        agent_rollout: the tool loop (``agents.AgentRollout``), or None.
        engine_factory: ``() -> GenerationEngine``, the vLLM engine (built when first needed).
        turns: ``(prefixes, max_new_tokens) -> (ids, logprobs)`` that the tool loop samples its turns
            with instead of :meth:`continue_prefixes` (a trainer subclass's own ``generate_continuations``).

    Attributes:
        engine: the vLLM engine, or None (none yet, or closed: the next vLLM sample builds one).
        tool_stats: the tool loop's counts summed over the batches sampled since it was last reset.
    """

    def __init__(self, args, tokenizer, accelerator, stop_token_ids: tuple, *,
                 rollout_func: Callable[[list], dict] | None = None, agent_rollout=None,
                 engine_factory: Callable[[], GenerationEngine] | None = None,
                 turns: Callable | None = None):
        self.args, self.tokenizer, self.accelerator = args, tokenizer, accelerator
        self.stop_token_ids = stop_token_ids
        self.rollout_func, self.agent_rollout = rollout_func, agent_rollout
        self.engine_factory, self.turns = engine_factory, turns
        self.engine: GenerationEngine | None = None
        self.tool_stats = ToolLoopStats()
        # The turn settings of the episodes being sampled. A rollout_func receives the trainer (TRL's contract)
        # and calls its generate_continuations(prefixes, max_new_tokens): those calls find the episode's policy,
        # temperature and log-prob mode here. The tool loop gets them bound as arguments instead.
        # Per thread: the producer's episodes (max_staleness > 0) and the trainer's own run at the same time.
        self._local = threading.local()
        # max_staleness > 0: the producer thread, the prompts it reads ahead, the newest published version,
        # the batch handed out last; the lock keeps one engine request stream at a time (producer or trainer)
        self._producer: RolloutProducer | None = None
        self._prompts: ReadAheadPrompts | None = None
        self._published = 0
        self._last: VersionedBatch | None = None
        self._engine_lock = threading.Lock()
        self._vocab_size = 0  # the policy's embedding rows, for the episodes the producer samples

    # ------------------------------------------------------------------ whole batches
    @torch.no_grad()
    def sample(self, batch, policy: PolicySnapshot, temperature: float | None = None) -> SampledBatch:
        """Sample responses to a collated batch of prompts with ``policy`` at ``temperature``
        (default: ``args.temperature``): through :meth:`sample_episodes` with a ``rollout_func``
        or tools, else one response per prompt on the run's engine -- the vLLM engine with
        ``use_vllm``, except below ``VLLM_MIN_TEMPERATURE`` (a greedy evaluation, which training
        never samples at: the config refuses it), where vLLM's log-probs are wrong and transformers'
        ``generate`` samples instead.

        Returns:
            A ``SampledBatch`` whose ``engine_logprobs`` ``(B, T)`` are vLLM's (0 off the response
            mask), or None where ``generate`` sampled.
        """
        args, pad_token_id = self.args, self.tokenizer.pad_token_id
        temperature = args.temperature if temperature is None else temperature
        if self.rollout_func is not None or self.agent_rollout is not None:
            return self.sample_episodes(batch, policy, temperature)
        queries, query_mask = prompt_tensors(batch, pad_token_id, self.accelerator.device)
        with self._generating(policy.model) as module:
            raw, engine_logprobs, sampled = self._sample_ids(module, queries, query_mask, temperature,
                                                             args.response_length, policy.weights_version)
        responses, mask, has_stop = finalize_responses(raw, self.stop_token_ids, pad_token_id, sampled)
        if engine_logprobs is not None:
            engine_logprobs = engine_logprobs.masked_fill(~mask, 0.0)
        return SampledBatch(
            queries=queries, query_mask=query_mask, responses=responses, response_mask=mask, has_stop=has_stop,
            policy_version=policy.version, engine_logprobs=engine_logprobs, extras=_columns(batch),
        )

    @torch.no_grad()
    def sample_episodes(self, batch, policy: PolicySnapshot, temperature: float) -> SampledBatch:
        """A batch of episodes from the ``rollout_func`` (called with a copy of the batch's
        ``prompt`` column, or its decoded prompts) or the tool loop (called with a copy of each
        row), checked (``episodes.rollout_outputs``: errors name the key and row) and padded
        (``episodes.pad_episodes``): ``prompt_ids`` are the queries, ``completion_ids`` the
        responses, ``env_mask`` the ``action_mask``, every other key a column the rewards receive.

        The turns sample with ``policy`` at ``temperature`` (:meth:`continue_prefixes`). The
        tool loop's turns skip the sampler's log-probs without vLLM (the trainer's forward gives the
        old ones); with vLLM the engine's are kept (importance weights, ``sampling/*``).
        """
        # an id past the embedding rows would crash deep in the model (a device assert on CUDA): refused there
        vocab_size = functools.partial(embedding_rows, self.accelerator.unwrap_model(policy.model).policy)
        with self._generating(policy.model) as module:
            turn = TurnSettings(module, temperature, logprobs=self.args.use_vllm if self.agent_rollout else True,
                                weights_version=policy.weights_version)
            sample, stats = self._episodes(batch, turn, self.accelerator.device, policy.version, vocab_size)
        self.tool_stats = self.tool_stats + stats
        return sample

    def _episodes(self, batch, turn: TurnSettings, device, policy_version: int, vocab_size: Callable[[], int],
                  slot: int = 0) -> tuple[SampledBatch, ToolLoopStats]:
        """:meth:`sample_episodes`' batch, its turns sampled as ``turn`` says, on ``device``, and
        the tool loop's counts (none for a ``rollout_func``). ``vocab_size()``: the policy's
        embedding rows (ids are checked against them); ``slot``: the environment pool
        (``agents.Environments.draw``; 0 on the trainer's thread). Reads no trainer state."""
        args, tok = self.args, self.tokenizer
        extras = _columns(batch)
        prompts = extras.get("prompt")
        if prompts is None:
            queries, query_mask = prompt_tensors(batch, tok.pad_token_id, device)
            prompts = tok.batch_decode([q[m].tolist() for q, m in zip(queries, query_mask)], skip_special_tokens=True)
        stats = ToolLoopStats()
        with self._in_episode(turn):
            if self.agent_rollout is not None:  # tools / environments: the tool loop
                rows = [{k: column[b] for k, column in extras.items()} for b in range(len(prompts))]
                generate = self.turns or functools.partial(self._continue_checked, turn=turn)
                output, stats = self.agent_rollout.run(copy.deepcopy(rows), generate, slot=slot)
            else:
                output = self.rollout_func(copy.deepcopy(prompts))
        outputs = rollout_outputs(output, num_prompts=len(prompts), response_length=args.response_length,
                                  vocab_size=vocab_size())
        responses, response_mask, action_mask, sampler_logprobs = pad_episodes(outputs, tok.pad_token_id)
        queries, query_mask = padded_prompts(outputs.prompt_ids, tok.pad_token_id)
        responses, response_mask, action_mask = responses.to(device), response_mask.to(device), action_mask.to(device)
        engine_logprobs = None
        if args.use_vllm:  # NaN where there is none (environment tokens count as none, and are never read)
            engine_logprobs = sampler_logprobs.to(device).masked_fill(~response_mask, 0.0)
        return SampledBatch(
            queries=queries.to(device), query_mask=query_mask.to(device), responses=responses,
            response_mask=response_mask, action_mask=action_mask,
            has_stop=episode_has_stop(responses, action_mask, self.stop_token_ids),
            policy_version=policy_version, engine_logprobs=engine_logprobs, extras={**extras, **outputs.extra},
        ), stats

    # ------------------------------------------------------------------ asynchronous rollouts
    def next_sample(self, feed: PromptFeed, policy: PolicySnapshot) -> SampledBatch:
        """The batch the trainer trains next, sampled ahead in the background (``max_staleness > 0``).

        The first call stages ``policy``'s weights as version ``policy.version`` (the global step)
        and starts the producer; every call reads prompts up to ``max_staleness`` batches ahead of
        this one from ``feed`` (on this thread) and waits for this batch. Batch ``i`` (counted in
        updates from the run's start, so a resumed run continues the numbering) is sampled at
        version ``max(v0, i - max_staleness)``; its ``policy_version`` says which. Episodes (a
        ``rollout_func``, tools) are sampled whole on the producer's thread, every turn at that
        version; the tool loop's counts of the batch are added to ``tool_stats`` here.

        Raises:
            NotImplementedError: an engine without a staged file push; with several processes,
                one that cannot follow the versions process 0 pushes (the ``"files"`` sync).
        """
        if self._producer is None:
            self._start_producer(feed, policy)
        index = self._producer_taken
        self._prompts.fill(upto=index + self.args.max_staleness)
        item = self._producer.get()
        self._prompts.taken(item.index)
        self._producer_taken, self._last = item.index + 1, item
        sample, stats = item.batch
        self.tool_stats = self.tool_stats + stats
        return _on_device(sample, self.accelerator.device)

    def end_update(self, policy: PolicySnapshot, *, checkpoint: bool = False) -> None:
        """After an update: stage ``policy``'s weights as version ``policy.version`` and announce
        them, then release the versions no batch will ask for. ``checkpoint``: a checkpoint of this
        step is about to be written: the batches sampled ahead are discarded and sampled again
        from these weights, which is what a run resumed from it does. No-op when synchronous.
        Every process calls it (the trainer's thread): see :meth:`_push_version`."""
        if self._producer is None:
            return
        self._push_version(policy)
        self._published = policy.version
        self._producer.publish(policy.version)
        self.engine.release_below(self._producer.needed_version())
        if checkpoint:
            self._producer.checkpoint()

    def _push_version(self, policy: PolicySnapshot) -> None:
        """Stage ``policy``'s weights as ``policy.version``. With several processes, process 0
        pushes them to the one server (``engine.push_version``: written and loaded there), every
        process waits for that push at a barrier, and the others then follow the version
        (``engine.follow_version``): no producer asks for a version before it is on the server.
        The barrier runs on the trainer's thread, between the trainer's own collectives; the
        producer threads run none (they only send requests to the server), so no two collectives
        of a process ever run at once. Under ZeRO-3 every process enters the gather."""
        accelerator = self.accelerator
        with self._generating(policy.model) as module:
            if accelerator.num_processes == 1:
                self.engine.stage_policy(module, policy.version)
                return
            if accelerator.is_main_process:
                self.engine.push_version(module, policy.version)
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            self.engine.follow_version(policy.version)

    def async_state(self) -> dict[str, int]:
        """What a resumed sampler starts from: ``{"next_index", "version"}``. At a checkpoint
        written after :meth:`end_update` both equal the trainer's global step, which the trainer
        saves anyway, so nothing more is saved; empty when synchronous."""
        if self._producer is None:
            return {}
        return {"next_index": self._producer_taken, "version": self._published}

    def async_metrics(self, rollout=None) -> dict[str, float]:
        """The ``async/*`` figures of the batch handed out last (``RolloutProducer.metrics``) and,
        with ``off_policy_correction``, the ``off_policy/*`` figures of ``rollout`` (its proximal
        log-probs ``logprobs`` against the engine's); empty when synchronous."""
        if self._producer is None:
            return {}
        metrics = dict(self._producer.metrics())
        correction = self.args.off_policy_correction
        if rollout is not None and correction != "none" and rollout.engine_logprobs is not None:
            weights = behaviour_weights(rollout.logprobs, rollout.engine_logprobs, rollout.loss_mask,
                                        correction=correction, cap=self.args.off_policy_cap)
            stats = off_policy_stats(rollout.logprobs, rollout.engine_logprobs, rollout.loss_mask, weights,
                                     cap=self.args.off_policy_cap, staleness=self._last.staleness)
            metrics.update({k: float(v) for k, v in stats.items()})
        return metrics

    def _start_producer(self, feed: PromptFeed, policy: PolicySnapshot) -> None:
        if self.engine is None:
            self.engine = self.engine_factory()
        if not hasattr(self.engine, "stage_policy"):
            raise NotImplementedError(
                f"max_staleness={self.args.max_staleness} needs an engine that stages versions "
                f"(server_weights.VLLMServerFileEngine), got {type(self.engine).__name__}; set "
                "vllm_server_weight_sync='adapter' or 'files'."
            )
        processes = self.accelerator.num_processes
        if processes > 1 and not getattr(self.engine, "follows_versions", False):
            raise NotImplementedError(
                f"max_staleness={self.args.max_staleness} with {processes} processes needs a weight push that keeps "
                "several versions on the server, which every process names (vllm_server_weight_sync='adapter': a "
                "LoRA policy); the 'files' sync reloads one version in place, under the other processes' requests. "
                "Use a LoRA policy with vllm_server_weight_sync='adapter', one process, or max_staleness=0."
            )
        if self.rollout_func is not None or self.agent_rollout is not None:
            # read once here, on the trainer's thread: the producer's episodes check their ids against it
            self._vocab_size = embedding_rows(self.accelerator.unwrap_model(policy.model).policy)
        self._push_version(policy)
        self._published = self._producer_taken = policy.version
        self._prompts = ReadAheadPrompts(feed, first_index=policy.version)
        self._prompts.fill(upto=policy.version + self.args.max_staleness)  # before the thread asks for them
        self._producer = RolloutProducer(self._sample_ahead, max_staleness=self.args.max_staleness,
                                         next_index=policy.version, version=policy.version)

    @torch.no_grad()
    def _sample_ahead(self, version: int, index: int) -> tuple[SampledBatch, ToolLoopStats]:
        """Batch ``index`` sampled at policy ``version`` on the engine (the producer's thread): a
        function of the two alone (the prompts of that index, request seeds from ``ahead_seed``,
        one stream for all the turns of an episode batch). Tensors stay on the CPU;
        :meth:`next_sample` moves them. Episodes draw their environments from slot
        ``1 + index % (max_staleness + 1)``: at most ``max_staleness + 1`` batches are alive at once
        (the one the trainer scores, the ones queued or in flight after it), so none shares an
        instance with another, nor with the trainer's own sampling (slot 0)."""
        args, pad_token_id = self.args, self.tokenizer.pad_token_id
        batch = self._prompts.batch(index)
        generator = torch.Generator().manual_seed(ahead_seed(args.seed, index, self.accelerator.process_index))
        if self.rollout_func is not None or self.agent_rollout is not None:
            turn = TurnSettings(None, args.temperature, logprobs=True, weights_version=version, ahead=generator)
            return self._episodes(batch, turn, "cpu", version, lambda: self._vocab_size,
                                  slot=1 + index % (args.max_staleness + 1))
        queries, query_mask = prompt_tensors(batch, pad_token_id, "cpu")
        raw, engine_logprobs, sampled = self._sample_staged(queries, query_mask, args.temperature,
                                                            args.response_length, version, generator)
        responses, mask, has_stop = finalize_responses(raw, self.stop_token_ids, pad_token_id, sampled)
        return SampledBatch(
            queries=queries, query_mask=query_mask, responses=responses, response_mask=mask, has_stop=has_stop,
            policy_version=version, engine_logprobs=engine_logprobs.masked_fill(~mask, 0.0), extras=_columns(batch),
        ), ToolLoopStats()

    def _sample_staged(self, queries: torch.Tensor, query_mask: torch.Tensor, temperature: float, width: int,
                       version: int, generator: torch.Generator):
        """``(responses (B, width), engine_logprobs (B, width), sampled (B, width) bool)`` from the
        engine at the staged ``version``, request seeds drawn from ``generator`` (the producer's
        thread; the lock keeps the version switch and its requests together)."""
        temperature = effective_temperature(temperature)
        settings = replace(self._settings(width, temperature), temperature=temperature)
        with self._engine_lock:
            self.engine.use_version(version)
            return sample_responses(self.engine, queries, query_mask, settings, self.tokenizer.pad_token_id,
                                    generator=generator)

    # ------------------------------------------------------------------ turns
    @torch.no_grad()
    def continue_prefixes(self, prefixes: list[list[int]], max_new_tokens: int | list[int],
                          temperature: float | None = None, *, logprobs: bool | None = None,
                          policy: PolicySnapshot | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """Continue token-id prefixes (a ``rollout_func``'s turns, or a call outside any rollout).

        Inside :meth:`sample_episodes` the episode's policy, temperature and log-prob mode fill what
        is not given; outside, ``policy`` samples at ``args.temperature`` with log-probs.

        Args:
            prefixes: B non-empty token-id lists (each a whole conversation so far).
            max_new_tokens: the most new tokens, one for all rows or one per row (>= 1 each).
            logprobs: False: NaN for every log-prob where ``generate`` sampled (skips the policy's
                forward that computes them; the vLLM engine returns its own anyway).
            policy: what samples outside an episode (needed there).

        Returns:
            ``(ids, logprobs)``: per row the new ids, ending with the first stop token when one was
            sampled (kept), at most that row's budget; and the sampler's log-prob of each new id at
            the sampling temperature (the policy's own where ``generate`` sampled).
        """
        turn = getattr(self._local, "episode", None)  # this thread's episode (the producer's, or the trainer's)
        if turn is not None:
            turn = replace(turn, temperature=turn.temperature if temperature is None else temperature,
                           logprobs=turn.logprobs if logprobs is None else logprobs)
            return self._continue_checked(prefixes, max_new_tokens, turn)
        if policy is None:
            raise ValueError("continue_prefixes outside an episode needs the policy to sample with (policy=).")
        budgets = _budgets(prefixes, max_new_tokens)  # refused before any gather
        with self._generating(policy.model) as module:
            turn = TurnSettings(module, self.args.temperature if temperature is None else temperature,
                                logprobs=True if logprobs is None else logprobs,
                                weights_version=policy.weights_version)
            return self._continue(prefixes, budgets, turn)

    def _continue_checked(self, prefixes, max_new_tokens, turn: TurnSettings):
        return self._continue(prefixes, _budgets(prefixes, max_new_tokens), turn)

    def _continue(self, prefixes: list[list[int]], budgets: list[int], turn: TurnSettings):
        """:meth:`continue_prefixes` with the turn's settings given; ``budgets`` one per prefix."""
        pad_token_id = self.tokenizer.pad_token_id
        device = "cpu" if turn.ahead is not None else self.accelerator.device
        queries, query_mask = (t.to(device) for t in padded_prompts(prefixes, pad_token_id))
        if turn.ahead is not None:  # the producer's thread: the staged version, the batch's seed stream
            raw, engine_logprobs, sampled = self._sample_staged(queries, query_mask, turn.temperature, max(budgets),
                                                                turn.weights_version, turn.ahead)
        else:
            raw, engine_logprobs, sampled = self._sample_ids(turn.policy, queries, query_mask, turn.temperature,
                                                             max(budgets), turn.weights_version)
        responses, mask, _ = finalize_responses(raw, self.stop_token_ids, pad_token_id, sampled)
        if engine_logprobs is None and turn.logprobs:  # generate's sampler is the policy: its log-probs at T
            part = SampledBatch(queries=queries, query_mask=query_mask, responses=responses, response_mask=mask,
                                has_stop=mask[:, -1])
            inputs = sequence_inputs(queries, query_mask, responses, mask)
            engine_logprobs = reference_response_logprobs(
                turn.policy, part, inputs, effective_temperature(turn.temperature), self.accelerator.autocast,
                filters=SamplingFilters.from_config(self.args))
        elif engine_logprobs is None:
            engine_logprobs = torch.full(responses.shape, float("nan"), device=responses.device)
        return continuation_rows(responses, mask, engine_logprobs, budgets)

    # ------------------------------------------------------------------ engines
    def _sample_ids(self, policy: nn.Module, queries, query_mask, temperature: float, width: int,
                    weights_version: int):
        """``(raw ids (B, width), engine log-probs or None, sampled mask or None)`` from the engine
        the temperature allows: vLLM with ``use_vllm`` at ``VLLM_MIN_TEMPERATURE`` or above, else
        transformers' ``generate`` on ``policy``."""
        if self.args.use_vllm and effective_temperature(temperature) >= VLLM_MIN_TEMPERATURE:
            return self.sample_on_engine(policy, queries, query_mask, temperature, weights_version, width)
        engine = TransformersEngine(policy, chunk_size=self.args.local_rollout_forward_batch_size,
                                    cache_implementation=self.args.cache_implementation,
                                    autocast=self.accelerator.autocast)
        return engine.sample(queries, query_mask, self._settings(width, temperature), self.tokenizer.pad_token_id)

    def sample_on_engine(self, policy: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor,
                         temperature: float, weights_version: int, max_tokens: int | None = None):
        """``(responses (B, T), engine_logprobs (B, T), sampled (B, T) bool)`` from the vLLM engine
        (``sampled``: where it produced a token). The policy's weights are pushed first when their
        version changed (under ZeRO-3 inside the caller's gather); request seeds come from the run's
        global RNG (which checkpoints save: a resumed run samples what the unbroken one did); the
        engine sleeps afterwards (its memory free while the model trains). ``max_tokens``: the most
        new tokens per row (default ``response_length``, the width of the result)."""
        width = self.args.response_length if max_tokens is None else max_tokens
        settings = replace(self._settings(width, temperature), temperature=effective_temperature(temperature))
        if self._producer is not None:  # asynchronous: the newest published version, between the producer's batches
            with self._engine_lock:
                self.engine.use_version(self._published)
                return self.engine.sample(queries, query_mask, settings, self.tokenizer.pad_token_id)
        if self.engine is None:  # none yet, or closed by an earlier train()
            self.engine = self.engine_factory()
        self.engine.load_policy(policy, weights_version)
        try:
            return self.engine.sample(queries, query_mask, settings, self.tokenizer.pad_token_id)
        finally:
            self.engine.sleep()

    def _settings(self, max_tokens: int, temperature: float) -> SamplingSettings:
        return SamplingSettings(max_tokens=max_tokens, temperature=temperature,
                                stop_token_ids=tuple(self.stop_token_ids),
                                **SamplingFilters.from_config(self.args).engine_fields())

    def close_engine(self) -> None:
        """Stop the asynchronous producer (its batches in flight are dropped) and release the vLLM
        engine; a later vLLM sample builds a new one."""
        producer, self._producer, self._prompts, self._last = self._producer, None, None, None
        if producer is not None:
            producer.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # ------------------------------------------------------------------ contexts
    @contextmanager
    def _generating(self, model: nn.Module) -> Iterator[nn.Module]:
        """The policy of the trainer's ``model`` ready to sample (unwrapped; gathered under ZeRO-3
        with ``ds3_gather_for_generation``)."""
        with unwrap_model_for_generation(
            model, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
        ) as unwrapped:
            yield unwrapped.policy

    @contextmanager
    def _in_episode(self, turn: TurnSettings) -> Iterator[TurnSettings]:
        self._local.episode = turn
        try:
            yield turn
        finally:
            self._local.episode = None


def ahead_seed(seed: int, index: int, process_index: int = 0) -> int:
    """The seed of the request seeds of batch ``index`` sampled ahead: a function of the run's
    seed, the batch and the process only (the run's RNG is the trainer thread's meanwhile).

    Example:
        >>> ahead_seed(0, 3) == ahead_seed(0, 3) != ahead_seed(0, 4)
        True
    """
    digest = hashlib.sha256(f"{seed}/{process_index}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _on_device(sample: SampledBatch, device) -> SampledBatch:
    """``sample`` with its tensors on ``device`` (the producer samples on the CPU)."""
    moved = {name: getattr(sample, name).to(device) for name in ("queries", "query_mask", "responses",
                                                                  "response_mask", "has_stop", "engine_logprobs")}
    return replace(sample, **moved)


def _columns(batch) -> dict[str, list]:
    """The batch's dataset columns other than the collator's token tensors."""
    return {k: list(v) for k, v in batch.items() if k not in PromptCollator.TOKEN_KEYS}


def _budgets(prefixes: list[list[int]], max_new_tokens: int | list[int]) -> list[int]:
    """One budget per prefix; refuses empty prefixes and budgets below 1."""
    budgets = [max_new_tokens] * len(prefixes) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if not prefixes or len(budgets) != len(prefixes) or min(budgets) < 1 or any(not p for p in prefixes):
        raise ValueError(
            f"generate_continuations needs non-empty prefixes and one max_new_tokens >= 1 per prefix; got "
            f"{len(prefixes)} prefixes (lengths {[len(p) for p in prefixes]}) and max_new_tokens={max_new_tokens}"
        )
    return budgets
