"""The synthetic task of examples/synthetic_task.py: the rule by hand, the pairs, the RM.

Task vocabulary ids: <pad>=0 <unk>=1 <bos>=2 <eos>=3 <user>=4 <assistant>=5, nice words
kind=6 clear=7 true=8 calm=9 warm=10 bright=11 fair=12 safe=13 wise=14 glad=15, nasty words
rude=16 vague=17 ... sad=25, topics cats=26 ... snow=35, prompt words tell=36 ... describe=45.
"""

import math
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from synthetic_task import (
    build_task,
    make_preference_pairs,
    pair_accuracy,
    score_sequences,
    score_with_reward_model,
    train_reward_model,
)

from trl_ppo_ext.tiny import build_tiny_scorer

PAD, EOS, KIND, CALM, RUDE, SAD, CATS = 0, 3, 6, 9, 16, 25, 26
PROMPT = [{"role": "user", "content": "tell me about cats"}]


@pytest.fixture(scope="module")
def task():
    return build_task(0)


# --- the rule, by hand (max_words=6, stop_bonus=0.5) ---------------------------------------


@pytest.mark.parametrize(
    "response, expected",
    [
        ("kind calm rude <eos>", 2 / 3 + 0.5),  # 2 nice of 3 words, stopped after 3 <= 6 words
        ("kind calm rude", 2 / 3),  # cut off: no <eos>, no bonus
        ("kind sad kind sad kind sad <eos>", 3 / 6 + 0.5),  # 6 words: still in time
        ("kind kind kind kind kind kind kind <eos>", 1.0),  # 7 words: too late for the bonus
        ("cats <eos> kind kind", 0.0 + 0.5),  # only the words before the first <eos> count
        ("<eos>", 0.0),  # an empty answer earns nothing, not even the bonus
        ("", 0.0),
    ],
)
def test_true_reward_on_text(task, response, expected):
    assert task.true_reward("tell me about cats", response) == pytest.approx(expected, abs=1e-12)


def test_true_reward_on_ids_matches_text(task):
    # kind calm rude <eos> kind <pad>: words kind, calm, rude -> 2/3 + 0.5
    assert task.true_reward(PROMPT, [KIND, CALM, RUDE, EOS, KIND, PAD]) == pytest.approx(2 / 3 + 0.5, abs=1e-12)
    # as a tensor, cut off: sad cats kind -> 1/3
    assert task.true_reward(PROMPT, torch.tensor([SAD, CATS, KIND])) == pytest.approx(1 / 3, abs=1e-12)


def test_true_reward_with_pad_equal_to_eos():
    task = build_task(0, pad_equals_eos=True)
    assert task.tokenizer.pad_token_id == EOS
    # kind <eos> <eos(pad)> <eos(pad)>: one nice word, stopped -> 1 + 0.5
    assert task.true_reward(PROMPT, [KIND, EOS, EOS, EOS]) == pytest.approx(1.5, abs=1e-12)


def test_describe_is_one_sentence(task):
    text = task.describe()
    assert text.count(". ") == 0 and text.endswith(".")
    assert "kind" in text and "1 to 6 words" in text and "0.5" in text


def test_prompts_are_deterministic_and_in_vocabulary(task):
    prompts = task.make_prompts(20, seed=3)
    assert prompts == task.make_prompts(20, seed=3) != task.make_prompts(20, seed=4)
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    unk = task.tokenizer.unk_token_id
    assert all(unk not in task.prompt_ids(p) for p in prompts)
    assert task.prompt_ids(PROMPT) == [4, 36, 37, 38, CATS, EOS, 5]  # <user> tell me about cats <eos> <assistant>


# --- preference pairs --------------------------------------------------------------------


def test_preference_pairs_are_ranked_by_the_rule(task):
    pairs = make_preference_pairs(task, 200, seed=5, max_answer_tokens=10)
    assert len(pairs) == 200
    tok = task.tokenizer
    cut_off = 0
    for row in pairs:
        assert row["chosen_reward"] > row["rejected_reward"]
        for name in ("chosen", "rejected"):
            # the stored reward is the rule applied to the text ...
            assert task.true_reward(None, row[name]) == pytest.approx(row[f"{name}_reward"], abs=1e-12)
            # ... and the ids are the prompt text + answer text, tokenised (what TRL would
            # build from text, minus the <eos> it appends to cut-off answers)
            text_ids = tok(row["prompt"] + row[name], add_special_tokens=False)["input_ids"]
            assert row[f"{name}_ids"] == text_ids
            answer = row[name].split()
            assert len(answer) <= 10
            cut_off += "<eos>" not in answer
            assert "<eos>" not in answer or answer.index("<eos>") == len(answer) - 1
    assert 0 < cut_off < 400  # both cut-off and stopped answers are in the data


