"""agents/rollout_func.py: tools and environment_factory as one rollout_func, with user code written
for TRL 1.16's GRPOTrainer (its docs' shapes: a standalone tool, an environment with reset/get_reward,
a dict of environments, env-owned data without a prompt column)."""

import json
import threading
import time
import warnings

import pytest

from trl_ppo_ext.agents.rollout_func import AgentRollout
from trl_ppo_ext.episodes import rollout_outputs

NO_THINK = {"enable_thinking": False}


def call(name, **arguments):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


class IncrementEnv:
    """TRL's docs example shape: reset samples the task, a method is the tool, get_reward scores."""

    def reset(self, target=2, **kwargs) -> str:
        self.counter, self.target = 0, target
        return f"Reach {target}."

    def increment(self, step: int) -> str:
        """Increment the counter.

        Args:
            step: The amount to add.
        """
        self.counter += step
        return str(self.counter)

    def get_reward(self) -> float:
        return float(self.counter == self.target)


class EchoEnv:
    def reset(self, **kwargs):
        return None

    def echo(self, text: str) -> str:
        """Echo a text.

        Args:
            text: The text.
        """
        return text


def test_tools_alone(chat_tok, scripted):
    rollout = AgentRollout(chat_tok, tools=[multiply], response_length=400, chat_template_kwargs=NO_THINK)
    rows = [{"prompt": [{"role": "user", "content": "Q0"}], "answer": "12"},
            {"prompt": [{"role": "user", "content": "Q1"}], "answer": "12"}]
    generate = scripted(chat_tok, {"Q0": ["12<|im_end|>"], "Q1": [call("multiply", a=3, b=4), "12<|im_end|>"]})
    out = rollout(rows, generate)
    assert "environments" not in out
    assert out["prompts"] == [r["prompt"] for r in rows]
    checked = rollout_outputs(out, num_prompts=2, response_length=400)
    assert sorted(checked.extra) == ["completions", "prompts"]
    assert out["completions"][1][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert rollout.last_stats.calls == 1 and rollout.reward_functions() == []
    assert rollout.chat_template is not None        # TRL's training template, swapped in at construction


def test_an_environment_gives_tools_reset_text_and_the_reward(chat_tok, scripted):
    rollout = AgentRollout(chat_tok, environment_factory=IncrementEnv, response_length=500,
                           chat_template_kwargs=NO_THINK)
    rows = [{"prompt": [{"role": "user", "content": "Q0"}], "target": 3},
            {"prompt": [{"role": "user", "content": "Q1"}], "target": 5}]
    generate = scripted(chat_tok, {"Q0": [call("increment", step=3), "Done.<|im_end|>"],
                                   "Q1": [call("increment", step=2), call("increment", step=2), "Done.<|im_end|>"]})
    out = rollout(rows, generate)
    prompt_text = chat_tok.decode(out["prompt_ids"][0])
    assert "<|im_start|>user\nQ0Reach 3.<|im_end|>" in prompt_text            # reset's string, appended
    assert '"name": "increment"' in prompt_text and '"name": "reset"' not in prompt_text
    assert out["prompts"][0] == [{"role": "user", "content": "Q0Reach 3."}]
    assert [e.counter for e in out["environments"]] == [3, 4]                 # each rollout its own instance
    (reward,) = rollout.reward_functions()
    assert reward.__name__ == "IncrementEnv"
    assert reward(environments=out["environments"]) == [1.0, 0.0]
    assert rollout_outputs(out, num_prompts=2, response_length=500).extra["environments"] == out["environments"]


def test_standalone_tools_and_environment_methods_together(chat_tok, scripted):
    rollout = AgentRollout(chat_tok, tools=[multiply], environment_factory=IncrementEnv, response_length=600,
                           chat_template_kwargs=NO_THINK)
    generate = scripted(chat_tok, {"Q": [call("multiply", a=2, b=3), call("increment", step=6), "ok<|im_end|>"]})
    out = rollout([{"prompt": [{"role": "user", "content": "Q"}], "target": 6}], generate)
    assert [m["content"] for m in out["completions"][0] if m["role"] == "tool"] == ["6", "6"]
    assert rollout.reward_functions()[0](environments=out["environments"]) == [1.0]


def test_a_dict_of_environments_shows_each_row_its_own_tools(chat_tok, scripted):
    rollout = AgentRollout(chat_tok, environment_factory={"inc": IncrementEnv, "echo": EchoEnv}, response_length=500,
                           chat_template_kwargs=NO_THINK)
    rows = [{"prompt": [{"role": "user", "content": "Q0"}], "environment": "echo"},
            {"prompt": [{"role": "user", "content": "Q1"}], "environment": "inc", "target": 1}]
    generate = scripted(chat_tok, {"Q0": [call("increment", step=1), "no<|im_end|>"],
                                   "Q1": [call("increment", step=1), "yes<|im_end|>"]})
    out = rollout(rows, generate)
    echo_prompt, inc_prompt = (chat_tok.decode(p) for p in out["prompt_ids"])
    assert '"name": "echo"' in echo_prompt and '"name": "increment"' not in echo_prompt
    assert '"name": "increment"' in inc_prompt and '"name": "echo"' not in inc_prompt
    # the echo environment has no `increment`: the call fails there and works in the other row
    assert out["completions"][0][1]["content"] == "{'error': 'Tool increment not found.'}"
    assert out["completions"][1][1]["content"] == "1"
    (reward,) = rollout.reward_functions()
    assert reward(environments=out["environments"]) == [None, 1.0]


def test_env_owned_data_needs_no_prompt_column(chat_tok, scripted):
    rollout = AgentRollout(chat_tok, environment_factory=IncrementEnv, response_length=400,
                           chat_template_kwargs=NO_THINK)
    out = rollout([{"target": 4}], scripted(chat_tok, {"Reach 4.": ["ok<|im_end|>"]}))
    assert out["prompts"] == [[{"role": "user", "content": "Reach 4."}]]


def test_an_environment_whose_tool_timed_out_is_not_reused(chat_tok, scripted):
    release = threading.Event()

    class Slow:
        def reset(self, **kwargs):
            return None

        def wait(self) -> str:
            """Wait for the world."""
            release.wait(10)
            return "done"

    rollout = AgentRollout(chat_tok, environment_factory=Slow, response_length=400, tool_timeout=0.2,
                           chat_template_kwargs=NO_THINK)
    first = rollout([{"prompt": [{"role": "user", "content": "Q"}]}],
                    scripted(chat_tok, {"Q": [call("wait"), "ok<|im_end|>"]}))
    release.set()
    assert "timed out after 0.2 s" in first["completions"][0][1]["content"]
    second = rollout([{"prompt": [{"role": "user", "content": "Q"}]}], scripted(chat_tok, {"Q": ["ok<|im_end|>"]}))
    assert second["environments"][0] is not first["environments"][0]
    rollout.close()


def test_a_text_prompt_is_refused(chat_tok):
    rollout = AgentRollout(chat_tok, tools=[multiply], response_length=100)
    with pytest.raises(ValueError, match="Row 0's prompt is a str: tools need conversational prompts"):
        rollout([{"prompt": "What is 3 * 4?"}], lambda prefixes, limits: ([], []))


def test_tools_or_an_environment_are_required(chat_tok):
    with pytest.raises(ValueError, match="needs tools or an environment_factory"):
        AgentRollout(chat_tok, response_length=100)


def test_construction_probes_reset_on_a_sample_row(chat_tok):
    class Picky:
        def reset(self, level):
            self.level = level

    with pytest.raises(ValueError, match=r"Picky.reset\(\*\*row\) raised on the first dataset row"):
        AgentRollout(chat_tok, environment_factory=Picky, response_length=100,
                     sample_row={"prompt": [{"role": "user", "content": "x"}], "level": 1})


class LateDoor:
    """A tool that outlives tool_timeout and then changes the environment (issue 40, case 3)."""

    def reset(self, **kwargs):
        self.opened = False

    def open_slowly(self) -> str:
        """Open the door, slowly."""
        time.sleep(0.3)
        self.opened = True
        return "opened"

    def get_reward(self) -> float:
        return float(self.opened)


def test_an_environment_whose_tool_timed_out_is_not_judged_by_get_reward(chat_tok, scripted):
    # before issue 40 the abandoned thread opened the door after the model was told the call timed out, and
    # get_reward scored that: [1.0, 0.0]; now the timed-out rollout is unscorable for it: [None, 0.0]
    rollout = AgentRollout(chat_tok, environment_factory=LateDoor, response_length=400, tool_timeout=0.05,
                           chat_template_kwargs=NO_THINK)
    rows = [{"prompt": [{"role": "user", "content": "Q0"}]}, {"prompt": [{"role": "user", "content": "Q1"}]}]
    turns = {"Q0": [call("open_slowly"), "ok<|im_end|>"], "Q1": ["ok<|im_end|>"]}
    with pytest.warns(UserWarning, match="past tool_timeout=0.05 s.*get_reward is not called"):
        out = rollout(rows, scripted(chat_tok, turns))
    assert "timed out after 0.05 s" in out["completions"][0][1]["content"]
    time.sleep(0.5)
    assert out["environments"][0].opened  # the abandoned thread did change the state
    assert out["tool_timed_out"] == [True, False]
    (reward,) = rollout.reward_functions()
    assert reward(environments=out["environments"], tool_timed_out=out["tool_timed_out"]) == [None, 0.0]
    assert rollout.last_stats.metrics()["tools/timed_out_frac"] == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is shown once
        again = rollout(rows, scripted(chat_tok, turns))
    assert again["tool_timed_out"] == [True, False]
    rollout.close()
