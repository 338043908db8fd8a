"""A reward model with its own tokenizer reads a multi-turn episode as the conversation it was
(issue 40, case 1): the prompt and the episode's messages (assistant turn with its tool call, the
tool message, the final turn) rendered with the RM's own chat template, as TRL 1.16's GRPOTrainer
renders them -- not the completion ids decoded into one assistant message with the policy
template's glue. Checked against TRL's own ``GRPOTrainer._calculate_rewards`` on the same episodes.

Before the fix, on the tool episodes below: ours -0.0114 per row, TRL's -0.0198."""

import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.rewards.text import reward_model_texts
from trl_ppo_ext.rollout import valid_token_ids
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer, build_tiny_scorer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_setup import TOOL_CALL as CALL  # noqa: E402
from tiny_setup import Vault, multiply, scripted_continuations, tool_config, tool_dataset  # noqa: E402

NO_THINK = {"enable_thinking": False}


def scripted(first_turn):
    class Scripted(PPOTrainer):
        """The policy's turns replayed: a tool call, then an answer after the tool's reply."""

        def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
            tok = self.processing_class
            texts = [first_turn if "<tool_response>" not in tok.decode(p) else "42<|im_end|>" for p in prefixes]
            return scripted_continuations(tok, texts, max_new_tokens)

    return Scripted


@pytest.fixture(scope="module")
def models():
    tok = build_tiny_chat_tokenizer()  # the policy: TRL's Qwen3 template
    rm_tok = build_tiny_chat_tokenizer((files("trl") / "chat_templates" / "qwen2_5.jinja").read_text())
    rm = build_tiny_scorer(rm_tok, max_position_embeddings=1024)
    rm.config.pad_token_id = rm_tok.pad_token_id  # what TRL's trainer sets on a reward model
    return build_tiny_causal_lm(tok, max_position_embeddings=1024), tok, rm, rm_tok


def trl_scores(trainer, rm, rm_tok, kwargs):
    """TRL 1.16's GRPOTrainer._calculate_rewards itself, on a bare instance holding what it reads."""
    from trl import GRPOTrainer

    grpo = GRPOTrainer.__new__(GRPOTrainer)
    grpo.__dict__.update(reward_funcs=[rm], reward_processing_classes=[rm_tok], reward_func_names=["rm"],
                         accelerator=trainer.accelerator, chat_template_kwargs=NO_THINK, environments=None,
                         state=trainer.state, _log_completion_extra=None, _log_metric=None, args=trainer.args,
                         is_deepspeed_enabled=False)
    inputs = [{"prompt": p} for p in kwargs["prompts"]]
    return GRPOTrainer._calculate_rewards(grpo, inputs, kwargs["prompts"], kwargs["completions"],
                                          kwargs["completion_ids"])[:, 0]


@pytest.mark.parametrize("agent", ["tools", "environment_factory"])
def test_a_reward_model_of_its_own_tokenizer_scores_the_episode_as_trl_grpo(needs_trl_grpo, tmp_path, models, agent):
    from trl.data_utils import apply_chat_template

    policy, tok, rm, rm_tok = models
    if agent == "tools":
        cls, extra = scripted(CALL.format(name="multiply", args='{"a": 6, "b": 7}')), {"tools": [multiply]}
    else:
        cls, extra = scripted(CALL.format(name="try_code", args='{"code": 41}')), {"environment_factory": Vault}
    trainer = cls(model=policy, processing_class=tok, reward_funcs=[rm], reward_processing_classes=[rm_tok],
                  args=tool_config(tmp_path), train_dataset=tool_dataset(), **extra)
    assert trainer.rewards[0].tokenizer is rm_tok  # the text path
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    kwargs = trainer.reward_function_kwargs(sample)
    assert [m["role"] for m in kwargs["completions"][0]] == ["assistant", "tool", "assistant"]

    rendered = reward_model_texts(kwargs["prompts"], valid_token_ids(sample)[0], kwargs["completion_ids"], tok,
                                  rm_tok, completions=kwargs["completions"], chat_template_kwargs=NO_THINK)
    expected = [apply_chat_template({"messages": p + c}, rm_tok, **NO_THINK)["text"]
                for p, c in zip(kwargs["prompts"], kwargs["completions"])]
    assert rendered == expected
    assert "<think>" not in rendered[0] and rendered[0].count("<|im_start|>assistant") == 2  # RM's template, 2 turns

    ours = trainer.reward_text_scores(trainer.rewards[0], sample, kwargs)
    theirs = trl_scores(trainer, rm, rm_tok, kwargs)
    torch.testing.assert_close(ours, theirs.to(ours), rtol=0, atol=1e-5)
    scores, _, _ = trainer.score_rewards(sample)  # the trainer's own scoring reads the same
    torch.testing.assert_close(scores, theirs.to(scores), rtol=0, atol=1e-5)


def test_a_rollout_funcs_messages_are_what_the_reward_model_reads(needs_trl_grpo, tmp_path, models):
    policy, tok, rm, rm_tok = models
    call = CALL.format(name="multiply", args='{"a": 6, "b": 7}')
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
                {"role": "tool", "name": "multiply", "content": "42"}, {"role": "assistant", "content": "42"}]

    def rollout_func(prompts, trainer):
        glue = tok("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False).input_ids
        first, last = (tok(t, add_special_tokens=False).input_ids for t in (call, "42<|im_end|>"))
        rendered = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **NO_THINK) for p in prompts]
        return {"prompt_ids": rendered, "completion_ids": [first + glue + last] * len(prompts),
                "env_mask": [[1] * len(first) + [0] * len(glue) + [1] * len(last)] * len(prompts),
                "logprobs": None, "completions": [messages] * len(prompts)}

    trainer = PPOTrainer(model=policy, processing_class=tok, reward_funcs=[rm], reward_processing_classes=[rm_tok],
                         args=tool_config(tmp_path), train_dataset=tool_dataset(), rollout_func=rollout_func)
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    kwargs = trainer.reward_function_kwargs(sample)
    ours = trainer.reward_text_scores(trainer.rewards[0], sample, kwargs)
    torch.testing.assert_close(ours, trl_scores(trainer, rm, rm_tok, kwargs).to(ours), rtol=0, atol=1e-5)
