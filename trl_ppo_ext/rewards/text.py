"""A reward model with its own tokenizer: the completion decoded, the text rebuilt, re-tokenized.

A reward model reads token ids of its own vocabulary. When its tokenizer is not the policy's
(a Llama-based RM scoring a Qwen policy), the policy's ids mean other words to it, so the
completion goes through text, as TRL GRPO does with ``reward_processing_classes``:

1. decode the completion ids with the policy's tokenizer (:func:`completion_texts`);
2. rebuild the text the RM was trained on (:func:`reward_texts`): for conversational prompts
   the messages plus an assistant turn, rendered with the **RM's** chat template; for plain
   prompts ``prompt + completion``, joined where the policy's tokenizer puts the boundary
   between the two (:func:`plain_reward_texts`: the prompt and completion ids decoded as one
   sequence, so no space between two words is lost);
3. tokenize with the RM's tokenizer, pad on its padding side (:func:`reward_model_inputs`) and
   read the score at each row's last real token (:func:`score_texts`). A text longer than the
   RM reads (:func:`reward_model_max_length`) loses its start (see :func:`reward_model_inputs`).

When both tokenizers have the same vocabulary (:func:`same_vocabulary`) *and* render prompts
alike (:func:`same_rendering`: the chat template, and plain text's special tokens), the trainer
keeps the id path (no decoding; bit-identical to a single-tokenizer run); an RM tokenizer of the
same vocabulary with another template reads its own rendering, through text, as in TRL GRPO.
:func:`resolve_reward_tokenizer` says which path a reward model takes.

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


def same_rendering(policy_tokenizer, reward_tokenizer) -> bool:
    """Whether the two tokenizers turn a prompt into the same ids, so that a reward model reading
    the policy's ids reads what its own tokenizer would have given it.

    Checked: the chat template (conversations; both None counts as the same), and plain text
    encoded with special tokens (a BOS or EOS one of them adds, another normalizer or
    pre-tokenizer), on a probe text made of the first ordinary tokens of the policy's vocabulary.
    The vocabulary itself is :func:`same_vocabulary`'s question.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> same_rendering(build_tiny_tokenizer(), build_tiny_tokenizer(padding_side="right"))
        True
        >>> same_rendering(build_tiny_tokenizer(), build_tiny_tokenizer(chat_template="{{ messages }}"))
        False
    """
    if policy_tokenizer is reward_tokenizer:
        return True
    if getattr(policy_tokenizer, "chat_template", None) != getattr(reward_tokenizer, "chat_template", None):
        return False
    special = set(policy_tokenizer.all_special_ids)
    ordinary = sorted(i for i in policy_tokenizer.get_vocab().values() if i not in special)[:16]
    probe = policy_tokenizer.decode(ordinary, skip_special_tokens=True)
    return list(policy_tokenizer(probe)["input_ids"]) == list(reward_tokenizer(probe)["input_ids"])


def resolve_reward_tokenizer(model, policy_tokenizer, reward_tokenizer=None, where: str = "reward_model"):
    """The tokenizer a reward model's inputs need, or None when it reads the policy's ids as they are.

    Args:
        model: the reward model (a sequence classifier).
        policy_tokenizer: the trainer's ``processing_class``.
        reward_tokenizer: its entry of ``reward_processing_classes``; None (GRPO's default) loads the
            model's own tokenizer from ``model.config._name_or_path`` when there is one.
        where: how the model was passed (``reward_model``, ``reward_funcs[1]``), for messages.
    Returns:
        None when the vocabularies and the renderings are the same (the id path: :func:`same_vocabulary`
        and :func:`same_rendering`), else the RM's tokenizer (the text path, its own template).
    Raises:
        ValueError when no tokenizer is given or loadable and the model's embeddings cannot hold the
        policy's ids (a different vocabulary for certain): scoring would be garbage.
    """
    if reward_tokenizer is None:
        reward_tokenizer = _load_own_tokenizer(model, where)
    if reward_tokenizer is not None:
        ids_read_alike = same_vocabulary(policy_tokenizer, reward_tokenizer)
        return None if ids_read_alike and same_rendering(policy_tokenizer, reward_tokenizer) else reward_tokenizer
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


def plain_reward_texts(prompts: Sequence[str], prompt_ids: Sequence[Sequence[int]],
                       completion_ids: Sequence[Sequence[int]], policy_tokenizer) -> list[str]:
    """``prompt + completion`` for plain-text prompts, joined where the policy's tokenizer joins them.

    Decoded apart and glued, ``"... w14" + "w7 ..."`` reads ``w14w7``: a word-level or SentencePiece
    decoder writes the space before a word only when a word comes before it. So the prompt and
    completion ids are decoded as one sequence (special tokens dropped) and the completion's part
    of it, from the end of the decoded prompt on, follows the prompt's own text; a prompt that
    already ends in a space takes the part without its leading space. Where the decoded sequence
    does not start with the decoded prompt (a decoder that merges across the boundary), the whole
    decoded sequence is the text.

    Args:
        prompts: ``B`` prompt strings (the dataset's, or the decoded prompt ids).
        prompt_ids, completion_ids: ``B`` id lists each: the real prompt tokens and the valid
            completion tokens (``rollout.valid_token_ids``).
    Returns:
        ``B`` texts.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> tok = build_tiny_tokenizer()  # w1 = 7, w2 = 8, w3 = 9, <eos> = 3
        >>> plain_reward_texts(["w1 w2"], [[7, 8]], [[9, 3]], tok)
        ['w1 w2 w3']
    """
    joined = policy_tokenizer.batch_decode([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)],
                                           skip_special_tokens=True)
    heads = policy_tokenizer.batch_decode([list(p) for p in prompt_ids], skip_special_tokens=True)
    texts = []
    for prompt, head, text in zip(prompts, heads, joined):
        if not text.startswith(head):
            texts.append(text)
            continue
        tail = text[len(head):]
        texts.append(prompt + (tail[1:] if prompt.endswith(" ") and tail.startswith(" ") else tail))
    return texts


def reward_model_texts(prompts: Sequence, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                       policy_tokenizer, reward_tokenizer, completions: Sequence | None = None,
                       chat_template_kwargs: dict | None = None) -> list[str]:
    """The text a reward model of its own tokenizer scores, one per completion: conversations
    rendered with the RM's chat template (:func:`reward_texts`), plain prompts joined to their
    completions as the policy's tokenizer joins them (:func:`plain_reward_texts`).

    ``completions``: the episodes as message lists when they are known (a tool or environment
    episode: assistant turns with their tool calls, the ``tool`` messages, the final turn; a
    ``rollout_func``'s ``completions``); with conversational prompts the RM reads exactly those
    messages, as TRL GRPO renders them, instead of the decoded ids as one assistant message (which
    would hold the policy template's glue and tool-response tags). None or plain strings: the
    completion ids decoded (:func:`completion_texts`). ``chat_template_kwargs``: passed to the
    RM's template, as TRL does (``{"enable_thinking": False}``)."""
    if prompts and not isinstance(prompts[0], str):
        if completions is not None and all(is_message_list(c) for c in completions):
            return reward_texts(prompts, completions, reward_tokenizer, chat_template_kwargs)
        return reward_texts(prompts, completion_texts(completion_ids, policy_tokenizer), reward_tokenizer,
                            chat_template_kwargs)
    if len(prompts) != len(completion_ids):
        raise ValueError(f"reward_model_texts: {len(prompts)} prompts for {len(completion_ids)} completions.")
    return plain_reward_texts(prompts, prompt_ids, completion_ids, policy_tokenizer)


def is_message_list(completion) -> bool:
    """Whether ``completion`` is an episode as chat messages (a list of ``{"role": ...}`` dicts).

    >>> is_message_list([{"role": "assistant", "content": "4"}]), is_message_list("4")
    (True, False)
    """
    return isinstance(completion, list) and bool(completion) and all(
        isinstance(m, dict) and "role" in m for m in completion)


def reward_texts(prompts: Sequence, completions: Sequence, reward_tokenizer,
                 chat_template_kwargs: dict | None = None) -> list[str]:
    """The text a reward model scores, one per completion (TRL GRPO's construction).

    Args:
        prompts: ``B`` prompts: strings, or conversations (lists of ``{"role", "content"}``).
        completions: ``B`` completion texts (:func:`completion_texts`), or with conversational
            prompts ``B`` message lists (an episode's turns, tool calls and tool messages).
        reward_tokenizer: the RM's tokenizer; its chat template renders conversations.
        chat_template_kwargs: passed to the RM's chat template (TRL's ``chat_template_kwargs``).
    Returns:
        Conversational: ``messages + [{"role": "assistant", "content": completion}]`` (or
        ``messages + completion`` for a message list) rendered with the RM's chat template and no
        generation prompt; plain: ``prompt + completion``.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> reward_texts(["w1 w2 "], ["w3"], build_tiny_tokenizer())
        ['w1 w2 w3']
        >>> reward_texts([[{"role": "user", "content": "w1"}]], ["w3"], build_tiny_tokenizer())
        ['<user> w1 <eos> <assistant> w3 <eos> ']
        >>> turns = [{"role": "assistant", "content": "w2"}, {"role": "assistant", "content": "w3"}]
        >>> reward_texts([[{"role": "user", "content": "w1"}]], [turns], build_tiny_tokenizer())
        ['<user> w1 <eos> <assistant> w2 <eos> <assistant> w3 <eos> ']
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
    kwargs = dict(chat_template_kwargs or {})
    return [reward_tokenizer.apply_chat_template(
        list(p) + (list(c) if is_message_list(c) else [{"role": "assistant", "content": c}]), tokenize=False, **kwargs)
        for p, c in zip(prompts, completions)]


@dataclass(frozen=True)
class RewardModelInputs:
    """One padded batch for a reward model, in its own vocabulary."""

    input_ids: torch.Tensor  # (B, L) long: RM token ids; padding holds the RM's pad id
    attention_mask: torch.Tensor  # (B, L) long: 1 = a real token
    position_ids: torch.Tensor  # (B, L) long: real tokens counted from 0 (padding side does not shift them)
    last_index: torch.Tensor  # (B,) long: position of each row's last real token, where the score is read


# A tokenizer's model_max_length above this is transformers' "no limit" sentinel (int(1e30)).
_NO_LIMIT = 10**12
_warned_truncation: list[str] = []  # the models warned about, once each per process


def reward_model_max_length(model, reward_tokenizer=None) -> int | None:
    """The most tokens a reward model reads: its config's ``max_position_embeddings`` (or GPT-2's
    ``n_positions``), and its tokenizer's ``model_max_length`` when that is a real limit; the smaller
    of those given, None when neither says. Past it a learned-position model raises an index error
    and a RoPE one extrapolates to positions it never saw."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions")]
    limits.append(getattr(reward_tokenizer, "model_max_length", None))
    limits = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and 0 < n < _NO_LIMIT]
    return min(limits) if limits else None


