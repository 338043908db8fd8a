"""benchmarks/sample_efficiency/arms.py: the arms, the ``--arm`` parser, and the arms a run refuses
before it builds anything."""

from pathlib import Path

import pytest
import torch


def test_parse_arm_and_missing_fields(se):
    name, arm = se.parse_arm("clip:cliprange_high=0.28,loss_type=dr_grpo,reward=summed,whiten_rewards=true")
    assert name == "clip"
    assert arm.overrides == {"cliprange_high": 0.28, "loss_type": "dr_grpo", "whiten_rewards": True}
    assert (arm.reward, arm.trainer) == ("summed", "ours")
    assert se.missing_fields(arm, {"cliprange_high", "whiten_rewards"}) == ["loss_type"]
    for bad in ("noseparator", "x:cliprange_high"):
        with pytest.raises(ValueError, match="--arm"):
            se.parse_arm(bad)


def test_recipe_arm_is_the_union_of_its_elements(se):
    union = {}
    for name in se.RECIPE:
        union.update(se.ARMS[name].overrides)
    assert se.ARMS["recipe"].overrides == union
    assert se.ARMS["trl112"].trainer == "trl112" and se.ARMS["defaults"].overrides == {}


def test_short_alpha_arms_give_the_lambdas_their_comment_says(se):
    from trl_ppo_ext.functional import length_adaptive_lam

    assert se.ARMS["length_lam_short"].overrides == {"lam_length_alpha": se.SHORT_ALPHA}
    assert se.ARMS["recipe_short"].overrides == {**se.ARMS["recipe"].overrides, "lam_length_alpha": se.SHORT_ALPHA}
    # alpha 2: 1 - 1/(2*2) = 0.75, 1 - 1/(2*5) = 0.9, 1 - 1/(2*10) = 0.95; VAPO's 0.05 gives 0 below 20 tokens
    mask = torch.tensor([[True] * 2 + [False] * 8, [True] * 5 + [False] * 5, [True] * 10])
    lam = length_adaptive_lam(mask, se.SHORT_ALPHA, torch.float64)
    torch.testing.assert_close(lam, torch.tensor([0.75, 0.9, 0.95], dtype=torch.float64), rtol=0, atol=1e-12)
    assert length_adaptive_lam(mask, se.RECIPE["length_lam"]["lam_length_alpha"]).tolist() == [0.0, 0.0, 0.0]


def test_critic_arms_parse_and_bad_ones_are_refused(se):
    name, arm = se.parse_arm("sep:critic=separate,value_lam=1.0")
    assert (name, arm.critic, arm.overrides) == ("sep", "separate", {"value_lam": 1.0})
    assert se.ARMS["defaults"].critic == "shared"
    for bad in (se.Arm(critic="sideways"), se.Arm(critic="separate", trainer="trl112")):
        with pytest.raises(ValueError, match="critic="):
            se.run_one("long", bad, 0, model_dir=Path("unused"), episodes=1, hidden_size=8, out=Path("unused"))


# --- the multiturn task's step_through arm ---------------------------------------------------


def test_step_through_arm_parses_and_is_refused_where_it_cannot_run(se):
    assert se.ARMS["step_through"].gae == "step_through" and se.ARMS["defaults"].gae == "actions"
    name, arm = se.parse_arm("st:gae=step_through,lam=0.9")
    assert (name, arm.gae, arm.overrides) == ("st", "step_through", {"lam": 0.9})
    assert se.TASKS["multiturn"].batch_size == 32
    for bad, message in ((se.Arm(gae="sideways"), "gae="), (se.Arm(trainer="trl112"), "rollout_func")):
        with pytest.raises(ValueError, match=message):
            se.run_one("multiturn", bad, 0, model_dir=Path("unused"), episodes=1, hidden_size=8, out=Path("unused"))
