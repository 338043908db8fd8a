"""A sampled batch's rewards, read as the trainer reads them: every reward once per batch.

A reward model of the policy's vocabulary is read at the last valid token, chunk by chunk of
the scoring forwards (``chunk_scores``, the trainer's ``reward_scores`` hook, which a subclass
may override as in TRL); one with its own tokenizer scores its own rendering of the text
(:func:`text_scores`); reward functions get the batch's keyword arguments, built once
(``function_kwargs``, the trainer's ``reward_function_kwargs`` hook). Those two hooks are the
only calls back into the trainer; everything else is an argument (:class:`RewardReader`).

Notation: ``B`` rows of the batch, ``T`` response tokens, ``F`` rewards.

>>> from types import SimpleNamespace
>>> from trl_ppo_ext.rewards.scoring import Reward
>>> sample = SimpleNamespace(response_mask=torch.ones(2, 1, dtype=torch.bool), action_mask=None)
>>> reader = RewardReader(None, torch.device("cpu"), None, 2, None, offload=False)
>>> length = Reward("length", lambda completions, **kw: [float(len(c)) for c in completions], 0.5)
>>> score_batch_rewards([length], sample, [], reader, chunk_scores=None, update=1,
...                     function_kwargs=lambda s: {"completions": ["ab", "abcd"]})[0]  # 0.5 * 2, 0.5 * 4
tensor([1., 2.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..models.offload import on_device
from .scoring import Reward, rewards_per_token
from .text import reward_model_texts, score_texts

__all__ = ["RewardReader", "model_scores", "score_batch_rewards", "text_scores"]


@dataclass(frozen=True)
class RewardReader:
    """What reading a batch's rewards needs besides the batch and the rewards.

    ``tokenizer`` is the policy's; ``forward_batch_size`` the rows a text-path reward model scores
    at once (``PPOConfig.scoring_chunk_size``); ``offload``: reward models live on the CPU and
    come to ``device`` for their block (``offload_reward_model``, never under DeepSpeed);
    ``primary`` the run's ``reward_model`` (the hook's two-argument form reads it).
    """

    tokenizer: object
    device: torch.device
    autocast: Callable
    forward_batch_size: int
    chat_template_kwargs: dict | None
    offload: bool
    primary: object = None


def text_scores(reward: Reward, sample, kwargs: dict, reader: RewardReader) -> torch.Tensor:
    """Raw scores ``(B,)`` of a reward model whose tokenizer is not the policy's (``reward.tokenizer``):
    the RM's text rebuilt (conversational prompts: the prompt and the episode's messages, or the
    decoded completion as one assistant message, in the RM's chat template with
    ``chat_template_kwargs``; plain: the decoded text) and scored ``forward_batch_size`` rows at a
    time (``rewards.text.reward_model_texts``, ``score_texts``). ``kwargs``: the batch's reward-function
    arguments (``prompts``, ``completion_ids``, ``completions`` when known)."""
    prompt_ids = [q[m].tolist() for q, m in zip(sample.queries.cpu(), sample.query_mask.cpu())]
    # an episode's messages when known (tools, environments, a rollout_func's `completions`): the RM reads
    # the conversation the episode was, in its own template, as TRL GRPO renders it
    rendered = reward_model_texts(kwargs["prompts"], prompt_ids, kwargs["completion_ids"], reader.tokenizer,
                                  reward.tokenizer, completions=kwargs.get("completions"),
                                  chat_template_kwargs=reader.chat_template_kwargs)
    return score_texts(reward.source, reward.tokenizer, rendered, reader.forward_batch_size, device=reader.device,
                       autocast=reader.autocast)


def model_scores(reward: Reward, kwargs: Callable[[], dict], *, sample, chunks, reader: RewardReader,
                 chunk_scores: Callable) -> torch.Tensor:
    """Raw scores ``(B,)`` of one reward model on ``sample``: at the last valid token chunk by chunk
    (``chunks``, ``rollout.forward_chunks``; ``chunk_scores(part, inputs[, model])`` per chunk, the
    model named only when it is not ``reader.primary``), or through text (:func:`text_scores`) when
    its vocabulary is not the policy's; an offloaded model is on the device for the block."""
    with on_device(reward.source, reader.device) if reader.offload else nullcontext():
        if reward.tokenizer is not None:  # another vocabulary: through text
            return text_scores(reward, sample, kwargs(), reader)
        extra = () if reward.source is reader.primary else (reward.source,)
        return chunks.merge([chunk_scores(p, i, *extra) for p, i in chunks])


def score_batch_rewards(rewards: Sequence[Reward], sample, chunks, reader: RewardReader, *, chunk_scores: Callable,
                        function_kwargs: Callable, update: int):
    """Every reward of ``rewards`` on a sampled batch (``rewards.scoring.rewards_per_token``): functions
    get the whole batch at once, with ``function_kwargs(sample)`` built at most once.

    Returns:
        ``(scores (B,) float32, values (B, F) float32, applies (B, F) bool, token_rewards (B, T)
        float32 or None)``: ``token_rewards`` the weighted sum of the token-level functions (0 off
        ``response_mask``), None in a run without reward functions.
    """
    def scores_of(reward, kwargs):
        return model_scores(reward, kwargs, sample=sample, chunks=chunks, reader=reader, chunk_scores=chunk_scores)

    def batch_kwargs():
        return function_kwargs(sample)

    return rewards_per_token(rewards, scores_of, batch_kwargs, sample.response_mask, update, sample.action_mask)
