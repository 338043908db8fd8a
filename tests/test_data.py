"""render_prompts: the ids written by hand from the tiny vocabulary, the drops, the errors.

The tiny tokenizer's ids (``trl_ppo_ext.tiny``): <pad>=0 <unk>=1 <bos>=2 <eos>=3 <user>=4
<assistant>=5, then w0=6, w1=7, ... (w_i = 6 + i). Its chat template renders a user turn as
``<user> TEXT <eos>``, an assistant turn as ``<assistant> TEXT <eos>``, and the generation
prompt as ``<assistant>``.
"""

import logging

import pytest
import torch
from datasets import Dataset
from tokenizers import processors

from trl_ppo_ext.data import RenderInfo, _template_ids, render_prompts, repeat_prompts
from trl_ppo_ext.tiny import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

USER, ASSISTANT, EOS, BOS = 4, 5, 3, 2
W0, W1, W2, W3, W4, W5 = 6, 7, 8, 9, 10, 11


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def ids(dataset):
    return [list(row) for row in dataset["input_ids"]]


def test_string_prompt_column_is_wrapped_as_a_user_turn(tok):
    ds = Dataset.from_dict({"prompt": ["w0 w1", "w5"], "label": [1, 2]})
    out, info = render_prompts(ds, tok)
    # "<user> w0 w1 <eos> <assistant>" and "<user> w5 <eos> <assistant>"
    assert ids(out) == [[USER, W0, W1, EOS, ASSISTANT], [USER, W5, EOS, ASSISTANT]]
    assert out.column_names == ["prompt", "label", "input_ids"]  # every column kept, the ids added
    assert list(out["prompt"]) == ["w0 w1", "w5"] and list(out["label"]) == [1, 2]
    assert info == RenderInfo("prompt", conversational=False, used_chat_template=True,
                              max_prompt_tokens=None, num_prompts=2, num_empty=0, num_too_long=0)


def test_string_prompt_without_template_when_turned_off(tok):
    ds = Dataset.from_dict({"prompt": ["w0 w1"]})
    out, info = render_prompts(ds, tok, use_chat_template=False)
    assert ids(out) == [[W0, W1]]  # the tiny tokenizer adds no special tokens of its own
    assert not info.used_chat_template


def test_messages_column_multi_turn(tok):
    conv = [user("w2"), assistant("w3"), user("w4")]
    out, info = render_prompts(Dataset.from_dict({"messages": [conv]}), tok)
    # <user> w2 <eos> <assistant> w3 <eos> <user> w4 <eos> <assistant>
    assert ids(out) == [[USER, W2, EOS, ASSISTANT, W3, EOS, USER, W4, EOS, ASSISTANT]]
    assert info.prompt_column == "messages" and info.conversational


def test_final_assistant_turn_is_dropped(tok):
    conv = [user("w2"), assistant("w3")]  # an SFT-style row: the answer is in the data
    out, _ = render_prompts(Dataset.from_dict({"messages": [conv]}), tok)
    assert ids(out) == [[USER, W2, EOS, ASSISTANT]]  # the policy must write "w3" itself


def test_conversational_prompt_column(tok):
    ds = Dataset.from_dict({"prompt": [[user("w0")], [user("w1 w2")]], "chosen": ["x", "y"]})
    out, info = render_prompts(ds, tok)
    assert ids(out) == [[USER, W0, EOS, ASSISTANT], [USER, W1, W2, EOS, ASSISTANT]]
    assert out.column_names == ["prompt", "chosen", "input_ids"]
    assert info.prompt_column == "prompt" and info.conversational


def test_prompt_column_argument_picks_another_column(tok):
    ds = Dataset.from_dict({"question": ["w3"], "prompt": ["w4"]})
    out, info = render_prompts(ds, tok, prompt_column="question")
    assert ids(out) == [[USER, W3, EOS, ASSISTANT]]
    assert info.prompt_column == "question"


def test_special_tokens_are_not_added_twice():
    # A tokenizer whose backend adds BOS, with a template that writes BOS itself.
    tok = build_tiny_tokenizer(chat_template="{{ bos_token }} " + TINY_CHAT_TEMPLATE)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    ds = Dataset.from_dict({"prompt": ["w0", "<bos> w1"]})
    templated, _ = render_prompts(ds, tok)
    assert ids(templated) == [[BOS, USER, W0, EOS, ASSISTANT], [BOS, USER, BOS, W1, EOS, ASSISTANT]]
    raw, _ = render_prompts(ds, tok, use_chat_template=False)
    assert ids(raw) == [[BOS, W0], [BOS, W1]]  # added to the first, already there in the second


def test_template_output_as_a_plain_list():
    class ListTokenizer:  # transformers 4 returns a list from apply_chat_template(tokenize=True)
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return [4, 6, 3, 5]

    assert _template_ids(ListTokenizer(), [user("w0")]) == [4, 6, 3, 5]


