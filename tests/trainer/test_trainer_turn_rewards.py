"""Per-turn rewards end to end: an environment package's step rewards, through
``agents.gym_environment`` and ``environment_factory=``, reach the trainer's token rewards on the
last token of the model turn that called each step, and the returns carry them from there."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.agents import gym_environment
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_setup import TOOL_CALL as CALL  # noqa: E402
from tiny_setup import scripted_continuations, tool_config  # noqa: E402


class Steps:
    """Gym-style stand-in for a package's environment: step k pays REWARDS[k]."""

    REWARDS = (0.5, -0.25, 1.0)

    def reset(self, seed=None):
        self.t = 0
        return f"start {seed}", {}

    def step(self, action):
        reward, self.t = self.REWARDS[self.t], self.t + 1
        return f"moved {action}", reward, self.t == 3, False, {}


Move = gym_environment(Steps, tool="move", description="Make a move.", argument="direction",
                       argument_description="Where to go.")


class TwoMoves(PPOTrainer):
    """The policy's turns replayed: turn 0 and turn 1 call the tool, turn 2 answers."""

    def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
        tok = self.processing_class
        texts = [CALL.format(name="move", args='{"direction": "n"}') if tok.decode(p).count("<tool_response>") < 2
                 else "Done.<|im_end|>" for p in prefixes]
        return scripted_continuations(tok, texts, max_new_tokens)


@pytest.fixture(scope="module")
def policy_and_tok():
    tok = build_tiny_chat_tokenizer()
    return build_tiny_causal_lm(tok, max_position_embeddings=2048), tok


def _runs(action_row):
    """(start, end) of each run of action tokens: the model turns, read without the code under test."""
    runs = []
    for t, on in enumerate(action_row.tolist()):
        if on and (t == 0 or not action_row[t - 1]):
            runs.append([t, t])
        if on:
            runs[-1][1] = t
    return runs


def test_step_rewards_reach_the_token_rewards_on_the_turn_that_called_them(tmp_path, policy_and_tok):
    from datasets import Dataset

    policy, tok = policy_and_tok
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "Go."}], "seed": i} for i in range(4)])
    trainer = TwoMoves(model=policy, processing_class=tok, train_dataset=data, environment_factory=Move,
                       args=tool_config(tmp_path, response_length=400, gamma=1.0, lam=1.0, kl_coef=0.0,
                                        whiten_rewards=False, missing_eos_penalty=None))
    assert [r.name for r in trainer.rewards] == ["MoveEnvironment"]
    rollouts = []
    trainer.score_rollout = lambda sample, _orig=trainer.score_rollout: rollouts.append(r := _orig(sample)) or r
    trainer.train()
    assert len(rollouts) == 2
    for rollout in rollouts:
        assert rollout.scores.eq(0).all()  # the environment's reward is per turn: none of it in the score
        for b in range(rollout.responses.shape[0]):
            runs = _runs(rollout.action_mask[b])
            assert len(runs) == 3  # call, call, answer
            expected = torch.zeros(rollout.responses.shape[1])
            expected[runs[0][1]], expected[runs[1][1]] = 0.5, -0.25  # steps 1 and 2 on turns 0 and 1; the answer none
            torch.testing.assert_close(rollout.token_rewards[b], expected, rtol=0, atol=0)
        # gamma = lam = 1, no KL, values 0: a token's return is the sum of the turn rewards from its turn on
        targets = trainer.compute_advantages(replace(rollout, values=torch.zeros_like(rollout.values)))
        for b in range(rollout.responses.shape[0]):
            (s0, e0), (s1, e1), (s2, e2) = _runs(rollout.action_mask[b])
            row = targets.returns[b]
            assert row[s0:e0 + 1].eq(0.25).all() and row[s1:e1 + 1].eq(-0.25).all() and row[s2:e2 + 1].eq(0).all()
            assert row[e0 + 1:s1].eq(0).all()  # the tool's reply: not a step
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(h["rewards/MoveEnvironment/mean"] == pytest.approx(0.25) for h in logs)
    assert all(h["objective/token_rewards"] == pytest.approx(0.25) for h in logs)
