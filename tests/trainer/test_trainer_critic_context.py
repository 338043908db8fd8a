"""PPOConfig.critic_context_column, the privileged critic (``trl_ppo_ext.critic_context``): the critic
reads a dataset column before the prompt, the policy never does. Checked on the tiny models: the rollout's
values equal the critic's own forward on ``[context, prompt, response]`` assembled by hand here; the
policy's and the reference's log-probs are bit for bit those of a run without the field; a run trains,
logs its explained variance and resumes exactly (after an update and inside one); the refusals."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from peft import LoraConfig
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig, PPOTrainer
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.run.preemption import InflightUpdate, inflight_filename
from trl_ppo_ext.tiny import build_tiny_causal_lm, default_words

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
# two PPO epochs (the old log-probs and values come from the scoring forward), chunks of 2 rows
RUN = dict(num_ppo_epochs=2, local_rollout_forward_batch_size=2, response_length=6)


def _answers(n: int) -> list[str]:
    """``n`` answers of 1 to 3 ordinary words, lengths varying from row to row."""
    words = default_words()
    return [" ".join(words[(7 * i + k) % len(words)] for k in range(1 + i % 3)) for i in range(n)]


def _dataset(make_prompts, tok, n=16):
    prompts = make_prompts(tok, n=n)
    return prompts.add_column("answer", _answers(n))


def _layout(name: str) -> dict:
    """A separate value model (the builder's default) or a value adapter on the policy's base."""
    if name == "separate":
        return {}
    return dict(ref_model=None, value_model=None, peft_config=LoraConfig(**LORA), use_value_adapter=True)


def _first_rollout(trainer):
    """The first batch's scored rollout, as train() would make it."""
    trainer._begin_training(None)
    return trainer.score_rollout(trainer.generate_rollout(trainer.repeated_prompts(next(trainer.loop_state.batches))))


def _values_by_hand(trainer, ids: list[int]) -> torch.Tensor:
    """``V`` at every position of one unpadded sequence ``ids``: the value model's backbone and score head,
    or the base under the value adapter and the value head."""
    model = trainer.unwrapped
    x = torch.tensor([ids])
    with torch.no_grad():
        if getattr(model, "value_model", None) is not None:
            hidden = model.value_model.model(input_ids=x).last_hidden_state
            return model.value_model.score(hidden)[0, :, 0].float()
        base = model.policy.get_base_model()
        with model._active_adapter(model.value_adapter):
            hidden = base.model(input_ids=x).last_hidden_state
        return model.value_head(hidden)[0, :, 0].float()


# ---------------------------------------------------------------- the values, by hand


@pytest.mark.parametrize("layout", ["separate", "value_adapter"])
@pytest.mark.parametrize("epochs", [2, 1])  # 2: the scoring forward; 1: the critic's pass alone (on-policy)
def test_the_values_are_the_critics_own_forward_on_context_prompt_and_response(make_trainer, make_prompts, tok,
                                                                              layout, epochs):
    trainer = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), critic_context_column="answer",
                           **{**RUN, "num_ppo_epochs": epochs}, **_layout(layout))
    rollout = _first_rollout(trainer)
    answers = rollout.extras["answer"]
    assert rollout.critic_queries is not None and len(set(map(len, answers))) > 1
    differs = 0
    for b in range(rollout.batch_size):
        context = tok.convert_tokens_to_ids(answers[b].split())  # the words; the newline is whitespace here
        prompt = rollout.queries[b][rollout.query_mask[b]].tolist()
        response = rollout.responses[b][rollout.response_mask[b]].tolist()
        values = _values_by_hand(trainer, context + prompt + response)
        # V(s_t) is read where response token t is predicted: the position before it
        start = len(context) + len(prompt) - 1
        expected = values[start:start + len(response)]
        torch.testing.assert_close(rollout.values[b, :len(response)], expected, rtol=0, atol=2e-6)
        assert (rollout.values[b, len(response):] == 0).all()
        # the same row without the context: the critic's values depend on it
        plain = _values_by_hand(trainer, prompt + response)[len(prompt) - 1:len(prompt) - 1 + len(response)]
        differs += not torch.allclose(plain, expected, atol=1e-4)
    assert differs == rollout.batch_size


