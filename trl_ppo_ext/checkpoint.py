"""Old import path of the checkpoint helpers (atomic folders, rotation, RNG streams).

Everything that saves and loads a run is in ``trl_ppo_ext.checkpointing`` now; this module
re-exports its public names so that ``from trl_ppo_ext.checkpoint import isolated_rng`` (and
the like) keeps working.

Example:

>>> from trl_ppo_ext import checkpoint, checkpointing
>>> checkpoint.isolated_rng is checkpointing.isolated_rng
True
"""

from .checkpointing import *  # noqa: F401, F403
