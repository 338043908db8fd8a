"""The tasks, one module each (``TASKS``: name -> ``TaskSpec``; ``task_module(name)``: its module).

* ``synthetic``: ``examples/ppo_lora.py``'s demo, a trained reward model, the true reward measured;
* ``verifiable``: ``examples/ppo_verifiable.py``, ``max a b`` after an SFT warm-up, its accuracy;
* ``long``: the synthetic words with 32-token responses and one reward at the end;
* ``multiturn``: ``examples/ppo_multiturn.py``'s episodes with turns from a ``rollout_func``;
* ``tools_env``: ``examples/ppo_tools.py``'s calculator as an ``environment_factory``;
* ``gem_guess``: GEM's GuessTheNumber (the ``envs`` extra), a reward per step, through ``examples/env_gem.py``.

Each module's docstring says what its runs share and what its ``reward`` is.
"""

from __future__ import annotations

from types import ModuleType

from ..common import _examples_on_path
from . import gem_guess, long, multiturn, synthetic, tools_env, verifiable
from .base import GRPOInputs, OursRun, TaskSpec

__all__ = ["TASKS", "GRPOInputs", "OursRun", "TaskSpec", "task_module", "task_settings", "task_sizes"]

_MODULES = {"synthetic": synthetic, "verifiable": verifiable, "long": long, "multiturn": multiturn,
            "tools_env": tools_env, "gem_guess": gem_guess}
TASKS = {name: module.SPEC for name, module in _MODULES.items()}


def task_module(task_name: str) -> ModuleType:
    """The module of ``task_name`` (``tasks/<name>.py``)."""
    if task_name not in _MODULES:
        raise ValueError(f"task {task_name!r}: pick one of {sorted(TASKS)}.")
    return _MODULES[task_name]


def task_settings(task_name: str, fields: set[str] | None = None) -> dict:
    """The PPO settings of ``task_name``'s example (its module's ``settings()``), keeping only the keys
    in ``fields`` when given (the installed config's fields). Run settings (output_dir, logging, ...)
    are the benchmark's, set on top."""
    module = task_module(task_name)
    _examples_on_path()
    return {k: v for k, v in module.settings().items() if fields is None or k in fields}


def task_sizes(task_name: str) -> tuple[int, int]:
    """``(episodes, hidden_size)`` of ``task_name``: its ``TaskSpec``'s, or where that says None, its
    example's as they are now (the module's ``sizes()``), so a change of the example's defaults flows in."""
    spec = TASKS[task_name]
    episodes, hidden_size = spec.episodes, spec.hidden_size
    if None in (episodes, hidden_size):
        now = task_module(task_name).sizes()
        episodes, hidden_size = episodes or now[0], hidden_size or now[1]
    return episodes, hidden_size
