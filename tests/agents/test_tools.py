"""agents/tools.py: parsed tool calls -> tool messages and counts, with TRL 1.16 GRPO's error rules,
async tools together on one loop, tool_timeout, and non-string results."""

import asyncio
import functools
import threading
import time
import warnings

import pytest

from trl_ppo_ext.agents.tools import ToolExecutor, is_async_tool, tool_dict


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def multiply(a: int, b: int) -> str:
    return str(a * b)


def broken(x: int) -> str:
    raise RuntimeError(f"cannot handle {x}")


def test_a_call_returns_the_tools_result_as_a_tool_message():
    out = ToolExecutor().execute([call("multiply", a=3, b=4)], {"multiply": multiply})
    assert out.messages == [{"role": "tool", "name": "multiply", "content": "12"}]
    assert (out.calls, out.failures, out.timed_out) == (1, 0, [])


def test_each_kind_of_bad_call_is_an_error_result_and_a_failure():
    calls = [
        call("broken", x=1),                                   # the tool raises
        call("nowhere"),                                       # an unknown name
        call("multiply", a=3),                                 # a missing argument
        call("multiply", a=3, b=4, c=5),                       # an unexpected one
        {"type": "retrieval", "name": "multiply"},             # not a function call
        {"type": "function", "function": {"name": "multiply", "arguments": "a=3"}},  # arguments not an object
        call("multiply", a=2, b=5),                            # and one good call
    ]
    out = ToolExecutor().execute(calls, {"multiply": multiply, "broken": broken})
    contents = [m["content"] for m in out.messages]
    assert contents[0] == "{'error': 'cannot handle 1'}"
    assert contents[1] == "{'error': 'Tool nowhere not found.'}"          # TRL's message
    assert "missing 1 required positional argument: 'b'" in contents[2]
    assert "unexpected keyword argument 'c'" in contents[3]
    assert contents[4] == "{'error': 'Unsupported tool call type: retrieval'}"
    assert "Tool multiply takes keyword arguments as a JSON object, got 'a=3'" in contents[5]
    assert contents[6] == "10"
    assert [m["name"] for m in out.messages] == ["broken", "nowhere", "multiply", "multiply", "multiply", "multiply",
                                                 "multiply"]
    assert (out.calls, out.failures) == (7, 6)


def test_missing_arguments_mean_no_arguments():
    # TRL's _validate_tool_calls normalises a call without arguments to {}
    out = ToolExecutor().execute([{"type": "function", "function": {"name": "now"}}], {"now": lambda: "noon"})
    assert out.messages[0]["content"] == "noon" and out.failures == 0


def test_async_tools_of_one_turn_run_together_on_one_loop():
    # `waiter` only finishes if `setter` runs while it waits: run one after the other, it would time out
    state = {}

    async def waiter() -> str:
        state["event"] = state.get("event") or asyncio.Event()
        await asyncio.wait_for(state["event"].wait(), 5)
        return "released"

    async def setter() -> str:
        await asyncio.sleep(0.05)
        state["event"] = state.get("event") or asyncio.Event()
        state["event"].set()
        return "set"

    executor = ToolExecutor()
    out = executor.execute([call("waiter"), call("setter")], {"waiter": waiter, "setter": setter})
    executor.close()
    assert [m["content"] for m in out.messages] == ["released", "set"]
    assert out.failures == 0


def test_messages_keep_the_call_order_when_sync_and_async_tools_mix():
    async def slow_echo(text: str) -> str:
        await asyncio.sleep(0.01)
        return text

    executor = ToolExecutor()
    out = executor.execute([call("slow_echo", text="first"), call("multiply", a=2, b=3), call("slow_echo", text="3rd")],
                           {"slow_echo": slow_echo, "multiply": multiply})
    executor.close()
    assert [m["content"] for m in out.messages] == ["first", "6", "3rd"]


def test_an_async_tool_that_raises_is_a_failure():
    async def fails() -> str:
        raise ValueError("no network")

    executor = ToolExecutor()
    out = executor.execute([call("fails")], {"fails": fails})
    executor.close()
    assert out.messages[0]["content"] == "{'error': 'no network'}" and out.failures == 1


def test_a_sync_tool_past_tool_timeout_is_an_error_and_its_thread_is_left_running():
    release = threading.Event()
    finished = []

    def hangs() -> str:
        release.wait(10)
        finished.append(True)
        return "too late"

    executor = ToolExecutor(tool_timeout=0.2)
    start = time.monotonic()
    out = executor.execute([call("hangs"), call("multiply", a=2, b=2)], {"hangs": hangs, "multiply": multiply})
    waited = time.monotonic() - start
    assert out.messages[0]["content"] == "{'error': 'Tool hangs timed out after 0.2 s.'}"
    assert out.messages[1]["content"] == "4"                 # the next call still runs
    assert (out.failures, out.timed_out, executor.abandoned_threads) == (1, ["hangs"], 1)
    assert 0.2 <= waited < 5
    assert finished == []                                    # still running in its daemon thread
    release.set()


