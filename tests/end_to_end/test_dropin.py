"""The drop-in claim: a TRL-style PPO script runs with only its import line changed.

Runs ``tests/scripts/ppo_trl_style.py`` on tiny models saved to disk and a local JSON prompt
dataset, with full models and with ``--use_peft`` (ref_model=None). One subprocess runs the
script as ``__main__`` once per configuration, in turn (``runpy``, its own ``sys.argv`` each
time), so the imports are paid once; each configuration's test reads its own exit status.
CI also runs this file against the lowest supported TRL (see .ci/run).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

pytestmark = pytest.mark.slow  # subprocess runs

SCRIPT = Path(__file__).parents[1] / "scripts" / "ppo_trl_style.py"


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


CONFIGS = {"full-roomy": (False, "roomy"), "full-exact": (False, "exact"), "peft-exact": (True, "exact")}

# Runs SCRIPT as __main__ for each (name, argv) of a JSON list, as `python SCRIPT argv` would
# (the script's folder first on sys.path), and writes REPORT/<name>.json: the exit status that
# run would have had, and its traceback. A marker line starts each run's output.
DRIVER = """
import json, runpy, sys, traceback
from pathlib import Path
script, report, configs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, str(Path(script).parent))
for name, args in configs:
    for stream in (sys.stdout, sys.stderr):
        print(f"=== configuration {name} ===", file=stream, flush=True)
    sys.argv = [script, *args]
    status, trace = 0, ""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception:
        status, trace = 1, traceback.format_exc()
    (report / f"{name}.json").write_text(json.dumps({"status": status, "traceback": trace}))
"""


def _script_args(assets, out, use_peft, kind):
    models = assets / kind
    args = [
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
        args += ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    return args


@pytest.fixture(scope="module")
def script_runs(assets, tmp_path_factory):
    """Every configuration of CONFIGS run by one subprocess (DRIVER): ``(root, process)``, with
    ``root/<name>.json`` (exit status, traceback) and ``root/<name>/out`` for each."""
    root = tmp_path_factory.mktemp("dropin_runs")
    configs = [[name, _script_args(assets, root / name / "out", *config)] for name, config in CONFIGS.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(SCRIPT), str(root), json.dumps(configs)],
                          capture_output=True, text=True, env=env, timeout=1200)
    return root, proc


def _section(text, name):
    """The part of the driver's output that configuration ``name``'s run printed."""
    marker = f"=== configuration {name} ==="
    return text.split(marker, 1)[1].split("=== configuration ", 1)[0] if marker in text else text


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trl_style_script_runs_with_only_the_import_changed(script_runs, name):
    root, proc = script_runs
    use_peft, _ = CONFIGS[name]
    report = root / f"{name}.json"
    assert report.exists(), f"{name} did not run (driver exit status {proc.returncode}):\n" + proc.stderr[-6000:]
    result = json.loads(report.read_text())
    assert result["status"] == 0, (result["traceback"] + _section(proc.stdout, name)[-3000:]
                                   + _section(proc.stderr, name)[-6000:])
    out = root / name / "out"
    saved = {p.name for p in out.iterdir()}
    assert ("adapter_config.json" in saved) if use_peft else ("model.safetensors" in saved), saved
    assert "tokenizer_config.json" in saved


def test_the_process_that_runs_every_configuration_exits_cleanly(script_runs):
    """The driver ends with status 0 after the last configuration (each one's own status is its test's)."""
    _, proc = script_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
