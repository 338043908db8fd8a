"""agents/adapters.py: a gym-style or OpenEnv environment as an environment_factory class -- its one
tool and schema, reset(**row) seeding from the row, step rewards kept and summed, the end of an
episode, and the class through Environments and the tool executor. Hand-written environments stand
in for the packages (tests/end_to_end/test_example_environments.py runs the packages themselves)."""

import json

import pytest
from transformers.utils import get_json_schema

from trl_ppo_ext.agents.adapters import gym_environment, observation_fields, openenv_environment
from trl_ppo_ext.agents.environments import Environments
from trl_ppo_ext.agents.tools import ToolExecutor, tool_dict
from trl_ppo_ext.rewards.scoring import TurnRewards


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


# ---------------------------------------------------------------- per-turn rewards
def test_steps_are_booked_on_the_turn_that_called_them():
    env = steps_env()()
    env.reset(seed=0)
    env.turn = 0
    env.move("a"), env.move("b")  # two calls in one turn: 0.5 and -0.25
    env.turn = 2  # turn 1 made no step (a bad call, a standalone tool, or no call)
    env.move("c")  # 1.0, terminated
    assert env.step_turns == [0, 0, 2] and env.rewards == [0.5, -0.25, 1.0]
    reward = env.get_reward()
    assert isinstance(reward, TurnRewards) and reward.turns == (0.25, 0.0, 1.0) and reward == 1.25
    other = steps_env()()
    other.reset(seed=0)  # outside the trainer's tool loop (TRL GRPO): the turn is unknown, one step per turn
    other.move("a"), other.move("b")
    assert other.turn is None and other.get_reward().turns == (0.5, -0.25) and other.get_reward() == 0.25


def test_the_tool_loop_tells_each_adapter_its_turns_and_the_rewards_land_on_them(chat_tok, scripted):
    from trl_ppo_ext.agents.rollout_func import AgentRollout
    from trl_ppo_ext.episodes import pad_episodes, rollout_outputs
    from trl_ppo_ext.rewards.scoring import token_rewards

    def call(**arguments):
        return '<tool_call>\n{"name": "move", "arguments": %s}\n</tool_call>' % json.dumps(arguments)

    rollout = AgentRollout(chat_tok, environment_factory=steps_env(), response_length=600,
                           chat_template_kwargs={"enable_thinking": False})
    rows = [{"prompt": [{"role": "user", "content": "Q0"}], "seed": 1},
            {"prompt": [{"role": "user", "content": "Q1"}], "seed": 1}]
    generate = scripted(chat_tok, {
        # turn 0: two calls (steps 1 and 2); turn 1: a bad call (no step); turn 2: step 3 (terminated); turn 3: answer
        "Q0": [call(direction="n") + "\n" + call(direction="e") + "<|im_end|>",
               call(where="s") + "<|im_end|>", call(direction="s") + "<|im_end|>", "Done.<|im_end|>"],
        "Q1": ["No moves.<|im_end|>"]})  # one turn, no step
    out = rollout(rows, generate)
    first, second = out["environments"]
    assert first.step_turns == [0, 0, 2] and first.rewards == [0.5, -0.25, 1.0] and second.rewards == []
    (reward,) = rollout.reward_functions()
    got = reward(environments=out["environments"])
    assert [r.turns for r in got] == [(0.25, 0.0, 1.0), ()] and got == [1.25, 0.0]
    # on the padded episode: 0.25 at the end of turn 0, 1.0 at the end of turn 2, nothing elsewhere
    _, response_mask, action_mask, _ = pad_episodes(rollout_outputs(out, 2, 600), chat_tok.pad_token_id)
    placed, applies = token_rewards(got, response_mask, "MoveEnvironment", action_mask)
    runs = [[], []]  # an independent reading of the turns: (start, end) of each run of action tokens
    for b in range(2):
        row = action_mask[b].tolist()
        for t, on in enumerate(row):
            if on and (t == 0 or not row[t - 1]):
                runs[b].append([t, t])
            if on:
                runs[b][-1][1] = t
    assert len(runs[0]) == 4 and len(runs[1]) == 1
    ends = [end for _, end in runs[0]]
    assert placed[0].nonzero().flatten().tolist() == [ends[0], ends[2]]
    assert placed[0, ends[0]] == 0.25 and placed[0, ends[2]] == 1.0
    assert placed[1].eq(0).all() and applies.tolist() == [True, True]
