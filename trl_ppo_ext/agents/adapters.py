"""Environments users already have, as ``environment_factory`` classes with one action tool.

Two episode APIs are common among environment packages, and both run in-process:

- gym-style (GEM ``gem.make(id)``, gymnasium text environments): ``reset(seed=) -> (observation,
  info)`` and ``step(action) -> (observation, reward, terminated, truncated, info)``;
- OpenEnv's server-side ``Environment`` (``openenv.core.env_server.interfaces``): ``reset(seed=)
  -> Observation`` and ``step(Action) -> Observation`` whose ``done`` and ``reward`` fields end
  and score the step. No server: the instance is the environment.

`gym_environment` and `openenv_environment` turn a factory of either into a class that TRL GRPO's
``environment_factory=`` takes (and so this package's ``PPOTrainer``). Its instances:

- build the environment once (``make()``) and reset it per episode: ``reset(**row)`` passes the
  row's ``seed`` column (``seed_column``) to the environment's ``reset``, so the
  ``num_generations`` samples of one prompt start from the same state and a group stays a group.
  A row without it lets the environment draw its own start (each sample then starts elsewhere:
  no group baseline is meaningful). The first observation's text is appended to the prompt;
- expose one tool, named and documented by the caller (TRL's docs: a model learns a
  ``guess(number)`` better than a generic ``step(action)``), whose one argument goes through
  ``to_action`` to ``step``; the tool's reply is the observation's text;
- keep each step's reward in ``rewards`` and the model turn that called the step in
  ``step_turns``; ``get_reward()`` returns them as per-turn rewards (a ``TurnRewards``: the
  rewards of the steps each turn called, summed per turn), the reward of weight 1 named after the
  class (``rewards/<name>/mean``, the episode's undiscounted return). Each lands on the last
  token of the turn that called the step, and GAE carries it back from there; whatever reads a
  number (TRL GRPO, the critic-free estimators) reads the sum. The trainer's tool loop says which
  turn runs (``turn``); without it (TRL GRPO) each step counts as its own turn;
- refuse a step after the episode ended (``terminated`` or ``truncated``; ``done``) with an
  error, which the tool loop returns to the model as the tool's result, as TRL's Wordle example
  does.

Example (a two-step gym-style environment, written here):

>>> class Countdown:
...     def reset(self, seed=None):
...         self.left = 2 if seed is None else seed
...         return f"{self.left} to go.", {}
...     def step(self, action):
...         self.left -= 1
...         return f"{self.left} to go.", 0.5, self.left == 0, False, {}
>>> Env = gym_environment(Countdown, tool="tick", description="Count down by one.",
...                       argument="note", argument_description="Anything.")
>>> env = Env()
>>> env.reset(prompt=[{"role": "user", "content": "Count down."}], seed=2)
'\\n\\n2 to go.'
>>> env.tick("a"), env.tick("b"), env.rewards, env.get_reward(), env.done
('1 to go.', '0 to go.', [0.5, 0.5], TurnRewards([0.5, 0.5]), True)
>>> float(env.get_reward())
1.0
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from ..rewards.scoring import TurnRewards

__all__ = ["StepEnvironment", "gym_environment", "observation_fields", "openenv_environment"]


class StepEnvironment:
    """What the generated classes share: the episode's bookkeeping around ``_reset_env`` and
    ``_step_env``, which the two APIs define. Only ``reset`` and ``get_reward`` are public, so the
    trainer finds exactly one tool, the generated one (public functions of the class are tools).

    Attributes, after ``reset``:
        environment: the wrapped environment, built once per instance.
        seed: the seed the episode started from (None: the environment's own draw).
        rewards: each step's reward, in order (a step without one: 0.0).
        step_turns: the model turn (0 = the first) whose tool call ran each step, in order.
        turn: the model turn whose tool calls run now, set by the trainer's tool loop
            (`AgentRollout`) before each turn is generated; None: unknown, and each step counts
            as its own turn (step ``i`` on turn ``i``).
        done: whether the episode has ended; a step after it raises.
        observations: the text of each observation, the first one (``reset``) included.
    """

    seed_column = "seed"
    _to_action: Callable = staticmethod(lambda value: value)
    _render: Callable = staticmethod(str)

    def __init__(self):
        self.environment = self._make()

    def reset(self, **row) -> str:
        """Start an episode from the row's seed; returns the first observation's text, after a
        blank line when the row's prompt has text (the prompt and the observation stay apart)."""
        seed = row.get(self.seed_column)
        self.seed = None if seed is None else int(seed)
        self.rewards: list[float] = []
        self.step_turns: list[int] = []
        self.turn: int | None = None
        self.done = False
        text = self._render(self._reset_env(self.seed))
        self.observations = [text]
        prompt = row.get("prompt")
        has_text = isinstance(prompt, list) and bool(prompt) and bool(prompt[-1].get("content"))
        return f"\n\n{text}" if has_text else text

    def get_reward(self) -> TurnRewards:
        """The step rewards per model turn: entry ``t`` sums the rewards of the steps turn ``t``
        called (0.0 for a turn that called none), up to the last turn with a step; its value as a
        float is the episode's return (0.0 before any step).

        Equivalent loop::

            for reward, t in zip(rewards, step_turns): per_turn[t] += reward
        """
        per_turn = [0.0] * (max(self.step_turns, default=-1) + 1)
        for reward, turn in zip(self.rewards, self.step_turns):
            per_turn[turn] += reward
        return TurnRewards(per_turn)

    def _act(self, value) -> str:
        if self.done:
            raise ValueError(f"The episode is over (after {len(self.rewards)} steps): make no more calls.")
        observation, reward, self.done = self._step_env(self._to_action(value))
        self.rewards.append(0.0 if reward is None else float(reward))
        # the turn that called this step; unknown (outside this package's tool loop): one turn per step
        self.step_turns.append(len(self.step_turns) if self.turn is None else self.turn)
        text = self._render(observation)
        self.observations.append(text)
        return text


class _Gym(StepEnvironment):
    def _reset_env(self, seed):
        observation, _info = self.environment.reset() if seed is None else self.environment.reset(seed=seed)
        return observation

    def _step_env(self, action):
        observation, reward, terminated, truncated, _info = self.environment.step(action)
        return observation, reward, bool(terminated or truncated)


class _OpenEnv(StepEnvironment):
    def _reset_env(self, seed):
        return self.environment.reset(seed=seed)

    def _step_env(self, action):
        observation = self.environment.step(action)
        return observation, observation.reward, bool(observation.done)


def observation_fields(observation) -> str:
    """An OpenEnv observation as JSON text: its own fields, without ``done``, ``reward`` and
    ``metadata`` (which the trainer reads, not the model).

    >>> class Seen:  # stands for a pydantic Observation
    ...     def model_dump(self, exclude):
    ...         return {k: v for k, v in {"hint": "higher", "done": False}.items() if k not in exclude}
    >>> observation_fields(Seen())
    '{"hint": "higher"}'
    """
    return json.dumps(observation.model_dump(exclude={"done", "reward", "metadata"}), default=str)


def _tool_method(tool: str, description: str, argument: str, argument_description: str, argument_type: type):
    """A function named ``tool`` with one parameter ``argument: argument_type`` and a Google-style
    docstring, as transformers' ``get_json_schema`` reads a tool's schema from."""
    if not tool.isidentifier() or tool.startswith("_") or tool in ("reset", "get_reward"):
        raise ValueError(f"tool={tool!r}: pass a public Python name other than reset and get_reward; the "
                         "trainer offers the public methods of an environment class as its tools.")
    if not argument.isidentifier() or argument == "self":
        raise ValueError(f"argument={argument!r}: pass a Python name for the tool's one argument")
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=argument_type)],
        return_annotation=str)

    def method(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)  # a call with other argument names raises: an error result
        return bound.arguments["self"]._act(bound.arguments[argument])

    method.__signature__ = signature
    method.__annotations__ = {argument: argument_type, "return": str}
    method.__name__ = method.__qualname__ = tool
    method.__doc__ = f"{description}\n\nArgs:\n    {argument}: {argument_description}\n"
    return method


