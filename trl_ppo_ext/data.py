"""Prompt datasets for PPO: render with the tokenizer's own chat template, tokenise, filter.

PPO generates the answer itself, so a prompt dataset only needs the token ids of each
prompt, ending where the model should start writing. ``render_prompts`` turns the usual
dataset shapes into that:

- a ``prompt`` column of plain strings (``"What color is the sky?"``);
- a ``prompt`` or ``messages`` column holding a conversation, a list of
  ``{"role": ..., "content": ...}`` dicts.

Conversations are rendered with ``tokenizer.apply_chat_template(..., add_generation_prompt
=True)``, so the ids end with the template's "assistant, your turn" marker. Prompts that
would leave no room for ``response_length`` generated tokens within the model's
``max_length`` positions are dropped, never truncated: cutting a rendered chat prompt would
cut off the generation prompt that tells the model to answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from .sampler import EpochSeededSampler

logger = logging.getLogger(__name__)

# Columns searched, in order, when ``prompt_column`` is not given. ``prompt`` first: it is
# TRL's name for "what the model is asked"; ``messages`` is a whole chat.
PROMPT_COLUMNS = ("prompt", "messages")


@dataclass(frozen=True)
class RenderInfo:
    """What ``render_prompts`` did: where prompts came from and how many were dropped."""

    prompt_column: str  # the column the prompts were read from
    conversational: bool  # True: the column held conversations (lists of messages)
    used_chat_template: bool  # True: rendered with the tokenizer's chat template
    max_prompt_tokens: int | None  # longest prompt kept, in tokens (None: no limit)
    num_prompts: int  # rows in the input dataset
    num_empty: int  # rows dropped: no text to answer
    num_too_long: int  # rows dropped: longer than ``max_prompt_tokens``

    @property
    def num_kept(self) -> int:
        return self.num_prompts - self.num_dropped

    @property
    def num_dropped(self) -> int:
        return self.num_empty + self.num_too_long


def render_prompts(
    dataset: Dataset,
    tokenizer,
    *,
    prompt_column: str | None = None,
    use_chat_template: bool | None = None,
    max_prompt_length: int | None = None,
    response_length: int | None = None,
    max_length: int | None = None,
    num_proc: int | None = None,
    empty_ids: list[int] | None = None,
) -> tuple[Dataset, RenderInfo]:
    """Tokenise a prompt dataset for PPO; drop empty prompts and those that do not fit.

    Rendering rules:

    - A conversation (list of ``{"role", "content"}`` dicts) is rendered with the
      tokenizer's chat template and ``add_generation_prompt=True``. If it ends with an
      assistant turn, that last turn is dropped first: it is the answer the policy must
      write itself (preference and SFT datasets often keep it in ``messages``).
    - A plain string is, by default (``use_chat_template=None``), wrapped as one user
      message and rendered the same way when the tokenizer has a chat template: a chat
      model asked a bare string without its template sees text unlike its training data.
      ``use_chat_template=False`` tokenises the string as it is.
    - Special tokens are not added a second time: template output already holds them, so
      it is tokenised with ``add_special_tokens=False``. A raw string gets the tokenizer's
      special tokens (e.g. BOS) unless it already starts with the BOS token.

    Args:
        dataset: a ``datasets.Dataset`` with a prompt column (see ``prompt_column``).
        tokenizer: a ``transformers`` tokenizer; it needs a ``chat_template`` for
            conversations.
        prompt_column: the column to read; default: the first of ``"prompt"``,
            ``"messages"`` that the dataset has.
        use_chat_template: True: always render with the chat template; False: only
            conversations are (plain strings are tokenised raw); None (default): render
            whenever the tokenizer has a template.
        max_prompt_length: drop prompts with more tokens than this.
        response_length: tokens the policy will generate after the prompt.
        max_length: the model's maximum positions (``config.max_position_embeddings``);
            prompts with more than ``max_length - response_length`` tokens are dropped.
        num_proc: processes for ``Dataset.map``.
        empty_ids: the ids an empty prompt gets instead of being dropped (an environment's
            ``reset`` gives its prompt, as in TRL GRPO's runs without a dataset); None drops it.

    Returns:
        ``(prompts, info)``: the dataset with an ``input_ids`` column (a list of ints per
        row; an existing ``input_ids``/``attention_mask`` is replaced) and every other column
        unchanged -- the prompt column too, so a conversation reaches reward functions as
        messages -- in the input order minus dropped rows; and a ``RenderInfo`` with the
        counts. A warning is logged when any row is dropped.

    Raises:
        ValueError: no usable prompt column; conversations without a chat template;
            ``response_length >= max_length``; every prompt dropped.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> tok = build_tiny_tokenizer()  # <user>=4, <assistant>=5, <eos>=3, w0=6
        >>> ds = Dataset.from_dict({"prompt": ["w0 w1", ""], "answer": ["w1", "w0"]})
        >>> prompts, info = render_prompts(ds, tok)
        >>> list(prompts["input_ids"]), list(prompts["answer"]), info.num_empty
        ([[4, 6, 7, 3, 5]], ['w1'], 1)
    """
    column = _resolve_prompt_column(dataset, prompt_column)
    if len(dataset) == 0:
        raise ValueError("render_prompts: the dataset has 0 rows; pass a dataset with prompts.")
    limit = _prompt_token_limit(max_prompt_length, response_length, max_length)
    conversational = _is_conversation(dataset[0][column])
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if (conversational or use_chat_template) and not has_template:
        what = "holds conversations" if conversational else "is to be rendered (use_chat_template=True)"
        raise ValueError(
            f"render_prompts: column {column!r} {what}, but the tokenizer "
            f"({type(tokenizer).__name__}) has no chat template (tokenizer.chat_template is None). "
            "Set tokenizer.chat_template to a Jinja template, or pass plain string prompts "
            "with use_chat_template=False."
        )
    templated = conversational or (has_template and use_chat_template is not False)

    encoded = dataset.map(
        _encode_row,
        fn_kwargs={"tokenizer": tokenizer, "column": column, "templated": templated, "empty_ids": empty_ids},
        # Every other column stays as it is (the prompt's messages, an `answer`, ...): the
        # collator hands them to reward functions. Old token columns would not match the new ids.
        remove_columns=[c for c in PromptCollator.TOKEN_KEYS if c in dataset.column_names],
        num_proc=num_proc,
        desc="Rendering prompts",
    )
    info, keep = _count_and_select(encoded, column, conversational, templated, limit)
    _report(info, max_prompt_length, response_length, max_length)
    return encoded.select(keep).remove_columns(["_empty", "_length"]), info


def _resolve_prompt_column(dataset: Dataset, prompt_column: str | None) -> str:
    """The column holding prompts, or a ValueError that lists the columns there are."""
    columns = list(dataset.column_names)
    if prompt_column is not None:
        if prompt_column not in columns:
            raise ValueError(
                f"render_prompts: prompt_column={prompt_column!r} is not a column of the dataset "
                f"(columns: {columns}). Pass one of those columns as prompt_column."
            )
        return prompt_column
    for name in PROMPT_COLUMNS:
        if name in columns:
            return name
    raise ValueError(
        f"render_prompts: the dataset has no prompt column; looked for {list(PROMPT_COLUMNS)} "
        f"and found columns {columns}. Rename the prompt column "
        "(dataset.rename_column(old, 'prompt')) or pass prompt_column=<name>."
    )


def _prompt_token_limit(max_prompt_length, response_length, max_length) -> int | None:
    """Longest prompt, in tokens, that still leaves room for the response (None: no limit)."""
    for name, value in (("max_prompt_length", max_prompt_length), ("response_length", response_length),
                        ("max_length", max_length)):
        if value is not None and value < 0:
            raise ValueError(f"render_prompts: {name}={value} must be >= 0 (or None for no limit).")
    limits = []
    if max_prompt_length is not None:
        limits.append(max_prompt_length)
    if max_length is not None:
        room = max_length - (response_length or 0)
        if response_length is not None and room <= 0:
            raise ValueError(
                f"render_prompts: response_length={response_length} >= max_length={max_length} "
                "leaves no position for the prompt. Lower response_length or use a model with "
                "more positions (max_length = config.max_position_embeddings)."
            )
        limits.append(room)
    return min(limits) if limits else None


def _is_conversation(value) -> bool:
    """True for a list of ``{"role", "content"}`` mappings (an empty list included)."""
    return isinstance(value, list) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in value
    )


def _prompt_messages(conversation: list) -> list[dict]:
    """The conversation up to the turn the policy must answer: a final assistant turn is dropped."""
    messages = [dict(m) for m in conversation]
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages


def _encode_row(row: dict, tokenizer, column: str, templated: bool, empty_ids: list[int] | None = None) -> dict:
    """``Dataset.map`` body: one row to ``input_ids`` plus the emptiness flag and length."""
    value = row[column]
    if _is_conversation(value):
        messages = _prompt_messages(value)
        empty = not any(str(m["content"] or "").strip() for m in messages)
    elif isinstance(value, str):
        messages = [{"role": "user", "content": value}] if templated else None
        empty = not value.strip()
    else:
        raise ValueError(
            f"render_prompts: column {column!r} holds a value of type {type(value).__name__} "
            f"({value!r:.80}); "
            "expected a string or a list of {'role', 'content'} messages. Pass the right "
            "column as prompt_column."
        )
    if empty and empty_ids is not None:  # kept: an environment gives this prompt at reset
        ids, empty = list(empty_ids), False
    elif empty:
        ids = []
    elif messages is not None:
        ids = _template_ids(tokenizer, messages)
    else:
        bos = getattr(tokenizer, "bos_token", None)
        add_special = not (bos and value.startswith(bos))
        ids = list(tokenizer(value, add_special_tokens=add_special)["input_ids"])
    return {"input_ids": ids, "_empty": empty, "_length": len(ids)}


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids of ``messages`` with the generation prompt appended.

    ``apply_chat_template(tokenize=True)`` tokenises without adding special tokens again.
    It returns a ``BatchEncoding`` in transformers 5 and a plain list in transformers 4.
    """
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(i) for i in out]


