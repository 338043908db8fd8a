"""The sample-efficiency benchmark's ``gem_guess`` task (GEM's GuessTheNumber, a reward per step)
without training: the search the warm-up demonstrates, by hand; a game played through the
example's environment and the rewards it books per turn; the warm-up episode's ids and labels;
the return TRL GRPO's run measures per generation batch; the skip where GEM is missing. The
tests that play GEM skip without it (``pip install -e ".[envs]"``), except where CI installed it."""

import importlib
import importlib.util
import os
import random
from types import SimpleNamespace

import pytest


@pytest.fixture
def gem_task(se):
    """The task module where GEM is installed; a skip without it, but a failure where CI installed the
    environment packages (TRL_PPO_EXT_REQUIRE_ENVS=1)."""
    if os.environ.get("TRL_PPO_EXT_REQUIRE_ENVS") == "1":
        importlib.import_module("gem")
    else:
        pytest.importorskip("gem")
    return se.task_module("gem_guess")


def test_search_guesses_halfway_through_what_the_hints_leave(se):
    task = se.task_module("gem_guess")
    # 1..10: 5; higher than 5 -> 6..10: 8; lower than 8 -> 6..7: 6; higher than 6 -> 7..7: 7
    assert task.search_guess([]) == 5
    assert task.search_guess([(5, "... the target number is higher than 5.")]) == 8
    assert task.search_guess([(5, "higher than 5."), (8, "lower than 8.")]) == 6
    assert task.search_guess([(5, "higher"), (8, "lower"), (6, "higher")]) == 7


def test_pieces_are_longest_first_and_ties_in_text_order(se):
    """The warm-up and each run build the tokenizer in a process of their own: the pieces' order (so
    their ids) must not follow a set's order, which string hashing changes from process to process."""
    task = se.task_module("gem_guess")
    # "lower than 5." -> "lower than " (11 chars), "." (1, left out); "higher than 7" -> "higher than " (12);
    # "<x>ab1cd" with <x> an added token -> "ab", "cd"; "ba2dc" -> "ba", "dc"
    texts = ["lower than 5.", "higher than 7", "<x>ab1cd", "ba2dc"]
    assert task._pieces(texts, ["<x>"]) == ["higher than ", "lower than ", "ab", "ba", "cd", "dc"]


def test_the_task_is_skipped_with_a_message_where_gem_is_missing(se, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gem" else real(name, *a))
    assert se.main(["--task", "gem_guess", "--arms", "defaults", "--seeds", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: task 'gem_guess' skipped" in out and 'pip install "trl-ppo-ext[envs]"' in out
    assert not (tmp_path / "gem_guess").exists()  # nothing prepared, nothing run
    with pytest.raises(ModuleNotFoundError, match="gem-llm"):
        se.task_module("gem_guess").environment_class()


def test_a_searched_game_books_its_rewards_per_turn(gem_task):
    """GEM 0.1.0's seed 9 hides 8: the search guesses 5 (higher, 0.0), then 8 (right, 1.0)."""
    env = gem_task.environment_class()()
    turns = gem_task.play(env, 9, True, random.Random(0))
    assert [guess for guess, _ in turns] == [5, 8]
    assert "higher than 5" in turns[0][1] and "correct number 8" in turns[1][1]
    assert env.rewards == [0.0, 1.0] and env.step_turns == [0, 1] and float(env.get_reward()) == 1.0


def test_a_random_game_ends_by_the_fourth_guess(gem_task):
    env = gem_task.environment_class()()
    turns = gem_task.play(env, 9, False, random.Random(3))
    assert 1 <= len(turns) <= gem_task.TURNS and env.done
    won = any(guess == 8 for guess, _ in turns)
    assert float(env.get_reward()) == (1.0 if won else sum(env.rewards))


def test_warm_up_episode_ids_round_trip_and_learn_the_policy_turns_only(gem_task):
    """Seed 9 searched: two calls and the last turn are labelled, GEM's replies and the prompt are not."""
    tok, template = gem_task.build_tokenizer()
    env = gem_task.environment_class()()
    ids, labels = gem_task.episode_ids(tok, template, env, 9, True, random.Random(0))
    text = tok.decode(ids)
    assert text.endswith("Done.<|im_end|>") and "Find the hidden number with the guess tool." in text
    learned = tok.decode([i for i, label in zip(ids, labels) if label != -100])
    assert learned == gem_task.call_text(5) + gem_task.call_text(8) + gem_task.LAST_TURN
    assert len(ids) < 200  # the fixed text as whole tokens: byte by byte the prompt alone is ~1,300 ids


def test_trl_grpo_run_measures_each_generation_batch_of_returns(gem_task, tmp_path):
    """A batch of 2 episodes (1 x 2): the first batch's returns reach the recorder once both are read."""
    measured = []
    recorder = SimpleNamespace(measure=measured.append)
    ppo = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    fake_model_dir = tmp_path  # _inputs loads the SFT policy: give it a tiny one
    tok, _ = gem_task.build_tokenizer()
    from trl_ppo_ext.tiny import build_tiny_causal_lm

    build_tiny_causal_lm(tok, hidden_size=8).save_pretrained(fake_model_dir / "sft")
    inputs = gem_task.grpo(0, ppo, model_dir=fake_model_dir, hidden_size=8, recorder=recorder)
    Env = inputs.environments["environment_factory"]
    assert Env.__name__ == "GemGuessTheNumber" and inputs.funcs == []  # get_reward is GRPO's reward
    won, lost = Env(), Env()
    gem_task.play(won, 9, True, random.Random(0))  # 5, 8: a win
    lost.reset(prompt=gem_task.PROMPT, seed=9)
    lost.guess(1)  # higher than 1, then nothing more: 0.0
    assert won.get_reward() == 1.0 and measured == []
    assert lost.get_reward() == 0.0 and measured == [[1.0, 0.0]]


@pytest.mark.slow
def test_both_arms_run_the_game_and_line_up(gem_task, needs_trl_grpo, se, tmp_path):
    """Both arms end to end, 64 episodes (2 rollouts of 32), from the random model (no warm-up): rows for
    the same episodes, each reward a mean return (-0.1 per move without a number .. 1.0), TRL GRPO's
    measured over all 32 episodes of its generation batch."""
    import json

    model_dir = tmp_path / "_models" / "seed0"
    info = gem_task.build_sft(0, model_dir / "sft", 16, trainer_dir=tmp_path / "trainer", steps=0)
    assert info["sft_steps"] == 0
    rows = {}
    for name in ("trl_grpo", "defaults"):
        out = tmp_path / name / "0.jsonl"
        out.parent.mkdir()
        assert se.run_one("gem_guess", se.ARMS[name], 0, model_dir=model_dir, episodes=64, hidden_size=16,
                          out=out) == 2
        *rows[name], done = [json.loads(line) for line in out.with_suffix(".partial").read_text().splitlines()]
        assert done["done"] and done["updates"] == 2 and done["train_s"] > 0
    assert [r["episode"] for r in rows["trl_grpo"]] == [r["episode"] for r in rows["defaults"]] == [32, 64]
    for row in rows["trl_grpo"] + rows["defaults"]:
        assert -0.1 * gem_task.TURNS <= row["reward"] <= 1.0 and row["entropy"] > 0
    assert all(r["scored"] == 32 for r in rows["trl_grpo"])