def test_preference_pairs_are_reproducible(task):
    a = make_preference_pairs(task, 10, seed=1)
    b = make_preference_pairs(task, 10, seed=1)
    assert a["chosen_ids"] == b["chosen_ids"] and a["rejected_ids"] == b["rejected_ids"]


# --- scoring with a reward model ----------------------------------------------------------


def test_scores_ignore_padding_even_when_pad_is_eos():
    task = build_task(0, pad_equals_eos=True)
    model = build_tiny_scorer(task.tokenizer, seed=0)
    prompts = [task.prompt_ids(PROMPT)] * 3
    responses = [[KIND, EOS], [RUDE, SAD, CALM, KIND], [EOS]]  # ends: EOS, a word, EOS
    batched = score_with_reward_model(model, task.tokenizer, prompts, responses)
    alone = [score_with_reward_model(model, task.tokenizer, [p], [r])[0] for p, r in zip(prompts, responses)]
    assert batched == pytest.approx(alone, abs=1e-5)
    # The model's own forward locates the end by searching for the pad id: with pad == EOS
    # it reads the token before the final EOS, so it disagrees on the first response.
    seq = torch.tensor([prompts[0] + responses[0]])
    with torch.no_grad():
        hf = model(input_ids=seq).logits.item()
    assert not math.isclose(hf, alone[0], abs_tol=1e-5)


def test_scores_match_the_model_forward_when_pad_differs_from_eos(task):
    model = build_tiny_scorer(task.tokenizer, seed=0)
    seqs = [[4, 36, CATS, EOS, 5, KIND, EOS], [4, CATS, EOS, 5, RUDE]]
    ours = score_sequences(model, seqs, pad_token_id=PAD)
    padded = torch.tensor([seqs[0], seqs[1] + [PAD, PAD]])
    with torch.no_grad():
        hf = model(input_ids=padded, attention_mask=(padded != PAD).long()).logits.squeeze(-1).tolist()
    assert ours == pytest.approx(hf, abs=1e-5)
    assert model.training  # mode restored (build_tiny_scorer returns a model in train mode)


def test_score_errors(task):
    model = build_tiny_scorer(task.tokenizer, seed=0)
    with pytest.raises(ValueError, match="2 prompts_ids but 1 responses_ids"):
        score_with_reward_model(model, task.tokenizer, [[4], [4]], [[KIND]])
    with pytest.raises(ValueError, match="empty sequence"):
        score_sequences(model, [[]], pad_token_id=PAD)


# --- reward-model training ----------------------------------------------------------------


def test_short_reward_model_training_runs(task, tmp_path):
    train = make_preference_pairs(task, 64, seed=1)
    held_out = make_preference_pairs(task, 32, seed=2)
    model, accuracy = train_reward_model(task, train, held_out, str(tmp_path), epochs=1, max_steps=4, batch_size=16)
    assert 0.0 <= accuracy <= 1.0
    assert accuracy == pytest.approx(pair_accuracy(model, task, held_out), abs=1e-12)
    scores = score_sequences(model, held_out["chosen_ids"], pad_token_id=PAD)
    assert all(math.isfinite(s) for s in scores)
    assert not model.training


def test_reward_model_gets_its_own_pad_when_pad_is_eos(tmp_path):
    task = build_task(0, pad_equals_eos=True)
    pairs = make_preference_pairs(task, 16, seed=1)
    model, _ = train_reward_model(task, pairs, pairs, str(tmp_path), epochs=1, max_steps=1, batch_size=8)
    assert model.config.pad_token_id == PAD  # reads the final <eos>, not the token before it
    assert task.tokenizer.pad_token_id == EOS  # the task's tokenizer is left as it was


@pytest.mark.slow
def test_reward_model_learns_the_rule(task, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a busy 2-core machine runs faster on one thread
    try:
        start = time.perf_counter()
        train = make_preference_pairs(task, 1500, seed=1)
        held_out = make_preference_pairs(task, 300, seed=2)
        _, accuracy = train_reward_model(task, train, held_out, str(tmp_path), epochs=3)
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert accuracy >= 0.8, f"held-out pair accuracy {accuracy:.3f} after {elapsed:.1f}s"