def _count_and_select(encoded: Dataset, column, conversational, templated, limit):
    """Count the drops and return ``(info, indices of kept rows)``."""
    empty = [bool(e) for e in encoded["_empty"]]
    lengths = [int(n) for n in encoded["_length"]]
    too_long = too_long_prompts(lengths, empty, limit)
    keep = [i for i, (e, t) in enumerate(zip(empty, too_long)) if not (e or t)]
    info = RenderInfo(
        prompt_column=column,
        conversational=conversational,
        used_chat_template=templated,
        max_prompt_tokens=limit,
        num_prompts=len(encoded),
        num_empty=sum(empty),
        num_too_long=sum(too_long),
    )
    return info, keep


def _report(info: RenderInfo, max_prompt_length, response_length, max_length) -> None:
    """Warn about dropped rows; raise when nothing is left."""
    if info.num_dropped == 0:
        return
    message = (
        f"render_prompts: dropped {info.num_dropped} of {info.num_prompts} prompts from column "
        f"{info.prompt_column!r}: {info.num_empty} empty"
    )
    if info.max_prompt_tokens is not None:
        message += (
            f", {info.num_too_long} longer than {info.max_prompt_tokens} tokens "
            f"(max_prompt_length={max_prompt_length}, max_length={max_length}, "
            f"response_length={response_length})"
        )
    if info.num_kept == 0:
        raise ValueError(
            message + ". No prompt is left: raise max_length or max_prompt_length, lower "
            "response_length, or check that the prompt column holds text."
        )
    logger.warning(message + ".")


