"""``environment_factory`` as TRL 1.16 GRPO reads it: probed once, pooled, reset per rollout.

An environment is an object with ``reset(**row) -> str | None``, whose public methods are the
model's tools, and optionally ``get_reward() -> float`` (sync or async). ``environment_factory``
is a callable returning one, or a dict ``{name: factory}`` that each dataset row picks by its
``environment`` column. The rules (TRL 1.16's ``grpo_trainer.py`` G:671-730, G:2343-2398):

- At construction one probe instance per factory checks that its class defines ``reset``; its
  tools are the functions on the *class* (``inspect.getmembers(type(env), inspect.isfunction)``:
  properties are never evaluated) except ``reset``, ``get_reward`` and ``_private`` names. The
  probe seeds the pool. Here a failing factory, and (given a ``sample_row``) a failing
  ``reset``, are construction errors too, naming the class.
- Per batch every rollout takes its own instance (`Environments.draw`); the pool of each name
  grows only when a batch needs more instances than it holds ("construct once, reset often").
  Batches that are alive at the same time (sampled ahead while an earlier one is scored, with
  ``max_staleness > 0``) draw from pools of different ``slot``s, so that no instance is reset for
  one batch while the rewards of another still read it; slot 0 is the synchronous loop's.
- ``reset(**row)`` gets every dataset column; in dict mode without the ``environment`` column.
  A returned string is appended to the last user message of the rollout's prompt.
- Each environment class that defines ``get_reward`` gives one reward function
  (`Environments.reward_functions`) named after the class, for weight 1 and the metric
  ``rewards/<EnvClass>/mean``; it scores the rollouts of exactly that class (``type(env) is``)
  and returns None for the others. Reward functions receive the instances as
  ``environments=``, one per completion, in order.
- ``get_reward`` returns a number (TRL GRPO's one reward per episode, on its last model token)
  or, ours, one reward per model turn: a list (or ``TurnRewards``), whose ``i``-th value lands on
  the last token of the episode's ``i``-th model turn (``rewards.scoring.TurnRewards``; an
  environment cannot name tokens, so a list here always means turns). TRL GRPO would refuse a
  list; a ``TurnRewards`` it reads as the sum.
- A rollout with a tool call that ran out of ``tool_timeout`` is unscorable for these rewards:
  the abandoned thread may still change its environment after the model was told the call
  timed out, so ``get_reward`` is not called and the reward is None there (the rollout's
  ``tool_timed_out`` column, True for it, says which).

Example:

>>> class Counter:
...     def reset(self, start=0, **row):
...         self.value = start
...         return f"Start at {start}."
...     def increment(self, step: int) -> str:
...         '''Add to the counter.
...
...         Args:
...             step: how much to add.
...         '''
...         self.value += step
...         return str(self.value)
...     def get_reward(self):
...         return float(self.value == 3)
>>> envs = Environments(Counter)
>>> [tool.__name__ for tool in envs.tools_of[None]]
['increment']
>>> batch = envs.start_batch([{"prompt": [{"role": "user", "content": "Count to 3."}], "start": 1}])
>>> batch.prompts[0][-1]["content"]
'Count to 3.Start at 1.'
>>> batch.environments[0].increment(2), envs.reward_functions()[0](environments=batch.environments)
('3', [1.0])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards.scoring import TurnRewards
from .tools import is_async_tool

__all__ = ["EnvironmentBatch", "Environments", "environment_methods", "per_turn"]

_HOOKS = ("reset", "get_reward")
ENVIRONMENT_COLUMN = "environment"  # the dataset column a dict factory routes on


def environment_methods(environment) -> list[Callable]:
    """The bound public methods of ``environment`` that are tools: the functions defined on its
    class, less ``reset``, ``get_reward`` and names starting with ``_``."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in _HOOKS and not name.startswith("_")]


def _class_functions(environment) -> set[str]:
    # on the class: getmembers on the instance would evaluate its properties
    return {name for name, _ in inspect.getmembers(type(environment), inspect.isfunction)}


def _class_name(factory) -> str:
    return getattr(factory, "__name__", None) or type(factory).__name__


@dataclass
class EnvironmentBatch:
    """One rollout batch's environments, aligned with its rows."""

    environments: list  # (B,) the instance each rollout runs in, reset with its row
    names: list  # (B,) the factory name each row chose (None with a single factory)
    prompts: list[list[dict]]  # (B,) the prompts after reset: observations appended to the last user message


