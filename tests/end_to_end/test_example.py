"""examples/ppo_lora.py: the demo end to end (reduced size, in a subprocess) and real mode on
local files: its argument errors, raised before any trainer exists, and one tiny real run.

The learning claim (true reward clearly higher after PPO) is not asserted here: it needs the
full-size demo, run by hand (`accelerate launch examples/ppo_lora.py`, about a minute).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppo_lora.py"
sys.path.insert(0, str(ROOT / "examples"))

import ppo_lora  # noqa: E402

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer  # noqa: E402

NUMBERS = ["rm_pair_accuracy", "rm_score_before", "rm_score_after", "true_reward_before", "true_reward_after",
           "kl_to_ref", "kl_to_ref_before", "eos_rate_before", "eos_rate_after", "response_length_before",
           "response_length_after", "wall_time_s", "ppo_train_time_s"]


def _finite_numbers(obj, where="summary"):
    """Every float/int anywhere in ``obj`` is finite; returns how many were checked."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return 0
    if isinstance(obj, (int, float)):
        assert math.isfinite(obj), f"{where} = {obj}"
        return 1
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return sum(_finite_numbers(v, f"{where}.{k}") for k, v in items)


@pytest.mark.slow
def test_demo_runs_in_a_subprocess_and_writes_every_field(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--total_episodes", "32", "--num_train_prompts", "64", "--rm_pairs", "200", "--rm_eval_pairs", "50",
            "--rm_epochs", "1", "--num_eval_prompts", "16", "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    missing = [k for k in NUMBERS + ["settings"] if k not in summary]
    assert not missing, f"summary.json lacks {missing}"
    assert all(isinstance(summary[k], (int, float)) for k in NUMBERS)
    assert _finite_numbers(summary) > len(NUMBERS)
    assert summary["mode"] == "demo"
    assert 0.0 <= summary["eos_rate_before"] <= 1.0 and 0.0 <= summary["eos_rate_after"] <= 1.0
    # LoRA's B matrices start at zero: before PPO the policy is exactly the reference.
    assert abs(summary["kl_to_ref_before"]) < 1e-6
    settings = summary["settings"]
    assert settings["lora"]["target_modules"] == sorted(ppo_lora.DEMO_LORA_TARGETS)
    assert settings["ppo"]["total_episodes"] == 32 and settings["evaluation"]["num_eval_prompts"] == 16
    assert settings["torch_num_threads"] >= 1

    history = json.loads((out / "log_history.json").read_text())
    assert any("objective/scores" in entry for entry in history)
    assert (out / "adapter_config.json").is_file() and (out / "value_head.safetensors").is_file()
    # Samples before and after are printed; progress goes to stderr, the trainer's one line per logged update.
    assert "Before PPO" in proc.stdout and "After PPO" in proc.stdout and "->" in proc.stdout
    assert "update 1/1 | score " in proc.stdout and " s/update" in proc.stdout  # the trainer's line (tqdm.write)
    assert "'objective/non_score_reward'" not in proc.stderr + proc.stdout  # no full metrics dicts


# ------------------------------------------------------------------------- real mode, locally
@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    """A tiny policy checkpoint (with and without a chat template), a reward model, prompt files."""
    root = tmp_path_factory.mktemp("real")
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok, seed=0)
    for name, template in (("policy", tok.chat_template), ("policy_no_template", None)):
        policy.save_pretrained(root / name)
        saved = build_tiny_tokenizer(chat_template=template)
        saved.save_pretrained(root / name)
    build_tiny_scorer(tok, seed=2).save_pretrained(root / "rm")

    def write(name, rows):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(root / name)

    words = [f"w{i}" for i in range(40)]
    return {
        "root": root,
        "policy": str(root / "policy"),
        "policy_no_template": str(root / "policy_no_template"),
        "rm": str(root / "rm"),
        "prompts": write("prompts.jsonl", [{"prompt": f"{words[i]} {words[i + 1]}"} for i in range(24)]),
        "questions": write("questions.jsonl", [{"question": "w1 w2"}, {"question": "w3"}]),
        "messages": write("messages.jsonl", [{"messages": [{"role": "user", "content": "w1 w2"}]}] * 4),
    }


@pytest.fixture
def no_trainer(monkeypatch):
    """Fail the test if the example gets as far as building a PPOTrainer."""

    def refuse(*args, **kwargs):
        raise AssertionError("the error was not raised before training")

    monkeypatch.setattr(ppo_lora, "PPOTrainer", refuse)


def _real(files, tmp_path, *extra, model=None, data="prompts"):
    return ["--model_name_or_path", model or files["policy"], "--reward_model_path", files["rm"],
            "--dataset_name", "json", "--data_files", files[data], "--output_dir", str(tmp_path / "out"),
            "--response_length", "4", "--report_to", "none", *extra]


def test_error_missing_model_path(local_files, tmp_path, no_trainer):
    missing = str(local_files["root"] / "no_such_model")
    with pytest.raises(FileNotFoundError, match=r"--model_name_or_path: .*no_such_model.*not an existing local "
                       r"directory.*Pass the directory"):
        ppo_lora.main(_real(local_files, tmp_path, model=missing))