def _environment_class(base: type, make: Callable, *, tool: str, description: str, argument: str,
                       argument_description: str, argument_type: type, to_action: Callable | None,
                       render: Callable, seed_column: str, name: str | None) -> type:
    if not callable(make):
        raise TypeError(f"make must be a callable returning an environment, got {type(make).__name__}")
    name = name or "".join(part[:1].upper() + part[1:] for part in tool.split("_")) + "Environment"
    namespace = {
        "_make": staticmethod(make),
        "_render": staticmethod(render),
        "seed_column": seed_column,
        tool: _tool_method(tool, description, argument, argument_description, argument_type),
        "__doc__": f"{description} (an environment_factory class: one tool, {tool}({argument}); "
                   f"get_reward() is the step rewards per model turn, summing to the episode's return).",
    }
    if to_action is not None:
        namespace["_to_action"] = staticmethod(to_action)
    return type(name, (base,), namespace)


def gym_environment(make: Callable[[], Any], *, tool: str, description: str, argument: str = "action",
                    argument_description: str = "The action, as text.", argument_type: type = str,
                    to_action: Callable | None = None, render: Callable[[Any], str] = str,
                    seed_column: str = "seed", name: str | None = None) -> type:
    """An ``environment_factory`` class around a gym-style environment.

    Args:
        make: builds the environment, called once per instance (e.g. ``lambda:
            gem.make("game:GuessTheNumber-v0-easy")``); its ``reset(seed=)`` returns
            ``(observation, info)``, its ``step(action)`` ``(observation, reward, terminated,
            truncated, info)``.
        tool: the tool's name, shown to the model (``"guess"``).
        description: the tool's description, shown to the model.
        argument: the name of the tool's one argument.
        argument_description: its description, shown to the model.
        argument_type: its JSON type as a Python type (``str``, ``int``, ``float``).
        to_action: the argument to the environment's action (default: unchanged), e.g.
            ``lambda n: f"\\\\boxed{{{n}}}"`` for GEM's games.
        render: an observation to the text the model reads (default ``str``).
        seed_column: the dataset column whose value seeds ``reset`` (None or absent in a row:
            the environment draws its own start).
        name: the class name, which names the reward (``rewards/<name>/mean``); default from
            ``tool`` (``"guess"`` -> ``GuessEnvironment``).

    Returns:
        A class for ``environment_factory=``: ``reset(**row)``, the tool, ``get_reward()`` (the
        step rewards per model turn, a ``TurnRewards`` whose float value is their sum) and the
        attributes of `StepEnvironment`.

    Raises:
        ValueError: ``tool`` not a public name (or ``reset`` / ``get_reward``), ``argument`` not a name.
        TypeError: ``make`` not callable.
    """
    return _environment_class(_Gym, make, tool=tool, description=description, argument=argument,
                              argument_description=argument_description, argument_type=argument_type,
                              to_action=to_action, render=render, seed_column=seed_column, name=name)


