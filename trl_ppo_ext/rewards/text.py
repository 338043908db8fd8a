"""A reward model with its own tokenizer: the completion decoded, the text rebuilt, re-tokenized.

A reward model reads token ids of its own vocabulary. When its tokenizer is not the policy's
(a Llama-based RM scoring a Qwen policy), the policy's ids mean other words to it, so the
completion goes through text, as TRL GRPO does with ``reward_processing_classes``:

1. decode the completion ids with the policy's tokenizer (:func:`completion_texts`);
2. rebuild the text the RM was trained on (:func:`reward_texts`): for conversational prompts
   the messages plus an assistant turn, rendered with the **RM's** chat template; for plain
   prompts ``prompt + completion``;
3. tokenize with the RM's tokenizer, pad on its padding side (:func:`reward_model_inputs`) and
   read the score at each row's last real token (:func:`score_texts`).

When both tokenizers have the same vocabulary (:func:`same_vocabulary`), the trainer keeps the
id path (no decoding; bit-identical to a single-tokenizer run): :func:`resolve_reward_tokenizer`
says which path a reward model takes.

Notation: ``B`` completions, ``L`` RM tokens per padded row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..functional import last_valid_index
from ..models.policy_value import backbone_hidden, scalar_head
from ..models.prepare import embedding_rows

logger = logging.getLogger(__name__)


def same_vocabulary(policy_tokenizer, reward_tokenizer) -> bool:
    """Whether ``reward_tokenizer`` reads every id the policy's tokenizer produces as the same token,
    so that a reward model can take the policy's ids as they are.

    Every token of the policy's vocabulary must have the same id in the reward tokenizer's, except a
    pad token the reward tokenizer does not have: padding is masked and never read, and TRL's
    scripts add a ``[PAD]`` to the policy's tokenizer after the reward model was saved with its own.
    Tokens only the reward tokenizer has do not matter (the policy never produces them).

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> same_vocabulary(build_tiny_tokenizer(), build_tiny_tokenizer())
        True
        >>> same_vocabulary(build_tiny_tokenizer(), build_tiny_tokenizer(words=["w0", "w2"]))
        False
    """
    if policy_tokenizer is reward_tokenizer:
        return True
    theirs = reward_tokenizer.get_vocab()
    pad = policy_tokenizer.pad_token
    return all(theirs.get(token) == i for token, i in policy_tokenizer.get_vocab().items()
               if not (token == pad and token not in theirs))


def resolve_reward_tokenizer(model, policy_tokenizer, reward_tokenizer=None, where: str = "reward_model"):
    """The tokenizer a reward model's inputs need, or None when it reads the policy's ids as they are.

    Args:
        model: the reward model (a sequence classifier).
        policy_tokenizer: the trainer's ``processing_class``.
        reward_tokenizer: its entry of ``reward_processing_classes``; None (GRPO's default) loads the
            model's own tokenizer from ``model.config._name_or_path`` when there is one.
        where: how the model was passed (``reward_model``, ``reward_funcs[1]``), for messages.
    Returns:
        None when the vocabularies are the same (the id path), else the RM's tokenizer.
    Raises:
        ValueError when no tokenizer is given or loadable and the model's embeddings cannot hold the
        policy's ids (a different vocabulary for certain): scoring would be garbage.
    """
    if reward_tokenizer is None:
        reward_tokenizer = _load_own_tokenizer(model, where)
    if reward_tokenizer is not None:
        return None if same_vocabulary(policy_tokenizer, reward_tokenizer) else reward_tokenizer
    try:
        embeddings = embedding_rows(model)
    except (NotImplementedError, AttributeError):
        # a custom PreTrainedModel that does not say (transformers raises NotImplementedError for
        # get_input_embeddings): it reads the policy's ids, as TRL's trainer has it do
        return None
    # the ids a reward model reads: every id but the pad id (padding is masked and fed as 0), so a
    # [PAD] added after the models were built (TRL's scripts) is no vocabulary mismatch
    read = [i for i in policy_tokenizer.get_vocab().values() if i != policy_tokenizer.pad_token_id]
    if read and embeddings <= max(read):
        raise ValueError(
            f"{where} has {embeddings} token embeddings but the policy's tokenizer has {len(policy_tokenizer)} tokens: "
            "it has another vocabulary and would score the policy's ids as other words. Pass its tokenizer in "
            "`reward_processing_classes` (in the order reward_model, then the models in reward_funcs)."
        )
    return None


def _load_own_tokenizer(model, where: str):
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not path:
        return None  # built in this process: nothing to load, the caller checks what it can
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)  # never trust_remote_code
    except (OSError, ValueError, TypeError, KeyError) as err:
        logger.warning("%s: no tokenizer loadable from %r (%s); assuming it shares the policy's vocabulary. Pass "
                       "`reward_processing_classes` to be sure.", where, path, err)
        return None


def completion_texts(completion_ids: Sequence[Sequence[int]], policy_tokenizer) -> list[str]:
    """The completions as text, special tokens (EOS) dropped: what GRPO's reward functions read."""
    return policy_tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)


