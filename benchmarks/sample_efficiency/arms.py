"""The arms: named ways to train (config overrides, trainer, reward variant, critic, GAE mode),
and the ``--arm NAME:field=value,...`` parser."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arm:
    """A way to train: config overrides (a ``PPOConfig``'s, or for ``trl_grpo`` a ``GRPOConfig``'s), the
    trainer (``TRAINERS``), the reward variant, and for ours the critic: the shared LoRA actor-critic
    of the examples, or a separate value model built as the ``trl112`` arm's (TRL's example script:
    the reward model, or the SFT checkpoint with a fresh head) beside a LoRA policy, trained whole
    (``separate``) or as a LoRA adapter and its head on a frozen base (``lora``: how a critic
    adapter of its own would learn)."""

    overrides: dict = field(default_factory=dict)
    trainer: str = "ours"
    reward: str = "default"
    note: str = ""
    # ours: "shared" (value head on the policy's LoRA backbone), "value_lora" (the shared actor-critic
    # with its own value adapter, SharedActorCritic(value_lora_config=...)), "separate" (TRL's value
    # model, every weight trained) or "lora" (that value model trained as a LoRA adapter + head)
    critic: str = "shared"
    # ours, on episodes with turns: "actions" (the package's GAE over the policy's own tokens) or
    # "step_through" (environment tokens as steps with value and reward 0: step_through_gae)
    gae: str = "actions"
    # ours: how the policy's LM head trains, "adapter" (the task's LoRA on it) or "whole" (lm_head out of the
    # LoRA targets and trained whole, modules_to_save: what the trl_grpo arm must do, TRL GRPO refusing an
    # adapter there)
    lm_head: str = "adapter"


# The recipe's values: VC-PPO/VAPO (2503.01491, 2504.05118), DAPO's clip-higher (2503.14476),
# dual-clip PPO (Ye et al. 2020). The warm-up is sized for runs of ~32 updates.
RECIPE = {
    "critic_warmup": {"critic_warmup_steps": 4, "critic_warmup_explained_variance": 0.5},
    "value_lam": {"value_lam": 1.0},
    "length_lam": {"lam_length_alpha": 0.05},
    "clip_higher": {"cliprange_high": 0.28},
    "dual_clip": {"dual_clip": 3.0},
}
# "ours": this package's PPOTrainer; "trl112": TRL 1.12's PPOTrainer (its own python, --trl-python);
# "trl_grpo": TRL's GRPOTrainer of the python that runs the benchmark (TRL 1.16 in /work/venv)
TRAINERS = ("ours", "trl112", "trl_grpo")
ARMS = {
    "trl112": Arm(trainer="trl112", note="TRL 1.12's own trainer"),
    "trl_grpo": Arm(trainer="trl_grpo", note="TRL's own GRPOTrainer, 4 completions per prompt"),
    "defaults": Arm(note="this package's defaults"),
    **{name: Arm(overrides, note="one recipe element") for name, overrides in RECIPE.items()},
    "loss_grpo": Arm({"loss_type": "grpo"}, note="sequence-mean token-mean loss"),
    "loss_dr_grpo": Arm({"loss_type": "dr_grpo"}, note="Dr. GRPO's constant normaliser"),
    "recipe": Arm({k: v for o in RECIPE.values() for k, v in o.items()}, note="every recipe element"),
}
# VAPO's alpha 0.05 gives lambda = 0 to every response under 20 tokens, and these tasks' responses
# are 1-10 tokens (synthetic) and ~2 (verifiable: a number and <eos>). SHORT_ALPHA = 2 makes the
# horizon 1 / (1 - lambda) = 2 L: lambda 0.9 at 5 tokens, 0.95 at 10, 0.75 at 2.
SHORT_ALPHA = 2.0
ARMS["length_lam_short"] = Arm({"lam_length_alpha": SHORT_ALPHA},
                               note="length-adaptive lambda, alpha sized for 1-10 tokens")
ARMS["recipe_short"] = Arm({**ARMS["recipe"].overrides, "lam_length_alpha": SHORT_ALPHA},
                           note="every recipe element, the short responses' alpha")


ARMS["step_through"] = Arm(gae="step_through", note="GAE steps through environment tokens (OpenRLHF, SkyRL)")
GAE_MODES = ("actions", "step_through")
LM_HEADS = ("adapter", "whole")


def parse_arm(text: str) -> tuple[str, Arm]:
    """``NAME:field=value,field=value`` (values as JSON, else strings; ``reward=...`` picks the
    reward variant, ``trainer=trl112`` TRL's trainer, ``critic=``, ``gae=`` and ``lm_head=`` the fields
    of :class:`Arm`) -> ``(NAME, Arm)``."""
    name, _, spec = text.partition(":")
    if not name or not spec:
        raise ValueError(f"--arm {text!r}: write NAME:field=value[,field=value...], e.g. clip:cliprange_high=0.28")
    overrides, extra = {}, {}
    for item in spec.split(","):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--arm {text!r}: {item!r} is not field=value.")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        (extra if key in ("reward", "trainer", "critic", "gae", "lm_head") else overrides)[key.strip()] = value
    return name, Arm(overrides, note="from --arm", **extra)


def missing_fields(arm: Arm, config_fields: set[str]) -> list[str]:
    """The overrides of ``arm`` that the installed PPOConfig does not have."""
    return sorted(k for k in arm.overrides if k not in config_fields)


# ours: the value head on the policy's LoRA backbone, its own value adapter there, a separate value
# model trained whole, or that value model as a LoRA adapter and head (see Arm.critic)
CRITICS = ("shared", "value_lora", "separate", "lora")
