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