def test_a_sync_tool_within_tool_timeout_returns_its_value_and_its_error():
    executor = ToolExecutor(tool_timeout=5)
    out = executor.execute([call("multiply", a=6, b=7), call("broken", x=2)], {"multiply": multiply, "broken": broken})
    assert [m["content"] for m in out.messages] == ["42", "{'error': 'cannot handle 2'}"]
    assert (out.failures, out.timed_out, executor.abandoned_threads) == (1, [], 0)


def test_an_async_tool_past_tool_timeout_is_cancelled():
    cancelled = []

    async def sleeps() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "woke"

    async def quick() -> str:
        return "quick"

    executor = ToolExecutor(tool_timeout=0.2)
    out = executor.execute([call("sleeps"), call("quick")], {"sleeps": sleeps, "quick": quick})
    executor.close()
    assert [m["content"] for m in out.messages] == ["{'error': 'Tool sleeps timed out after 0.2 s.'}", "quick"]
    assert (out.failures, out.timed_out, cancelled) == (1, ["sleeps"], [True])


def test_an_async_tool_that_blocks_its_loop_times_out_and_a_fresh_loop_serves_the_next_calls():
    release = threading.Event()

    async def blocks() -> str:
        release.wait(10)                 # a blocking call inside a coroutine: wait_for cannot fire
        return "blocked"

    async def fine() -> str:
        return "fine"

    executor = ToolExecutor(tool_timeout=0.1)
    out = executor.execute([call("blocks"), call("fine")], {"blocks": blocks, "fine": fine})
    # the whole turn's async calls time out together: the loop they shared was stuck
    assert out.timed_out == ["blocks", "fine"] and out.failures == 2 and executor.abandoned_threads == 1
    again = executor.execute([call("fine")], {"fine": fine})
    assert again.messages[0]["content"] == "fine" and again.failures == 0
    release.set()
    executor.close()


@pytest.mark.parametrize("value", [0, -1.5, "5", float("nan")])
def test_tool_timeout_must_be_none_or_positive(value):
    with pytest.raises(ValueError, match="tool_timeout must be None"):
        ToolExecutor(tool_timeout=value)


def test_a_result_that_is_not_a_string_is_stringified_with_one_warning_per_tool():
    tools = {"number": lambda: 12, "pairs": lambda: [("a", 1)], "nothing": lambda: None}
    for name in tools:
        tools[name].__name__ = name
    executor = ToolExecutor()
    with pytest.warns(UserWarning) as first:
        out = executor.execute([call("number"), call("pairs"), call("number")], tools)
    # lists too: TRL passes a list on as content blocks, which a text-only template renders as nothing
    assert [m["content"] for m in out.messages] == ["12", "[('a', 1)]", "12"]
    assert sorted(str(w.message).split("'")[1] for w in first) == ["number", "pairs"]
    assert "returned a value of type int, not a str" in str(first[0].message)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        out = executor.execute([call("number"), call("nothing")], tools)
    assert [m["content"] for m in out.messages] == ["12", "None"]
    assert [str(w.message).split("'")[1] for w in again] == ["nothing"]   # `number` warned already
    assert out.failures == 0


def test_error_results_are_not_warned_about():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ToolExecutor().execute([call("nowhere")], {})
    assert seen == []


def test_tool_dict_keys_standalone_tools_and_environment_methods_by_name():
    class Env:
        def look(self) -> str:
            return "a room"

    env = Env()
    tools = tool_dict([multiply, broken], [env.look])
    assert list(tools) == ["multiply", "broken", "look"]
    assert tools["look"]() == "a room"


def test_async_callables_are_recognised_through_partial_and_call():
    async def coroutine_tool(x: int) -> str:
        return str(x)

    class AsyncCallable:
        async def __call__(self) -> str:
            return "x"

    assert is_async_tool(coroutine_tool) and is_async_tool(functools.partial(coroutine_tool, 1))
    assert is_async_tool(AsyncCallable())
    assert not is_async_tool(multiply) and not is_async_tool(functools.partial(multiply, 1))


class Unprintable:
    def __str__(self):
        raise ValueError("no text for you")


class UnprintableError(Exception):
    def __str__(self):
        raise ValueError("nor for me")


@pytest.mark.parametrize("tool_timeout", [None, 5])
def test_a_result_whose_str_raises_is_an_error_result_and_a_failure(tool_timeout):
    # issue 40 case 5: before, str(result) raised out of the executor and ended train()
    def odd() -> str:
        return Unprintable()

    async def odd_async() -> str:
        return Unprintable()

    def raises_oddly() -> str:
        raise UnprintableError()

    tools = {"odd": odd, "odd_async": odd_async, "raises_oddly": raises_oddly, "multiply": multiply}
    out = ToolExecutor(tool_timeout).execute([call("odd"), call("odd_async"), call("raises_oddly"),
                                              call("multiply", a=2, b=3)], tools)
    contents = [m["content"] for m in out.messages]
    assert contents[0] == ("{'error': 'Tool odd returned a Unprintable whose str() raised ValueError: "
                           "no text for you'}")
    assert contents[1].startswith("{'error': 'Tool odd_async returned a Unprintable whose str() raised")
    assert contents[2] == "{'error': '<UnprintableError whose str() raised>'}"
    assert contents[3] == "6" and (out.calls, out.failures) == (4, 3)