def openenv_environment(make: Callable[[], Any], *, tool: str, description: str, to_action: Callable,
                        argument: str = "action", argument_description: str = "The action.",
                        argument_type: type = str, render: Callable[[Any], str] = observation_fields,
                        seed_column: str = "seed", name: str | None = None) -> type:
    """An ``environment_factory`` class around an OpenEnv server-side ``Environment``, in-process.

    Args:
        make: builds the environment (an ``openenv.core.env_server.interfaces.Environment``
            subclass instance), called once per instance; its ``reset(seed=)`` and
            ``step(action)`` return observations with ``done`` and ``reward``.
        tool, description, argument, argument_description, argument_type, seed_column, name:
            as in `gym_environment`.
        to_action: the tool's argument to the environment's ``Action`` (a pydantic model), e.g.
            ``lambda n: GuessAction(guess=n)``.
        render: an observation to the text the model reads; default `observation_fields` (its
            own fields as JSON, without ``done``, ``reward`` and ``metadata``).

    Returns:
        As `gym_environment`; a step whose observation has ``reward=None`` counts 0.0.
    """
    return _environment_class(_OpenEnv, make, tool=tool, description=description, argument=argument,
                              argument_description=argument_description, argument_type=argument_type,
                              to_action=to_action, render=render, seed_column=seed_column, name=name)
