"""examples/ppo_verifiable.py and its task (examples/verifiable_task.py): the task, the reward
functions and TRL's ready-made reward on hand-computed values, and a reduced run of the whole
example in a subprocess whose summary fields must all be present and finite.

The learning claim (held-out accuracy clearly higher after PPO) is not asserted here: it needs
the full-size run, made by hand (`accelerate launch examples/ppo_verifiable.py`, about a minute).

Task vocabulary ids (``build_task("max", 20)``): <pad>=0 <unk>=1 <bos>=2 <eos>=3 <user>=4
<assistant>=5, max=6 min=7, then the numbers: "0"=8 .. "19"=27.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppo_verifiable.py"
sys.path.insert(0, str(ROOT / "examples"))

from verifiable_task import (  # noqa: E402
    answered_other_operand,
    build_task,
    exact_answer,
    format_reward,
    make_format_reward,
    prompt_dataset,
    sft_dataset,
    split_pairs,
)

EOS, MAX, N3, N17 = 3, 6, 11, 25  # "3" is id 8 + 3, "17" is id 8 + 17


@pytest.fixture(scope="module")
def task():
    return build_task("max", 20)


# --- the task ------------------------------------------------------------------------------
def test_prompt_ids_and_columns(task):
    rows = prompt_dataset(task, [(3, 17), (17, 3)])
    assert rows[0]["input_ids"] == [4, MAX, N3, N17, EOS, 5]  # <user> max 3 17 <eos> <assistant>
    assert rows[0]["prompt"] == [{"role": "user", "content": "max 3 17"}]
    assert rows["answer"] == ["17", "17"]
    assert build_task("min", 20).answer(3, 17) == 3


def test_the_example_renders_its_prompts_with_render_prompts_into_the_task_rows(task):
    """Issue 23: the example builds its PPO rows with trl_ppo_ext.data.render_prompts (prompt
    and answer columns kept) and gets exactly the rows the task's own prompt_dataset writes, so
    its reward functions receive `answer` and conversational prompts as before."""
    import ppo_verifiable

    pairs = [(3, 17), (17, 3), (5, 5)]
    rendered, expected = ppo_verifiable.ppo_prompts(task, pairs), prompt_dataset(task, pairs)
    assert sorted(rendered.column_names) == sorted(expected.column_names) == ["answer", "input_ids", "prompt"]
    assert [rendered[i] for i in range(3)] == [expected[i] for i in range(3)]


def test_pairs_are_split_without_overlap(task):
    split = split_pairs(task, num_sft=150, num_held_out=100, seed=0)
    sft, ppo, held = set(split.sft), set(split.ppo), set(split.held_out)
    assert (len(sft), len(ppo), len(held)) == (150, 150, 100)  # 400 ordered pairs in all
    assert not (sft & ppo or sft & held or ppo & held)
    assert split == split_pairs(task, num_sft=150, num_held_out=100, seed=0)
    with pytest.raises(ValueError, match=r"num_sft=300, num_held_out=100: .* leave PPO at least one of the 400"):
        split_pairs(task, num_sft=300, num_held_out=100, seed=0)


def test_sft_rows_answer_right_or_with_the_other_operand(task):
    pairs = [(3, 17), (9, 2), (5, 5)]
    right = sft_dataset(task, pairs, correct_fraction=1.0)
    wrong = sft_dataset(task, pairs, correct_fraction=0.0)
    assert [c[0]["content"] for c in right["completion"]] == ["17", "9", "5"]
    assert [c[0]["content"] for c in wrong["completion"]] == ["3", "2", "5"]  # a == b: both operands are right
    assert right["prompt"][0] == [{"role": "user", "content": "max 3 17"}]
    assert right["completion"][0] == [{"role": "assistant", "content": "17"}]
    mixed = sft_dataset(task, [(3, 17)] * 1000, correct_fraction=0.4, seed=1)
    share = sum(c[0]["content"] == "17" for c in mixed["completion"]) / 1000
    assert 0.35 < share < 0.45  # binomial(1000, 0.4): std 0.015


# --- reward functions, GRPO's calling convention ------------------------------------------
def test_exact_answer_on_text_and_messages():
    completions = ["17", [{"role": "assistant", "content": " 17 "}], "17 17", "3", ""]
    # exact after stripping; a repeated answer (cut off, no <eos>) is wrong; an empty one too
    assert exact_answer(completions=completions, answer=["17"] * 5, prompts=None) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_reward_reads_completion_ids(task):
    fmt = make_format_reward(task)
    ids = [[N17, EOS], [N3, EOS], [N17], [N17, N17, EOS], [EOS], [MAX, EOS]]
    # one number then <eos> -> 1, right or wrong; no <eos>, two numbers, nothing, a non-number -> 0
    assert fmt(completion_ids=ids, completions=None, answer=None) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert fmt.func is format_reward  # metrics are named after it: rewards/format_reward/mean


def test_answered_other_operand():
    prompts = ["max 3 17", "<user> max 3 17 <assistant>", [{"role": "user", "content": "min 3 17"}], "max 5 5"]
    completions = ["3 <eos>", "17 <eos>", "17", "5 <eos>"]
    # min's other operand is the max; a == b has no other operand
    assert answered_other_operand(prompts, completions) == [1.0, 0.0, 1.0, 0.0]


def test_trl_soft_overlong_punishment_as_the_example_uses_it():
    rewards = pytest.importorskip("trl.rewards", reason="this TRL has no trl.rewards")
    # response_length 4, cache 2: 0 up to 2 tokens, then (2 - length) / 2, i.e. -0.5 and -1.0
    fn = rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)
    assert fn(completion_ids=[[N17, EOS], [N17], [N17, N17, EOS], [N17] * 4]) == [0.0, 0.0, -0.5, -1.0]


# --- the example, reduced, in a subprocess -------------------------------------------------
def _numbers(obj, where="summary"):
    """``(where, value)`` for every int/float anywhere in ``obj`` (bools and strings skipped).
    Test modules do not import each other, so this is not shared with test_example.py."""
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [(where, obj)]
    if isinstance(obj, dict):
        return [n for k, v in obj.items() for n in _numbers(v, f"{where}.{k}")]
    if isinstance(obj, list):
        return [n for i, v in enumerate(obj) for n in _numbers(v, f"{where}[{i}]")]
    return []


NUMBERS = [f"{what}_{where}_{when}"
           for what in ("accuracy", "format_rate", "other_operand_rate")
           for where in ("held_out_greedy", "held_out_sampled", "ppo_prompts_greedy")
           for when in ("before", "after")] + ["sft_time_s", "ppo_train_time_s", "wall_time_s"]
REWARDS = ("exact_answer", "format_reward", "soft_overlong_punishment_reward")


@pytest.mark.slow
@pytest.mark.launches
@pytest.mark.parametrize("extra", [[], ["--value_lora"]], ids=["value_head", "value_adapter"])
def test_example_runs_in_a_subprocess_and_writes_every_field(tmp_path, extra):
    out = tmp_path / "verifiable"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--num_values", "8", "--num_sft_pairs", "16", "--num_held_out_pairs", "8", "--max_ppo_pairs", "32",
            "--sft_steps", "5", "--total_episodes", "32", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "2", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
            "--eval_steps", "1", "--num_train_pairs_evaluated", "8", "--output_dir", str(out), *extra]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    missing = [k for k in NUMBERS + ["task", "samples_before", "samples_after", "settings"] if k not in summary]
    assert not missing, f"summary.json lacks {missing}"
    assert all(isinstance(summary[k], (int, float)) for k in NUMBERS)
    numbers = _numbers(summary)
    assert len(numbers) > len(NUMBERS) and not [(k, v) for k, v in numbers if not math.isfinite(v)]
    for key in NUMBERS[:-3]:
        assert 0.0 <= summary[key] <= 1.0, key  # accuracies and rates
    settings = summary["settings"]
    assert settings["task"]["pairs"] == {"sft": 16, "ppo": 32, "held_out": 8}
    assert [r["name"] for r in settings["rewards"]] == list(REWARDS)
    assert settings["ppo"]["reward_weights"] == [1.0, 0.2, 0.2] and settings["ppo"]["total_episodes"] == 32
    assert settings["lora"]["value_adapter"] == ("value" if extra else None)
    assert len(summary["samples_before"]) == len(summary["samples_after"]) == 4

    history = json.loads((out / "log_history.json").read_text())
    updates = [h for h in history if "objective/scores" in h]
    assert len(updates) == 2
    for name in REWARDS:  # per-update reward metrics and the held-out value of every reward
        assert all(math.isfinite(h[f"rewards/{name}/mean"]) and math.isfinite(h[f"eval/{name}"]) for h in updates)
    assert all(math.isfinite(h["eval/other_operand"]) for h in updates)
    assert (out / "adapter_config.json").is_file() and (out / "value_head.safetensors").is_file()
    assert (out / "value" / "adapter_config.json").is_file() == bool(extra)  # the value adapter, saved beside
    assert "Before PPO" in proc.stdout and "After PPO" in proc.stdout and "held-out accuracy, greedy" in proc.stdout


@pytest.mark.parametrize("flag, value, message", [
    ("--sft_correct_fraction", "1.5", r"--sft_correct_fraction=1.5: pass a share between 0 and 1"),
    ("--soft_overlong_cache", "5", r"--soft_overlong_cache=5 with --response_length=4"),
    ("--num_sft_pairs", "0", r"--num_sft_pairs=0: pass at least 1"),
    ("--num_held_out_pairs", "300", r"--num_held_out_pairs=300 leave PPO none of the 400 pairs"),
])
def test_bad_flags_are_refused_before_anything_is_built(flag, value, message):
    import ppo_verifiable

    with pytest.raises(ValueError, match=message):
        ppo_verifiable.parse_args([flag, value])
