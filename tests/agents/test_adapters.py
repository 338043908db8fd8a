"""agents/adapters.py: a gym-style or OpenEnv environment as an environment_factory class -- its one
tool and schema, reset(**row) seeding from the row, step rewards kept and summed, the end of an
episode, and the class through Environments and the tool executor. Hand-written environments stand
in for the packages (tests/test_example_environments.py runs the packages themselves)."""

import pytest
from transformers.utils import get_json_schema

from trl_ppo_ext.agents.adapters import gym_environment, observation_fields, openenv_environment
from trl_ppo_ext.agents.environments import Environments
from trl_ppo_ext.agents.tools import ToolExecutor, tool_dict


class Steps:
    """Gym-style: the start is the seed (7 without one); each step pays the next of REWARDS and
    ends the episode at the third step (terminated) or when the action is "quit" (truncated)."""

    REWARDS = (0.5, -0.25, 1.0)

    def __init__(self):
        self.resets, self.actions = [], []

    def reset(self, seed=None):
        self.resets.append(seed)
        self.start, self.t = (7 if seed is None else seed), 0
        return f"start {self.start}", {"info": "dropped"}

    def step(self, action):
        self.actions.append(action)
        reward, self.t = self.REWARDS[self.t], self.t + 1
        return f"step {self.t} got {action}", reward, self.t == 3, action == "quit", {}


def steps_env(**kwargs):
    defaults = dict(tool="move", description="Make a move.", argument="direction",
                    argument_description="Where to go.")
    return gym_environment(Steps, **{**defaults, **kwargs})


def test_the_class_has_one_tool_with_the_given_name_and_schema():
    Env = steps_env(argument="number", argument_type=int, argument_description="Your number.")
    envs = Environments(Env)
    (tool,) = envs.tools_of[None]  # reset and get_reward are hooks, the rest private: one tool
    assert Env.__name__ == "MoveEnvironment" and tool.__name__ == "move"
    assert get_json_schema(tool)["function"] == {
        "name": "move", "description": "Make a move.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer", "description": "Your number."}},
                       "required": ["number"]},
        "return": {"type": "string"}}
    assert [r.__name__ for r in envs.reward_functions()] == ["MoveEnvironment"]  # get_reward: weight 1, named
    assert steps_env(name="Maze").__name__ == "Maze"


def test_reset_seeds_from_the_row_so_a_group_starts_alike():
    Env = steps_env()
    a, b, c = Env(), Env(), Env()
    row = {"prompt": [{"role": "user", "content": "Go."}], "seed": 3}
    assert a.reset(**row) == b.reset(**row) == "\n\nstart 3"  # a blank line after the prompt's text
    assert a.environment.resets == b.environment.resets == [3] and a.seed == 3
    assert c.reset(prompt=[{"role": "user", "content": ""}]) == "start 7"  # no seed column: its own draw
    assert Env().reset(prompt="Go.") == "start 7"  # a text prompt: no message to separate from
    assert c.environment.resets == [None] and c.seed is None
    assert c.reset(level=2, seed="5") == "start 5" and c.environment.resets == [None, 5]  # other columns ignored
    assert steps_env(seed_column="level")().reset(level=4, seed=9) == "start 4"


def test_step_rewards_are_kept_in_order_and_summed():
    env = steps_env(to_action=str.upper)()
    env.reset(seed=1)
    assert env.get_reward() == 0.0 and env.rewards == [] and not env.done
    assert env.move("north") == "step 1 got NORTH"  # to_action before step; the observation is the reply
    assert env.move(direction="east") == "step 2 got EAST" and not env.done
    assert env.move("south") == "step 3 got SOUTH" and env.done  # terminated at the third step
    assert env.rewards == [0.5, -0.25, 1.0] and env.get_reward() == 1.25  # 0.5 - 0.25 + 1.0
    assert env.environment.actions == ["NORTH", "EAST", "SOUTH"]
    assert env.observations == ["start 1", "step 1 got NORTH", "step 2 got EAST", "step 3 got SOUTH"]
    with pytest.raises(ValueError, match="episode is over"):
        env.move("west")
    assert env.environment.actions == ["NORTH", "EAST", "SOUTH"]  # the environment never saw it
    env.reset(seed=1)  # a new episode forgets the last one
    assert (env.rewards, env.done, env.get_reward()) == ([], False, 0.0)


def test_truncation_ends_the_episode_too():
    env = steps_env()()
    env.reset(seed=0)
    env.move("quit")
    assert env.done and env.rewards == [0.5] and env.get_reward() == 0.5


def test_a_bad_call_is_an_error_result_and_the_instances_are_separate():
    Env = steps_env()
    envs = Environments(Env)
    batch = envs.start_batch([{"prompt": [{"role": "user", "content": "Go."}], "seed": 2}] * 2)
    first, second = batch.environments
    assert first is not second and batch.prompts[0][-1]["content"] == "Go.\n\nstart 2"
    calls = [{"type": "function", "function": {"name": "move", "arguments": {"direction": "up"}}},
             {"type": "function", "function": {"name": "move", "arguments": {"where": "up"}}}]
    out = ToolExecutor().execute(calls, tool_dict([], [first.move]))
    assert [m["content"] for m in out.messages][0] == "step 1 got up" and out.failures == 1
    assert "missing a required argument: 'direction'" in out.messages[1]["content"]  # told to the model
    assert first.rewards == [0.5] and second.rewards == []
    assert envs.reward_functions()[0](environments=[first, second]) == [0.5, 0.0]


class Observed:
    """Stands for an OpenEnv Observation (a pydantic model): fields, done, reward, metadata."""

    def __init__(self, hint, done=False, reward=None):
        self.hint, self.done, self.reward, self.metadata = hint, done, reward, {"secret": 1}

    def model_dump(self, exclude=()):
        return {k: v for k, v in vars(self).items() if k not in exclude}


class Guessing:
    """Stands for an OpenEnv server-side Environment: reset(seed=) and step(action) -> Observation."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = seed
        return Observed("guess a number")

    def step(self, action, timeout_s=None, **kwargs):
        guess = action["guess"]
        if guess == self.target:
            return Observed("right", done=True, reward=1.0)
        penalty = -0.5 if guess == 0 else None  # 0 is out of range; a wrong guess in range pays nothing (None)
        return Observed("higher" if guess < self.target else "lower", reward=penalty)


def test_an_openenv_environment_reads_done_and_reward_from_its_observations():
    Env = openenv_environment(Guessing, tool="guess", description="Guess.", argument="number", argument_type=int,
                              to_action=lambda n: {"guess": n})
    env = Env()
    assert env.reset(seed=4) == '{"hint": "guess a number"}'  # no prompt in the row: no blank line
    assert env.guess(0) == '{"hint": "higher"}' and env.guess(6) == '{"hint": "lower"}'
    assert env.guess(4) == '{"hint": "right"}' and env.done
    assert env.rewards == [-0.5, 0.0, 1.0] and env.get_reward() == 0.5  # reward None counts 0.0
    assert observation_fields(Observed("x", reward=2.0)) == '{"hint": "x"}'  # done, reward, metadata left out


@pytest.mark.parametrize("kwargs, message", [
    ({"tool": "reset"}, "tool='reset'"), ({"tool": "_move"}, "tool='_move'"), ({"tool": "two words"}, "public"),
    ({"argument": "self"}, "argument='self'"),
])
def test_names_the_trainer_could_not_offer_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        steps_env(**kwargs)


def test_make_must_be_callable():
    with pytest.raises(TypeError, match="make must be a callable"):
        gym_environment(Steps(), tool="move", description="Move.")
