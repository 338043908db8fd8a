"""agents/environments.py: environment_factory as TRL 1.16 GRPO reads it -- the probe, the tools of
a class, the pool, reset(**row), dict routing, and get_reward as a reward function."""

import asyncio
import copy
import inspect

import pytest

from trl_ppo_ext.agents.environments import Environments, environment_methods


class Counter:
    def __init__(self):
        self.resets = []

    def reset(self, start=0, **row):
        self.resets.append({"start": start, **row})
        self.value = start
        return f" Start at {start}."

    def increment(self, step: int) -> str:
        self.value += step
        return str(self.value)

    def peek(self) -> str:
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value)

    def _helper(self):
        return None

    @property
    def explodes(self):
        raise AssertionError("a property must never be evaluated")

    @staticmethod
    def static_tool(x: int) -> str:
        return str(x)


class Quiet:
    def reset(self, **row):
        self.row = row          # returns None: the prompt stays as it is

    def listen(self) -> str:
        return "silence"


class AsyncScored:
    def reset(self, **row):
        self.score = row.get("score", 0.0)

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return self.score


def counted(made: list):
    """A Counter factory that records each instance it builds in ``made``."""
    def factory():
        made.append(Counter())
        return made[-1]
    return factory


def rows(*starts):
    return [{"prompt": [{"role": "user", "content": f"Count from {s}."}], "start": s} for s in starts]


def test_tools_are_the_public_functions_of_the_class():
    envs = Environments(Counter)
    # not reset, get_reward, _helper or the property; a staticmethod is a function on the class
    assert [t.__name__ for t in envs.tools_of[None]] == ["increment", "peek", "static_tool"]
    assert [t.__name__ for t in environment_methods(Counter())] == ["increment", "peek", "static_tool"]
    probe = envs.pool[None][0]
    assert envs.tools_of[None][0].__self__ is probe     # bound to the probe, which seeds the pool


def test_an_environment_without_reset_is_refused_naming_its_class():
    class NoReset:
        def act(self) -> str:
            return ""

    with pytest.raises(ValueError, match=r"Environment NoReset \(from environment_factory\) has no `reset`"):
        Environments(NoReset)
    with pytest.raises(ValueError, match=r"environment_factory\['b'\]"):
        Environments({"a": Quiet, "b": NoReset})


def test_a_factory_that_raises_or_is_not_callable_is_refused():
    def factory():
        raise OSError("no sandbox")

    with pytest.raises(ValueError, match=r"environment_factory \(factory\) raised when called: OSError\('no sandbox"):
        Environments(factory)
    with pytest.raises(ValueError, match="must be a callable"):
        Environments({"a": Quiet()})
    with pytest.raises(ValueError, match="empty dict"):
        Environments({})


def test_a_reset_that_fails_on_the_first_row_is_refused_at_construction():
    class Strict:
        def reset(self, target):
            self.target = target

    with pytest.raises(ValueError, match=r"Environment Strict.reset\(\*\*row\) raised on the first dataset row "
                                         r"\(columns \['prompt', 'target'\]\).*unexpected keyword argument 'prompt'"):
        Environments(Strict, sample_row={"prompt": [], "target": 3})
    Environments(Strict)  # without a sample row reset is not called


def test_each_rollout_gets_its_own_instance_and_the_pool_grows_only_when_needed():
    made = []
    envs = Environments(counted(made))
    assert len(made) == 1                                          # the probe
    first = envs.start_batch(rows(1, 2, 3)).environments
    assert len(made) == 3 and len({id(e) for e in first}) == 3
    assert first[0] is made[0]                                     # the probe is used, not wasted
    second = envs.start_batch(rows(4, 5)).environments
    assert len(made) == 3 and [id(e) for e in second] == [id(e) for e in first[:2]]   # reused, reset
    third = envs.start_batch(rows(6, 7, 8, 9)).environments
    assert len(made) == 4 and len({id(e) for e in third}) == 4
    assert [e.value for e in third] == [6, 7, 8, 9]


