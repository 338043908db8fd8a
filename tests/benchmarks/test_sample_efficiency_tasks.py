"""benchmarks/sample_efficiency/tasks/: the verifiable task's rule against the example's own reward
functions, and the long task's rule by hand."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_verifiable_rule_matches_the_example_reward_functions(se):
    """TRL's arm trains on ``verifiable_rule``; this package's on the example's functions. Same numbers."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    from trl.rewards import get_soft_overlong_punishment
    from verifiable_task import build_task, exact_answer, make_format_reward

    task = build_task("max", 20)
    tok = task.tokenizer
    rule = se.verifiable_rule(task, weights=(1.0, 0.2, 0.2), response_length=4, overlong_cache=2)
    ids = tok.convert_tokens_to_ids
    responses = [["17", "<eos>"], ["3", "<eos>"], ["17"], ["17", "17", "<eos>"], ["<eos>"], ["17", "3", "3", "3"],
                 ["max", "<eos>"], ["<user>", "<eos>"], ["<assistant>", "17", "<eos>"], ["17", "<user>", "max", "1"]]
    prompt = task.prompt_ids(3, 17)
    overlong = get_soft_overlong_punishment(4, 2)
    fmt = make_format_reward(task)
    for response in responses:
        rid = ids(response)
        padded = [tok.pad_token_id] * 2 + prompt + rid + [tok.pad_token_id] * (4 - len(rid))
        text = tok.decode(rid, skip_special_tokens=True)
        exact = exact_answer(completions=[text], answer=["17"])[0]
        expected = exact + 0.2 * fmt(completion_ids=[rid])[0] + 0.2 * overlong(completion_ids=[rid])[0]
        assert rule(padded) == pytest.approx((expected, exact), abs=1e-12), response
    # by hand: "17 <eos>" = 1 + 0.2 * 1 + 0; "17 3 3 3" (4 tokens, cut off) = 0 + 0 + 0.2 * -1
    assert rule([*prompt, *ids(["17", "<eos>"])])[0] == pytest.approx(1.2, abs=1e-12)
    assert rule([*prompt, *ids(["17", "3", "3", "3"])])[0] == pytest.approx(-0.2, abs=1e-12)


def test_long_task_reward_by_hand(se):
    sys.path.insert(0, str(ROOT / "examples"))
    from synthetic_task import build_task

    task = build_task(0)
    tok = task.tokenizer
    eos = tok.eos_token
    ids = lambda words: tok.convert_tokens_to_ids(words)  # noqa: E731
    # 3 nice of 4 words, no <eos>: 3 / 4 of the target 4, no bonus
    assert se.long_task_reward(task, ids(["kind", "rude", "calm", "wise"]), target_words=4) == 0.75
    # 5 nice words then <eos>: capped at 1, and the bonus (5 >= 4 words)
    assert se.long_task_reward(task, ids(["kind"] * 5 + [eos]), target_words=4) == 1.0 + task.stop_bonus
    # stopping before the target earns no bonus: 2 nice words of a target of 4
    assert se.long_task_reward(task, ids(["kind", "calm", eos]), target_words=4) == 0.5
    # what follows the <eos> does not count
    assert se.long_task_reward(task, ids([eos, "kind", "kind"]), target_words=1) == 0.0