class PromptCollator:
    """The trainer's default collator: pads ``input_ids`` (and ``attention_mask``) with the
    tokenizer's padding side and pad id, and carries every other dataset column (an ``answer``
    for a verifiable reward, the ``prompt`` text or messages, ...) as a plain list, so reward
    functions receive them unchanged.

    Returns ``{"input_ids": (B, P) long, "attention_mask": (B, P) long, <column>: list of B}``.
    """

    TOKEN_KEYS = ("input_ids", "attention_mask")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict:
        tokens = [{k: f[k] for k in self.TOKEN_KEYS if k in f} for f in features]
        batch = dict(self.tokenizer.pad(tokens, padding=True, return_tensors="pt"))
        for key in features[0]:
            if key not in self.TOKEN_KEYS:
                batch[key] = [f[key] for f in features]
        return batch


def prompt_dataloader(dataset, batch_size: int, collate_fn, *, seed: int, shuffle: bool) -> DataLoader:
    """The training prompts in batches of ``batch_size`` (the last short one dropped: every rollout
    batch has the same size). The shuffle order is a function of ``(seed, epoch)``, the same on every
    process (``sampler.EpochSeededSampler``), so a resumed run finds its place without replaying RNG
    draws; each new iterator draws its worker seed from its own generator, not the global RNG, so
    starting an epoch (or resuming mid-epoch) leaves the sampling RNG untouched."""
    return DataLoader(dataset, batch_size=batch_size,
                      sampler=EpochSeededSampler(len(dataset), seed, shuffle=shuffle),
                      collate_fn=collate_fn, drop_last=True, generator=torch.Generator().manual_seed(seed))


