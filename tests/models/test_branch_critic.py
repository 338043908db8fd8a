"""Tests for trl_ppo_ext.models.branch_critic: the critic branching from the policy's pass at a layer.

CPU only, tiny random models. The values are checked against the layers run by hand from the policy's
``output_hidden_states`` (mask and rotary built here, not captured); the gradient of a value loss on the
policy's adapter against exact zero; the policy's logits against the policy run alone, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig
from torch import nn

from trl_ppo_ext.models import branch_critic
from trl_ppo_ext.models.actor_critic import VALUE_ADAPTER_NAME, VALUE_HEAD_CONFIG, SharedActorCritic
from trl_ppo_ext.models.assembly import build_policy_and_value
from trl_ppo_ext.models.loading import load_actor_critic
from trl_ppo_ext.models.values import has_values_alone, value_forward
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

LAYERS = 4
QV = ["q_proj", "v_proj"]


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=QV)


def build_base(family: str = "llama", seed: int = 0) -> nn.Module:
    """A tiny causal LM of ``family`` with LAYERS layers and a 48-token vocabulary."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if family == "llama":
        return build_tiny_causal_lm(build_tiny_tokenizer(), seed=seed, num_layers=LAYERS)
    torch.manual_seed(seed)
    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=8))  # shorter than the inputs
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))