def test_error_missing_reward_model_path(local_files, tmp_path, no_trainer):
    argv = _real(local_files, tmp_path)
    argv[argv.index("--reward_model_path") + 1] = str(local_files["root"] / "no_such_rm")
    with pytest.raises(FileNotFoundError, match=r"--reward_model_path: .*no_such_rm.*not an existing local directory"):
        ppo_lora.main(argv)


def test_error_dataset_without_prompt_column(local_files, tmp_path, no_trainer):
    with pytest.raises(ValueError, match=r"--dataset_name='json'.*no prompt column.*\['question'\].*prompt_column"):
        ppo_lora.main(_real(local_files, tmp_path, data="questions"))


def test_error_named_prompt_column_absent(local_files, tmp_path, no_trainer):
    with pytest.raises(ValueError, match=r"prompt_column='text' is not a column.*\['prompt'\]"):
        ppo_lora.main(_real(local_files, tmp_path, "--prompt_column", "text"))


def test_error_messages_without_chat_template(local_files, tmp_path, no_trainer):
    with pytest.raises(ValueError, match=r"--model_name_or_path=.*policy_no_template.*column 'messages' holds "
                       r"conversations.*no chat template.*Set tokenizer.chat_template"):
        ppo_lora.main(_real(local_files, tmp_path, model=local_files["policy_no_template"], data="messages"))


def test_error_missing_data_file(local_files, tmp_path, no_trainer):
    argv = _real(local_files, tmp_path)
    argv[argv.index("--data_files") + 1] = str(local_files["root"] / "nothing.jsonl")
    with pytest.raises(FileNotFoundError, match=r"--dataset_name='json'.*could not be loaded.*--data_files"):
        ppo_lora.main(argv)


def test_error_real_mode_needs_reward_model_and_dataset(local_files, tmp_path, no_trainer):
    with pytest.raises(ValueError, match=r"--reward_model_path is TRL's placeholder default.*Pass --reward_model_path"):
        ppo_lora.main(["--model_name_or_path", local_files["policy"], "--dataset_name", "json",
                       "--data_files", local_files["prompts"], "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"needs prompts: pass --dataset_name"):
        ppo_lora.main(["--model_name_or_path", local_files["policy"], "--reward_model_path", local_files["rm"],
                       "--output_dir", str(tmp_path / "out")])


def test_error_demo_refuses_real_mode_arguments(tmp_path, no_trainer):
    with pytest.raises(ValueError, match=r"--dataset_name='json' given without --model_name_or_path"):
        ppo_lora.main(["--dataset_name", "json", "--output_dir", str(tmp_path / "out")])


def test_real_mode_on_local_files(local_files, tmp_path):
    argv = _real(local_files, tmp_path, "--total_episodes", "8", "--per_device_train_batch_size", "4",
                 "--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
                 "--stop_token", "eos", "--num_eval_prompts", "4", "--lora_r", "4", "--lora_alpha", "8",
                 "--num_sample_generations", "0", "--save_strategy", "no", "--disable_tqdm", "True")
    summary = ppo_lora.main(argv)
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk == summary
    assert summary["mode"] == "real"
    assert summary["true_reward_before"] is None and summary["true_reward_after"] is None
    assert "no known true preference" in summary["true_reward_note"]
    assert summary["rm_pair_accuracy"] is None
    for key in ("rm_score_before", "rm_score_after", "kl_to_ref", "eos_rate_before", "eos_rate_after"):
        assert math.isfinite(summary[key])
    prompts = summary["settings"]["prompts"]
    assert prompts["train"] == 20 and summary["settings"]["evaluation"]["num_eval_prompts"] == 4  # 24 - 4 held out
    # all-linear, as peft expands it: every attention and MLP projection, never lm_head
    targets = summary["settings"]["lora"]["target_modules"]
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"}
    assert summary["settings"]["lora"]["value_adapter"] is None  # the value head reads the policy's states


def test_value_lora_gives_the_critic_its_own_adapter(local_files, tmp_path):
    argv = _real(local_files, tmp_path, "--total_episodes", "4", "--per_device_train_batch_size", "4",
                 "--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
                 "--stop_token", "eos", "--num_eval_prompts", "4", "--lora_r", "4", "--lora_alpha", "8",
                 "--num_sample_generations", "0", "--save_strategy", "no", "--disable_tqdm", "True",
                 "--value_lora")
    summary = ppo_lora.main(argv)
    assert summary["settings"]["lora"]["value_adapter"] == "value"
    policy_only = ppo_lora.main(argv[:-1] + ["--output_dir", str(tmp_path / "plain")])
    # a second adapter of the same rank and targets: twice the LoRA weights, the same value head
    lora = lambda s: s["settings"]["lora"]["trainable_parameters"] - 33  # noqa: E731  (value head: H=32 + bias)
    assert lora(summary) == 2 * lora(policy_only)