def test_too_long_and_empty_prompts_are_dropped_and_counted(tok, caplog):
    # max_length 8 - response_length 3 = 5 prompt tokens at most.
    ds = Dataset.from_dict({"prompt": ["w0", "w0 w1", "w0 w1 w2", "  ", "w3 w4 w5 w0"]})
    # rendered lengths: 4, 5, 6, (empty), 7
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.data"):
        out, info = render_prompts(ds, tok, response_length=3, max_length=8)
    assert ids(out) == [[USER, W0, EOS, ASSISTANT], [USER, W0, W1, EOS, ASSISTANT]]
    assert (info.num_prompts, info.num_empty, info.num_too_long, info.num_kept) == (5, 1, 2, 2)
    assert info.max_prompt_tokens == 5
    assert "dropped 3 of 5 prompts" in caplog.text and "1 empty, 2 longer than 5 tokens" in caplog.text


def test_max_prompt_length_is_the_tighter_limit(tok):
    ds = Dataset.from_dict({"prompt": ["w0", "w0 w1"]})  # 4 and 5 tokens
    out, info = render_prompts(ds, tok, max_prompt_length=4, response_length=3, max_length=100)
    assert ids(out) == [[USER, W0, EOS, ASSISTANT]]
    assert (info.max_prompt_tokens, info.num_too_long) == (4, 1)


def test_empty_conversation_is_dropped(tok):
    ds = Dataset.from_dict({"messages": [[user("w0")], [assistant("w1")], [user("")]]})
    out, info = render_prompts(ds, tok)
    assert ids(out) == [[USER, W0, EOS, ASSISTANT]]
    assert info.num_empty == 2  # only an answer to drop; an empty user turn


def test_no_warning_when_nothing_is_dropped(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.data"):
        render_prompts(Dataset.from_dict({"prompt": ["w0"]}), tok, response_length=2, max_length=16)
    assert caplog.text == ""


# --- errors -----------------------------------------------------------------------------


def test_error_no_prompt_column_lists_columns(tok):
    ds = Dataset.from_dict({"question": ["w0"], "answer": ["w1"]})
    with pytest.raises(ValueError, match=r"no prompt column.*\['question', 'answer'\].*prompt_column"):
        render_prompts(ds, tok)


def test_error_unknown_prompt_column(tok):
    with pytest.raises(ValueError, match=r"prompt_column='text'.*columns: \['prompt'\]"):
        render_prompts(Dataset.from_dict({"prompt": ["w0"]}), tok, prompt_column="text")


def test_error_column_of_the_wrong_type(tok):
    with pytest.raises(ValueError, match=r"column 'prompt' holds a value of type int"):
        render_prompts(Dataset.from_dict({"prompt": [3]}), tok)


def test_error_conversations_without_chat_template():
    tok = build_tiny_tokenizer(chat_template=None)
    ds = Dataset.from_dict({"messages": [[user("w0")]]})
    with pytest.raises(ValueError, match=r"'messages' holds conversations.*no chat template.*chat_template"):
        render_prompts(ds, tok)


def test_error_chat_template_requested_but_missing():
    tok = build_tiny_tokenizer(chat_template=None)
    ds = Dataset.from_dict({"prompt": ["w0"]})
    with pytest.raises(ValueError, match=r"use_chat_template=True.*no chat template"):
        render_prompts(ds, tok, use_chat_template=True)
    out, info = render_prompts(ds, tok)  # auto: no template, strings are tokenised raw
    assert ids(out) == [[W0]] and not info.used_chat_template


@pytest.mark.parametrize("response_length, max_length", [(8, 8), (9, 8)])
def test_error_response_length_not_below_max_length(tok, response_length, max_length):
    ds = Dataset.from_dict({"prompt": ["w0"]})
    with pytest.raises(ValueError, match=rf"response_length={response_length} >= max_length={max_length}"):
        render_prompts(ds, tok, response_length=response_length, max_length=max_length)


def test_error_all_prompts_dropped(tok):
    ds = Dataset.from_dict({"prompt": ["w0 w1", "w2 w3 w4"]})  # 5 and 6 tokens
    with pytest.raises(ValueError, match=r"dropped 2 of 2 prompts.*0 empty, 2 longer than 3 tokens.*No prompt"):
        render_prompts(ds, tok, response_length=5, max_length=8)


def test_error_empty_dataset(tok):
    with pytest.raises(ValueError, match="0 rows"):
        render_prompts(Dataset.from_dict({"prompt": []}), tok)


def test_other_columns_reach_reward_functions_row_aligned_and_messages_stay_messages(tok):
    """Issue 23: render_prompts kept only input_ids, so a reward function asking for `answer`
    failed (missing argument) and conversational prompts arrived as decoded text."""
    from trl_ppo_ext.data import PromptCollator

    ds = Dataset.from_dict({
        "prompt": [[user("w0")], [user("")], [user("w1 w2")]],  # the middle row is empty: dropped
        "answer": ["w0", "none", "w2"],
        "input_ids": [[9, 9], [9], [9]],  # stale ids (another tokenizer): replaced
        "attention_mask": [[1, 1], [1], [1]],
    })
    out, info = render_prompts(ds, tok)
    assert info.num_empty == 1
    assert out.column_names == ["prompt", "answer", "input_ids"]  # the stale mask is gone too
    assert ids(out) == [[USER, W0, EOS, ASSISTANT], [USER, W1, W2, EOS, ASSISTANT]]
    batch = PromptCollator(tok)([out[0], out[1]])
    assert batch["answer"] == ["w0", "w2"]  # the rows kept, in order: answer still matches its prompt
    assert batch["prompt"] == [[user("w0")], [user("w1 w2")]]  # messages, not text
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]  # fresh, from the new ids


