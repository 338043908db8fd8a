"""The trainer's inputs as GRPO users give them: a model id or folder, no tokenizer, a dataset of
prompts (text or messages), or render_prompts' own (dataset, info) pair."""

import pytest
import torch
from datasets import Dataset

from trl_ppo_ext.data import render_prompts
from trl_ppo_ext.inputs import (
    default_value_model,
    load_policy,
    load_processing_class,
    load_reward_models,
    model_init_kwargs,
    prompt_dataset,
    value_model_or_default,
)
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


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_the_default_critic_is_the_policys_backbone_with_a_new_scalar_head(family):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

    tok = build_tiny_tokenizer()
    config = {"llama": LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4),
              "gpt2": GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64),
              "opt": OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                               num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64)}[family]
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    value = default_value_model(policy)
    assert value.config.num_labels == 1
    policy.eval(), value.eval()  # GPT-2 and OPT keep their dropout on otherwise
    ids = torch.tensor([[6, 7, 8, 9]])
    with torch.no_grad():  # the critic's hidden states are the policy's: same backbone weights
        hidden = policy.base_model(input_ids=ids).last_hidden_state
        assert torch.equal(value.base_model(input_ids=ids).last_hidden_state, hidden)
        assert value(input_ids=ids).logits.shape == (1, 1)
    backbone_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not any(p.data_ptr() in backbone_ptrs for p in value.parameters())  # a copy: training one leaves the other


def test_no_backbone_to_copy_names_both_ways_out():
    with pytest.raises(ValueError, match="value_model=AutoModelForSequenceClassification.*peft_config=peft.LoraConfig"):
        default_value_model(torch.nn.Linear(2, 2))


def test_no_default_critic_is_built_for_an_estimator_without_one():
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    assert value_model_or_default(policy, None, None, with_value=False) is None
    assert value_model_or_default(policy, None, None) is not None  # gae: the backbone copy


def test_reward_model_ids_load_as_scalar_scorers(tmp_path):
    from trl_ppo_ext.tiny import build_tiny_scorer

    tok = build_tiny_tokenizer()
    build_tiny_scorer(tok).save_pretrained(tmp_path / "rm")

    def brevity(completions, **kwargs):
        return [0.0] * len(completions)

    reward_model, funcs = load_reward_models(str(tmp_path / "rm"), [str(tmp_path / "rm"), brevity], _args())
    assert reward_model.config.num_labels == 1 and funcs[0].config.num_labels == 1 and funcs[1] is brevity
    assert load_reward_models(None, brevity, _args()) == (None, brevity)


def test_the_tokenizer_is_loaded_with_the_configs_trust_remote_code(monkeypatch, make_config):
    """PPOConfig(trust_remote_code=True) (GRPO's field) reaches the tokenizer's from_pretrained too."""
    from types import SimpleNamespace

    import transformers

    from trl_ppo_ext import inputs as inputs_module

    seen = []

    def from_pretrained(source, **kwargs):
        seen.append(kwargs)
        return SimpleNamespace(pad_token="<pad>")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(inputs_module, "load_policy", lambda model, args: model)
    monkeypatch.setattr(inputs_module, "load_reward_models", lambda rm, funcs, args: (rm, funcs))
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path="some/folder"))
    prompts = Dataset.from_dict({"input_ids": [[5, 6, 7]]})  # tokenized: the fake tokenizer is never asked to render
    for config, expected in ((make_config(trust_remote_code=True), {"trust_remote_code": True}), (make_config(), {})):
        inputs_module.trainer_inputs(config, model, None, None, None, prompts, None, object(), None)
        assert seen.pop() == expected
