"""Everything that turns a rollout into rewards: reward models, Python reward functions, HTTP
services and process reward models, with what they report beside their rewards.

``scoring``  rewards built from ``reward_model`` + ``reward_funcs`` and evaluated per rollout
             (weights, ``None`` = "does not apply", per-token and per-turn rewards, the PRM step
             reading)
``building`` every reward of a run built in one call, readied to score once the devices exist
``batch``    a sampled batch's rewards, every reward read once (the trainer's scoring phase)
``text``     a reward model with its own tokenizer: decode, render with its template, re-tokenize
``remote``   ``remote_reward(url)``: a reward served over HTTP (OpenRLHF's protocol)
``process``  ``ProcessRewardModel``: a PRM's step scores on the step separators
``logs``     ``RewardLogs``: GRPO's ``log_metric`` / ``log_extra`` for reward functions

The user-facing names are exported from ``trl_ppo_ext`` itself.

Example:

>>> from trl_ppo_ext.rewards import build_rewards
>>> def brevity(completions, **kwargs):
...     return [1.0 / (1 + len(c.split())) for c in completions]
>>> [r.name for r in build_rewards(None, [brevity], None)]
['brevity']
"""

from .process import ProcessRewardModel
from .remote import RemoteRewardError, remote_reward
from .scoring import TurnRewards, build_rewards

__all__ = ["ProcessRewardModel", "RemoteRewardError", "TurnRewards", "build_rewards", "remote_reward"]
