"""The synthetic task's reward variants of issue 22 (benchmarks/sample_efficiency/): the
``process`` reward spreads the true reward over the tokens (each nice word's share on its token,
the stop bonus on the <eos>) and sums to it; ``final`` is that sum as a number; the
``other_vocab`` reward model's tokenizer gives every word another id. Expected values by hand."""

import random
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def task(se):
    from synthetic_task import build_task

    return build_task(0)


def ids(task, text):
    return task.tokenizer.convert_tokens_to_ids(text.split())


def test_token_rewards_by_hand(task):
    # 3 words, 2 nice: 1/3 on each nice word, 0 on "rude", the stop bonus 0.5 on the <eos>
    assert task.token_rewards(ids(task, "kind rude calm <eos>")) == pytest.approx([1 / 3, 0.0, 1 / 3, 0.5])
    # cut off (no <eos>): the shares only, 1/2 each
    assert task.token_rewards(ids(task, "kind rude")) == pytest.approx([0.5, 0.0])
    # 7 words > max_words 6: no bonus on the <eos>; 7 nice words 1/7 each
    assert task.token_rewards(ids(task, "kind " * 7 + "<eos>")) == pytest.approx([1 / 7] * 7 + [0.0])
    assert task.token_rewards(ids(task, "<eos>")) == [0.0]  # an empty answer: true reward 0
    assert task.token_rewards(ids(task, "kind <eos> kind")) == pytest.approx([1.0, 0.5, 0.0])  # after the <eos>: 0


def test_prefix_token_rewards_by_hand(task):
    # shares of the prefixes: kind 1/1, kind rude 1/2, kind rude calm 2/3 -> changes 1, -1/2, 1/6; bonus 0.5
    assert task.prefix_token_rewards(ids(task, "kind rude calm <eos>")) == pytest.approx([1.0, -0.5, 1 / 6, 0.5])
    assert task.prefix_token_rewards(ids(task, "rude kind")) == pytest.approx([0.0, 0.5])  # cut off: no bonus
    assert task.prefix_token_rewards(ids(task, "kind " * 7 + "<eos>")) == pytest.approx([1.0] + [0.0] * 7)
    assert task.prefix_token_rewards(ids(task, "<eos>")) == [0.0]


def test_each_prefix_reward_depends_only_on_the_tokens_up_to_it(task):
    rng = random.Random(1)
    for _ in range(100):
        answer = task.sample_answer(rng, 10)
        whole = task.prefix_token_rewards(answer)
        for k in range(len(answer)):
            if task.tokenizer.eos_token_id not in answer[:k]:  # up to and including the first <eos>
                assert task.prefix_token_rewards(answer[:k + 1])[k] == pytest.approx(whole[k], abs=1e-12)


@pytest.mark.parametrize("method", ["token_rewards", "prefix_token_rewards"])
def test_spread_rewards_sum_to_the_true_reward(task, method):
    rng = random.Random(0)
    for _ in range(300):
        answer = task.sample_answer(rng, 10)
        spread = getattr(task, method)(answer)
        assert len(spread) == len(answer)
        assert sum(spread) == pytest.approx(task.true_reward(None, answer), abs=1e-12)


def test_reward_function_variants_and_the_measurement(se, task):
    seen = []
    completions = [ids(task, "kind rude calm <eos>"), ids(task, "rude")]
    process = se.synthetic_reward_function(task, "process", seen)
    final = se.synthetic_reward_function(task, "final", seen)
    dense = process(completion_ids=completions)
    assert len(dense) == 2 and dense[0] == pytest.approx([1 / 3, 0.0, 1 / 3, 0.5]) and dense[1] == [0.0]
    assert final(completion_ids=[torch.tensor(c) for c in completions]) == pytest.approx([2 / 3 + 0.5, 0.0])
    prefix = se.synthetic_reward_function(task, "process_prefix", seen)(completion_ids=completions)
    assert prefix[0] == pytest.approx([1.0, -0.5, 1 / 6, 0.5]) and prefix[1] == [0.0]
    assert seen == pytest.approx([2 / 3 + 0.5, 0.0] * 3)  # every call measures the true reward
    with pytest.raises(ValueError, match="variant='steps'"):
        se.synthetic_reward_function(task, "steps", seen)


def test_variants_are_declared_per_task(se):
    assert se.TASKS["synthetic"].rewards == ("default", "process", "process_prefix", "final", "other_vocab")
    assert se.TASKS["verifiable"].rewards == ("default",)
    assert set(se.REWARD_VARIANTS) >= set(se.TASKS["synthetic"].rewards)
    with pytest.raises(ValueError, match=r"reward variant 'process': the verifiable task has 'default'"):
        se.run_one("verifiable", se.Arm(reward="process"), 0, model_dir=Path("unused"), episodes=1, hidden_size=8,
                   out=Path("unused"))
    with pytest.raises(ValueError, match=r"reward variant 'final' needs this package's trainer"):
        se.run_one("synthetic", se.Arm(reward="final", trainer="trl112"), 0, model_dir=Path("unused"), episodes=1,
                   hidden_size=8, out=Path("unused"))


def test_other_vocab_tokenizer_gives_every_word_another_id(se, task):
    from trl_ppo_ext.rewards.text import same_vocabulary

    other = se.other_vocab_tokenizer()
    words = [w for w in task.tokenizer.get_vocab() if not w.startswith("<")]
    assert sorted(other.get_vocab()) == sorted(task.tokenizer.get_vocab())  # the same tokens
    assert all(other.convert_tokens_to_ids(w) != task.tokenizer.convert_tokens_to_ids(w) for w in words)
    assert not same_vocabulary(task.tokenizer, other)
    assert other.chat_template == task.tokenizer.chat_template
