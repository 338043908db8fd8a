"""TextArena (``pip install textarena``): a single-player game as a TRL GRPO environment,
written by hand as TRL's docs write their Wordle environment.

``ta.make("GuessTheNumber-v0")``: a number from 1 to 20, ten turns (Wordle-v0 needs an NLTK
download at ``make``, which an offline machine cannot do). TextArena's episode API is its own:
``reset(num_players=1, seed=)``, ``get_observation() -> (player, text)`` with the whole history so
far, ``step(action) -> (done, info)``, and the rewards only at ``close() -> (rewards, info)``.
So the class keeps what the model has seen and returns only the new part of the history (as
TRL's Wordle example slices its feedback), and the reward is the game's at ``close()``: 1 for a
win, else how close the last valid guess came (``1 - distance / 19``); a game the episode left
unfinished (the turn cap, or the length budget) scores 0.0.

``reset(**row)`` passes the row's ``seed``: the samples of a prompt play the same number.
TextArena's ``reset(seed=)`` reseeds Python's global ``random``.

Used by ``examples/ppo_environments.py --env textarena`` and tests/end_to_end/test_example_environments.py.
"""

from __future__ import annotations

import textarena as ta
from datasets import Dataset

GAME, LOW, HIGH = "GuessTheNumber-v0", 1, 20


class TextArenaGuessTheNumber:
    """TextArena's GuessTheNumber-v0, one instance per episode (``environment_factory=``).

    Attributes, after ``reset``:
        seed: the row's seed; done: whether the game has ended; reward: its reward at ``close()``
        (0.0 until then).
    """

    def __init__(self):
        self.env = ta.make(GAME)

    def reset(self, seed=None, **row) -> str:
        self.seed = seed
        self.env.reset(num_players=1, seed=seed)
        self.done, self.reward = False, 0.0
        _, self._seen = self.env.get_observation()
        return self._seen

    def guess(self, number: int) -> str:
        """Guess the hidden number. The reply says whether it is higher or lower.

        Args:
            number: Your guess, a whole number from 1 to 20.
        """
        if self.done:
            raise ValueError("The game is over: make no more guesses.")
        self.done, _ = self.env.step(f"[{number}]")
        if self.done:
            rewards, info = self.env.close()
            self.reward = float(rewards[0])
            return info[0]["reason"]
        _, history = self.env.get_observation()
        new, self._seen = history[len(self._seen):], history
        return new.strip()

    def get_reward(self) -> float:
        return self.reward


ENVIRONMENT = TextArenaGuessTheNumber
REWARD_FUNCS: list = []  # get_reward is the reward (rewards/TextArenaGuessTheNumber/mean)


def rows(n: int, seed: int = 0) -> Dataset:
    """``n`` prompts, each with its game's seed (``seed``, ``seed + 1``, ...)."""
    prompt = [{"role": "user", "content": "Find the hidden number with the guess tool."}]
    return Dataset.from_list([{"prompt": prompt, "seed": seed + i} for i in range(n)])
