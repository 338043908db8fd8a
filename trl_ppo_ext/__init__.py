"""trl-ppo-ext: a drop-in PPOTrainer for TRL with correct token-level PPO math.

    from trl_ppo_ext import PPOConfig, PPOTrainer   # instead of trl.experimental.ppo
"""

import importlib

from ._compat import TRL_MAX, TRL_MIN, check_trl_version
from ._version import __version__

# Cheap (reads package metadata): an unsupported TRL fails here, with the supported range.
check_trl_version()

# Public names, imported on first use so that `import trl_ppo_ext.functional` stays light.
_LAZY = {
    "PPOConfig": ".config",
    "PPOTrainer": ".trainer",
    "functional": None,
}

__all__ = ["PPOConfig", "PPOTrainer", "functional", "TRL_MIN", "TRL_MAX", "__version__"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'trl_ppo_ext' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(module, __name__), name)
