"""Tests for trl_ppo_ext.models.actor_critic (shared actor-critic, loaders) and trl_ppo_ext.models.quantization.

CPU only, tiny random Llama models built locally (trl_ppo_ext.tiny); 4-bit tests use the
bitsandbytes CPU backend with hidden_size=64 (bnb quantizes in blocks of 64 inputs).
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GenerationMixin,
    LlamaForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from trl_ppo_ext.models import quantization as quant
from trl_ppo_ext.models.actor_critic import (
    VALUE_HEAD_CONFIG,
    VALUE_HEAD_WEIGHTS,
    SharedActorCritic,
    default_lora_config,
)
from trl_ppo_ext.models.loading import load_actor_critic, load_reward_model
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer, tiny_llama_config

# peft 0.21 reads a property transformers 5 deprecated; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def small_lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=QKVO, task_type="CAUSAL_LM")


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]). Shape: (B, L-1)."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def ppo_like_loss(model: SharedActorCritic, ids: torch.Tensor) -> torch.Tensor:
    """Any scalar that depends on both heads: mean token log-prob plus a value regression."""
    logits, values = model(ids)
    return -token_log_probs(logits, ids).mean() + (values - 1.0).pow(2).mean()


def train_steps(model: SharedActorCritic, ids: torch.Tensor, steps: int = 1) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        ppo_like_loss(model, ids).backward()
        optimizer.step()


def fill_trainable(model: nn.Module, seed: int) -> None:
    """Give every LoRA and value-head tensor the same non-zero values in models built alike."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name or name.startswith("value_head."):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return torch.randint(len(tok) - 40, len(tok), (3, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def lm_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm")
    build_tiny_causal_lm(tok, seed=0, hidden_size=64).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    build_tiny_scorer(tok, seed=1, hidden_size=64).save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------- actor-critic


def test_forward_returns_logits_and_fp32_values_from_the_last_hidden_state(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora())
    logits, values = model(ids)
    assert logits.shape == (3, 9, len(tok)) and values.shape == (3, 9)
    assert values.dtype == torch.float32
    hidden = model.policy(ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(values, model.value_head(hidden).squeeze(-1))
    assert model.is_actor_critic and model.config is model.policy.get_base_model().config


def test_values_stay_fp32_under_bf16_autocast(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, values = model(ids)
        hidden = model.policy(ids, output_hidden_states=True).hidden_states[-1]
    assert values.dtype == torch.float32
    # The value head itself ran in fp32 (bf16 would round to ~3 significant digits).
    assert torch.equal(values, model.value_head(hidden.float()).squeeze(-1))


def test_only_lora_and_value_head_train(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Two steps: lora_B starts at zero, so lora_A gets its first gradient in step two.
    train_steps(model, ids, steps=2)
    for name, param in model.named_parameters():
        if name in trainable:
            assert not torch.equal(param, before[name]), f"{name} did not move"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"


def test_reference_context_gives_the_untouched_base_after_training(tok, ids):
    untouched = build_tiny_causal_lm(tok, seed=0)
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=small_lora())
    train_steps(model, ids)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    model.eval()
    with torch.no_grad():
        expected = token_log_probs(untouched(ids).logits, ids)
        policy = token_log_probs(model.policy(ids).logits, ids)
        with model.reference_context():
            reference = token_log_probs(model.policy(ids).logits, ids)
            via_forward = token_log_probs(model(ids)[0], ids)
        with model.policy.disable_adapter():  # what the trainer calls
            via_peft = token_log_probs(model.policy(ids).logits, ids)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(via_forward, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(via_peft, expected, rtol=0, atol=1e-6)
    assert (policy - expected).abs().max() > 1e-3  # the trained adapter does change the policy


def test_existing_peft_model_is_accepted_but_not_with_lora_config(tok):
    from peft import get_peft_model

    peft_model = get_peft_model(build_tiny_causal_lm(tok), small_lora())
    assert SharedActorCritic(peft_model).policy is peft_model
    with pytest.raises(ValueError, match=r"base_model is already a PeftModel.*lora_config="):
        SharedActorCritic(peft_model, lora_config=small_lora())


def test_value_head_of_wrong_size_is_rejected(tok):
    with pytest.raises(ValueError, match=r"value_head=Linear\(16, 1\).*hidden_size=32"):
        SharedActorCritic(build_tiny_causal_lm(tok), value_head=nn.Linear(16, 1))


def test_default_lora_config_targets_llama_projections(tok):
    config = default_lora_config(build_tiny_causal_lm(tok))
    assert set(config.target_modules) == set(QKVO) and config.task_type == "CAUSAL_LM"
    assert (config.r, config.lora_alpha, config.lora_dropout) == (16, 32, 0.0)
    with pytest.raises(ValueError, match="lora_target_modules=None"):
        default_lora_config(nn.Sequential(nn.Linear(4, 4)))


def test_gradient_checkpointing_pass_through_keeps_gradients(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora())
    fill_trainable(model, seed=0)
    model.train()
    ppo_like_loss(model, ids).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    ppo_like_loss(model, ids).backward()
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-7)
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing


def test_save_and_load_round_trip_is_exact(tok, ids, tmp_path):
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=small_lora())
    train_steps(model, ids)
    model.eval()
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / VALUE_HEAD_CONFIG).read_text())
    assert meta["hidden_size"] == 32 and meta["dtype"] == "float32" and meta["value_adapter"] is None
    assert (tmp_path / VALUE_HEAD_WEIGHTS).is_file()

    loaded = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path)
    assert not any(p.requires_grad for p in loaded.parameters())
    with torch.no_grad():
        logits, values = model(ids)
        logits2, values2 = loaded(ids)
        plain_peft = PeftModel.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path)
        peft_logits = plain_peft(ids).logits
    assert torch.equal(logits, logits2) and torch.equal(values, values2)
    assert torch.equal(logits, peft_logits)

    resumed = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path,
                                                is_trainable=True)
    trainable = {n for n, p in resumed.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in model.named_parameters() if p.requires_grad}


