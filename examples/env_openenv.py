"""OpenEnv (``pip install openenv-core``): a server-side ``Environment``, run in-process, as a
TRL GRPO environment through ``trl_ppo_ext.agents.openenv_environment``.

TRL's docs wrap an OpenEnv *client* (``EchoEnv(base_url=...)``) in an ``environment_factory``
class whose methods are tools. The server-side class under every client has the same episode API
(``reset(seed=) -> Observation``, ``step(Action) -> Observation`` with ``done`` and ``reward``), and
needs no server: here ``GuessTheNumber`` is written as an OpenEnv environment author writes one
(typed ``Action`` / ``Observation`` models, a ``state``), and the adapter makes the class with one
tool, ``guess(number)``. With a deployed environment, ``make`` returns its client instead, whose
``step`` returns a ``StepResult``: write that class by hand, as ``env_textarena.py`` does.

Rewards per step: -0.1 for each wrong guess, 1.0 for the right one; ``get_reward()`` gives them
per turn (each on the last token of the turn whose guess it paid), and their sum is the episode's
return: 1.0 - 0.1 * (wrong guesses) for a win, -0.1 * (wrong guesses) otherwise.
The target is drawn from ``random.Random(seed)``: the row's ``seed`` column makes the samples of
a prompt play the same number.

Used by ``examples/ppo_environments.py --env openenv`` and tests/end_to_end/test_example_environments.py.
"""

from __future__ import annotations

import random
import uuid

from datasets import Dataset
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from trl_ppo_ext.agents import openenv_environment

LOW, HIGH = 1, 10
WRONG, RIGHT = -0.1, 1.0


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    hint: str


class GuessTheNumber(Environment):
    """Guess a number from LOW to HIGH; each reply says higher, lower or right."""

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(hint=f"Guess my number from {LOW} to {HIGH}.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(hint="right", done=True, reward=RIGHT)
        return GuessObservation(hint="higher" if action.guess < self.target else "lower", reward=WRONG)

    @property
    def state(self) -> State:
        return self._state


OpenEnvGuessTheNumber = openenv_environment(
    GuessTheNumber,
    tool="guess",
    description="Guess the hidden number. The reply's hint says higher, lower or right.",
    argument="number",
    argument_description=f"Your guess, a whole number from {LOW} to {HIGH}.",
    argument_type=int,
    to_action=lambda number: GuessAction(guess=number),
    name="OpenEnvGuessTheNumber",
)

ENVIRONMENT = OpenEnvGuessTheNumber
REWARD_FUNCS: list = []  # get_reward is the reward (rewards/OpenEnvGuessTheNumber/mean)


def rows(n: int, seed: int = 0) -> Dataset:
    """``n`` prompts, each with its game's seed (``seed``, ``seed + 1``, ...)."""
    prompt = [{"role": "user", "content": "Find the hidden number with the guess tool."}]
    return Dataset.from_list([{"prompt": prompt, "seed": seed + i} for i in range(n)])