def reward_model_inputs(texts: Sequence[str], reward_tokenizer, max_length: int | None = None,
                        add_special_tokens: bool = False, name: str = "reward model") -> RewardModelInputs:
    """``texts`` tokenized by the RM's tokenizer and padded on its ``padding_side``.

    Args:
        max_length: the most tokens a row may hold (:func:`reward_model_max_length`); a longer
            text keeps its **last** ``max_length`` tokens, whatever the tokenizer's
            ``truncation_side``: the score is read at the last token, so the end of the completion,
            which the RM judges, must stay, and the start of the prompt is what goes. Logged once
            per ``name`` as a warning. None keeps every token.
        add_special_tokens: False (GRPO's choice: a chat template already wrote them).
    """
    encoded = reward_tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    if max_length is not None:
        cut = sum(len(ids) > max_length for ids in encoded)
        if cut and name not in _warned_truncation:
            _warned_truncation.append(name)
            logger.warning("%s: %d of %d texts are longer than the %d tokens it reads; each keeps its last %d tokens "
                           "(the start of the prompt goes; the completion's end, where the score is read, stays). "
                           "Shorten prompts or response_length to score whole texts.", name, cut, len(encoded),
                           max_length, max_length)
        encoded = [ids[-max_length:] if len(ids) > max_length else ids for ids in encoded]
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
    read at each row's last real token (as the trainer reads the id path's last valid token).
    ``max_length``: the most tokens a row keeps (its last ones, see :func:`reward_model_inputs`);
    None: the model's own limit (:func:`reward_model_max_length`), so no text runs past it."""
    device = device if device is not None else next(model.parameters()).device
    if max_length is None:
        max_length = reward_model_max_length(model, reward_tokenizer)
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    scores = []
    for start in range(0, len(texts), batch_size):
        batch = reward_model_inputs(texts[start:start + batch_size], reward_tokenizer, max_length, name=name)
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
        # max_length: the most tokens of a text it reads, its last ones; None: the model's own limit
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"TextRewardModel: batch_size={batch_size!r}; it must be an integer >= 1.")
        self.model, self.reward_tokenizer = model, reward_tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        self.__name__ = name or path.rstrip("/").split("/")[-1] or type(model).__name__

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if prompts and not isinstance(prompts[0], str):  # an episode's messages as they are (its tool turns too)
            rendered = reward_texts(prompts, list(completions), self.reward_tokenizer)
        else:
            texts = [c if isinstance(c, str) else "".join(m.get("content") or "" for m in c) for c in completions]
            rendered = reward_texts(prompts, texts, self.reward_tokenizer)
        return score_texts(self.model, self.reward_tokenizer, rendered, self.batch_size,
                           max_length=self.max_length).tolist()
