"""What every module of the benchmark shares: where the checkout is, the examples on the path,
quiet libraries, and what a row keeps of the trainer's logs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(__file__).resolve().parent  # run as a directory: python benchmarks/sample_efficiency ...

# What a row keeps of each update's log_history entry: row key -> the logged metric.
LOGGED = {
    "score": "objective/scores",
    "kl": "objective/kl",
    "entropy": "policy/entropy_avg",
    "explained_variance": "val/explained_variance",
}


def _examples_on_path() -> None:
    for path in (str(ROOT), str(ROOT / "examples")):
        if path not in sys.path:
            sys.path.insert(0, path)


def _quiet() -> None:
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Setting `save_embedding_layers`", category=UserWarning)
