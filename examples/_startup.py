"""The start-up every example script shares, imported first (``import _startup``): quiet
defaults for TRL and tokenizers, and the package from this source checkout when it is not
installed (``pip install -e .`` makes that step a no-op).

The examples' own folder is on ``sys.path`` when they run (``python examples/X.py``,
``accelerate launch examples/X.py``) and in the tests that import them, so this module is
found as a sibling.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL keeps its PPO in trl.experimental
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import trl_ppo_ext  # noqa: F401
except ModuleNotFoundError:  # run from a source checkout without `pip install -e .`
    ROOT = Path(__file__).resolve().parents[1]
    if not (ROOT / "trl_ppo_ext").is_dir():
        raise
    sys.path.insert(0, str(ROOT))


# vLLM's CPU attention kernels take head sizes 32, 64, 80, 96, 112, 128, ... (docs/vllm.md).
VLLM_MIN_HEAD_DIM = 32


def vllm_demo_hidden_size(hidden_size: int, use_vllm: bool, num_heads: int = 4) -> int:
    """The demo model's hidden size: ``hidden_size``, or with ``--use_vllm`` the smallest one whose
    heads vLLM's CPU attention takes (the tiny demo's 32 / 4 heads = head_dim 8 has no kernel)."""
    if not use_vllm or hidden_size // num_heads >= VLLM_MIN_HEAD_DIM:
        return hidden_size
    print(f"--use_vllm: the demo model's hidden_size goes from {hidden_size} to {VLLM_MIN_HEAD_DIM * num_heads} "
          f"(head_dim {VLLM_MIN_HEAD_DIM}: vLLM's CPU attention has no kernel for {hidden_size // num_heads}).")
    return VLLM_MIN_HEAD_DIM * num_heads


def vllm_cpu_defaults(use_vllm: bool) -> None:
    """On a machine without CUDA, vLLM's CPU settings the docs give, where unset: a 1 GiB KV cache
    (else it takes gpu_memory_utilization of the RAM) and no core binding."""
    import torch

    if use_vllm and not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def write_run_files(trainer, output_dir: str, summary: dict) -> str | None:
    """On the main process: ``summary.json`` (the run's figures) and ``log_history.json`` (every
    logged update) in ``output_dir``; returns the summary's path (None on the other processes)."""
    import json

    from trl_ppo_ext.run.manifest import to_jsonable

    if not trainer.accelerator.is_main_process:
        return None
    path = os.path.join(output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
    with open(os.path.join(output_dir, "log_history.json"), "w") as f:
        json.dump(to_jsonable(trainer.state.log_history), f, indent=1, allow_nan=False)
    return path