@pytest.mark.parametrize("layout", ["separate", "value_adapter"])
def test_the_policys_and_references_log_probs_are_unchanged_bit_for_bit(make_trainer, make_prompts, layout):
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    rollouts = []
    for column in (None, "answer"):
        tok = build_tiny_tokenizer()
        trainer = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), critic_context_column=column, **RUN,
                               **_layout(layout))
        assert trainer.scoring.reference and trainer.scoring.old_logprobs  # both forwards run before the update
        rollouts.append(_first_rollout(trainer))
    plain, privileged = rollouts
    assert plain.critic_queries is None and privileged.critic_queries is not None
    for name in ("responses", "response_mask", "logprobs", "ref_logprobs", "scores"):
        assert torch.equal(getattr(plain, name), getattr(privileged, name)), name
    assert not torch.allclose(plain.values, privileged.values)


# ---------------------------------------------------------------- runs


def _trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}


def _logs(trainer):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history
            if "objective/scores" in h]


@pytest.mark.parametrize("layout", ["separate", "value_adapter"])
def test_a_run_trains_logs_its_explained_variance_and_resumes_exactly(make_trainer, make_prompts, tok, tmp_path,
                                                                      layout):
    """Three updates with two samples per prompt, checkpointed after each: the critic moves, every update
    logs a finite explained variance, and a run resumed from checkpoint-1 ends torch.equal to the unbroken one."""
    settings = dict(RUN, total_episodes=12, num_generations=2, critic_context_column="answer",
                    save_strategy="steps", save_steps=1, **_layout(layout))
    straight = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), output_dir=str(tmp_path / "straight"),
                            **settings)
    start = _trainable(straight)
    straight.train()
    logs = _logs(straight)
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["val/explained_variance"])) for h in logs)
    critic = [n for n in start if n.startswith("value_") or ".value." in n]
    assert critic and all(not torch.equal(start[n], _trainable(straight)[n]) for n in critic)
    shutil.copytree(tmp_path / "straight" / "checkpoint-1", tmp_path / "checkpoint-1")
    resumed = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), output_dir=str(tmp_path / "resumed"),
                           **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    final, again = _trainable(straight), _trainable(resumed)
    assert final.keys() == again.keys() and all(torch.equal(final[n], again[n]) for n in final)
    assert _logs(resumed) == logs  # the history up to the checkpoint comes back with it


class SigtermInStep(PPOTrainer):
    """Sends itself SIGTERM in the first optimizer step of update 1 (a test sets nothing on the class)."""

    sent = False

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step == 0 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().compute_loss_terms(mb, adv, num_tokens)


def test_a_preempted_update_keeps_the_critics_prompts_and_resumes_exactly(make_trainer, make_prompts, tok, tmp_path):
    settings = dict(RUN, total_episodes=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_mini_batches=2, critic_context_column="answer", on_sigterm="save_and_return")
    straight = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), output_dir=str(tmp_path / "straight"),
                            **settings)
    straight.train()
    stopped = make_trainer(tok, cls=SigtermInStep, train_dataset=_dataset(make_prompts, tok),
                           output_dir=str(tmp_path / "run"), **settings)
    stopped.train()
    assert stopped.state.stop_reason == "preempted"
    saved = InflightUpdate.load(str(tmp_path / "run" / "checkpoint-0-preempted" / inflight_filename(0)),
                                torch.device("cpu"))
    assert saved.rollout["critic_queries"].shape[0] == 4 and saved.rollout["critic_query_mask"].dtype == torch.bool
    resumed = make_trainer(tok, train_dataset=_dataset(make_prompts, tok), output_dir=str(tmp_path / "run"), **settings)
    resumed.train(resume_from_checkpoint=True)
    final, again = _trainable(straight), _trainable(resumed)
    assert all(torch.equal(final[n], again[n]) for n in final)
    assert _logs(resumed) == _logs(straight)


class RecordsValueSteps(PPOTrainer):
    """Keeps its rollout and counts the real tokens its value model reads in value-only steps."""

    rollout, in_value_step, value_step_tokens = None, False, 0  # defaults; each trainer sets its own

    def compute_advantages(self, rollout):
        self.rollout = rollout
        return super().compute_advantages(rollout)

    def compute_value_loss_terms(self, mb, adv, num_tokens=None, num_sequences=None):
        self.in_value_step = True
        try:
            return super().compute_value_loss_terms(mb, adv, num_tokens, num_sequences)
        finally:
            self.in_value_step = False