# ---------------------------------------------------------------- one prompt rule, two users
def test_too_long_prompts_is_the_one_rule_render_prompts_and_the_trainer_apply():
    from trl_ppo_ext.data import check_prompt_lengths, too_long_prompts

    # limit 4: 5 > 4 too long; 4 fits; an empty prompt is never "too long" (it is dropped as empty)
    assert too_long_prompts([5, 4, 0], [False, False, True], 4) == [True, False, False]
    assert too_long_prompts([500], [False], None) == [False]  # no limit
    tok = build_tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": ["w0", "w0 w1 w2 w3 w4 w5"]})
    kept, info = render_prompts(ds, tok, use_chat_template=False, response_length=4, max_length=8)
    assert info.num_too_long == 1 and info.max_prompt_tokens == 4
    check_prompt_lengths(kept, "train_dataset", max_positions=8, response_length=4)  # what it keeps passes
    encoded = Dataset.from_dict({"input_ids": [tok("w0 w1 w2 w3 w4 w5")["input_ids"]]})
    with pytest.raises(ValueError, match=r"`train_dataset` has 1 prompt\(s\) longer than 4 tokens"):
        check_prompt_lengths(encoded, "train_dataset", max_positions=8, response_length=4)


def test_check_prompt_lengths_refuses_empty_prompts_and_skips_torch_datasets():
    from trl_ppo_ext.data import check_prompt_lengths

    with pytest.raises(ValueError, match=r"`eval_dataset` holds 1 empty prompt\(s\)"):
        check_prompt_lengths(Dataset.from_dict({"input_ids": [[1], []]}), "eval_dataset", None, 4)
    check_prompt_lengths([{"input_ids": []}], "train_dataset", 8, 4)  # no column_names: checked per batch later
    check_prompt_lengths(Dataset.from_dict({"input_ids": [[1] * 100]}), "train_dataset", None, 4)  # no limit


def test_check_prompt_dataset_names_what_is_missing():
    from types import SimpleNamespace

    from trl_ppo_ext.data import check_prompt_dataset

    with pytest.raises(ValueError, match="`train_dataset` is required"):
        check_prompt_dataset(None, SimpleNamespace(pad_token_id=0))
    with pytest.raises(ValueError, match="`train_dataset` is empty"):
        check_prompt_dataset(Dataset.from_dict({"input_ids": []}), SimpleNamespace(pad_token_id=0))
    with pytest.raises(ValueError, match=r"`processing_class` \(SimpleNamespace\) has no pad token"):
        check_prompt_dataset(Dataset.from_dict({"input_ids": [[1]]}), SimpleNamespace(pad_token_id=None))


# ---------------------------------------------------------------- repeat_prompts


def test_repeat_prompts_keeps_the_copies_of_a_row_adjacent():
    batch = {"input_ids": torch.tensor([[0, 5], [6, 7], [8, 9]]), "attention_mask": torch.tensor([[0, 1], [1, 1],
             [1, 1]]), "answer": ["x", "y", "z"], "prompt": ("p", "q", "r")}
    out = repeat_prompts(batch, 2)
    assert out["input_ids"].tolist() == [[0, 5], [0, 5], [6, 7], [6, 7], [8, 9], [8, 9]]
    assert out["attention_mask"].tolist() == [[0, 1], [0, 1], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert out["answer"] == ["x", "x", "y", "y", "z", "z"] and out["prompt"] == ["p", "p", "q", "q", "r", "r"]
    # the rows of group b are row b: out[b*G + i] == batch[b] for every i (the estimators' grouping)
    for b in range(3):
        for i in range(2):
            assert torch.equal(out["input_ids"][b * 2 + i], batch["input_ids"][b])
    assert batch["answer"] == ["x", "y", "z"] and batch["input_ids"].shape == (3, 2)  # not modified


def test_repeat_prompts_once_is_the_batch():
    batch = {"input_ids": torch.tensor([[1], [2]]), "answer": ["a", "b"]}
    out = repeat_prompts(batch, 1)
    assert torch.equal(out["input_ids"], batch["input_ids"]) and out["answer"] == ["a", "b"]


def test_repeat_prompts_refuses_what_it_cannot_repeat():
    with pytest.raises(ValueError, match="num_generations must be an int >= 1, got 0"):
        repeat_prompts({"input_ids": torch.zeros(2, 1)}, 0)
    with pytest.raises(ValueError, match="different numbers of rows: {'input_ids': 2, 'answer': 3}"):
        repeat_prompts({"input_ids": torch.zeros(2, 1), "answer": ["a", "b", "c"]}, 2)
    with pytest.raises(TypeError, match="field 'step' is a int"):
        repeat_prompts({"input_ids": torch.zeros(2, 1), "step": 3}, 2)
