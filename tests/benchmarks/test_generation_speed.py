"""benchmarks/generation_speed.py's transformers arm samples through the trainer's own generation
helpers (they moved once and the benchmark broke without a test): a tiny batch gives valid tokens,
at least one and at most one per prompt and position. The vLLM arm needs vLLM and is not run here."""

import importlib.util
from pathlib import Path

from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generation_speed.py"


def test_the_transformers_arm_samples_the_trainers_way():
    spec = importlib.util.spec_from_file_location("generation_speed_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = build_tiny_tokenizer()
    prompts = module.random_prompts(tok, 3, seed=0)
    valid = module.transformers_arm(build_tiny_causal_lm(tok), tok, prompts, 8)()
    assert 3 <= valid <= 3 * 8  # each response keeps at least its first token, at most 8
