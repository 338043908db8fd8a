"""Our own base for ``PPOConfig`` / ``PPOTrainer`` where the installed TRL has no PPO trainer.

TRL 1.13 removed ``trl.experimental.ppo``. What the package took from TRL's PPO classes was
small: the config's PPO field block, ``save_model`` (policy only), and the class attributes
TRL's model card reads (``_name``, ``_paper``, ``_tag_names``). This module provides them on
what every TRL 1.x still ships, its base config and base trainer
(``trl.trainer.base_config._BaseConfig``, ``trl.trainer.base_trainer._BaseTrainer``), and
falls back to transformers' ``TrainingArguments`` / ``Trainer`` when those are gone.

Field names, types and defaults are those of TRL 1.12's ``PPOConfig`` (checked against TRL
in ``tests/test_base.py`` where TRL has one, against a table kept there where it does not).

No ``from __future__ import annotations`` here: the field types stay real objects, exactly
as in TRL's config, so ``HfArgumentParser`` and ``dataclasses.fields`` see the same thing.
"""

from dataclasses import dataclass, field
from typing import Literal

from transformers import Trainer, TrainingArguments

ZIEGLER_2019 = {
    "title": "Fine-Tuning Language Models from Human Preferences",
    "id": "1909.08593",
    "citation": (
        "@article{ziegler2019finetuning,\n"
        "    title   = {Fine-Tuning Language Models from Human Preferences},\n"
        "    author  = {Ziegler, Daniel M. and Stiennon, Nisan and Wu, Jeffrey and Brown, Tom B. and Radford, Alec "
        "and Amodei, Dario and Christiano, Paul F. and Irving, Geoffrey},\n"
        "    journal = {arXiv preprint arXiv:1909.08593},\n"
        "    year    = {2019}\n"
        "}"
    ),
}


