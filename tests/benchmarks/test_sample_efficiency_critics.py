"""benchmarks/sample_efficiency/critics.py: the critic of each arm, chosen in one place."""

def test_shared_actor_critic_has_a_value_head_only_when_the_estimator_trains_a_critic(se, tmp_path):
    from peft import LoraConfig

    from trl_ppo_ext import PPOConfig
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    built = {}
    for estimator, generations in (("gae", 1), ("grpo", 4), ("reinforce_pp", 1)):
        config = PPOConfig(output_dir=str(tmp_path), advantage_estimator=estimator, num_generations=generations,
                           per_device_train_batch_size=4, report_to="none")
        model = se.shared_actor_critic("shared", build_tiny_causal_lm(tok, hidden_size=8), lora, config)
        built[estimator] = (model.has_value, any("value" in n for n, _ in model.named_parameters()))
    # without a config (TRL's own config, or a PPOConfig before the estimators): a value head, as before
    model = se.shared_actor_critic("shared", build_tiny_causal_lm(tok, hidden_size=8), lora)
    built["no config"] = (model.has_value, any("value" in n for n, _ in model.named_parameters()))
    assert built == {"gae": (True, True), "grpo": (False, False), "reinforce_pp": (False, False),
                     "no config": (True, True)}


def test_the_critic_of_each_arm_is_chosen_in_one_place(se):
    """trl112 and "separate" get the loaded value model itself, every weight trained; "lora" the same
    model with an adapter (only lora_* and score.* train); "shared" no value model, and the value
    model is then never loaded."""
    from peft import LoraConfig

    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    loads = []

    def value_model():
        loads.append(1)
        return build_tiny_scorer(tok, hidden_size=8)

    for arm in (se.ARMS["trl112"], se.Arm(critic="separate")):
        models = se.actor_and_critic(arm, "policy", lora, None, value_model)
        assert models["model"] == "policy" and models["peft_config"] is lora and models["ref_model"] is None
        assert all(p.requires_grad for p in models["value_model"].parameters())
        assert not any("lora_" in n for n, _ in models["value_model"].named_parameters())
    models = se.actor_and_critic(se.Arm(critic="lora"), "policy", lora, None, value_model)
    trained = [n for n, p in models["value_model"].named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or n.startswith("score.") for n in trained)
    assert any(n.startswith("score.") for n in trained) and any("lora_" in n for n in trained)
    assert len(loads) == 3
    models = se.actor_and_critic(se.ARMS["defaults"], build_tiny_causal_lm(tok, hidden_size=8), lora, None, value_model)
    assert isinstance(models["model"], SharedActorCritic) and models["value_model"] is None and len(loads) == 3


def test_lm_head_whole_trains_the_policy_head_as_the_trl_grpo_arm_does(se):
    """``lm_head=whole``: the policy's LM head leaves the LoRA targets and trains whole (a full copy,
    vocab x hidden weights) while the other targets keep their adapter; the value adapter is untouched.
    The default keeps the adapter on the head; lm_head= is parsed as an Arm field, and a value other
    than "adapter"/"whole", or "whole" on a TRL arm, is refused before anything is built."""
    from pathlib import Path

    import pytest
    from peft import LoraConfig

    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    name, arm = se.parse_arm("w:critic=value_lora,lm_head=whole,kl_coef=0.0")
    assert (name, arm.lm_head, arm.critic, arm.overrides) == ("w", "whole", "value_lora", {"kl_coef": 0.0})
    assert se.ARMS["defaults"].lm_head == "adapter"

    def trained(arm_):
        policy = build_tiny_causal_lm(tok, hidden_size=8)
        vocab, hidden = policy.get_output_embeddings().weight.shape
        model = se.actor_and_critic(arm_, policy, lora, None, lambda: None)["model"]
        return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}, vocab * hidden

    whole, head_size = trained(arm)
    head = [n for n in whole if "lm_head" in n]
    assert [whole[n] for n in head] == [head_size]  # one full copy of the head, no adapter on it
    assert not any("lora_" in n for n in head)
    assert any("q_proj" in n and "lora_" in n for n in whole)  # the other targets keep their adapter
    adapted, _ = trained(se.Arm(critic="value_lora"))
    assert any("lm_head" in n and "lora_" in n for n in adapted)  # the default: an adapter on the head
    assert sum(adapted.values()) < sum(whole.values())
    for bad in (se.Arm(lm_head="half"), se.Arm(lm_head="whole", trainer="trl_grpo")):
        with pytest.raises(ValueError, match="lm_head="):
            se.run_one("long", bad, 0, model_dir=Path("unused"), episodes=1, hidden_size=8, out=Path("unused"))


def test_an_arm_asking_for_use_value_adapter_hands_the_trainer_the_policy_and_its_lora(se, tmp_path):
    """``use_value_adapter=True`` in an arm's overrides (the only way to reach ``value_branch_layer``):
    the policy and its LoRA config go to the trainer untouched (with ``lm_head=whole``, the head left out
    of the targets), no value model is loaded; the trainer's value adapter then has the same trainable
    parameters as the one the ``value_lora`` critic builds by hand, so that critic name leads here too.
    A separate value model named beside it is refused."""
    import pytest
    from peft import LoraConfig

    from trl_ppo_ext import PPOConfig
    from trl_ppo_ext.models.assembly import build_policy_and_value
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    config = PPOConfig(output_dir=str(tmp_path), use_value_adapter=True, report_to="none")

    def no_value_model():
        raise AssertionError("the value model was loaded")

    policy = build_tiny_causal_lm(tok, hidden_size=8)
    models = se.actor_and_critic(se.Arm(), policy, lora, config, no_value_model)
    assert models == dict(model=policy, ref_model=None, value_model=None, peft_config=lora)
    whole = se.actor_and_critic(se.Arm(lm_head="whole"), policy, lora, config, no_value_model)["peft_config"]
    assert "lm_head" not in whole.target_modules and "lm_head" in whole.modules_to_save

    def trainable(model):
        return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}

    by_trainer = build_policy_and_value(build_tiny_causal_lm(tok, hidden_size=8), None, lora, value_adapter=True)
    by_hand = se.actor_and_critic(se.Arm(critic="value_lora"), build_tiny_causal_lm(tok, hidden_size=8), lora,
                                  None, no_value_model)["model"]
    assert trainable(by_trainer) == trainable(by_hand)
    assert se.actor_and_critic(se.Arm(critic="value_lora"), policy, lora, config, no_value_model) == models
    for separate in ("separate", "lora"):
        with pytest.raises(ValueError, match="use_value_adapter=True"):
            se.actor_and_critic(se.Arm(critic=separate), policy, lora, config, no_value_model)
