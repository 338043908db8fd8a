"""Reasoning Gym (``pip install reasoning-gym``): procedural single-turn tasks, scored by the
task's own ``score_answer``, as TRL GRPO reward functions.

No environment: a dataset of the task's questions and one reward function. Each row carries what
rebuilds its entry, ``(task, size, seed, index)``: ``reasoning_gym.create_dataset(task, size=,
seed=)`` is deterministic, so the reward function rebuilds it (once, cached) and scores the
completion with ``dataset.score_answer(answer, entry)``. No entry (with its nested metadata)
goes through the dataset's columns.

The answer is what the completion writes between ``<answer>`` and ``</answer>``
(``reasoning_gym.utils.extract_answer``); a completion without the tags scores 0.0.

Used by ``examples/ppo_environments.py --env reasoning_gym`` and tests/end_to_end/test_example_environments.py.
"""

from __future__ import annotations

import functools

import reasoning_gym
from datasets import Dataset
from reasoning_gym.utils import extract_answer

TASK = "basic_arithmetic"
ENVIRONMENT = None


@functools.cache
def task_data(task: str, size: int, seed: int):
    return reasoning_gym.create_dataset(task, size=size, seed=seed)


def rows(n: int, seed: int = 0, task: str = TASK) -> Dataset:
    """The task's first ``n`` questions (seed ``seed``), each asking for the answer in tags."""
    data = task_data(task, n, seed)
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"{entry['question']} Put the answer in <answer></answer>."}],
         "task": task, "size": n, "seed": seed, "index": i}
        for i, entry in enumerate(data)])


def reasoning_gym_score(completions, task, size, seed, index, **kwargs) -> list[float]:
    """The task's ``score_answer`` of each completion's tagged answer (one message list, or text,
    per completion)."""
    scores = []
    for completion, *key in zip(completions, task, size, seed, index):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        data = task_data(*key[:3])
        scores.append(float(data.score_answer(extract_answer(text or ""), data[key[3]])))
    return scores


REWARD_FUNCS = [reasoning_gym_score]
