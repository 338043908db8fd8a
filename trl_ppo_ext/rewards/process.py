"""A process reward model (PRM) as a reward function: its step scores on the step separators.

A PRM trained with TRL's ``PRMTrainer`` is a token classifier (``num_labels=2``) that read

    [bos] + prompt + step_1 + separator + step_2 + separator + ...

(each step tokenized alone, ``tokenizer.encode(step_separator, add_special_tokens=False)``
appended to it) and learned, at the last token of every separator, whether the step before it
is good (label 1) or not (label 0). :class:`ProcessRewardModel` rebuilds that input for each
completion, reads ``P(good)`` at the separators and returns ``(token_index, score)`` pairs in
GRPO's reward-function convention, so ``PPOTrainer(reward_funcs=[prm])`` puts each step's score
on the token that ends the step's separator in the policy's completion (per-token rewards,
``rewards.token_rewards``).

Two paths, as for sequence reward models (``reward_text``):

* **ids** (the PRM's tokenizer has the policy's vocabulary, ``reward_text.same_vocabulary``): the
  completion's own ids (without its final EOS) follow the prompt, and the separators are found in them
  (:func:`separator_ends`): the scores land exactly on the policy's separator tokens.
* **text** (another vocabulary): the completion is decoded, split into steps on
  ``step_separator`` and tokenized step by step as ``PRMTrainer`` does; the ``j``-th score goes
  to the policy token whose decoded text ends the ``j``-th separator.

A completion whose last step has no separator gets that step scored too (``final_step=True``):
the separator is appended to the PRM's input, as ``PRMTrainer`` ends every step with one, and
the score lands on the completion's last token.

A row longer than the PRM reads (``reward_text.reward_model_max_length``) keeps its first tokens,
as ``PRMTrainer`` cut its rows (``input_ids[:max_length]``): the prompt and the early steps stay
at the positions the PRM learned them at, and a step whose separator lies past the limit gets
no score (one warning per PRM). Cutting the start instead would drop the prompt the steps are
judged against. Notation: ``B`` completions, ``L`` PRM tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .scoring import processing_class_entries

logger = logging.getLogger(__name__)

__all__ = ["ProcessRewardModel", "is_token_classifier", "prm_steps_text", "separator_positions", "token_text_ends",
           "with_process_reward_models"]


class ProcessRewardModel:
    """A ``PRMTrainer``-style token classifier as a per-token reward function.

    Args:
        model: a ``*ForTokenClassification`` with ``num_labels >= 2`` (``PRMTrainer``: 2, label 1
            = good step). Put in eval mode here; the trainer neither moves nor offloads it (place
            it on the training device yourself).
        policy_tokenizer: the trainer's ``processing_class``: it decodes the completions and
            says which path the PRM takes.
        reward_tokenizer: the PRM's tokenizer (``PRMTrainer``'s ``processing_class``); None =
            the model's own, loaded from its ``name_or_path`` when there is one, else the
            policy's (GRPO's ``reward_processing_classes`` default).
        step_separator: ``PRMTrainer``'s ``step_separator`` (default ``"\\n"``); must encode to at
            least one known token of the PRM's tokenizer.
        positive_label: the "good step" class (1 in ``PRMTrainer``).
        final_step: score a last step that has no separator (see the module docstring).
        through_text: take the text path even when the vocabularies match: the separator is then
            found in the decoded text, also where the policy's tokenizer merged it into another
            token (a BPE ``".\n"``), which the id path's search of the separator's ids misses.
        batch_size: completions per PRM forward pass.
        name: the reward's name in metrics (default: the last part of the model's path).
    Raises:
        ValueError naming the argument: a head with fewer than 2 labels or without
        ``positive_label``, a separator that encodes to nothing or to an unknown token, a
        ``batch_size`` below 1.
    """

    def __init__(self, model, policy_tokenizer, reward_tokenizer=None, step_separator: str = "\n",
                 positive_label: int = 1, final_step: bool = True, through_text: bool = False, batch_size: int = 8,
                 name: str | None = None):
        from .text import resolve_reward_tokenizer, reward_model_max_length

        labels = getattr(getattr(model, "config", None), "num_labels", None)
        if not isinstance(labels, int) or labels < 2:
            raise ValueError(
                f"ProcessRewardModel: `model` has num_labels={labels!r}; a process reward model is a token "
                "classifier with 2 labels (PRMTrainer: 0 = bad step, 1 = good step). Load it with "
                "AutoModelForTokenClassification.from_pretrained(path), or pass a sequence reward model as "
                "`reward_model` instead."
            )
        if isinstance(positive_label, bool) or not isinstance(positive_label, int) or not 0 <= positive_label < labels:
            raise ValueError(f"ProcessRewardModel: positive_label={positive_label!r} is not one of the model's "
                             f"{labels} labels 0..{labels - 1}; PRMTrainer's good step is 1.")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ProcessRewardModel: batch_size={batch_size!r}; it must be an integer >= 1.")
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        self.__name__ = name or path.rstrip("/").split("/")[-1] or type(model).__name__
        # None: the PRM reads the policy's ids (same vocabulary); else its own tokenizer, through text
        self.text_tokenizer = resolve_reward_tokenizer(model, policy_tokenizer, reward_tokenizer,
                                                       where=f"ProcessRewardModel {self.__name__!r}")
        if through_text and self.text_tokenizer is None:
            self.text_tokenizer = reward_tokenizer if reward_tokenizer is not None else policy_tokenizer
        self.model, self.policy_tokenizer = model.eval(), policy_tokenizer
        self.tokenizer = self.text_tokenizer or policy_tokenizer  # the PRM's
        self.step_separator, self.positive_label = step_separator, positive_label
        self.final_step, self.batch_size = final_step, batch_size
        self.separator_ids = _separator_ids(self.tokenizer, step_separator)
        self.max_length = reward_model_max_length(model, self.tokenizer)  # None: no limit known
        self._warned_truncation = False

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[list[tuple[int, float]]]:
        """Per completion, ``[(token_index, P(good step)), ...]`` in GRPO's convention: the index
        counts the completion's tokens from 0, as ``completion_ids``."""
        heads = [self._prompt_ids(p) for p in prompts]
        rows, reads, places = [], [], []  # PRM input ids; where to read them; where the scores go
        for head, ids in zip(heads, completion_ids):
            body, read, place = (self._id_path(ids) if self.text_tokenizer is None else self._text_path(ids))
            rows.append(head + body)
            reads.append([len(head) + r for r in read])
            places.append(place)
        rows, reads = self._truncated(rows, reads)
        scores = self._scores(rows, reads)
        return [list(zip(place, score)) for place, score in zip(places, scores)]  # zip: unread steps drop

    def _truncated(self, rows: list[list[int]], reads: list[list[int]]) -> tuple[list, list]:
        """Rows cut to ``max_length`` tokens, keeping their start (``PRMTrainer``'s cut), and the
        reads that still fall inside them; warns once when anything was cut."""
        limit = self.max_length
        if limit is None or all(len(r) <= limit for r in rows):
            return rows, reads
        if not self._warned_truncation:
            self._warned_truncation = True
            logger.warning("ProcessRewardModel %r: %d of %d inputs are longer than the %d tokens it reads; each keeps "
                           "its first %d (as PRMTrainer truncates) and the steps past them are not scored.",
                           self.__name__, sum(len(r) > limit for r in rows), len(rows), limit, limit)
        return [r[:limit] for r in rows], [[t for t in at if t < limit] for at in reads]

    # ----------------------------------------------------------------- building the PRM's input
    def _prompt_ids(self, prompt) -> list[int]:
        """``[bos] + prompt`` in the PRM's ids (``PRMTrainer``: the prompt text, bos first)."""
        tok = self.tokenizer
        if not isinstance(prompt, str):  # a conversation: the PRM's chat template with the generation prompt
            if getattr(tok, "chat_template", None) is None:
                raise ValueError(
                    f"ProcessRewardModel {self.__name__!r}: the prompts are conversational but the PRM's tokenizer has "
                    "no chat template. Set `chat_template` on the tokenizer passed as `reward_tokenizer`, or give "
                    "the trainer plain-text prompts."
                )
            prompt = tok.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(ids)

    def _id_path(self, completion_ids) -> tuple[list[int], list[int], list[int]]:
        """The completion's own ids up to its last non-special token (``PRMTrainer``'s rows have no
        EOS); the scores at its separator ends (and at its last token for a final step)."""
        ids = [int(i) for i in completion_ids]
        last = len(ids) - 1
        while last >= 0 and ids[last] in self.policy_tokenizer.all_special_ids:  # the EOS is no step text
            last -= 1
        body = ids[:last + 1]
        ends = separator_positions(body, self.separator_ids)
        read, place = list(ends), list(ends)
        if self.final_step and last >= 0 and (not ends or ends[-1] < last):
            body = body + list(self.separator_ids)  # the step closed as PRMTrainer closes every step
            read.append(len(body) - 1)
            place.append(len(ids) - 1)
        return body, read, place

    def _text_path(self, completion_ids) -> tuple[list[int], list[int], list[int]]:
        """``PRMTrainer``'s ids of the decoded completion; each score on the policy token that
        ends its separator in the text."""
        ids = [int(i) for i in completion_ids]
        text = self.policy_tokenizer.decode(ids, skip_special_tokens=True)
        steps, ends = prm_steps_text(text, self.step_separator, self.final_step)
        token_ends = token_text_ends(ids, self.policy_tokenizer)
        body, read, place = [], [], []
        for step, end in zip(steps, ends):
            body += self.tokenizer(step, add_special_tokens=False)["input_ids"] + list(self.separator_ids)
            read.append(len(body) - 1)
            # the first token whose decoded text reaches the separator's end; a final step without one: the last
            reached = (k for k, e in enumerate(token_ends) if end is not None and e >= end)
            place.append(next(reached, len(ids) - 1))
        return body, read, place

    # ----------------------------------------------------------------------------- the PRM
    @torch.no_grad()
    def _scores(self, rows: list[list[int]], reads: list[list[int]]) -> list[list[float]]:
        """``P(positive_label)`` at ``reads[b]`` of each row, ``batch_size`` rows per forward."""
        device = next(self.model.parameters()).device
        pad = next((t for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0)
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk, at = rows[start:start + self.batch_size], reads[start:start + self.batch_size]
            width = max(len(r) for r in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for b, row in enumerate(chunk):  # right padding: positions need no shift
                ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
                mask[b, :len(row)] = 1
            position_ids = (mask.cumsum(1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                position_ids=position_ids.to(device)).logits
            if logits.dim() != 3 or logits.shape[:2] != ids.shape:
                raise ValueError(
                    f"ProcessRewardModel {self.__name__!r}: `model` returned logits of shape {tuple(logits.shape)} "
                    f"for input ids {tuple(ids.shape)}; a process reward model is a token classifier (B, L, labels)."
                )
            # (b, L): P(positive_label) where a separator ends (every read is one), read as the tensor function does
            probs = process_rewards(logits, ids.to(logits.device), mask.bool().to(logits.device), self.separator_ids,
                                    self.positive_label).cpu()
            out += [[float(probs[b, t]) for t in places] for b, places in enumerate(at)]
        return out


def separator_ends(ids: torch.Tensor, mask: torch.Tensor, separator_ids: Sequence[int]) -> torch.Tensor:
    """Where each occurrence of the step separator ends.

    Args:
        ids: ``(B, T)`` token ids. mask: bool ``(B, T)``, True = the token counts.
        separator_ids: the separator's token ids (TRL's ``PRMTrainer`` appends
            ``tokenizer.encode(step_separator, add_special_tokens=False)`` to every step and labels
            its last token), ``k >= 1`` of them.
    Returns:
        bool ``(B, T)``: True at the last token of every run ``ids[b, t-k+1 : t+1] == separator_ids``
        lying wholly on counted tokens.

    Example:
        >>> separator_ends(torch.tensor([[5, 9, 7, 9]]), torch.tensor([[True, True, True, False]]), [9])
        tensor([[False,  True, False, False]])
    """
    k = len(separator_ids)
    if k == 0:
        raise ValueError("separator_ids is empty; pass the step separator's token ids (at least one).")
    out = torch.zeros_like(mask, dtype=torch.bool)
    if ids.shape[1] < k:
        return out
    sep = torch.as_tensor(list(separator_ids), dtype=ids.dtype, device=ids.device)
    windows = ids.unfold(1, k, 1)  # (B, T - k + 1, k): window j covers tokens j .. j + k - 1
    found = (windows == sep).all(-1) & mask.bool().unfold(1, k, 1).all(-1)
    out[:, k - 1:] = found
    return out


def process_rewards(logits: torch.Tensor, ids: torch.Tensor, response_mask: torch.Tensor,
                    separator_ids: Sequence[int], positive_label: int = 1) -> torch.Tensor:
    """A process reward model's step scores placed on the step separators of the responses.

    A PRM trained with TRL's ``PRMTrainer`` is a token classifier whose label at the last token
    of each step's separator says whether the step is correct (1) or not (0). Its step score is
    ``P(positive_label)``, read at every separator end.

    Args:
        logits: ``(B, T, C)`` token-classification logits at the response tokens (``logits[:, t]``
            classifies token ``t``: no shift, unlike a causal LM).
        ids: ``(B, T)`` response ids the PRM read. response_mask: bool ``(B, T)``.
        separator_ids: the step separator's token ids. positive_label: the "correct" class.
    Returns:
        ``(B, T)`` float32: ``softmax(logits[b, t])[positive_label]`` where a separator ends at
        ``t`` (:func:`separator_ends`), 0 elsewhere. A final step without a separator gets no
        score (``PRMTrainer`` labels only separators).
    """
    if logits.shape[:2] != ids.shape or ids.shape != response_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be (B, T, C) over ids/response_mask (B, T) = "
                         f"{tuple(ids.shape)}/{tuple(response_mask.shape)}.")
    if not 0 <= positive_label < logits.shape[-1]:
        raise ValueError(f"positive_label={positive_label} is not a class of the PRM's {logits.shape[-1]} labels.")
    scores = logits.float().softmax(-1)[..., positive_label]
    at_step = separator_ends(ids, response_mask, separator_ids)
    return torch.where(at_step, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


# ---------------------------------------------------------------- what the trainer hands over


def _separator_ids(tokenizer, step_separator: str) -> list[int]:
    if not isinstance(step_separator, str) or not step_separator:
        raise ValueError(f"ProcessRewardModel: step_separator={step_separator!r}; pass PRMTrainer's step separator "
                         "string (its default is '\\n').")
    ids = list(tokenizer.encode(step_separator, add_special_tokens=False))
    unk = tokenizer.unk_token_id
    if not ids or (unk is not None and unk in ids):
        raise ValueError(
            f"ProcessRewardModel: step_separator={step_separator!r} encodes to {ids} with the PRM's tokenizer "
            f"({type(tokenizer).__name__}), {'nothing' if not ids else 'an unknown token'}: it is not in the "
            "vocabulary. Pass the step_separator the PRM was trained with (PRMTrainerConfig.step_separator)."
        )
    return ids


def separator_positions(ids: Sequence[int], separator_ids: Sequence[int]) -> list[int]:
    """Indices in ``ids`` where a run equal to ``separator_ids`` ends (``rewards.separator_ends``
    on one row of a list).

    Example:
        >>> separator_positions([5, 9, 6, 9], [9])
        [1, 3]
    """
    if not ids:
        return []
    row = torch.tensor([list(ids)], dtype=torch.long)
    return separator_ends(row, torch.ones_like(row, dtype=torch.bool), separator_ids)[0].nonzero().flatten().tolist()


def prm_steps_text(text: str, step_separator: str, final_step: bool = True) -> tuple[list[str], list[int | None]]:
    """A completion's steps as ``PRMTrainer`` lists them, and where each step's separator ends.

    Returns:
        ``(steps, ends)``: ``text.split(step_separator)`` without the last piece when it is blank
        (or always when ``final_step`` is False); ``ends[j]`` is the character index just after
        the ``j``-th separator in ``text``, None for a final step without one.

    Example:
        >>> prm_steps_text("a\\nbb\\nc", "\\n")
        (['a', 'bb', 'c'], [2, 5, None])
        >>> prm_steps_text("a\\nbb\\n", "\\n")
        (['a', 'bb'], [2, 5])
    """
    pieces = text.split(step_separator)
    ends, at = [], 0
    for piece in pieces[:-1]:
        at += len(piece) + len(step_separator)
        ends.append(at)
    steps = pieces[:-1]
    if final_step and pieces[-1].strip():
        steps.append(pieces[-1])
        ends.append(None)
    return steps, ends


def token_text_ends(ids: Sequence[int], tokenizer) -> list[int]:
    """``len(decode(ids[:k + 1]))`` for each ``k``: where each token's decoded text ends in the
    decoded completion (special tokens skipped, as the trainer decodes for reward functions).
    ``O(T^2)`` decoding; responses are short next to the models that read them."""
    return [len(tokenizer.decode(list(ids[:k + 1]), skip_special_tokens=True)) for k in range(len(ids))]


def is_token_classifier(model) -> bool:
    """Whether ``model`` is a ``*ForTokenClassification`` (by class or config architecture): a
    process reward model, as opposed to a sequence classifier read at the last token."""
    names = [type(model).__name__, *(getattr(getattr(model, "config", None), "architectures", None) or [])]
    return any(str(n).endswith("ForTokenClassification") for n in names)


def with_process_reward_models(rewards: Sequence, policy_tokenizer, reward_processing_classes=None,
                               step_separator: str = "\n") -> tuple[list, list | None]:
    """``rewards`` (``rewards.build_rewards``) with every token-classifier model replaced by its
    :class:`ProcessRewardModel`, for a trainer that takes a PRM as ``reward_model`` or among
    ``reward_funcs``.

    Args:
        reward_processing_classes: GRPO's list, one entry per reward model in order (a single
            tokenizer = a list of one; None = all None). A PRM takes its entry as its tokenizer.
        step_separator: ``PRMTrainer``'s separator, for every PRM.
    Returns:
        ``(rewards, remaining)``: the rewards (a PRM becomes a function of the same name and weight),
        and the entries of the other reward models (None when none was given), for
        ``rewards.with_reward_tokenizers``.
    Raises:
        ValueError when ``reward_processing_classes`` does not have one entry per reward model.
    """
    from dataclasses import replace

    models = [r for r in rewards if r.is_model]
    given = reward_processing_classes
    by_model = dict(zip((id(r) for r in models), processing_class_entries(rewards, given)))
    out, remaining = [], []
    for r in rewards:
        if r.is_model and is_token_classifier(r.source):
            prm = ProcessRewardModel(r.source, policy_tokenizer, by_model[id(r)], step_separator=step_separator,
                                     name=r.name)
            out.append(replace(r, source=prm))
        else:
            if r.is_model:
                remaining.append(by_model[id(r)])
            out.append(r)
    return out, (None if given is None else remaining)
