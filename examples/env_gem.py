"""GEM (``pip install gem-llm``): a gym-style game as a TRL GRPO environment, through
``trl_ppo_ext.agents.gym_environment``.

``gem.make("game:GuessTheNumber-v0-easy")``: a number between 1 and 10, four turns. Each turn the
model calls ``guess(number)``; the tool writes GEM's action (``\\boxed{n}``), steps the game and
returns its reply ("... the target number is higher than 5."). GEM pays a reward per step: 1.0 for
the right number, 0.0 for a hint, -0.1 for a move without a number. The class's ``get_reward()``
gives them per turn: each step's reward on the last token of the turn that called it; its sum,
the episode's return, is what ``rewards/GemGuessTheNumber/mean`` logs (here 1.0 for a win, else 0.0).

``reset(**row)`` seeds ``env.reset(seed=row["seed"])``, so the ``num_generations`` samples of a row
play the same number. GEM's ``reset(seed=)`` reseeds Python's and NumPy's global generators
(``gem.utils.seeding.set_seed``); torch's, which the trainer samples with, is untouched.

Used by ``examples/ppo_environments.py --env gem`` and tests/end_to_end/test_example_environments.py.
"""

from __future__ import annotations

import gem
from datasets import Dataset

from trl_ppo_ext.agents import gym_environment

GAME, LOW, HIGH = "game:GuessTheNumber-v0-easy", 1, 10

GemGuessTheNumber = gym_environment(
    lambda: gem.make(GAME),
    tool="guess",
    description="Guess the hidden number. The reply says whether it is higher or lower.",
    argument="number",
    argument_description=f"Your guess, a whole number from {LOW} to {HIGH}.",
    argument_type=int,
    to_action=lambda number: f"\\boxed{{{number}}}",  # GEM reads the last \boxed{n} of the action text
    name="GemGuessTheNumber",
)

ENVIRONMENT = GemGuessTheNumber
REWARD_FUNCS: list = []  # the environment's get_reward is the reward (rewards/GemGuessTheNumber/mean)


def rows(n: int, seed: int = 0) -> Dataset:
    """``n`` prompts, each with its game's seed (``seed``, ``seed + 1``, ...)."""
    prompt = [{"role": "user", "content": "Find the hidden number with the guess tool."}]
    return Dataset.from_list([{"prompt": prompt, "seed": seed + i} for i in range(n)])