def eval_dataloader(dataset, batch_size: int, collate_fn) -> DataLoader:
    """The held-out prompts in order, in batches of ``batch_size``, the last one as long as it is."""
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=False)


def repeat_batches(dataloader, cursor):
    """A ``prompt_dataloader``'s batches forever, epoch after epoch, from ``cursor`` (a
    ``run.state.RunCounters``: ``epoch``, and ``batches`` of it already consumed, skipped), which it
    advances as it yields, so a checkpoint of the cursor resumes at the next batch exactly."""
    while True:
        dataloader.set_epoch(cursor.epoch)  # accelerate resets the sampler epoch from this
        skip = cursor.batches
        for index, batch in enumerate(dataloader):
            if index < skip:
                continue
            cursor.batches = index + 1
            yield batch
        cursor.epoch, cursor.batches = cursor.epoch + 1, 0


def repeat_prompts(batch: Mapping, num_generations: int) -> dict:
    """Every row of a collated prompt batch ``num_generations`` times, the copies adjacent: rows
    ``b*G .. b*G+G-1`` of the result are row ``b`` of ``batch`` (``repeat_interleave`` order, the
    grouping ``trl_ppo_ext.estimators`` reads).

    Args:
        batch: a collated batch (``PromptCollator``'s): tensors with ``B`` rows along dim 0
            (``input_ids``, ``attention_mask``, ...) and lists or tuples of ``B`` per-row extras
            (an ``answer`` column, the prompt text). The same object fills a row's copies (no
            deep copy), as TRL GRPO repeats its inputs.
        num_generations: ``G >= 1``.

    Returns:
        A new dict with the same keys: tensors ``(B * G, ...)``, lists of ``B * G``. ``batch``
        is not modified.

    Raises:
        ValueError: ``G < 1``, or fields with different numbers of rows (naming them).
        TypeError: a field that is neither a tensor with a batch dimension nor a list/tuple.

    Example:
        >>> import torch
        >>> out = repeat_prompts({"input_ids": torch.tensor([[1, 2], [3, 4]]), "answer": ["a", "b"]}, 2)
        >>> out["input_ids"].tolist(), out["answer"]
        ([[1, 2], [1, 2], [3, 4], [3, 4]], ['a', 'a', 'b', 'b'])
    """
    import torch

    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}.")
    rows = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0:
            rows[key] = value.shape[0]
        elif isinstance(value, (list, tuple)):
            rows[key] = len(value)
        else:
            raise TypeError(
                f"repeat_prompts: field {key!r} is a {type(value).__name__}; a collated batch holds tensors with a "
                "batch dimension and lists of per-row values. Collate it as PromptCollator does."
            )
    if len(set(rows.values())) > 1:
        raise ValueError(f"repeat_prompts: the fields have different numbers of rows: {rows}.")
    return {
        key: value.repeat_interleave(num_generations, dim=0) if torch.is_tensor(value)
        else [item for item in value for _ in range(num_generations)]
        for key, value in batch.items()
    }


def too_long_prompts(lengths: Sequence[int], empty: Sequence[bool], limit: int | None) -> list[bool]:
    """The prompt rule ``render_prompts`` drops by and the trainer refuses by: a non-empty prompt
    of more than ``limit`` tokens (``max_length - response_length``) leaves no room for the
    response. ``lengths``/``empty``: ``(N,)`` per prompt; ``limit`` None: no limit.

    Example:
        >>> too_long_prompts([3, 0, 9], [False, True, False], limit=5)
        [False, False, True]
    """
    return [not e and limit is not None and n > limit for e, n in zip(empty, lengths)]


