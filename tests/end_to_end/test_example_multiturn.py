"""examples/ppo_multiturn.py and its task (examples/multiturn_task.py): the environment's reply,
the turn scores and the reward on hand-worked episodes, the rollout function's output against
the trainer's own checks (``trl_ppo_ext.episodes.rollout_outputs``) with a stand-in trainer, and
a reduced run of the whole example in a subprocess that must learn.

Task vocabulary ids (``build_task()``): <pad>=0 <unk>=1 <bos>=2 <eos>=3 <user>=4 <assistant>=5,
nice words 6..15 (kind=6, clear=7), nasty 16..25 (rude=16), closing 26..28 (thanks=26, bye=27),
topics 29..38 (cats=29), prompt words 39..48 (tell=39, me=40, about=41), the environment's words
49..53 (good=49, bad=50, none=51, now=52, close=53).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppo_multiturn.py"
sys.path.insert(0, str(ROOT / "examples"))

from multiturn_task import build_task, conversations, make_reward, make_rollout_func, prompt_dataset  # noqa: E402

from trl_ppo_ext.episodes import rollout_outputs  # noqa: E402

EOS, USER, ASSISTANT = 3, 4, 5
KIND, CLEAR, RUDE, THANKS, BYE, CATS = 6, 7, 16, 26, 27, 29
GOOD, BAD, NONE, NOW, CLOSE = 49, 50, 51, 52, 53


@pytest.fixture(scope="module")
def task():
    return build_task()


# --- the task ------------------------------------------------------------------------------
def test_vocabulary_and_prompts(task):
    assert task.tokenizer.convert_tokens_to_ids(["kind", "rude", "thanks", "cats", "good", "close"]) == \
        [KIND, RUDE, THANKS, CATS, GOOD, CLOSE]
    assert len(task.tokenizer) == 54
    rows = prompt_dataset(task)
    assert len(rows) == 48 and len(prompt_dataset(task, held_out=True, repeats=2)) == 24  # 8 topics x 6, 2 x 6
    assert rows[0]["prompt"] == [{"role": "user", "content": "tell me about cats"}]
    assert rows[0]["input_ids"] == [USER, 39, 40, 41, CATS, EOS, ASSISTANT]  # the chat template
    assert not {c[0]["content"].split()[-1] for c in conversations(False)} & {"sea", "snow"}


def test_the_environment_replies_with_a_verdict_per_word(task):
    # kind rude <eos>: good, bad, then none for the missing third word; always 3 + 5 tokens
    assert task.reply([KIND, RUDE, EOS]) == [USER, GOOD, BAD, NONE, NOW, CLOSE, EOS, ASSISTANT]
    assert task.reply([RUDE, KIND, CLEAR]) == [USER, BAD, GOOD, GOOD, NOW, CLOSE, EOS, ASSISTANT]  # cut, no <eos>
    assert task.reply([EOS]) == [USER, NONE, NONE, NONE, NOW, CLOSE, EOS, ASSISTANT]
    assert task.reply_length == 8


def test_turn_scores_and_reward_by_hand(task):
    # answer 1 "kind rude": 1 nice of 2 words = 0.5; answer 2 "thanks": 1 closing of 1 = 1.0; reward (0.5 + 1) / 2
    assert task.turn_scores([KIND, RUDE, EOS], [THANKS, EOS]) == (0.5, 1.0)
    assert task.reward([KIND, RUDE, EOS], [THANKS, EOS]) == 0.75
    # a nice word in answer 2 is not a closing one: 1 of 2; words after <eos> do not count
    assert task.turn_scores([KIND, CLEAR, KIND], [BYE, KIND, EOS]) == (1.0, 0.5)
    assert task.turn_scores([KIND, EOS, RUDE], [EOS, THANKS]) == (1.0, 0.0)
    assert task.turn_scores([EOS], []) == (0.0, 0.0)  # turns without words score 0


class StandInTrainer:
    """What a rollout_func reads of the trainer: ``args.response_length`` and
    ``generate_continuations``, here answering with fixed turns and recording its calls."""

    def __init__(self, turns, response_length=14):
        self.args = SimpleNamespace(response_length=response_length)
        self.turns, self.calls = list(turns), []

    def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
        self.calls.append(([list(p) for p in prefixes], max_new_tokens))
        ids = self.turns.pop(0)
        return ids, [[-0.5] * len(row) for row in ids]


def test_rollout_func_returns_trl_keys_that_the_trainer_accepts(task):
    trainer = StandInTrainer([[[KIND, RUDE, EOS], [BYE]], [[THANKS, EOS], [KIND, KIND, KIND]]])
    prompts = conversations(False)[:2]
    out = make_rollout_func(task)(prompts, trainer)
    prompt0 = [USER, 39, 40, 41, CATS, EOS, ASSISTANT]
    reply0 = [USER, GOOD, BAD, NONE, NOW, CLOSE, EOS, ASSISTANT]
    reply1 = [USER, BAD, NONE, NONE, NOW, CLOSE, EOS, ASSISTANT]
    assert trainer.calls[0] == ([prompt0, task.prompt_ids(prompts[1])], 3)
    # turn 2 continues prompt + answer 1 + reply, within 14 - len(answer 1) - 8 tokens
    assert trainer.calls[1] == ([prompt0 + [KIND, RUDE, EOS] + reply0, task.prompt_ids(prompts[1]) + [BYE] + reply1],
                                [3, 5])
    assert out["completion_ids"][0] == [KIND, RUDE, EOS, *reply0, THANKS, EOS]
    assert out["env_mask"][0] == [1, 1, 1] + [0] * 8 + [1, 1]
    assert out["logprobs"][1] == [-0.5] + [0.0] * 8 + [-0.5] * 3
    checked = rollout_outputs(out, num_prompts=2, response_length=14)
    assert checked.extra == {"first_answer": [[KIND, RUDE, EOS], [BYE]], "second_answer": [[THANKS, EOS], [KIND] * 3]}
    # the reward function reads those columns: (0.5 + 1) / 2 and (0 + 0) / 2
    assert make_reward(task)(prompts=prompts, completions=None, **checked.extra) == [0.75, 0.0]
    assert make_reward(task).func.__name__ == "multiturn_reward"  # metrics: rewards/multiturn_reward/mean


@pytest.mark.parametrize("flag, value, message", [
    ("--first_turn_tokens", "0", r"--first_turn_tokens=0: pass at least 1"),
    ("--response_length", "11", r"--response_length=11 with --first_turn_tokens=3: .* pass at least 12"),
])
def test_bad_flags_are_refused_before_anything_is_built(flag, value, message):
    import ppo_multiturn

    with pytest.raises(ValueError, match=message):
        ppo_multiturn.parse_args([flag, value])


# --- the example, reduced, in a subprocess -------------------------------------------------
# Measured with these flags on seeds 0-3 (one thread), the example's critic (value adapter, lam_length_alpha 2,
# kl_coef 0): held-out reward 0.13-0.15 before, 0.83-0.97 after (gains 0.70-0.82; with the value head on the
# policy's backbone and kl_coef 0.02 it was 0.52-0.67).
LEARNS_BY = 0.5


@pytest.mark.slow
@pytest.mark.launches
def test_example_learns_in_a_subprocess(tmp_path):
    out = tmp_path / "multiturn"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    args = ["--total_episodes", "512", "--eval_repeats", "4", "--num_samples_shown", "2", "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    for key in ("reward", "first_turn", "second_turn"):
        assert 0.0 <= summary[f"{key}_before"] <= 1.0 and 0.0 <= summary[f"{key}_after"] <= 1.0, key
    assert summary["reward_after"] > summary["reward_before"] + LEARNS_BY, summary
    assert summary["settings"]["task"] == {"first_turn_tokens": 3, "reply_length": 8, "train_prompts": 192,
                                           "held_out_episodes": 48}
    history = json.loads((out / "log_history.json").read_text())
    updates = [h for h in history if "objective/scores" in h]
    assert len(updates) == 8  # 16 updates, logged every 2 (logging_steps)
    # two policy turns per episode, 8 of its at most 14 tokens from the environment
    assert all(h["rollout/turns_mean"] == 2.0 and 8 / 14 <= h["rollout/env_token_frac"] < 1 for h in updates)
    assert all(math.isfinite(h["rewards/multiturn_reward/mean"]) for h in updates)
    assert "Before PPO" in proc.stdout and "After PPO" in proc.stdout and "held-out reward" in proc.stdout