def test_round_trip_with_a_non_default_adapter_name(tok, ids, tmp_path):
    from peft import get_peft_model

    model = SharedActorCritic(get_peft_model(build_tiny_causal_lm(tok, seed=0), small_lora(),
                                             adapter_name="policy"))
    fill_trainable(model, seed=0)
    model.save_pretrained(tmp_path)
    loaded = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path)
    assert loaded.policy.active_adapter == "policy"
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model.eval()(ids), loaded(ids)))


def test_from_pretrained_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="output_dir=.*value_head_config.json"):
        SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok), tmp_path)
    SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_size=32 but base_model has hidden_size=64"):
        SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, hidden_size=64), tmp_path)


# ------------------------------------------------------------------ value adapter


def test_value_adapter_reads_its_own_hidden_states(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora(),
                              value_lora_config=small_lora())
    assert model.value_adapter == "value"
    # Policy adapter made non-zero; the new value adapter (lora_B = 0) is still the identity,
    # so the values must be the value head on the *base* model's final hidden states.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.default" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        _, values = model(ids)
        with model.reference_context():
            base_hidden = model.policy(ids, output_hidden_states=True).hidden_states[-1]
        policy_hidden = model.policy(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(values, model.value_head(base_hidden).squeeze(-1), rtol=0, atol=1e-6)
    assert not torch.allclose(values, model.value_head(policy_hidden).squeeze(-1))


def test_value_adapter_trains_with_the_policy_and_round_trips(tok, ids, tmp_path):
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=small_lora(),
                              value_lora_config=small_lora())
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert any(v for n, v in flags.items() if ".value." in n)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model, ids, steps=2)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert model.policy.active_adapter == "default"
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) != flags[name], name

    model.eval()
    model.save_pretrained(tmp_path)
    loaded = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path)
    assert loaded.value_adapter == "value"
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(ids), loaded(ids)))


def _value_adapter_model(tok) -> SharedActorCritic:
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=small_lora(),
                              value_lora_config=small_lora())
    fill_trainable(model, seed=3)  # both adapters non-zero: a pass under the wrong one differs
    return model.train()


