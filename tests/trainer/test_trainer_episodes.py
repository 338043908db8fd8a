"""PPOTrainer with TRL GRPO's ``rollout_func``: episodes with turns, trained over the policy's own tokens."""

import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext import functional as F
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_setup import two_turn_rollout  # noqa: E402


def _length_reward(completions, **kwargs):
    return [len(c.split()) / 10 for c in completions]


def test_rollout_func_gets_the_prompts_and_its_episodes_train_over_the_action_tokens(make_trainer, assert_metrics):
    tok = build_tiny_tokenizer()
    calls, seen = [], {}
    inner = two_turn_rollout(tok)

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        return inner(prompts, trainer)

    def reward(completions, reply, **kwargs):  # the rollout_func's own key reaches the reward functions
        seen.setdefault("reply", []).extend(reply)
        return _length_reward(completions)

    trainer = make_trainer(tok, rollout_func=rollout_func, reward_funcs=[reward], reward_model=None)
    batches = []
    trainer.score_rollout = lambda sample, _orig=trainer.score_rollout: batches.append(r := _orig(sample)) or r
    trainer.train()
    assert_metrics(trainer, n_updates=2)
    assert len(calls) == 2 and all(len(c) == 4 and all(isinstance(p, str) and p for p in c) for c in calls)
    assert len(seen["reply"]) == 8 and all(len(r.split()) == 2 for r in seen["reply"])
    for rollout in batches:
        act, resp = rollout.action_mask, rollout.response_mask
        assert act is not None and not torch.equal(act, resp) and not (act & ~resp).any()
        assert ((resp & ~act).sum(1) == 2).all()  # the two reply words of every episode
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    for log in logs:
        assert log["rollout/turns_mean"] == 2.0  # every turn holds at least one token
        assert 0 < log["rollout/env_token_frac"] < 1 and log["rollout/ends_on_env_frac"] == 0.0
    # the old log-probs are the trainer's own forward over the whole sequence: the first ratio is 1
    assert logs[0]["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    first = batches[0]
    assert float(first.logprobs.masked_fill(~first.action_mask, 0).sum(1).neg().mean()) == pytest.approx(
        logs[0]["objective/entropy"], rel=1e-5)


def test_a_single_turn_rollout_func_trains_bitwise_as_the_trainers_own_sampling(make_trainer):
    tok = build_tiny_tokenizer()

    def one_turn(prompts, trainer):
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out, lps = trainer.generate_continuations(ids, trainer.args.response_length)
        return {"prompt_ids": ids, "completion_ids": out, "logprobs": lps, "env_mask": [[1] * len(o) for o in out]}

    own = make_trainer(tok, num_ppo_epochs=2, seed=4)
    own.train()
    funcs = make_trainer(tok, num_ppo_epochs=2, seed=4, rollout_func=one_turn)
    funcs.train()
    a, b = dict(own.unwrapped.named_parameters()), dict(funcs.unwrapped.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    logs = [[h for h in t.state.log_history if "objective/scores" in h] for t in (own, funcs)]
    turns = {"rollout/turns_mean", "rollout/env_token_frac", "rollout/ends_on_env_frac"}
    assert [{k: v for k, v in h.items() if k not in turns | set(TIMING_KEYS)} for h in logs[0]] == \
        [{k: v for k, v in h.items() if k not in turns | set(TIMING_KEYS)} for h in logs[1]]


def test_a_reward_function_placing_a_reward_on_an_environment_token_is_an_error(make_trainer):
    tok = build_tiny_tokenizer()

    def on_the_reply(completion_ids, **kwargs):  # index 2: the first reply word when the first turn has 2 tokens
        return [[(2, 1.0)] for _ in completion_ids]

    trainer = make_trainer(tok, rollout_func=two_turn_rollout(tok, first_turn=2), reward_funcs=[on_the_reply],
                           reward_model=None, stop_token=None)  # no stop: the first turn has its 2 tokens
    with pytest.raises(ValueError, match=r"reward 'on_the_reply' is 1\.0 at row 0, index 2"):
        trainer.train()


def test_a_number_from_a_token_level_reward_goes_on_the_last_action_token(make_trainer):
    tok = build_tiny_tokenizer()

    def mixed(completion_ids, **kwargs):  # row 0 a number, the others pairs on the first token
        return [0.5] + [[(0, 0.25)] for _ in completion_ids[1:]]

    trainer = make_trainer(tok, rollout_func=two_turn_rollout(tok), reward_funcs=[mixed], reward_model=None)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    last_action = F.last_valid_index(rollout.action_mask)
    assert rollout.token_rewards[0, last_action[0]] == 0.5 and rollout.token_rewards[0].sum() == 0.5
    assert (rollout.token_rewards[1:, 0] == 0.25).all()


def test_generate_continuations_keeps_each_budget_and_the_policys_log_probs(make_trainer):
    tok = build_tiny_tokenizer()
    trainer = make_trainer(tok, stop_token=None, temperature=0.9)
    prefixes = [[6, 7, 8], [9], [10, 11]]
    torch.manual_seed(0)
    ids, lps = trainer.generate_continuations(prefixes, [5, 1, 3])
    assert [len(i) for i in ids] == [5, 1, 3] and [len(lp) for lp in lps] == [5, 1, 3]
    # log-probs at the sampling temperature, by a plain forward of the policy on each whole sequence
    policy = trainer.unwrapped.policy
    for prefix, new, lp in zip(prefixes, ids, lps):
        with torch.no_grad():
            logits = policy(torch.tensor([prefix + new])).logits[0, len(prefix) - 1:-1] / 0.9
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        assert lp == pytest.approx(expected.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        trainer.generate_continuations(prefixes, [2, 0, 1])
    with pytest.raises(ValueError, match="non-empty prefixes"):
        trainer.generate_continuations([[6], []], 2)


def test_a_stop_token_ends_a_continuation_and_is_kept(make_trainer):
    tok = build_tiny_tokenizer()
    trainer = make_trainer(tok)  # stop_token="eos"
    eos = tok.eos_token_id
    torch.manual_seed(1)
    ids, _ = trainer.generate_continuations([[6, 7]] * 16, 6)
    assert all(eos not in row[:-1] for row in ids)
    assert all(len(row) == 6 or row[-1] == eos for row in ids)


def test_rollout_func_must_be_callable(make_trainer):
    with pytest.raises(TypeError, match="rollout_func must be callable"):
        make_trainer(rollout_func="not a function")


def test_the_rollout_funcs_checks_reach_the_user(make_trainer):
    tok = build_tiny_tokenizer()

    def too_long(prompts, trainer):
        return {"prompt_ids": [[6]] * len(prompts), "completion_ids": [[7] * 7] * len(prompts),
                "logprobs": None}

    trainer = make_trainer(tok, rollout_func=too_long)  # response_length=6
    with pytest.raises(ValueError, match=r"'completion_ids'\[0\] has 7 tokens, more than response_length=6"):
        trainer.train()


def test_a_token_id_beyond_the_policys_embeddings_is_refused_before_any_forward(make_trainer):
    # issue 40 case 4: before, an IndexError deep in the embedding lookup (a device assert on CUDA)
    tok = build_tiny_tokenizer()

    def out_of_vocabulary(prompts, trainer):
        rows = trainer.unwrapped.policy.get_input_embeddings().num_embeddings
        return {"prompt_ids": [[6]] * len(prompts), "completion_ids": [[7, rows]] * len(prompts), "logprobs": None}

    trainer = make_trainer(tok, rollout_func=out_of_vocabulary)
    rows = trainer.unwrapped.policy.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"'completion_ids'\[0\] holds token id {rows} at position 1, beyond the "
                                         rf"policy's {rows} embedding rows"):
        trainer.generate_rollout(next(iter(trainer.dataloader)))


@pytest.mark.parametrize("layout", ["shared", "value_adapter"])
def test_episodes_train_the_shared_lora_actor_critic(make_trainer, assert_metrics, layout):
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=lora,
                              value_lora_config=lora if layout == "value_adapter" else None)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = make_trainer(tok, model=model, ref_model=None, value_model=None, rollout_func=two_turn_rollout(tok))
    trainer.train()
    assert_metrics(trainer, n_updates=2)
    after = dict(model.named_parameters())
    assert not torch.equal(after["value_head.weight"], before["value_head.weight"])
    assert any(not torch.equal(after[n], v) for n, v in before.items() if "lora_B" in n)


@pytest.mark.slow
def test_a_grpo_rollout_func_samples_with_trainer_model_generate(make_trainer):
    """TRL's docs' rollout_func without vLLM: tokenize, then `trainer.model.generate` (here also through
    `accelerator.unwrap_model`), then return ids and log-probs. trainer.model is the policy+critic
    module; its generate is the policy's."""
    tok = build_tiny_tokenizer()
    used = []

    def rollout_func(prompts, trainer):
        device = trainer.accelerator.device
        prompt_ids, completion_ids = [], []
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
            model = trainer.model if i % 2 else trainer.accelerator.unwrap_model(trainer.model)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=True,
                                 pad_token_id=tok.pad_token_id)
            used.append(type(model).__name__)
            prompt_ids.append(ids[0].tolist())
            completion_ids.append(out[0, ids.shape[1]:].tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}

    trainer = make_trainer(tok, rollout_func=rollout_func, reward_funcs=[_length_reward], reward_model=None,
                           max_steps=1)
    trainer.train()
    assert used and set(used) == {"PolicyAndValue"}
    assert [h for h in trainer.state.log_history if "objective/scores" in h]