def test_reset_gets_every_column_and_its_string_is_appended_to_the_last_user_message():
    batch_rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}],
                   "start": 2, "answer": "5"}]
    before = copy.deepcopy(batch_rows)
    batch = Environments(Counter).start_batch(batch_rows)
    env = batch.environments[0]
    assert env.resets == [{"start": 2, "prompt": before[0]["prompt"], "answer": "5"}]
    assert batch.prompts == [[{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Count. Start at 2."}]]
    assert batch_rows == before                                    # the dataset rows are not modified


def test_a_reset_returning_none_leaves_the_prompt_and_a_missing_prompt_is_an_empty_user_message():
    batch = Environments(Quiet).start_batch([{"prompt": [{"role": "user", "content": "Hi"}]}, {"level": 3}])
    assert batch.prompts == [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": ""}]]
    assert batch.environments[1].row == {"level": 3}


def test_an_observation_joins_content_blocks_as_a_text_block():
    class Blocks:
        def reset(self, **row):
            return "observed"

    prompt = [{"role": "user", "content": [{"type": "text", "text": "Look."}]}]
    batch = Environments(Blocks).start_batch([{"prompt": prompt}])
    assert batch.prompts[0][0]["content"] == [{"type": "text", "text": "Look."}, {"type": "text", "text": "observed"}]


def test_a_dict_factory_routes_rows_by_their_environment_column_and_reset_does_not_see_it():
    envs = Environments({"count": Counter, "quiet": Quiet})
    assert envs.multi_environment
    assert [t.__name__ for t in envs.tools_of["quiet"]] == ["listen"]
    batch_rows = [{"environment": "quiet", "x": 1}, {"environment": "count", "start": 4}, {"environment": "quiet"}]
    batch = envs.start_batch(batch_rows)
    assert [type(e).__name__ for e in batch.environments] == ["Quiet", "Counter", "Quiet"]
    assert batch.names == ["quiet", "count", "quiet"]
    assert batch.environments[0].row == {"x": 1}
    assert batch.environments[1].resets == [{"start": 4}]
    assert batch.environments[0] is not batch.environments[2]


def test_a_single_factory_passes_an_environment_column_to_reset():
    batch = Environments(Quiet).start_batch([{"environment": "lab", "x": 1}])
    assert batch.environments[0].row == {"environment": "lab", "x": 1}


def test_a_row_naming_an_unknown_environment_is_an_error_listing_the_known_ones():
    envs = Environments({"count": Counter, "quiet": Quiet})
    with pytest.raises(ValueError, match=r"environment='loud', not among .*\['count', 'quiet'\]"):
        envs.start_batch([{"environment": "loud"}])


def test_a_reset_that_raises_during_a_batch_names_the_class_and_the_row():
    class Fragile:
        def reset(self, ok=True, **row):
            if not ok:
                raise KeyError("seed")

    with pytest.raises(RuntimeError, match=r"Fragile.reset\(\*\*row\) raised on row 1 of the batch: KeyError"):
        Environments(Fragile).start_batch([{"ok": True}, {"ok": False}])


def test_get_reward_becomes_a_reward_function_named_after_the_class():
    envs = Environments({"count": Counter, "quiet": Quiet, "again": Counter})
    rewards = envs.reward_functions()
    assert [r.__name__ for r in rewards] == ["Counter"]            # one per class, none for Quiet
    batch = envs.start_batch([{"environment": "count", "start": 2}, {"environment": "quiet"},
                              {"environment": "again", "start": 5}])
    batch.environments[0].increment(1)
    assert rewards[0](environments=batch.environments, completions=[[], [], []]) == [3.0, None, 5.0]


def test_an_async_get_reward_gives_a_coroutine_reward_function():
    envs = Environments({"scored": AsyncScored, "quiet": Quiet})
    (reward,) = envs.reward_functions()
    assert reward.__name__ == "AsyncScored" and inspect.iscoroutinefunction(reward)
    batch = envs.start_batch([{"environment": "scored", "score": 0.5}, {"environment": "quiet"}])
    assert asyncio.run(reward(environments=batch.environments)) == [0.5, None]


def test_a_subclass_is_not_scored_by_its_parents_reward():
    class Child(Counter):
        pass

    envs = Environments({"parent": Counter, "child": Child})
    names = [r.__name__ for r in envs.reward_functions()]
    assert names == ["Counter", "Child"]
    batch = envs.start_batch([{"environment": "parent", "start": 1}, {"environment": "child", "start": 2}])
    parent, child = envs.reward_functions()
    assert parent(environments=batch.environments) == [1.0, None]
    assert child(environments=batch.environments) == [None, 2.0]


def test_a_retired_instance_leaves_the_pool_and_is_replaced_when_needed():
    made = []
    envs = Environments(counted(made))
    (first,) = envs.start_batch(rows(1)).environments
    envs.retire(first)
    assert envs.pool[None] == []
    (second,) = envs.start_batch(rows(2)).environments
    assert second is not first and len(made) == 2


def test_a_get_reward_list_is_one_reward_per_turn_and_a_number_stays_a_number():
    from trl_ppo_ext.rewards.scoring import TurnRewards

    class Turns:
        def reset(self, **row):
            return None

        def get_reward(self):
            return [0.0, 1.0]  # an environment cannot name tokens: a list is per turn

    class Episode:
        def reset(self, **row):
            return None

        def get_reward(self):
            return 2.0  # TRL GRPO's one reward per episode, unchanged

    envs = Environments({"turns": Turns, "episode": Episode})
    batch = envs.start_batch([{"environment": "turns"}, {"environment": "episode"}])
    turns, episode = envs.reward_functions()
    got = turns(environments=batch.environments)
    assert isinstance(got[0], TurnRewards) and got[0].turns == (0.0, 1.0) and got[1] is None
    assert episode(environments=batch.environments) == [None, 2.0]
    assert type(episode(environments=batch.environments)[1]) is float