# --------------------------------------------------------------------------- config
@dataclass
class TransformersRootConfig(TrainingArguments):
    """Last-resort root when TRL's ``_BaseConfig`` is gone: ``TrainingArguments`` with the
    defaults every TRL 1.x config sets (its base config's overrides), so a config built here
    has the same defaults as one built on TRL's base.

    ``logging_steps`` 10 (not 500), ``gradient_checkpointing`` True (not False), ``bf16``
    unset meaning "True unless fp16", and the fields whose transformers help text breaks
    ``--help`` on some releases redeclared with the same default.
    """

    logging_steps: float = field(
        default=10,
        metadata={"help": "Updates between two logs; a float in [0, 1) is a fraction of the total updates."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass instead of keeping them (less memory)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "Train in bf16 mixed precision. Unset: True unless fp16 is set."},
    )
    lr_scheduler_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments of the learning-rate scheduler, e.g. {'num_cycles': 1}."},
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Patch the model with Liger kernels (needs the liger-kernel package)."},
    )
    torch_empty_cache_steps: int | None = field(
        default=None,
        metadata={"help": "Empty the accelerator's memory cache every this many steps; None: never."},
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16
        super().__post_init__()


@dataclass
class PPOFields:
    """The PPO block of TRL 1.12's ``PPOConfig``: same names, types and defaults.

    Fields the trainer derives itself (``world_size``, ``num_total_batches``,
    ``micro_batch_size``, ``local_batch_size``, ``batch_size``, ``local_mini_batch_size``,
    ``mini_batch_size``) are kept for compatibility: scripts read them after construction.
    """

    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate of the AdamW optimizer."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Worker processes for dataset preprocessing; None: the main process."}
    )
    num_mini_batches: int = field(
        default=1, metadata={"help": "Mini-batches per rollout batch; one optimizer step per mini-batch."}
    )
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Responses to sample over the whole run; None: num_train_epochs * len(train_dataset)."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Sequences per no-grad forward while scoring a rollout, per process."}
    )
    num_sample_generations: int = field(
        default=10, metadata={"help": "How many times during training to print sample completions (0: never)."}
    )
    response_length: int = field(default=53, metadata={"help": "Tokens to generate for each prompt."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "'eos' to end responses at the tokenizer's EOS token; excludes stop_token_id."},
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "Token id that ends a response; excludes stop_token. None: no stop token."}
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of the rollouts."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of a response that never emits the stop token (a positive "
                  "number); None: no penalty."},
    )
    sft_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Path or hub id of the SFT policy (read by scripts)."}
    )
    world_size: int | None = field(default=None, metadata={"help": "Set by the trainer: number of processes."})
    num_total_batches: int | None = field(
        default=None, metadata={"help": "Set by the trainer: number of PPO updates in the run."}
    )
    micro_batch_size: int | None = field(
        default=None, metadata={"help": "Set by the trainer: per_device_train_batch_size * world_size."}
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={"help": "Set by the trainer: per_device_train_batch_size * gradient_accumulation_steps."},
    )
    batch_size: int | None = field(
        default=None, metadata={"help": "Set by the trainer: rollout batch over all processes."}
    )
    local_mini_batch_size: int | None = field(
        default=None, metadata={"help": "Set by the trainer: mini-batch size on one process."}
    )
    mini_batch_size: int | None = field(
        default=None, metadata={"help": "Set by the trainer: mini-batch size over all processes."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Push the trained model to the Hub."})
    reward_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Path or hub id of the reward model (read by scripts)."}
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "PEFT adapter to train when the policy carries several."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "PEFT adapter that acts as the reference policy, if any."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the shaped rewards before GAE."})
    kl_coef: float = field(default=0.05, metadata={"help": "Weight of the per-token KL penalty in the reward."})
    kl_estimator: Literal["k1", "k3"] = field(
        default="k1",
        metadata={"help": "Per-token KL estimator (http://joschu.net/blog/kl-approx.html): 'k1' or 'k3'."},
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value loss."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "DeepSpeed ZeRO-3 and FSDP2: gather the policy weights for generation (faster; False "
                  "fits models larger than one device at the cost of speed)."},
    )


def config_root() -> type:
    """TRL's base config where it exists (every 1.x so far), else ``TransformersRootConfig``."""
    try:
        from trl.trainer.base_config import _BaseConfig
    except ImportError:
        return TransformersRootConfig
    return _BaseConfig


def make_config_base(root: type) -> type:
    """``PPOFields`` on top of ``root`` as one dataclass (``root``'s fields first, PPO's
    after; ``learning_rate`` keeps its place with PPO's default)."""
    cls = type("PPOConfigBase", (PPOFields, root), {
        "__module__": __name__,
        "__qualname__": "PPOConfigBase",
        "__doc__": "TRL 1.12's PPOConfig fields on top of " + root.__name__ + ".",
    })
    return dataclass(cls)


# --------------------------------------------------------------------------- trainer
class PPOTrainerParts:
    """What our ``PPOTrainer`` used from TRL's PPO trainer: the model-card attributes, the
    dataloader getters and a ``save_model`` that saves the policy only."""

    _tag_names = ["trl", "ppo"]
    _name = "PPO"
    _paper = ZIEGLER_2019

    def get_train_dataloader(self):
        return self.dataloader

    def get_eval_dataloader(self, eval_dataset=None):
        return self.eval_dataloader

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save ``self.model.policy`` for inference (the value model is not saved), through
        ``Trainer.save_model``. (``trl_ppo_ext.PPOTrainer`` saves under DeepSpeed itself and
        never comes here then.)"""
        model = self.model
        self.model = getattr(model, "policy", model)
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model = model


def trainer_root() -> type:
    """TRL's base trainer (model card, telemetry) where it exists, else transformers' ``Trainer``."""
    try:
        from trl.trainer.base_trainer import _BaseTrainer
    except ImportError:
        return Trainer
    return _BaseTrainer


def make_trainer_base(root: type) -> type:
    """``PPOTrainerParts`` on top of ``root``."""
    return type("PPOTrainerBase", (PPOTrainerParts, root), {
        "__module__": __name__,
        "__qualname__": "PPOTrainerBase",
        "__doc__": "The PPO parts of TRL's PPOTrainer on top of " + root.__name__ + ".",
    })


PPOConfigBase = make_config_base(config_root())
PPOTrainerBase = make_trainer_base(trainer_root())
