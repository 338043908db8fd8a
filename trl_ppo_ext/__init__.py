"""trl-ppo-ext: a drop-in PPOTrainer for TRL with correct token-level PPO math.

    from trl_ppo_ext import PPOConfig, PPOTrainer   # instead of trl.experimental.ppo

The names a user needs are importable from here (loaded on first use, so that
``import trl_ppo_ext.functional`` stays light):

>>> import trl_ppo_ext
>>> sorted(trl_ppo_ext.__all__)[:4]
['PPOConfig', 'PPOTrainer', 'PolicyAndValue', 'ProcessRewardModel']
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
    "SharedActorCritic": ".models.actor_critic",
    "PolicyAndValue": ".models.policy_value",
    "default_lora_config": ".models.actor_critic",
    "load_actor_critic": ".models.loading",
    "load_reward_model": ".models.loading",
    "ProcessRewardModel": ".rewards.process",
    "remote_reward": ".rewards.remote",
    "RemoteRewardError": ".rewards.remote",
    "TurnRewards": ".rewards.scoring",
    "render_prompts": ".data",
    "functional": None,
}

__all__ = [*_LAZY, "TRL_MIN", "TRL_MAX", "__version__"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'trl_ppo_ext' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(module, __name__), name)