def check_prompt_dataset(train_dataset, processing_class) -> None:
    """Refuse what no PPO run can start from: no ``train_dataset``, one without an ``input_ids``
    column or without rows, a ``processing_class`` without a pad token.

    Raises:
        ValueError: naming the argument, what it holds and how to fix it.

    Example:
        >>> from types import SimpleNamespace
        >>> check_prompt_dataset(Dataset.from_dict({"input_ids": [[1, 2]]}), SimpleNamespace(pad_token_id=0))
        >>> try:
        ...     check_prompt_dataset(Dataset.from_dict({"text": ["hi"]}), SimpleNamespace(pad_token_id=0))
        ... except ValueError as err:
        ...     print(str(err)[:59])
        `train_dataset` has no `input_ids` column (columns: ['text'
    """
    if train_dataset is None:
        raise ValueError("`train_dataset` is required: a dataset of tokenized prompts with an `input_ids` column.")
    columns = getattr(train_dataset, "column_names", None)
    if columns is None and len(train_dataset) > 0:
        columns = list(train_dataset[0].keys())
    if columns is not None and "input_ids" not in columns:
        raise ValueError(
            f"`train_dataset` has no `input_ids` column (columns: {list(columns)}). Tokenize the prompts first, "
            "e.g. `trl_ppo_ext.data.render_prompts(dataset, tokenizer)` or "
            "`dataset.map(lambda x: tokenizer(x['prompt']))`."
        )
    if len(train_dataset) == 0:
        raise ValueError("`train_dataset` is empty; PPO needs at least one batch of prompts.")
    if getattr(processing_class, "pad_token_id", None) is None:
        raise ValueError(
            f"`processing_class` ({type(processing_class).__name__}) has no pad token (pad_token=None). Set one "
            "before building the trainer, e.g. `tokenizer.pad_token = tokenizer.eos_token` or "
            "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})` (then resize the embeddings)."
        )


def check_prompt_lengths(dataset, name: str, max_positions: int | None, response_length: int) -> list[int] | None:
    """Every prompt of ``dataset`` non-empty and short enough to leave ``response_length`` of the
    model's ``max_positions`` (None: no limit) to the response (:func:`too_long_prompts`). A
    dataset without an ``input_ids`` column (a torch ``Dataset``) is checked batch by batch
    during the rollout instead.

    Returns:
        the prompts' token counts (read once, for further checks), None without ``input_ids``.

    Raises:
        ValueError: naming ``name``, how many prompts break the rule and how to filter them.

    Example:
        >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]})
        >>> check_prompt_lengths(ds, "train_dataset", max_positions=8, response_length=5)  # 3 <= 8 - 5
        [3, 1]
        >>> try:
        ...     check_prompt_lengths(ds, "train_dataset", max_positions=8, response_length=6)
        ... except ValueError as err:
        ...     print(str(err)[:59])
        `train_dataset` has 1 prompt(s) longer than 2 tokens: the m
    """
    columns = getattr(dataset, "column_names", None)
    if columns is None or "input_ids" not in columns:
        return None
    lengths = [len(ids) for ids in dataset["input_ids"]]
    empty = [n == 0 for n in lengths]
    if any(empty):
        raise ValueError(
            f"`{name}` holds {sum(empty)} empty prompt(s) (input_ids of length 0). Drop them first, e.g. "
            "`dataset.filter(lambda x: len(x['input_ids']) > 0)` or `trl_ppo_ext.data.render_prompts`."
        )
    if max_positions is None:
        return lengths
    limit = max_positions - response_length
    too_long = sum(too_long_prompts(lengths, empty, limit))
    if too_long:
        raise ValueError(
            f"`{name}` has {too_long} prompt(s) longer than {limit} tokens: the model has "
            f"max_position_embeddings={max_positions} and response_length={response_length} leaves "
            f"{limit} for the prompt (longest prompt: {max(lengths)}). Filter or truncate the prompts (e.g. "
            "`trl_ppo_ext.data.render_prompts(..., response_length=..., max_length=...)` drops them), or lower "
            "response_length."
        )
    return lengths