class Environments:
    """The environments of a run: factories, their tools, the pool, and the env-owned rewards.

    Args:
        environment_factory: a callable returning an environment, or a dict ``{name: factory}``
            routed by each row's ``environment`` column.
        sample_row: a dataset row (dict of columns) to call each probe's ``reset`` with, so that
            a ``reset`` that fails on the data fails at construction; None skips that call.

    Raises:
        ValueError: a factory that is not callable or raises, an instance whose class has no
            ``reset``, or a ``reset`` that raises on ``sample_row``; each names the class.
    """

    def __init__(self, environment_factory: Callable | Mapping[str, Callable], sample_row: Mapping | None = None):
        self.multi_environment = isinstance(environment_factory, Mapping)
        factories = dict(environment_factory) if self.multi_environment else {None: environment_factory}
        if not factories:
            raise ValueError("environment_factory is an empty dict: give at least one {name: factory}")
        self.factories: dict[Any, Callable] = factories
        self.tools_of: dict[Any, list[Callable]] = {}  # name -> the probe's tool methods (for the schema)
        self.pools: dict[int, dict[Any, list]] = {0: {}}  # slot -> name -> instances (slot 0 holds the probes)
        self._reward_classes: list[type] = []  # classes with get_reward, each once, in factory order
        for name, factory in factories.items():
            probe = self._probe(name, factory, sample_row)
            self.tools_of[name] = environment_methods(probe)
            self.pools[0][name] = [probe]
            if "get_reward" in _class_functions(probe) and type(probe) not in self._reward_classes:
                self._reward_classes.append(type(probe))

    def _probe(self, name, factory: Callable, sample_row: Mapping | None):
        where = f"environment_factory[{name!r}]" if self.multi_environment else "environment_factory"
        if not callable(factory):
            raise ValueError(f"{where} must be a callable that returns an environment, got {type(factory).__name__}")
        try:
            instance = factory()
        except Exception as error:
            raise ValueError(f"{where} ({_class_name(factory)}) raised when called: {error!r}") from error
        cls = type(instance).__name__
        if "reset" not in _class_functions(instance):
            raise ValueError(
                f"Environment {cls} (from {where}) has no `reset` method: every environment must define "
                "reset(self, **row) -> str | None, called with the dataset row at the start of each rollout."
            )
        if sample_row is not None:
            try:
                instance.reset(**self._reset_kwargs(sample_row))
            except Exception as error:
                raise ValueError(
                    f"Environment {cls}.reset(**row) raised on the first dataset row (columns {sorted(sample_row)}): "
                    f"{error!r}. reset receives every dataset column as a keyword; accept the ones it does not use "
                    "with **kwargs."
                ) from error
        return instance

    # ------------------------------------------------------------ per batch
    def _reset_kwargs(self, row: Mapping) -> dict:
        return {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.multi_environment else dict(row)

    def route(self, rows: Sequence[Mapping]) -> list:
        """The factory name of each row: its ``environment`` column in dict mode, else None.

        Raises:
            ValueError: a row whose ``environment`` is not a key of the factory dict.
        """
        if not self.multi_environment:
            return [None] * len(rows)
        names = [row.get(ENVIRONMENT_COLUMN) for row in rows]
        unknown = sorted({repr(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(
                f"Dataset rows have environment={', '.join(unknown)}, not among the environments of "
                f"environment_factory: {list(self.factories)}. Give each row an `environment` column naming one."
            )
        return names

    @property
    def pool(self) -> dict[Any, list]:
        """Slot 0's pool, ``name -> instances`` (the probes and the synchronous loop's)."""
        return self.pools[0]

    def draw(self, names: Sequence, slot: int = 0) -> list:
        """One instance per rollout from the pool of its name in ``slot``, creating instances only
        when a batch needs more than that pool holds. Two batches drawn from different slots never
        share an instance (each slot's pool is its own; one thread draws from a slot at a time)."""
        # every name's list made at once: `retire`, on another thread, may iterate this dict meanwhile
        pools = self.pools.setdefault(slot, {name: [] for name in self.factories})
        handed_out: dict[Any, int] = {}
        instances = []
        for name in names:
            pool, index = pools[name], handed_out.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed_out[name] = index + 1
            instances.append(pool[index])
        return instances

    def retire(self, environment) -> None:
        """Take ``environment`` out of its pool (a tool of it timed out and may still be running);
        a fresh instance replaces it when a batch needs one."""
        for pools in list(self.pools.values()):
            for pool in pools.values():
                for i, instance in enumerate(pool):
                    if instance is environment:
                        del pool[i]
                        return

    def start_batch(self, rows: Sequence[Mapping], prompts: Sequence | None = None, slot: int = 0) -> EnvironmentBatch:
        """Route, draw (from ``slot``'s pool) and reset: ``reset(**row)`` on each rollout's instance.

        Args:
            rows: (B,) the batch's dataset rows, every column (``prompt`` included).
            prompts: (B,) message lists; default each row's ``prompt``, or one empty user message
                where a row has none (the environment supplies the task).

        Returns:
            `EnvironmentBatch` whose prompts are new lists: a string ``reset`` returns is appended
            to the last message's content (a list of content blocks gets a text block). The inputs
            are not modified.

        Raises:
            RuntimeError: a ``reset`` that raises, naming the class and the row.
        """
        names = self.route(rows)
        environments = self.draw(names, slot)
        if prompts is None:
            prompts = [row.get("prompt") or [{"role": "user", "content": ""}] for row in rows]
        new_prompts = []
        for b, (environment, row, prompt) in enumerate(zip(environments, rows, prompts)):
            try:
                observation = environment.reset(**self._reset_kwargs(row))
            except Exception as error:
                raise RuntimeError(
                    f"Environment {type(environment).__name__}.reset(**row) raised on row {b} of the batch: {error!r}"
                ) from error
            new_prompts.append(_with_observation(list(prompt), observation))
        return EnvironmentBatch(environments, names, new_prompts)

    # ------------------------------------------------------------ rewards
    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class that defines ``get_reward``.

        Each is called as ``fn(environments=..., **kwargs)`` and returns, per rollout, its
        instance's ``get_reward()`` when the instance is exactly of that class, else None. Its
        ``__name__`` is the class name (the metric ``rewards/<EnvClass>/mean``); it is a
        coroutine function when ``get_reward`` is.
        """
        return [_reward_function(cls) for cls in self._reward_classes]


TIMED_OUT_COLUMN = "tool_timed_out"  # the rollout column: (B,) bool, a tool call of the row ran out of tool_timeout


def _judged(environments, tool_timed_out) -> list[bool]:
    # a row whose tool call timed out is not judged: the abandoned thread may still change its environment
    return [not timed_out for timed_out in (tool_timed_out or [False] * len(environments))]


def per_turn(value):
    """``get_reward``'s value as the trainer reads it: a list or tuple is one reward per model
    turn (`TurnRewards`); anything else (a number, None, a ``TurnRewards``) as it is.

    >>> per_turn([0.0, 1.0]), per_turn(1.0)
    (TurnRewards([0.0, 1.0]), 1.0)
    """
    return TurnRewards(value) if isinstance(value, (list, tuple)) else value


def _reward_function(cls: type) -> Callable:
    if is_async_tool(cls.get_reward):
        async def reward(environments, tool_timed_out=None, **kwargs):
            return [per_turn(await env.get_reward()) if type(env) is cls and judged else None
                    for env, judged in zip(environments, _judged(environments, tool_timed_out))]
    else:
        def reward(environments, tool_timed_out=None, **kwargs):
            return [per_turn(env.get_reward()) if type(env) is cls and judged else None
                    for env, judged in zip(environments, _judged(environments, tool_timed_out))]
    reward.__name__ = reward.__qualname__ = cls.__name__
    reward.__doc__ = (f"{cls.__name__}.get_reward() of each rollout's environment (None for other classes, and for "
                      f"a rollout whose tool call timed out: `{TIMED_OUT_COLUMN}`).")
    return reward


def _with_observation(prompt: list, observation) -> list:
    if observation is None:
        return prompt
    last = dict(prompt[-1])
    content = last.get("content")
    if isinstance(content, list):
        blocks = observation if isinstance(observation, list) else [{"type": "text", "text": str(observation)}]
        last["content"] = [*content, *blocks]
    elif isinstance(observation, list):
        last["content"] = [{"type": "text", "text": content or ""}, *observation]
    else:
        last["content"] = (content or "") + str(observation)
    return [*prompt[:-1], last]