def reward_texts(prompts: Sequence, completions: Sequence[str], reward_tokenizer) -> list[str]:
    """The text a reward model scores, one per completion (TRL GRPO's construction).

    Args:
        prompts: ``B`` prompts: strings, or conversations (lists of ``{"role", "content"}``).
        completions: ``B`` completion texts (:func:`completion_texts`).
        reward_tokenizer: the RM's tokenizer; its chat template renders conversations.
    Returns:
        Conversational: ``messages + [{"role": "assistant", "content": completion}]`` rendered
        with the RM's chat template; plain: ``prompt + completion``.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> reward_texts(["w1 w2 "], ["w3"], build_tiny_tokenizer())
        ['w1 w2 w3']
        >>> reward_texts([[{"role": "user", "content": "w1"}]], ["w3"], build_tiny_tokenizer())
        ['<user> w1 <eos> <assistant> w3 <eos> ']
    """
    if len(prompts) != len(completions):
        raise ValueError(f"reward_texts: {len(prompts)} prompts for {len(completions)} completions.")
    if not prompts or isinstance(prompts[0], str):
        return [p + c for p, c in zip(prompts, completions)]
    if getattr(reward_tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The prompts are conversational but the reward model's tokenizer has no chat template to render them "
            f"({type(reward_tokenizer).__name__}, name_or_path={getattr(reward_tokenizer, 'name_or_path', '')!r}). "
            "Set its `chat_template`, or give the RM plain-text prompts."
        )
    return [reward_tokenizer.apply_chat_template(list(p) + [{"role": "assistant", "content": c}], tokenize=False)
            for p, c in zip(prompts, completions)]


@dataclass(frozen=True)
class RewardModelInputs:
    """One padded batch for a reward model, in its own vocabulary."""

    input_ids: torch.Tensor  # (B, L) long: RM token ids; padding holds the RM's pad id
    attention_mask: torch.Tensor  # (B, L) long: 1 = a real token
    position_ids: torch.Tensor  # (B, L) long: real tokens counted from 0 (padding side does not shift them)
    last_index: torch.Tensor  # (B,) long: position of each row's last real token, where the score is read


def reward_model_inputs(texts: Sequence[str], reward_tokenizer, max_length: int | None = None,
                        add_special_tokens: bool = False) -> RewardModelInputs:
    """``texts`` tokenized by the RM's tokenizer and padded on its ``padding_side``.

    Args:
        max_length: truncate longer texts (on the tokenizer's ``truncation_side``); None keeps all.
        add_special_tokens: False (GRPO's choice: a chat template already wrote them).
    """
    encoded = reward_tokenizer(list(texts), add_special_tokens=add_special_tokens, truncation=max_length is not None,
                               max_length=max_length)["input_ids"]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"reward_model_inputs: text {empty[0]} ({texts[empty[0]]!r}) has no token for the reward "
                         "model; it needs at least one to be scored.")
    width = max(len(ids) for ids in encoded)
    pad = next((t for t in (reward_tokenizer.pad_token_id, reward_tokenizer.eos_token_id) if t is not None), 0)
    left = reward_tokenizer.padding_side == "left"
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for b, row in enumerate(encoded):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, span] = torch.tensor(row, dtype=torch.long)
        mask[b, span] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return RewardModelInputs(ids, mask, position_ids, last_valid_index(mask.bool()))


@torch.no_grad()
def score_texts(model, reward_tokenizer, texts: Sequence[str], batch_size: int, device=None,
                autocast=nullcontext, max_length: int | None = None) -> torch.Tensor:
    """A reward model's scores ``(B,)`` float32 on ``texts``, ``batch_size`` rows per forward,
    read at each row's last real token (as the trainer reads the id path's last valid token)."""
    device = device if device is not None else next(model.parameters()).device
    scores = []
    for start in range(0, len(texts), batch_size):
        batch = reward_model_inputs(texts[start:start + batch_size], reward_tokenizer, max_length)
        with autocast():
            hidden = backbone_hidden(model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                     batch.position_ids.to(device))
            # the head on every position, then one read per row: the same product shapes as the RM's
            # own forward, so a float32 score equals a direct call's to the bit (a (B, H) product may not)
            per_token = scalar_head(model, hidden)  # (B, L)
        rows = torch.arange(per_token.shape[0], device=per_token.device)
        scores.append(per_token[rows, batch.last_index.to(per_token.device)])
    return torch.cat(scores) if scores else torch.zeros(0, device=device)


class TextRewardModel:
    """A reward model of another vocabulary as a reward function (GRPO's convention).

    Usable today through ``PPOTrainer(reward_funcs=[...])``: the trainer passes the decoded
    completions, this rebuilds the RM's text (:func:`reward_texts`) and scores it
    (:func:`score_texts`). The model stays where the caller put it (the trainer neither moves,
    offloads nor shards it, as it does a ``reward_model``).
    """

    def __init__(self, model, reward_tokenizer, batch_size: int = 8, max_length: int | None = None,
                 name: str | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"TextRewardModel: batch_size={batch_size!r}; it must be an integer >= 1.")
        self.model, self.reward_tokenizer = model, reward_tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        self.__name__ = name or path.rstrip("/").split("/")[-1] or type(model).__name__

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
        rendered = reward_texts(prompts, texts, self.reward_tokenizer)
        return score_texts(self.model, self.reward_tokenizer, rendered, self.batch_size,
                           max_length=self.max_length).tolist()