def _gradients(model: SharedActorCritic, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    ppo_like_loss(model, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_value_adapter_checkpoints_with_the_gradients_of_no_checkpointing(tok, ids):
    expected = _gradients(_value_adapter_model(tok), ids)
    model = _value_adapter_model(tok)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    layer = model.policy.get_base_model().model.layers[0]
    calls = []
    layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(model.policy.active_adapter))
    got = _gradients(model, ids)
    # forward: the policy pass, then the value pass; backward recomputes each layer under its own
    # adapter (the value pass first: backward runs in reverse)
    assert calls == ["default", "value", "value", "default"]
    assert set(got) == set(expected) and any(".value." in n for n in got)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert model.policy.active_adapter == "default"


@pytest.mark.parametrize("family", ["gpt2", "opt", "qwen2"])
def test_value_adapter_checkpoints_exactly_on_other_families(family):
    """The recomputation under each layer's own adapter is not a Llama property: GPT-2 (fused c_attn,
    ``transformer`` backbone), OPT and Qwen2 give the gradients of no checkpointing, bit for bit."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

    def build():
        torch.manual_seed(0)
        if family == "gpt2":
            config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                                eos_token_id=0)
            return GPT2LMHeadModel(config), ["c_attn"]
        if family == "opt":
            config = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                               word_embed_proj_dim=32, max_position_embeddings=64)
            return OPTForCausalLM(config), ["q_proj", "v_proj"]
        config = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)
        return Qwen2ForCausalLM(config), ["q_proj", "v_proj"]

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpointing in (False, True):
        base, targets = build()
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        model = SharedActorCritic(base, lora_config=lora, value_lora_config=lora)
        fill_trainable(model, seed=3)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        grads.append(_gradients(model, ids))
    assert grads[0].keys() == grads[1].keys() and any(".value." in n for n in grads[0])
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_value_adapter_switch_equals_peft_set_adapter(tok, ids, checkpointing, monkeypatch):
    """The cheap switch (naming the active adapter on each LoRA layer) gives the values and gradients
    of peft's own ``set_adapter``, leaves flags and names as they were, and steps aside where a peft
    wrapper of another kind (``modules_to_save``) or a merged layer needs ``set_adapter``."""
    models = [_value_adapter_model(tok) for _ in range(2)]
    if checkpointing:
        for model in models:
            model.gradient_checkpointing_enable()
    fast, slow = models
    assert fast._switchable_layers() is not None
    monkeypatch.setattr(slow, "_switchable_layers", lambda: None)  # peft's set_adapter every time
    flags = {n: p.requires_grad for n, p in fast.named_parameters()}
    names = [layer._active_adapter for layer in fast._switchable_layers()]
    grads = [_gradients(model, ids) for model in models]
    assert grads[0].keys() == grads[1].keys() and any(".value." in n for n in grads[0])
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name
    assert {n: p.requires_grad for n, p in fast.named_parameters()} == flags
    assert [layer._active_adapter for layer in fast._switchable_layers()] == names
    assert fast.policy.active_adapter == fast.policy.base_model.active_adapter == "default"

    saving = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), value_lora_config=small_lora(),
                               lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=QKVO, task_type="CAUSAL_LM",
                                                      modules_to_save=["embed_tokens"]))
    assert saving._switchable_layers() is None
    merged = _value_adapter_model(tok)
    next(layer for layer in merged._switchable_layers()).merge(adapter_names=["default"])
    assert merged._switchable_layers() is None


def test_value_adapter_refuses_reentrant_checkpointing_and_a_base_checkpointed_behind_its_back(tok, ids):
    model = _value_adapter_model(tok)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        model.gradient_checkpointing_enable({"use_reentrant": True})
    # turned on on the base directly: the value pass would recompute under the policy adapter
    model.policy.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(RuntimeError, match="through SharedActorCritic.gradient_checkpointing_enable"):
        model(ids)
    with torch.no_grad():  # without grad nothing recomputes: allowed
        model(ids)
    # a base that comes checkpointing is switched to the adapter-safe recomputation
    base = build_tiny_causal_lm(tok, seed=0)
    base.gradient_checkpointing_enable({"use_reentrant": False})
    wrapped = SharedActorCritic(base, lora_config=small_lora(), value_lora_config=small_lora())
    assert wrapped.is_gradient_checkpointing and wrapped._recomputes_under_its_adapter()


class _ToyConfig(PretrainedConfig):
    model_type = "toy_two_layer_lm"

    def __init__(self, vocab_size=40, hidden_size=8, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size


class _ToyLM(PreTrainedModel, GenerationMixin):
    """A causal LM of a user's own that supports less than transformers' classes: no backbone under
    ``base_model_prefix``, no gradient checkpointing, no attention mask. ``h = tanh(v(tanh(q(e))))``."""

    config_class = _ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, output_hidden_states=False, **ignored):
        embedded = self.embed(input_ids)
        hidden = torch.tanh(self.v_proj(torch.tanh(self.q_proj(embedded))))
        return CausalLMOutputWithPast(logits=self.lm_head(hidden),
                                      hidden_states=(embedded, hidden) if output_hidden_states else None)


def test_value_adapter_on_a_custom_lm_without_backbone_or_checkpointing(caplog):
    torch.manual_seed(0)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = SharedActorCritic(_ToyLM(_ToyConfig()), lora_config=lora, value_lora_config=lora)
    ids = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 0]])
    _, values = model(ids)

    def adapted(linear, x, name):  # W x + b + scaling * B A x, from the adapter's own tensors
        return linear.base_layer(x) + linear.scaling[name] * linear.lora_B[name](linear.lora_A[name](x))

    toy = model.policy.get_base_model()
    with torch.no_grad():
        q = torch.tanh(adapted(toy.q_proj, toy.embed(ids), "value"))
        expected = model.value_head(torch.tanh(adapted(toy.v_proj, q, "value"))).squeeze(-1)
    torch.testing.assert_close(values, expected, rtol=1e-6, atol=1e-6)
    assert model.policy.active_adapter == "default"  # the policy's adapter is active again afterwards
    # TRL's default gradient_checkpointing=True: skipped with a warning, and the critic still trains
    with caplog.at_level(logging.WARNING):
        model.gradient_checkpointing_enable()
    assert not model.is_gradient_checkpointing
    assert any("_ToyLM" in r.getMessage() and "not applied" in r.getMessage() for r in caplog.records)
    model(ids)[1].pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if ".value." in n)
    assert all(grads[n] is None for n in grads if ".default." in n)  # a value loss leaves the policy adapter


# ---------------------------------------------------------------------- loaders


def test_load_actor_critic_fp32(lm_dir, ids):
    model = load_actor_critic(lm_dir, lora_r=4, lora_alpha=8, value_lora=True)
    assert isinstance(model.policy, PeftModel) and model.value_adapter == "value"
    assert model.policy.peft_config["default"].r == 4
    assert model(ids)[1].shape == ids.shape


def test_load_reward_model_is_frozen_scalar(rm_dir, ids):
    model = load_reward_model(rm_dir)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model(ids).logits.shape == (3, 1)


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    for load in (load_actor_critic, load_reward_model):
        with pytest.raises(FileNotFoundError, match="model_name_or_path=.*no-such-model"):
            load(missing)
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(FileNotFoundError, match="not an existing local directory"):
        load_actor_critic(tmp_path / "file.bin")


def test_mistyped_relative_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)  # "outputs/sft" would otherwise look like a Hub id
    with pytest.raises(FileNotFoundError, match="model_name_or_path='outputs/sft'"):
        load_actor_critic("outputs/sft")


def test_hub_failure_names_the_argument(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(OSError, match=r"model_name_or_path='org/model' \(revision='v1'\).*HF_HUB_OFFLINE"):
        load_actor_critic("org/model", revision="v1")


def test_reward_model_must_have_one_label(tok, tmp_path, rm_dir):
    with pytest.raises(ValueError, match="num_labels=2.*Pass num_labels=1"):
        load_reward_model(rm_dir, num_labels=2)
    torch.manual_seed(0)
    LlamaForSequenceClassification(tiny_llama_config(tok, num_labels=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has num_labels=2 in its config"):
        load_reward_model(tmp_path)


def test_bad_torch_dtype_is_rejected(lm_dir):
    with pytest.raises(ValueError, match="torch_dtype='bf17'"):
        load_actor_critic(lm_dir, torch_dtype="bf17")


@pytest.mark.parametrize("loader", [load_actor_critic, load_reward_model])
def test_4bit_without_bitsandbytes_is_a_clear_import_error(loader, lm_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now fails
    with pytest.raises(ImportError, match=r"load_in_4bit=True needs bitsandbytes.*pip install bitsandbytes"):
        loader(lm_dir, load_in_4bit=True)


# ------------------------------------------------------------------------ 4-bit


def test_4bit_reward_model_scores_close_to_fp32(rm_dir, tok):
    # nf4 on this tiny RM (seed 1, hidden 64): max |score error| measured 0.028-0.045 over
    # seeds 0-5 on 16x12 inputs, scores with std ~0.14; Pearson r >= 0.991. Tolerance 0.08
    # is below the gap to an unrelated RM (checked below), so a wrong model cannot pass.
    ids = torch.randint(6, len(tok), (16, 12), generator=torch.Generator().manual_seed(1))
    fp32 = load_reward_model(rm_dir)
    nf4 = load_reward_model(rm_dir, load_in_4bit=True)
    layers = quant.linear4bit_modules(nf4)
    assert len(layers) == 14 and not any(layer.support_avx512bf16_for_cpu for layer in layers)
    with torch.no_grad():
        exact = fp32(ids).logits.squeeze(-1)
        approx = nf4(ids).logits.squeeze(-1)
        unrelated = build_tiny_scorer(tok, seed=7, hidden_size=64)(ids).logits.squeeze(-1)
    assert (approx - exact).abs().max() <= 0.08
    assert torch.corrcoef(torch.stack([approx, exact]))[0, 1] >= 0.98
    assert (unrelated - exact).abs().max() > 0.08


@pytest.mark.parametrize("pretend_avx512_bf16", [False, True])
def test_4bit_lora_gradients_after_a_rollout_match_a_fresh_model(lm_dir, ids, monkeypatch,
                                                                  pretend_avx512_bf16):
    # On a CPU with avx512_bf16, bnb's Linear4bit starts with support_avx512bf16_for_cpu=True
    # and repacks its weight in the rollout below; backward then goes through an op without
    # autograd. Pretending this CPU has it reproduces the flag; without make_4bit_cpu_safe
    # the gradients below were measured wrong here by up to 4.3x their norm.
    if pretend_avx512_bf16:
        bnb = quant.import_bitsandbytes()
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    rolled, fresh = (load_actor_critic(lm_dir, lora_r=4, lora_alpha=8, load_in_4bit=True)
                     for _ in range(2))
    layers = quant.linear4bit_modules(rolled)
    assert len(layers) == 14 and not any(layer.support_avx512bf16_for_cpu for layer in layers)
    for model in (rolled, fresh):
        fill_trainable(model, seed=3)
    rolled.eval()  # the rollout: eval mode, no grad, generate then score
    with torch.no_grad():
        rolled.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=3, do_sample=False)
        rolled(ids)
    grads = []
    for model in (rolled, fresh):
        model.train()
        ppo_like_loss(model, ids).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    lora = [n for n in grads[1] if "lora_" in n]
    assert len(lora) == 16
    for name, grad in grads[1].items():
        assert grads[0][name] is not None and grad.abs().sum() > 0, name
        assert torch.equal(grads[0][name], grad), name
    assert not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)


def test_make_4bit_cpu_safe_undoes_an_avx512_repack(lm_dir):
    # The repack itself is plain torch, so it can be forced on any CPU.
    bnb = quant.import_bitsandbytes()
    model = AutoModelForCausalLM.from_pretrained(
        lm_dir, quantization_config=quant.nf4_quantization_config(torch.float32), device_map="cpu")
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    # On a CPU with avx512_bf16, bitsandbytes repacks on the first no-grad forward by itself: the
    # reference output must come from the unpacked layout, so the repack is turned off first.
    quant.make_4bit_cpu_safe(model)
    expected = layer(x)
    data, state = bnb.functional._convert_weight_packed_for_cpu(layer.weight.data, layer.weight.quant_state)
    layer.weight.data, layer.weight.quant_state, layer.quant_state = data, state, state
    with pytest.warns(UserWarning, match="1 Linear4bit layer"):
        assert quant.make_4bit_cpu_safe(model) == 14
    assert not layer.weight.quant_state.packing_format_for_cpu
    # The repack rounded absmax to bf16 (8 mantissa bits): ~0.4% per weight at most.
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0.01 * expected.abs().max().item())
    assert quant.make_4bit_cpu_safe(model) == 14  # idempotent, no second warning


def test_make_4bit_cpu_safe_ignores_plain_models(tok):
    assert quant.make_4bit_cpu_safe(build_tiny_causal_lm(tok)) == 0
    assert not quant.is_4bit_model(build_tiny_causal_lm(tok))


def test_bitsandbytes_kernels_notice_is_silenced_but_other_warnings_are_not(caplog):
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING), quant._quiet_kernels_notice():
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
                    "sure you already `pip install kernels`", "No module named 'kernels'")
        log.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    assert quant.import_bitsandbytes() is sys.modules["bitsandbytes"]


# ---------------------------------------------------------------- compute dtype


def test_resolve_compute_dtype_is_fp32_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="trl_ppo_ext.models.quantization"):
        assert [quant.resolve_compute_dtype(b, "cpu") for b in (True, False, None, True)] == [torch.float32] * 4
    assert len([r for r in caplog.records if "bf16=True is ignored" in r.getMessage()]) <= 1


@pytest.mark.parametrize(("bf16", "supported", "expected"), [
    (True, True, torch.bfloat16), (None, True, torch.bfloat16), (False, True, torch.float32),
    (None, False, torch.float32), (False, False, torch.float32),
])
def test_resolve_compute_dtype_on_cuda(monkeypatch, bf16, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert quant.resolve_compute_dtype(bf16, "cuda:0") == expected


def test_resolve_compute_dtype_refuses_bf16_where_unsupported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="bf16=True but CUDA device cuda"):
        quant.resolve_compute_dtype(True, "cuda")


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_4bit_actor_critic_on_cuda_uses_bf16_and_trains(lm_dir, ids):
    import bitsandbytes as bnb

    model = load_actor_critic(lm_dir, lora_r=4, lora_alpha=8, load_in_4bit=True)
    # bf16 compute: the quantization config, every 4-bit layer's matmul, and the unquantized weights
    assert model.policy.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.compute_dtype == torch.bfloat16 for m in layers)
    assert model.policy.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.value_head.weight.device.type == "cuda"
    assert model.value_head.weight.dtype == torch.float32
    ids = ids.cuda()
    with torch.no_grad():
        model.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)
    logits, values = model(ids)
    assert values.dtype == torch.float32
    (values.sum() + logits.float().mean()).backward()
    assert model.value_head.weight.grad is not None


# ------------------------------------------------------------------- without a critic


def _forward_counter(module: nn.Module) -> list:
    calls = []
    module.register_forward_hook(lambda m, args, out: calls.append(1))
    return calls


def test_without_a_critic_there_is_no_value_parameter_and_the_logits_are_the_policys(tok, ids):
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=3), lora_config=small_lora(), with_value=False)
    with_critic = SharedActorCritic(build_tiny_causal_lm(tok, seed=3), lora_config=small_lora())
    fill_trainable(model, seed=1)
    fill_trainable(with_critic, seed=1)  # the same LoRA weights
    names = [n for n, _ in model.named_parameters()]
    assert not model.has_value and model.value_head is None and model.value_adapter is None
    assert not any("value" in n for n in names) and all("lora_" in n for n, p in model.named_parameters()
                                                         if p.requires_grad)
    backbone = model.policy.get_base_model().model
    calls = _forward_counter(backbone)
    logits, values = model(ids, logits_to_keep=4)
    assert len(calls) == 1  # one backbone pass: no value pass ran
    assert values.shape == (3, 4) and values.dtype == torch.float32 and values.eq(0).all()
    assert torch.equal(logits, with_critic(ids, logits_to_keep=4)[0])
    with model.reference_context():  # the reference is still the adapter off
        ref_logits, _ = model(ids)
    assert torch.equal(ref_logits, build_tiny_causal_lm(tok, seed=3)(ids).logits)  # the untouched base


def test_without_a_critic_a_value_head_or_adapter_is_refused(tok):
    with pytest.raises(ValueError, match="with_value=False builds an actor-critic without a critic"):
        SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora(), value_lora_config=small_lora(),
                          with_value=False)
    with_adapter = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=small_lora(),
                                     value_lora_config=small_lora()).policy
    with pytest.raises(ValueError, match="carries a value adapter 'value'"):
        SharedActorCritic(with_adapter, with_value=False)


def test_without_a_critic_save_and_load_round_trip(tok, ids, tmp_path):
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=4), lora_config=small_lora(), with_value=False)
    fill_trainable(model, seed=2)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / VALUE_HEAD_WEIGHTS).exists()
    assert json.loads((tmp_path / VALUE_HEAD_CONFIG).read_text())["with_value"] is False
    loaded = SharedActorCritic.from_pretrained(build_tiny_causal_lm(tok, seed=4), tmp_path)
    assert not loaded.has_value
    assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_generate_samples_with_the_policy_adapter_whichever_is_active():
    """`trainer.model.generate` on the shared layout is the PeftModel's with the policy adapter, even
    while the value adapter is the active one; the active adapter is left as it was."""
    tok = build_tiny_tokenizer()
    ac = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=small_lora(),
                           value_lora_config=small_lora()).eval()
    torch.manual_seed(5)
    with torch.no_grad():  # a policy adapter that changes the greedy tokens (LoRA B starts at 0)
        for name, param in ac.policy.named_parameters():
            if "lora_B" in name and ac.policy_adapter in name:
                param.normal_(0, 2.0)
    ids = torch.tensor([[7, 8, 9]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = ac.policy.generate(ids, **kwargs)  # the policy adapter is active
    with ac.policy.disable_adapter():
        base = ac.policy.generate(ids, **kwargs)
    assert not torch.equal(expected, base)  # the adapter matters for these tokens
    ac.policy.set_adapter(ac.value_adapter)
    assert torch.equal(ac.generate(ids, **kwargs), expected)
    assert ac.policy.active_adapter == ac.value_adapter
