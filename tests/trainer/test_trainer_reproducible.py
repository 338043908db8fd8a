"""``PPOConfig(seed=...)`` alone reproduces a run bit for bit, in every critic layout, whatever the
script drew from the global RNG before building the trainer (issue 44 item 2); ``train()`` returns
transformers' ``TrainOutput`` as TRL GRPO's does (item 9)."""

import pytest
import torch
from peft import LoraConfig
from transformers.trainer_utils import TrainOutput

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
TIMING_KEYS = {"eps", "step_time", "train/step_time"}  # wall-clock figures differ between two runs


def _run(make_trainer, make_prompts, tok, tmp_path, layout, draw):
    """Build (after drawing ``draw`` from the global RNG, as a script's own code might) and train."""
    kwargs = {}
    if layout == "shared_head":  # the default critic of a LoRA run: a new value head on the policy's backbone
        kwargs = dict(value_model=None, peft_config=LoraConfig(**LORA))
    elif layout == "value_adapter":  # the critic's own LoRA adapter (PPOConfig.use_value_adapter): its init is random
        kwargs = dict(value_model=None, peft_config=LoraConfig(**LORA), use_value_adapter=True)
    elif layout == "value_model":  # no peft_config: a copy of the policy's backbone with a new scalar head
        kwargs = dict(value_model=None)
    models = dict(model=build_tiny_causal_lm(tok, seed=0), ref_model=None, reward_model=build_tiny_scorer(tok, seed=2))
    prompts = make_prompts(tok)
    torch.manual_seed(draw)  # the models' own seeds are behind us: only PPOConfig.seed remains
    trainer = make_trainer(tok, train_dataset=prompts, total_episodes=12, output_dir=str(tmp_path / f"{layout}-{draw}"),
                           **models, **kwargs)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    logs = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history]
    return weights, logs


@pytest.mark.parametrize("layout", ["shared_head", "value_adapter", "value_model"])
def test_the_seed_alone_reproduces_a_run_bit_for_bit(make_trainer, make_prompts, tok, tmp_path, layout):
    (w1, logs1), (w2, logs2) = (_run(make_trainer, make_prompts, tok, tmp_path, layout, draw) for draw in (1, 2))
    assert any("value" in n for n in w1)  # the layout has a critic with a head built by the trainer
    assert w1.keys() == w2.keys()
    for name, value in w1.items():
        assert torch.equal(value, w2[name]), name
    assert len(logs1) == 3 and logs1 == logs2


def test_train_returns_a_train_output(make_trainer, tok):
    trainer = make_trainer(tok, total_episodes=12)
    losses = []

    def recording(rollout, adv, update, _update=trainer.ppo_update):
        stats, decision = _update(rollout, adv, update)
        losses.append(float(stats["loss"].mean()))
        return stats, decision

    trainer.ppo_update = recording
    output = trainer.train()
    assert isinstance(output, TrainOutput) and output.global_step == 3 and len(losses) == 3
    assert output.training_loss == pytest.approx(sum(losses) / 3, rel=1e-12)  # GRPO's: the mean over the steps
    assert output.metrics["train_loss"] == output.training_loss
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second"} <= output.metrics.keys()
