"""Tiny local tokenizers and random Llama models: for tests, the example and benchmarks.

Nothing here touches a model hub. The tokenizer is a ``tokenizers`` WordLevel vocabulary
wrapped in ``PreTrainedTokenizerFast`` with a small chat template; the models are
random-init ``LlamaConfig`` models sized by arguments.

Example:

>>> from trl_ppo_ext.tiny import build_tiny_tokenizer
>>> tok = build_tiny_tokenizer()
>>> tok("w1 w2").input_ids, tok.pad_token, tok.padding_side
([7, 8], '<pad>', 'left')
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<user>", "<assistant>")

# A deliberately small template: one turn per message, generation prompt opens the
# assistant turn. Uses only what Jinja in transformers provides.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user> {{ message['content'] }} <eos> "
    "{% else %}<assistant> {{ message['content'] }} <eos> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def default_words(n: int = 40) -> list[str]:
    """``n`` plain words ``w0 .. w{n-1}`` for a tiny vocabulary."""
    return [f"w{i}" for i in range(n)]


def build_tiny_tokenizer(
    words: list[str] | None = None,
    *,
    pad_equals_eos: bool = False,
    padding_side: str = "left",
    chat_template: str | None = TINY_CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """A whitespace WordLevel tokenizer over ``SPECIAL_TOKENS + words``.

    Args:
        words: the ordinary vocabulary (default ``default_words()``).
        pad_equals_eos: use ``<eos>`` as the pad token (a common real-world setup that
            TRL's PPO mishandles); otherwise ``<pad>`` (id 0) is the pad token.
        padding_side: ``"left"`` (generation-friendly) or ``"right"``.
        chat_template: Jinja chat template, or None for a tokenizer without one.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = list(words) if words is not None else default_words()
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<eos>" if pad_equals_eos else "<pad>",
        padding_side=padding_side,
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def tiny_llama_config(tokenizer, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                      intermediate_size: int | None = None, max_position_embeddings: int = 256,
                      vocab_size: int | None = None, **overrides) -> LlamaConfig:
    """A ``LlamaConfig`` sized for tests; ids (pad/bos/eos) follow ``tokenizer``.

    ``vocab_size`` defaults to ``len(tokenizer)``; pass a larger value to leave room for
    tokens added later (as real checkpoints do by padding their embedding matrix).
    """
    return LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **overrides,
    )


def build_tiny_causal_lm(tokenizer, seed: int = 0, **config_kwargs) -> LlamaForCausalLM:
    """Random-init tiny Llama causal LM (fp32), reproducible from ``seed``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, **config_kwargs))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_scorer(tokenizer, seed: int = 1, **config_kwargs) -> LlamaForSequenceClassification:
    """Random-init tiny Llama with a scalar head (``num_labels=1``): a reward or value model."""
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(tiny_llama_config(tokenizer, num_labels=1, **config_kwargs))


def random_word_prompts(tokenizer, n: int = 16, min_len: int = 2, max_len: int = 5, seed: int = 0):
    """A ``datasets.Dataset`` of ``n`` tokenized prompts (``input_ids`` only) of random ordinary
    words (``w0``, ``w1``, ... of :func:`build_tiny_tokenizer`), each of a length drawn uniformly
    from ``[min_len, max_len]``; the same for the same ``seed``."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    first_word_id = tokenizer.convert_tokens_to_ids("w0")
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        rows.append(torch.randint(first_word_id, len(tokenizer), (length,), generator=g).tolist())
    return Dataset.from_dict({"input_ids": rows})


# ---------------------------------------------------------------- a tokenizer for tool calls
# Qwen3's added tokens, in Qwen3's order of kinds: the control tokens (special: stripped by
# skip_special_tokens) and the tags its chat template writes around thoughts and tool calls
# (plain added tokens, as in the real vocabulary: they survive decoding).
CHAT_CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def build_tiny_chat_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with Qwen3's chat tokens and TRL's bundled Qwen3 chat template.

    One token per byte (256 ids, a BPE without merges), so any text round-trips exactly:
    tool-call JSON, newlines and all. Then ``CHAT_CONTROL_TOKENS`` (ids 256-258; ``<|im_end|>``
    is the eos token, ``<|endoftext|>`` the pad token) and ``CHAT_TAG_TOKENS`` (259-264). The
    template is ``trl/chat_templates/qwen3.jinja`` of the installed TRL (1.2 on), which TRL's
    ``add_response_schema`` recognises; pass ``chat_template`` to carry another one.

    >>> tok = build_tiny_chat_tokenizer()
    >>> len(tok), tok.eos_token, tok.pad_token
    (265, '<|im_end|>', '<|endoftext|>')
    >>> tok.decode(tok("<tool_call>\\n{}").input_ids) == "<tool_call>\\n{}"
    True
    """
    from importlib.resources import files

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_CONTROL_TOKENS)})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TAG_TOKENS])
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    if chat_template is None:
        chat_template = (files("trl") / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    tok.chat_template = chat_template
    return tok
