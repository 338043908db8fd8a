"""examples/ppo_tools.py and its task (examples/tool_task.py): the tokenizer's whole-token pieces,
the demonstrations against the tool loop's own ids, the reward on hand-written episodes, the
``Calculator`` environment, and the whole example, which must learn: the held-out accuracy and
the tool-call rate clearly higher after PPO than before (measured over seeds 0..3: see the margins
below); and its ``--environment`` mode, reduced."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from tool_task import (  # noqa: E402
    CHAT_TEMPLATE_KWARGS,
    Calculator,
    build_task,
    calculator_answer,
    called_tool,
    correct_answer,
    demonstrations,
    factors,
    multiply,
    split_pairs,
)


@pytest.fixture(scope="module")
def task():
    return build_task()


def test_prompts_are_short_and_round_trip(task):
    tok = task.tokenizer
    ids = task.prompt_ids(23, 47)
    text = tok.apply_chat_template(task.conversation(23, 47), tools=[multiply], chat_template=task.chat_template,
                                   add_generation_prompt=True, tokenize=False, **CHAT_TEMPLATE_KWARGS)
    assert tok.decode(ids) == text and len(text) > 600  # the same text as byte by byte ...
    assert len(ids) == 25  # ... in 25 ids: the fixed pieces are whole tokens, "23*47" five bytes
    assert [tok.decode([i]) for i in ids[-13:-8]] == ["2", "3", "*", "4", "7"]
    assert len(tok(task.call_text(23, 47), add_special_tokens=False).input_ids) == 10  # 4 digits, 6 pieces


def test_a_demonstration_is_the_episode_the_tool_loop_builds(task):
    from trl_ppo_ext.agents.tool_loop import run_tool_loop
    from trl_ppo_ext.agents.tools import tool_dict

    tok = task.tokenizer
    turns = iter([task.call_text(23, 47), "1081<|im_end|>"])

    def generate(prefixes, max_new_tokens):
        ids = [tok(next(turns), add_special_tokens=False).input_ids]
        return ids, [[0.0] * len(ids[0])]

    result = run_tool_loop([task.conversation(23, 47)], tok, generate, response_length=48, tools=[[multiply]],
                           tool_dicts=[tool_dict([multiply])], chat_template=task.chat_template,
                           chat_template_kwargs=CHAT_TEMPLATE_KWARGS, max_tool_calling_iterations=1)
    ids, mask = task.episode(23, 47, call=True)
    assert result.outputs["prompt_ids"][0] == task.prompt_ids(23, 47)
    assert result.outputs["completion_ids"][0] == ids and list(result.outputs["env_mask"][0]) == mask
    assert correct_answer(result.outputs["completions"], ["1081"]) == [1.0]


def test_demonstrations_put_the_loss_on_the_model_tokens_only(task):
    rows = demonstrations(task, [(23, 47)] * 200, call_fraction=0.5, seed=0)
    prompt = len(task.prompt_ids(23, 47))
    calls = [r for r in rows if len(r["input_ids"]) > prompt + 5]
    assert 70 < len(calls) < 130  # binomial(200, 0.5): std 7
    ids, mask = task.episode(23, 47, call=True)
    row = calls[0]
    assert row["input_ids"] == task.prompt_ids(23, 47) + ids
    assert row["labels"] == [-100] * prompt + [i if m else -100 for i, m in zip(ids, mask)]
    guess = next(r for r in rows if len(r["input_ids"]) <= prompt + 5)
    assert all(label != -100 for label in guess["labels"][prompt:])  # "NNNN<|im_end|>": every id trained


def test_pairs_are_split_without_overlap():
    split = split_pairs(num_sft=300, num_ppo=512, num_held_out=128, seed=0)
    sft, ppo, held = set(split.sft), set(split.ppo), set(split.held_out)
    assert (len(sft), len(ppo), len(held)) == (300, 512, 128) and not (sft & ppo or sft & held or ppo & held)
    assert all(1000 <= a * b <= 9999 for a, b in split.sft)  # four-digit products
    with pytest.raises(ValueError, match="more than the 4624 pairs"):
        split_pairs(num_sft=4000, num_ppo=512, num_held_out=128)


def test_reward_and_figures_on_hand_written_episodes():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "multiply"}}]}
    reply = {"role": "tool", "name": "multiply", "content": "1081"}
    episodes = [
        [call, reply, {"role": "assistant", "content": "1081"}],  # called and copied: 1
        [call, reply, {"role": "assistant", "content": "1018"}],  # called, copied wrong: 0
        [{"role": "assistant", "content": " 1081 "}],  # right without the tool (a lucky guess): 1
        [call],  # ended on its call: 0
    ]
    assert correct_answer(episodes, ["1081"] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert called_tool(episodes) == [1.0, 1.0, 0.0, 0.0]  # a call whose reply was dropped has none
    assert factors([{"role": "user", "content": "23*47"}]) == (23, 47)


def test_the_calculator_environment_shows_the_same_tool_and_scores_its_own_episode(task):
    from transformers.utils import get_json_schema

    from trl_ppo_ext.agents.environments import Environments
    from trl_ppo_ext.agents.tool_loop import render_prompt

    row = {"prompt": task.conversation(23, 47), "answer": "1081"}
    envs = Environments(Calculator, sample_row=row)  # TRL's probe: a factory without arguments, reset(**row)
    assert [t.__name__ for t in envs.tools_of[None]] == ["multiply"] and envs.reward_functions() == []
    assert get_json_schema(envs.tools_of[None][0]) == get_json_schema(multiply)
    env = envs.start_batch([row]).environments[0]
    assert render_prompt(task.tokenizer, row["prompt"], envs.tools_of[None], task.chat_template,
                         CHAT_TEMPLATE_KWARGS) == task.prompt_ids(23, 47)  # the warm-up's prompt, id for id
    assert (env.factors, env.product, env.calls) == ((23, 47), 1081, [])
    assert env.multiply(23, 47) == "1081" and env.multiply(32, 47) == "1504" and env.calls == [(23, 47), (32, 47)]
    other = Calculator()
    other.reset(prompt=task.conversation(32, 47))  # another episode: 1504
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "multiply"}}]}
    episodes = [[call, {"role": "tool", "content": "1081"}, {"role": "assistant", "content": "1081"}],
                [{"role": "assistant", "content": "1081 "}], [call], [{"role": "assistant", "content": "1081"}]]
    assert calculator_answer(episodes, [env, env, env, other]) == [1.0, 1.0, 0.0, 0.0]
    assert calculator_answer(episodes[:3], [env] * 3) == correct_answer(episodes[:3], ["1081"] * 3)


def test_the_task_module_examples_run():
    import doctest

    import tool_task

    result = doctest.testmod(tool_task, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 10 and result.failed == 0


@pytest.mark.parametrize("flag, value, message", [
    ("--sft_call_fraction", "1.5", r"--sft_call_fraction=1.5: pass a share between 0 and 1"),
    ("--sft_warmup_ratio", "-0.1", r"--sft_warmup_ratio=-0.1: pass a share between 0 and 1"),
    ("--num_ppo_pairs", "0", r"--num_ppo_pairs=0: pass at least 1"),
])
def test_bad_flags_are_refused_before_anything_is_built(flag, value, message):
    import ppo_tools

    with pytest.raises(ValueError, match=message):
        ppo_tools.parse_args([flag, value])


# --- the example, whole, in this process ---------------------------------------------------
# Measured (OMP_NUM_THREADS=1, 2 cores), default flags (the recommended critic: value adapter, lam_length_alpha 2,
# kl_coef 0, 2 PPO epochs), --seed N --split_seed N for N = 0..7 and --seed N --split_seed 0 for N = 1..3: accuracy
# 0.41-0.53 -> 0.85-0.95, call rate 0.48-0.59 -> 0.94-0.98 on all eleven runs (docs/examples.md). The test runs the
# default, seed 0: 0.531 -> 0.891 (+0.36), 0.586 -> 0.961 (+0.38); the smallest gains of the eleven are seed 0's
# (accuracy +0.36, call rate +0.38), then seed 5's accuracy +0.38 and the split-0 seed 2's call rate +0.41. Which
# trajectory a seed takes moves with float order (the scoring forwards' chunks) and with the critic's settings (at
# 4 PPO epochs seed 3 collapsed to 0.0 / 0.0), so the margins sit well below the weakest run: a run that does not
# learn (accuracy and call rate where they started) fails.
# In this process rather than a subprocess: the imports are paid once for the file's two runs.
ACCURACY_GAIN, CALL_RATE_GAIN, CALL_RATE_AFTER = 0.25, 0.3, 0.9


def _newest_trl() -> bool:
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("trl")) >= Version("1.16")


def _run(argv: list[str]) -> dict:
    import ppo_tools

    return ppo_tools.main([*argv, "--disable_tqdm", "true", "--num_threads", "1"])  # one thread, as on 2 cores


# ~35 s of SFT and PPO: run in one environment only (CI's newest-TRL one), not again under older TRLs
@pytest.mark.slow
@pytest.mark.launches
@pytest.mark.skipif(not _newest_trl(), reason="the whole tools run is checked in the newest-TRL environment only")
def test_the_example_learns_to_call_the_tool(tmp_path, capsys):
    out = tmp_path / "tools"
    _run(["--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + ACCURACY_GAIN, summary
    assert summary["call_rate_after"] >= max(CALL_RATE_AFTER, summary["call_rate_before"] + CALL_RATE_GAIN), summary
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "tools/call_frequency" in h]
    assert len(history) == 12 and all(math.isfinite(h["rewards/correct_answer/mean"]) for h in history)
    assert history[-1]["tools/call_frequency"] > history[0]["tools/call_frequency"]
    assert "held-out tool-call rate" in capsys.readouterr().out and (out / "adapter_config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _newest_trl(), reason="the example's runs are checked in the newest-TRL environment only")
def test_the_environment_mode_trains_with_calculator_instances(tmp_path):
    # --environment, reduced (~6 s): environment_factory=Calculator and the reward calculator_answer in place of
    # tools=[multiply] and correct_answer. A short warm-up on calls only, so that episodes call the tool.
    out = tmp_path / "environment"
    summary = _run(["--environment", "--output_dir", str(out), "--num_sft_pairs", "64", "--sft_steps", "120",
                    "--sft_call_fraction", "1.0", "--num_ppo_pairs", "32", "--total_episodes", "32",
                    "--num_held_out_pairs", "16", "--logging_steps", "1"])
    assert summary["settings"]["environment_factory"] == "Calculator"
    assert summary["settings"]["rewards"] == [{"name": "calculator_answer", "weight": 1.0}]
    history = [h for h in json.loads((out / "log_history.json").read_text()) if "tools/call_frequency" in h]
    assert len(history) == 1  # 32 episodes: one update
    (h,) = history  # TRL's names; no rewards/Calculator/mean: the class has no get_reward
    assert not any(k.startswith("rewards/Calculator") for k in h) and math.isfinite(h["tools/failure_frequency"])
    assert h["tools/call_frequency"] > 0.5  # the instances' multiply ran (0.81 measured)
    assert h["rewards/calculator_answer/mean"] > 0  # right answers, scored through the instances (0.22 measured)
    for s in summary["samples_before"] + summary["samples_after"]:  # each reward is the episode's own answer
        assert s["reward"] == float(s["episode"].rsplit("\n", 1)[-1] == f"{s['answer']}<|im_end|>"), s
