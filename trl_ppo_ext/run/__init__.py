"""Keeping a run: what is saved and how it resumes, the run's counters, its manifest, the guards
that stop it, and preemption. None of it is PPO math; all of it is what makes a run trustworthy.

``checkpointing``  atomic checkpoints, exact resume, RNG streams, ``save_model``
``state``          ``RunCounters``: data cursor, skipped steps, policy lag, warm-up
``manifest``       ``run_manifest.json``: what the run was made of and how it ended
``guards``         ``GuardRails``: the halting rules checked every update
``preemption``     SIGTERM -> finish the step, checkpoint, exit

Example:

>>> from trl_ppo_ext.run import RunCounters
>>> RunCounters().nonfinite_steps
0
"""

from .guards import GuardDecision, GuardRails, GuardSettings
from .state import RunCounters

__all__ = ["GuardDecision", "GuardRails", "GuardSettings", "RunCounters"]
