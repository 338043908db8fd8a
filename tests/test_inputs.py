"""The trainer's inputs as GRPO users give them: a model id or folder, no tokenizer, a dataset of
prompts (text or messages), or render_prompts' own (dataset, info) pair."""

import pytest
import torch
from datasets import Dataset

from trl_ppo_ext.data import render_prompts
from trl_ppo_ext.inputs import load_policy, load_processing_class, model_init_kwargs, prompt_dataset
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    tok = build_tiny_tokenizer()
    tok.pad_token = None  # as many hub tokenizers come: no pad token
    model = build_tiny_causal_lm(tok, seed=3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model.state_dict()


def _args(**kwargs):
    from types import SimpleNamespace

    return SimpleNamespace(model_init_kwargs=kwargs.pop("model_init_kwargs", None))


def test_a_folder_loads_as_the_causal_lm_saved_there(saved_policy):
    folder, weights = saved_policy
    model = load_policy(str(folder), _args())
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    half = load_policy(str(folder), _args(model_init_kwargs={"dtype": torch.bfloat16}))
    assert half.dtype == torch.bfloat16  # model_init_kwargs reached from_pretrained


def test_a_model_passes_through_and_none_is_named():
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    assert load_policy(model, _args()) is model
    with pytest.raises(ValueError, match="`model` is required"):
        load_policy(None, _args())


def test_model_init_kwargs_read_json_text_and_name_bad_values():
    assert model_init_kwargs(_args(model_init_kwargs='{"dtype": "bfloat16"}')) == {"dtype": "bfloat16"}
    assert model_init_kwargs(_args()) == {}
    with pytest.raises(ValueError, match="model_init_kwargs='{oops' is not JSON"):
        model_init_kwargs(_args(model_init_kwargs="{oops"))


def test_no_processing_class_loads_the_policys_tokenizer_with_a_pad_token(saved_policy):
    model = load_policy(str(saved_policy[0]), _args())
    tok = load_processing_class(None, model)
    assert tok("w1 w2").input_ids == build_tiny_tokenizer()("w1 w2").input_ids
    assert tok.pad_token == tok.eos_token  # the saved one had none
    given = build_tiny_tokenizer()
    assert load_processing_class(given, model) is given


def test_no_processing_class_for_a_model_of_unknown_origin_is_named():
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    model.config._name_or_path = ""
    with pytest.raises(ValueError, match="processing_class=None.*Pass processing_class=tokenizer"):
        load_processing_class(None, model)


@pytest.mark.parametrize("prompts", [["w0 w1", "w2"], [[{"role": "user", "content": "w0 w1"}],
                                                       [{"role": "user", "content": "w2"}]]])
def test_a_prompt_column_is_rendered_as_render_prompts_renders_it(prompts):
    tok = build_tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": prompts, "answer": ["w1", "w2"]})
    rendered = prompt_dataset(ds, tok, response_length=4)
    expected, _ = render_prompts(ds, tok, response_length=4)
    assert rendered["input_ids"] == expected["input_ids"] == [[4, 6, 7, 3, 5], [4, 8, 3, 5]]  # <user> .. <assistant>
    assert rendered["answer"] == ["w1", "w2"] and rendered["prompt"] == prompts  # columns kept for rewards


def test_tokenized_datasets_and_render_prompts_pairs_pass_through():
    tok = build_tiny_tokenizer()
    tokenized = Dataset.from_dict({"input_ids": [[6, 7]]})
    assert prompt_dataset(tokenized, tok) is tokenized
    pair = render_prompts(Dataset.from_dict({"prompt": ["w0"]}), tok)
    assert prompt_dataset(pair, tok) is pair[0]
    assert prompt_dataset(None, tok) is None


def test_a_dataset_without_prompts_names_its_columns():
    with pytest.raises(ValueError, match=r"`eval_dataset` has neither .* its columns: \['text'\]"):
        prompt_dataset(Dataset.from_dict({"text": ["w0"]}), build_tiny_tokenizer(), name="eval_dataset")