def test_critic_epochs_train_the_privileged_critic_on_its_own_sequence(make_trainer, make_prompts, tok):
    """num_critic_epochs' value-only steps read the critic's own sequence: over the value-only epoch the value
    model attends to every row's context, prompt and response tokens, counted here by hand."""
    trainer = make_trainer(tok, cls=RecordsValueSteps, train_dataset=_dataset(make_prompts, tok),
                           critic_context_column="answer", num_critic_epochs=3, total_episodes=4, **RUN)

    def count(module, args, kwargs):
        if trainer.in_value_step:
            trainer.value_step_tokens += int(kwargs["attention_mask"].sum())

    trainer.unwrapped.value_model.model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    rollout = trainer.rollout
    expected = sum(len(a.split()) for a in rollout.extras["answer"]) + int(rollout.query_mask.sum()) + int(
        rollout.response_mask.sum())
    assert trainer.value_step_tokens == expected  # one value-only epoch: every row once
    (log,) = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert "loss/value_critic_epochs_avg" in log


# ---------------------------------------------------------------- refusals


def test_the_field_parses_from_the_command_line(tmp_path):
    parser = HfArgumentParser(PPOConfig)
    base = ["--output_dir", str(tmp_path), "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses(args=base + ["--critic_context_column", "answer"])
    assert args.critic_context_column == "answer"
    (args,) = parser.parse_args_into_dataclasses(args=base + ["--critic_context_column", "None"])
    assert args.critic_context_column is None
    assert PPOConfig(output_dir=str(tmp_path), report_to=[]).critic_context_column is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(critic_context_column="answer", advantage_estimator="rloo", num_generations=2),
         r"critic_context_column='answer' with advantage_estimator='rloo', which trains no critic"),
        (dict(critic_context_column="answer", use_value_adapter=True, value_branch_layer=1),
         r"critic_context_column='answer' with value_branch_layer=1: the branch critic shares the policy's layers"),
        (dict(critic_context_column=""), r"critic_context_column must be a dataset column's name or None, got ''"),
    ],
)
def test_the_config_refuses_what_cannot_read_a_context(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_the_shared_value_head_and_the_branch_critic_are_refused(make_trainer, make_prompts, tok):
    with pytest.raises(ValueError, match=r"critic_context_column='answer'.*the shared value head reads the policy's"):
        make_trainer(tok, train_dataset=_dataset(make_prompts, tok), critic_context_column="answer", ref_model=None,
                     value_model=None, peft_config=LoraConfig(**LORA))
    branch = SharedActorCritic(build_tiny_causal_lm(tok, seed=0), lora_config=LoraConfig(**LORA),
                               value_lora_config=LoraConfig(**LORA), value_branch_layer=1)
    with pytest.raises(ValueError, match=r"the branch critic \(value_branch_layer=1\) shares the policy's layers"):
        make_trainer(tok, train_dataset=_dataset(make_prompts, tok), critic_context_column="answer", model=branch,
                     ref_model=None, value_model=None)


def test_a_dataset_without_the_column_is_refused_at_construction(make_trainer, make_prompts, tok):
    with pytest.raises(ValueError, match=r"critic_context_column='answer' is not a column of `train_dataset` "
                                         r"\(columns: \['input_ids'\]\)"):
        make_trainer(tok, train_dataset=make_prompts(tok), critic_context_column="answer")
    with pytest.raises(ValueError, match=r"is not a column of `eval_dataset`"):
        make_trainer(tok, train_dataset=_dataset(make_prompts, tok), eval_dataset=make_prompts(tok, n=4),
                     critic_context_column="answer")


def test_a_value_that_is_not_a_string_is_named_at_the_first_rollout(make_trainer, make_prompts, tok):
    data = make_prompts(tok).add_column("answer", list(range(16)))
    trainer = make_trainer(tok, train_dataset=data, critic_context_column="answer")
    with pytest.raises(TypeError, match=r"critic_context_column='answer': row 0 holds a int .*str\(r\['answer'\]\)"):
        trainer.train()
