"""``trl_ppo_ext.models.fsdp`` in this process: the FSDP2 units the policy/value modules name, and,
on a one-process gloo group (``fully_shard`` with a mesh of one: DTensors and hooks as on many
processes, without the sharding, which tests/end_to_end/test_fsdp2.py runs on two), the policy gathered for
generation, the checks that refuse a layout FSDP2 cannot run, and the full optimizer state."""

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig
from transformers import LlamaForCausalLM

from trl_ppo_ext.models import fsdp
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.policy_value import PolicyAndValue
from trl_ppo_ext.models.sharding import is_fsdp2_param
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, tiny_llama_config

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _tied_causal_lm(tok):
    config = tiny_llama_config(tok)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_units_are_the_policy_lm_the_backbones_and_the_blocks(tok):
    separate = PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok))
    assert separate._no_split_modules == ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer"]
    shared = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=LoraConfig(**LORA))
    assert shared._no_split_modules == ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer"]  # through peft
    assert PolicyAndValue(build_tiny_causal_lm(tok), None)._no_split_modules == separate._no_split_modules


def test_a_policy_with_tied_embeddings_keeps_its_backbone_in_its_own_unit(tok):
    tied = _tied_causal_lm(tok)
    assert fsdp.ties_embeddings(tied) and not fsdp.ties_embeddings(build_tiny_causal_lm(tok))
    # the LM head is the embedding: one unit holds both (and a value model's backbone of that class)
    assert PolicyAndValue(tied, build_tiny_scorer(tok))._no_split_modules == ["LlamaForCausalLM", "LlamaDecoderLayer"]


# ---------------------------------------------------------------------- on a one-process group
@pytest.fixture
def process_group():
    """A gloo group of this process alone, for the duration of one test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard(model, names=None):
    """``fully_shard`` as accelerate's TRANSFORMER_BASED_WRAP does: every module of a class in
    ``names`` (default: the model's ``_no_split_modules``), innermost first, then the model."""
    from torch.distributed.fsdp import fully_shard

    names = set(model._no_split_modules if names is None else names)
    for module in reversed(list(model.modules())):
        if module is not model and type(module).__name__ in names:
            fully_shard(module)
    fully_shard(model)
    return model


def _generate(policy, tok):
    ids = torch.tensor([tok.convert_tokens_to_ids(["w1", "w2", "w3"])])
    return policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           pad_token_id=tok.pad_token_id)


def test_generation_with_gathered_weights_equals_the_unsharded_policy(tok, process_group):
    expected = _generate(build_tiny_causal_lm(tok), tok)
    model = _shard(PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)))
    fsdp.ready_root(model)  # as the root's first forward would: the root's own setting is decided here
    settings = [(g, g.post_forward_mesh_info) for u in fsdp.fsdp2_units(model) for g, _ in fsdp._reshard_settings(u)]
    with fsdp.policy_for_generation(model, model.policy, gather=True) as policy:
        assert not any(is_fsdp2_param(p) for p in policy.parameters())  # whole for the block
        assert torch.equal(_generate(policy, tok), expected)
    assert all(is_fsdp2_param(p) for p in model.policy.parameters())  # sharded again
    assert all(g.post_forward_mesh_info is info for g, info in settings)  # each unit resharding as before
    with fsdp.policy_for_generation(model, model.policy, gather=False) as policy:  # each unit in each forward
        assert torch.equal(_generate(policy, tok), expected)


def test_a_policy_without_units_of_its_own_is_refused_before_it_generates(tok, process_group):
    model = _shard(PolicyAndValue(build_tiny_causal_lm(tok), None), names=["LlamaDecoderLayer"])
    # the blocks are units, the embeddings and the LM head are the root's: whole only in its forward
    with pytest.raises(RuntimeError, match="lie in no FSDP unit of the policy.*TRANSFORMER_BASED_WRAP"):
        with fsdp.policy_for_generation(model, model.policy, gather=True):
            pass
    bare = _shard(PolicyAndValue(build_tiny_causal_lm(tok), None), names=[])
    with pytest.raises(RuntimeError, match="holds no FSDP unit of its own"):
        fsdp.check_policy_units(bare, bare.policy)


def test_a_value_adapter_on_tied_embeddings_is_refused_under_fsdp2(tok, process_group):
    lora = LoraConfig(**LORA)
    model = _shard(SharedActorCritic(_tied_causal_lm(tok), lora_config=lora, value_lora_config=lora))
    ids = torch.tensor([[7, 8, 9]])
    # its backbone is no unit: the value pass would read weights freed after the policy pass
    with pytest.raises(NotImplementedError, match="value_lora_config=None"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_the_full_optimizer_state_loads_back_into_a_sharded_optimizer(tok, process_group):
    model = _shard(PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[7, 8, 9]])
    logits, values = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    (logits.float().mean() + values.mean()).backward()
    optimizer.step()
    saved = fsdp.full_optimizer_state(optimizer, keep=True)
    assert fsdp.full_optimizer_state(optimizer, keep=False) is None
    # torch's own format, plain whole tensors, as a run without FSDP saves it
    params = list(model.parameters())
    assert sorted(saved["state"]) == list(range(len(params)))
    assert all(not is_fsdp2_param(v) and v.shape == params[i].shape for i, e in saved["state"].items()
               for k, v in e.items() if k != "step")
    again = _shard(PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)))
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-3)
    fsdp.load_full_optimizer_state(fresh, saved)
    loaded = fresh.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert is_fsdp2_param(loaded[index]["exp_avg"])  # the moments of a sharded parameter are sharded
        assert torch.equal(loaded[index]["exp_avg"].full_tensor(), entry["exp_avg"])
        assert torch.equal(loaded[index]["step"], entry["step"])