def fill_adapters(model: nn.Module, seed: int = 3) -> None:
    """Non-zero values in every LoRA and value-head tensor (lora_B starts at 0), the same in models built alike."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name or name.startswith("value_head."):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def branch_model(family: str = "llama", layer: int = 2, seed: int = 0) -> SharedActorCritic:
    model = SharedActorCritic(build_base(family, seed), lora_config=lora(), value_lora_config=lora(),
                              value_branch_layer=layer)
    fill_adapters(model)
    return model


@pytest.fixture(scope="module")
def batch():
    """Two rows, the second left-padded by 3: ids, attention mask, position ids, each (2, 11)."""
    ids = torch.randint(6, 48, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def values_by_hand(model: SharedActorCritic, ids, mask, positions, k: int) -> torch.Tensor:
    """The branch critic's values, computed without the package's branch code: the policy's
    ``hidden_states[k]``, then layers k..N-1 under the value adapter (peft's own ``set_adapter``) with a
    causal + padding (+ sliding window, Mistral) mask built here and the family's rotary embedding, the
    final norm, the value head. Shape: (B, L)."""
    backbone = model.policy.get_base_model().model
    with torch.no_grad():
        hidden = model.policy(input_ids=ids, attention_mask=mask, position_ids=positions,
                              output_hidden_states=True).hidden_states[k]
        L = ids.shape[1]
        allowed = torch.ones(L, L).tril().bool()[None] & mask.bool()[:, None, :]  # (B, L, L): query i sees key j
        window = getattr(model.config, "sliding_window", None) if model.config.model_type == "mistral" else None
        if window is not None:  # key j within the window's last `window` positions of query i
            allowed &= (torch.arange(L)[:, None] - torch.arange(L)[None, :] < window)[None]
        allowed |= torch.eye(L, dtype=torch.bool)[None]  # a padding query sees itself (its output is unused)
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        rotary = backbone.rotary_emb(hidden, positions)
        model.policy.set_adapter(VALUE_ADAPTER_NAME)
        try:
            for layer in backbone.layers[k:]:
                hidden = layer(hidden, attention_mask=bias, position_embeddings=rotary, position_ids=positions)
        finally:
            model.policy.set_adapter("default")
        return model.value_head(backbone.norm(hidden)).squeeze(-1)


# ------------------------------------------------------------------ the layer index

@pytest.mark.parametrize("layer, expected", [(1, 1), (3, 3), (-1, 3), (-3, 1)])
def test_the_branch_layer_counts_negative_indices_from_the_top(layer, expected):
    assert branch_critic.resolve_branch_layer(layer, num_layers=4) == expected


@pytest.mark.parametrize("layer", [0, 4, -4, 7, True, 1.5])
def test_a_branch_without_layers_on_both_sides_is_refused(layer):
    with pytest.raises(ValueError, match="value_branch_layer"):
        branch_critic.resolve_branch_layer(layer, num_layers=4)


def test_the_value_adapter_sits_on_the_layers_above_the_branch_only():
    model = branch_model(layer=-1)
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n, _ in model.named_parameters() if ".value." in n}
    assert layers == {3}  # -1 on 4 layers: the last one
    assert model.policy.peft_config[VALUE_ADAPTER_NAME].layers_to_transform == [3]
    assert model.value_branch_layer == 3


# ------------------------------------------------------------------ values, gradients, logits

@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_values_equal_the_upper_layers_run_by_hand_from_the_policys_hidden_state(family, batch):
    ids, mask, positions = batch
    model = branch_model(family, layer=2)
    with torch.no_grad():
        _, values = model(ids, mask, positions)
    expected = values_by_hand(model, ids, mask, positions, k=2)
    real = mask.bool()
    torch.testing.assert_close(values[real], expected[real], rtol=1e-5, atol=1e-6)
    assert values[real].std() > 1e-3  # values that depend on the position, not a constant


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_value_loss_reaches_neither_the_policy_adapter_nor_the_layers_below(checkpointing, batch):
    ids, mask, positions = batch
    model = branch_model(layer=2).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    _, values = model(ids, mask, positions)
    (values - 1.0).pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    policy = {n: g for n, g in grads.items() if ".default." in n}
    critic = {n: g for n, g in grads.items() if ".value." in n or n.startswith("value_head.")}
    assert len(policy) == 4 * LAYERS and len(critic) == 4 * 2 + 2  # q, v x A, B; the critic's 2 layers + head
    assert all(g is None or torch.count_nonzero(g) == 0 for g in policy.values())
    assert all(g is not None and torch.count_nonzero(g) > 0 for g in critic.values())


def test_the_policys_logits_are_those_of_the_policy_without_a_critic(batch):
    ids, mask, positions = batch
    model = branch_model(layer=2)
    alone = SharedActorCritic(build_base(), lora_config=lora(), with_value=False)
    alone.load_state_dict({k: v for k, v in model.state_dict().items() if k in alone.state_dict()})
    with torch.no_grad():
        logits, _ = model(ids, mask, positions)
        assert torch.equal(logits, model.policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits)
        assert torch.equal(logits, alone(ids, mask, positions)[0])


def test_values_alone_are_the_forwards_values_bit_for_bit(batch):
    """``value_forward`` (the on-policy scoring pass: the policy's layers below the branch, then the
    critic's) gives exactly ``forward``'s values, and switches back to the policy adapter."""
    ids, mask, positions = batch
    model = branch_model(layer=1)
    assert has_values_alone(model)
    with torch.no_grad():
        expected = model(ids, mask, positions, logits_to_keep=5)[1]
        got = value_forward(model, ids, mask, positions, keep=5)
    assert torch.equal(got, expected)
    assert model.policy.active_adapter == "default"


def test_checkpointing_gives_the_gradients_of_no_checkpointing_bit_for_bit(batch):
    ids, mask, positions = batch
    grads = []
    for checkpointing in (False, True):
        model = branch_model(layer=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        logits, values = model(ids, mask, positions)
        (logits.float().logsumexp(-1).mean() + values.pow(2).mean()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert model.policy.active_adapter == "default"
    assert grads[0].keys() == grads[1].keys() and any(".value." in n for n in grads[0])
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


# ------------------------------------------------------------------ save / load

def test_save_and_load_round_trip_keeps_the_branch(batch, tmp_path):
    ids, mask, positions = batch
    model = branch_model(layer=-2)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / VALUE_HEAD_CONFIG).read_text())["value_branch_layer"] == 2
    loaded = SharedActorCritic.from_pretrained(build_base(), tmp_path, is_trainable=True)
    assert loaded.value_branch_layer == 2
    assert loaded.policy.peft_config[VALUE_ADAPTER_NAME].layers_to_transform == [2, 3]
    with torch.no_grad():
        for got, expected in zip(loaded(ids, mask, positions), model(ids, mask, positions)):
            assert torch.equal(got, expected)
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


def test_load_actor_critic_builds_the_branch_critic(tmp_path):
    build_base().save_pretrained(tmp_path)
    model = load_actor_critic(str(tmp_path), lora_r=4, lora_target_modules=QV, value_lora=True,
                              value_branch_layer=-1)
    assert model.value_branch_layer == 3 and model.value_adapter == VALUE_ADAPTER_NAME


# ------------------------------------------------------------------ what is refused

def test_families_whose_layers_cannot_run_as_a_slice_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    base = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_embd=32, n_layer=4, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type='gpt2'\).*value_branch_layer=None"):
        SharedActorCritic(base, lora_config=LoraConfig(r=4, target_modules=["c_attn"]),
                          value_lora_config=LoraConfig(r=4, target_modules=["c_attn"]), value_branch_layer=2)
    assert not any("lora_" in name for name, _ in base.named_modules())  # refused before peft touched it


def test_a_branch_without_a_value_adapter_or_over_one_below_it_is_refused():
    with pytest.raises(ValueError, match="there is no value adapter"):
        SharedActorCritic(build_base(), lora_config=lora(), value_branch_layer=2)
    with pytest.raises(ValueError, match=r"weights on layers \[1\], below value_branch_layer=2"):
        SharedActorCritic(build_base(), lora_config=lora(),
                          value_lora_config=LoraConfig(r=4, target_modules=QV, layers_to_transform=[1, 3]),
                          value_branch_layer=2)
    with pytest.raises(ValueError, match="with_value=False"):
        SharedActorCritic(build_base(), lora_config=lora(), with_value=False, value_branch_layer=2)


def test_a_full_value_adapter_loaded_as_a_branch_is_refused(tmp_path):
    """A saved full value adapter has weights below any branch: they would never train."""
    SharedActorCritic(build_base(), lora_config=lora(), value_lora_config=lora()).policy.save_pretrained(tmp_path)
    from peft import PeftModel

    policy = PeftModel.from_pretrained(build_base(), tmp_path, is_trainable=True)
    policy.load_adapter(tmp_path / VALUE_ADAPTER_NAME, adapter_name=VALUE_ADAPTER_NAME, is_trainable=True)
    with pytest.raises(ValueError, match="weights on every layer, below value_branch_layer=2"):
        SharedActorCritic(policy, value_branch_layer=2)


def test_assembly_builds_the_branch_from_the_value_adapter_flag_only():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=QV, task_type="CAUSAL_LM")
    model = build_policy_and_value(build_base(), None, config, value_adapter=True, value_branch_layer=-1)
    assert isinstance(model, SharedActorCritic) and model.value_branch_layer == 3
    with pytest.raises(ValueError, match="use_value_adapter=False. Set use_value_adapter=True"):
        build_policy_and_value(build_base(), None, config, value_branch_layer=2)
    with pytest.raises(ValueError, match="no critic is trained"):
        build_policy_and_value(build_base(), None, config, with_value=False, value_adapter=True,
                               value_branch_layer=2)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_values_alone_train_the_critic_as_the_forward_does(checkpointing, batch):
    """With gradients (and checkpointing, which recomputes each layer under the adapter it ran with):
    the values-alone pass gives the critic the gradients ``forward`` gives it, and the policy none."""
    ids, mask, positions = batch
    grads = []
    for values_alone in (False, True):
        model = branch_model(layer=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        values = value_forward(model, ids, mask, positions) if values_alone else model(ids, mask, positions)[1]
        (values - 1.0).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and not any(".default." in n for n in grads[1])
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name
