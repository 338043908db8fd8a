"""Exact resume from every checkpoint of a run with everything on (issue 23).

The run: a held-out set evaluated every other update, TRL's default ``num_sample_generations``
(10: a completions table after every update here), a reward model plus a reward function,
adaptive KL, a LoRA shared actor-critic, 2 PPO epochs x 2 mini-batches, an epoch boundary in
the data. It checkpoints after every update; each checkpoint, resumed in a fresh trainer, must
end with the same trainable weights and the same logged metrics as the run that never stopped.

The same with a value adapter of the critic's own (``value_lora_config``): its weights and AdamW state
come back too, and it recomputes under TRL's default gradient checkpointing. And with that adapter on the
layer above a branch of the policy's pass only (``value_branch_layer=1`` of the tiny model's 2 layers).

Before the fix, the completions table drew from the training RNG after the checkpoint had
captured it, so a resumed run sampled other responses (max |diff| of the final weights ~1e-2).
"""

import shutil

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext import PPOConfig, PPOTrainer
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.run.checkpointing import isolated_rng
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer, random_word_prompts

UPDATES = 3  # total_episodes 12 / batch 4; 10 prompts = 2 batches per epoch, so update 3 starts epoch 2


def shorter_is_better(completions, **kwargs):
    """A reward function (GRPO's calling convention): 1 / (1 + words)."""
    return [1.0 / (1.0 + len(c.split())) for c in completions]


def build(out_dir, layout="shared"):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    torch.manual_seed(0)  # the LoRA and value-head initialisations draw from the global RNG
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=lora,
                              value_lora_config=None if layout == "shared" else lora,
                              value_branch_layer=1 if layout == "branch" else None)
    args = PPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
        num_ppo_epochs=2, total_episodes=4 * UPDATES, response_length=6, local_rollout_forward_batch_size=4,
        learning_rate=1e-2, report_to=[], disable_tqdm=True, num_sample_generations=10,  # TRL's default
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3, save_strategy="steps", save_steps=1,
        logging_steps=1, stop_token="eos", seed=0, bf16=False, adaptive_kl=True, kl_target=0.01, kl_horizon=100,
        kl_estimator="k3", reward_weights=[1.0, 0.5],
    )
    return PPOTrainer(
        args=args, processing_class=tok, model=model, ref_model=None, value_model=None,
        reward_model=build_tiny_scorer(tok, seed=2), reward_funcs=[shorter_is_better],
        train_dataset=random_word_prompts(tok, 10, 2, 5, 0), eval_dataset=random_word_prompts(tok, 5, 1, 6, 3),
    )


def trainable(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped.named_parameters() if v.requires_grad}


def update_logs(trainer):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history
            if "objective/scores" in h]


@pytest.fixture(scope="module", params=["shared", "value_adapter", "branch"])
def straight(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("straight")
    trainer = build(root / "out", layout=request.param)
    trainer.train()
    assert trainer.state.global_step == UPDATES
    assert any("eval/rm_score" in h for h in update_logs(trainer))  # the held-out evaluation ran
    if request.param != "shared":
        assert trainer.unwrapped.is_gradient_checkpointing  # TRL's default, with the adapter's recompute
        assert any(".value." in k for k in trainable(trainer))
    return root / "out", trainable(trainer), update_logs(trainer), request.param


@pytest.mark.slow  # four tiny runs
@pytest.mark.parametrize("step", range(UPDATES))
def test_resume_from_every_checkpoint_ends_equal_to_the_straight_run(tmp_path, straight, step):
    out, final, logs, layout = straight
    saved = tmp_path / f"checkpoint-{step}"
    shutil.copytree(out / f"checkpoint-{step}", saved)
    resumed = build(tmp_path / "resumed", layout=layout)
    resumed.train(resume_from_checkpoint=str(saved))
    params = trainable(resumed)
    assert params.keys() == final.keys()
    worst = max(float((params[k] - final[k]).abs().max()) for k in final)
    assert all(torch.equal(params[k], final[k]) for k in final), f"max |diff| {worst:.3g} after resuming at {step}"
    assert update_logs(resumed) == logs


def test_draws_outside_the_training_stream_leave_it_untouched(tmp_path):
    """The rule behind exact resume: the completions table, the held-out evaluation and whatever
    runs in ``isolated_rng`` (callbacks after a save) leave every global generator as it was."""
    import random

    import numpy as np

    trainer = build(tmp_path / "out")
    torch.manual_seed(123)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    trainer.generate_completions(sampling=True)
    trainer.evaluate_heldout()
    with isolated_rng():
        torch.rand(5), random.random(), np.random.rand()
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])
    # seeded: the same table whatever the training stream was before
    torch.manual_seed(1)
    first = trainer.generate_completions(sampling=True)
    torch.manual_seed(2)
    assert first.equals(trainer.generate_completions(sampling=True))
