"""The drop-in claim: a TRL-style PPO script runs with only its import line changed.

Runs ``tests/scripts/ppo_trl_style.py`` in a subprocess on tiny models saved to disk and a
local JSON prompt dataset, with full models and with ``--use_peft`` (ref_model=None). CI
also runs this file against the lowest supported TRL (see .ci/run).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

pytestmark = pytest.mark.slow  # subprocess runs

SCRIPT = Path(__file__).parent / "scripts" / "ppo_trl_style.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropin")
    tok = build_tiny_tokenizer()
    # The script adds a [PAD] token. "roomy" checkpoints leave room for it in the embeddings;
    # "exact" ones have exactly len(tokenizer) rows (GPT-2, Llama-2, TRL's tiny test models), so
    # the [PAD] id lies past the embedding matrix.
    for kind, size in (("roomy", dict(vocab_size=64)), ("exact", {})):
        build_tiny_causal_lm(tok, seed=0, **size).save_pretrained(root / kind / "sft")
        build_tiny_scorer(tok, seed=1, **size).save_pretrained(root / kind / "rm")
        for d in ("sft", "rm"):
            tok.save_pretrained(root / kind / d)
    data = root / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for i in range(20):
            words = " ".join(f"w{(i * 7 + k) % 40}" for k in range(2 + i % 4))
            f.write(json.dumps({"prompt": words}) + "\n")
    return root


@pytest.mark.parametrize("use_peft, kind", [(False, "roomy"), (False, "exact"), (True, "exact")],
                         ids=["full-roomy", "full-exact", "peft-exact"])
def test_trl_style_script_runs_with_only_the_import_changed(assets, tmp_path, use_peft, kind):
    out = tmp_path / "out"
    models = assets / kind
    cmd = [
        sys.executable, str(SCRIPT),
        "--dataset_name", str(assets / "data"), "--dataset_train_split", "train",
        "--model_name_or_path", str(models / "sft"), "--sft_model_path", str(models / "sft"),
        "--reward_model_path", str(models / "rm"), "--output_dir", str(out),
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2",
        "--total_episodes", "16", "--response_length", "5", "--num_ppo_epochs", "2",
        "--local_rollout_forward_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--missing_eos_penalty", "1.0", "--stop_token", "eos", "--learning_rate", "1e-3",
        "--report_to", "none", "--num_sample_generations", "1", "--save_strategy", "no",
    ]
    if use_peft:
        cmd += ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    saved = {p.name for p in out.iterdir()}
    assert ("adapter_config.json" in saved) if use_peft else ("model.safetensors" in saved), saved
    assert "tokenizer_config.json" in saved
