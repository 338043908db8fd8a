"""Tool execution: parsed tool calls in, ``tool`` messages and counts out (TRL 1.16 GRPO's rules).

A rollout's tools are one dict ``name -> callable`` (`tool_dict`): the standalone ``tools``
plus the public methods of that rollout's environment, keyed by ``__name__``, as TRL builds it
(``grpo_trainer.py`` G:2361-2380). A parsed call has TRL's form
``{"type": "function", "function": {"name": ..., "arguments": {...}}}``.

What a call becomes (TRL 1.16's ``grpo_trainer.py`` G:1970-2026):

- the tool's return value, as ``{"role": "tool", "name": name, "content": ...}``;
- ``{"error": str(e)}`` and one counted failure when the tool raises, the name is unknown
  (``"Tool {name} not found."``), the arguments do not fit the signature, or the call's type is
  not ``"function"`` (``"Unsupported tool call type: ..."``);
- the same when ``tool_timeout`` (seconds; ours, None = no limit, as TRL) runs out:
  ``{"error": "Tool {name} timed out after {t} s."}``.

Async tools of one call list run together on one event loop in a daemon thread, as TRL does
(G:1996-2012). Unlike TRL, which appends the sync results first and the async ones after, the
messages keep the order of the calls: the model's n-th call gets the n-th response.

Timeouts. A sync tool then runs in a daemon thread of its own and is waited for ``tool_timeout``
seconds. Python cannot stop a thread: one that never returns keeps running in the background,
its result discarded (it holds its memory, and may still change its environment's state; the
rollout wrapper retires such an environment from its pool). Daemon threads do not keep the
process alive at exit. An async tool is cancelled (``asyncio.wait_for``); one that blocks its
event loop (``time.sleep`` in a coroutine) cannot be cancelled, so after ``tool_timeout`` plus
a grace second the loop is abandoned the same way and a fresh one serves the next calls.

Results that are not strings. TRL passes a list through as content blocks (its VLM image path,
G:2018) and stringifies anything else. A text-only chat template renders list content as
nothing (Qwen3's writes ``''``), so here every non-string result is stringified, with one
warning per tool name. The error dicts are ours and are stringified silently. A result whose ``str()`` raises is an
error result and a counted failure, like any other tool failure (TRL 1.16 would raise).

Example:

>>> def add(a: int, b: int) -> str:
...     return str(a + b)
>>> executor = ToolExecutor()
>>> out = executor.execute(
...     [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
...      {"type": "function", "function": {"name": "mul", "arguments": {}}}], {"add": add})
>>> [message["content"] for message in out.messages]
['5', "{'error': 'Tool mul not found.'}"]
>>> out.calls, out.failures, out.timed_out
(2, 1, [])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolExecutor", "ToolResults", "is_async_tool", "tool_dict"]

_GRACE_S = 1.0  # beyond tool_timeout, how long a turn's async calls may take before the loop counts as blocked


def is_async_tool(tool: Callable) -> bool:
    """Whether calling ``tool`` returns a coroutine (through ``functools.partial``, and for a
    callable object whose ``__call__`` is async)."""
    while isinstance(tool, functools.partial):
        tool = tool.func
    return inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(getattr(tool, "__call__", None))


def tool_dict(tools: Sequence[Callable], environment_methods: Sequence[Callable] = ()) -> dict[str, Callable]:
    """One rollout's tools by ``__name__``: the standalone ``tools``, then its environment's
    methods (a later one of the same name wins, as in TRL's dict)."""
    return {getattr(tool, "__name__", type(tool).__name__): tool for tool in [*tools, *environment_methods]}


@dataclass
class ToolResults:
    """What one assistant message's tool calls produced."""

    messages: list[dict]  # one {"role": "tool", "name", "content": str} per call, in call order
    calls: int = 0  # tool calls attempted (each entry of the call list)
    failures: int = 0  # calls whose content is an {"error": ...}
    timed_out: list[str] = field(default_factory=list)  # names of the calls that ran out of tool_timeout


class _Call:
    """One call's outcome: ``value`` (what the tool returned) or ``error`` (a message)."""

    __slots__ = ("name", "value", "error", "timed_out")

    def __init__(self, name: str, value: Any = None, error: str | None = None, timed_out: bool = False):
        self.name, self.value, self.error, self.timed_out = name, value, error, timed_out


class ToolExecutor:
    """Runs parsed tool calls against a rollout's tool dict.

    Args:
        tool_timeout: seconds one call may take, or None for no limit (TRL's behaviour).

    Raises:
        ValueError: ``tool_timeout`` that is not None or a positive number.
    """

    def __init__(self, tool_timeout: float | None = None):
        if tool_timeout is not None and not (isinstance(tool_timeout, (int, float)) and tool_timeout > 0):
            raise ValueError(
                f"tool_timeout must be None (no limit) or a positive number of seconds, got {tool_timeout!r}")
        self.tool_timeout = tool_timeout
        self.abandoned_threads = 0  # tool threads (and blocked event loops) left running after a timeout
        self._warned: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    # ------------------------------------------------------------ the public step
    def execute(self, tool_calls: Sequence[Mapping], tools: Mapping[str, Callable]) -> ToolResults:
        """Run ``tool_calls`` (one assistant message's ``tool_calls``) with ``tools``.

        Returns:
            `ToolResults`: the ``tool`` messages in call order, the number of calls, of failures,
            and the names of the calls that timed out.
        """
        outcomes: list[_Call | None] = []
        pending = []  # (index in outcomes, name, coroutine function, arguments)
        for call in tool_calls:
            outcome, job = self._start(call, tools)
            if job is not None:
                pending.append((len(outcomes), *job))
            outcomes.append(outcome)
        if pending:
            for (index, *_), outcome in zip(pending, self._run_async(pending)):
                outcomes[index] = outcome
        results = ToolResults(messages=[], calls=len(outcomes))
        for outcome in outcomes:
            content = self._content(outcome)  # first: a result whose str() raises becomes an error here
            results.messages.append({"role": "tool", "name": outcome.name, "content": content})
            results.failures += outcome.error is not None
            if outcome.timed_out:
                results.timed_out.append(outcome.name)
        return results

    def close(self) -> None:
        """Stop the event loop thread, if one was started (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join(timeout=1.0)

    # ------------------------------------------------------------ one call
    def _start(self, call: Mapping, tools: Mapping[str, Callable]):
        """A sync call's outcome now, or the job an async call leaves for the event loop."""
        is_function = isinstance(call, Mapping) and call.get("type") == "function"
        if not is_function or not isinstance(call.get("function"), Mapping):
            kind = call.get("type") if isinstance(call, Mapping) else type(call).__name__
            name = call.get("name", "unknown") if isinstance(call, Mapping) else "unknown"
            return _Call(str(name), error=f"Unsupported tool call type: {kind}"), None
        function = call["function"]
        name = str(function.get("name"))
        arguments = function.get("arguments")
        arguments = {} if arguments is None else arguments
        tool = tools.get(name)
        if tool is None:
            return _Call(name, error=f"Tool {name} not found."), None
        if not isinstance(arguments, Mapping):
            return _Call(name, error=f"Tool {name} takes keyword arguments as a JSON object, got {arguments!r}"), None
        if is_async_tool(tool):
            return None, (name, tool, dict(arguments))
        if self.tool_timeout is None:
            try:
                return _Call(name, value=tool(**arguments)), None
            except Exception as error:  # noqa: BLE001 - any tool error becomes the model's observation
                return _Call(name, error=_describe(error)), None
        return self._run_in_thread(name, tool, dict(arguments)), None

    def _run_in_thread(self, name: str, tool: Callable, arguments: dict) -> _Call:
        box: dict[str, Any] = {}

        def target():
            try:
                box["value"] = tool(**arguments)
            except Exception as error:  # noqa: BLE001
                box["error"] = _describe(error)

        thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(self.tool_timeout)
        if thread.is_alive():
            self.abandoned_threads += 1
            return self._timeout(name)
        if "error" in box:
            return _Call(name, error=box["error"])
        return _Call(name, value=box.get("value"))

    def _timeout(self, name: str) -> _Call:
        return _Call(name, error=f"Tool {name} timed out after {self.tool_timeout} s.", timed_out=True)

    # ------------------------------------------------------------ async calls, together
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        # two threads may run episodes at once (the rollout producer and the trainer's evaluation): one loop
        with self._loop_lock:
            if self._loop is None:
                loop, ready = asyncio.new_event_loop(), threading.Event()

                def run():
                    asyncio.set_event_loop(loop)
                    ready.set()
                    loop.run_forever()

                self._loop_thread = threading.Thread(target=run, name="tool-event-loop", daemon=True)
                self._loop_thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def _run_async(self, pending: list) -> list[_Call]:
        timeout = self.tool_timeout

        async def one(name, tool, arguments):
            try:
                coroutine = tool(**arguments)
                value = await (coroutine if timeout is None else asyncio.wait_for(coroutine, timeout))
                return _Call(name, value=value)
            except asyncio.TimeoutError:
                return self._timeout(name)
            except Exception as error:  # noqa: BLE001
                return _Call(name, error=_describe(error))

        async def together():
            return await asyncio.gather(*(one(name, tool, arguments) for _, name, tool, arguments in pending))

        future = asyncio.run_coroutine_threadsafe(together(), self._event_loop())
        try:
            return future.result(None if timeout is None else timeout + _GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return self._abandon_loop(pending)

    def _abandon_loop(self, pending: list) -> list[_Call]:
        # A coroutine blocked the loop thread: wait_for cannot fire. Leave that loop (and thread)
        # behind; the next async call starts a fresh one.
        self._loop = None
        self.abandoned_threads += 1
        return [self._timeout(name) for _, name, _, _ in pending]

    # ------------------------------------------------------------ what the model reads
    def _content(self, outcome: _Call) -> str:
        """The text the model reads; a result whose ``str()`` raises becomes an error result (and
        ``outcome`` a counted failure), as every other tool failure does."""
        if outcome.error is not None:
            return str({"error": outcome.error})
        value = outcome.value
        if isinstance(value, str):
            return value
        try:
            text = str(value)
        except Exception as error:  # noqa: BLE001 - a result the model cannot read is a failed call, not a crash
            outcome.error = (f"Tool {outcome.name} returned a {type(value).__name__} whose str() raised "
                             f"{type(error).__name__}: {_describe(error)}")
            return str({"error": outcome.error})
        if outcome.name not in self._warned:
            self._warned.add(outcome.name)
            warnings.warn(
                f"Tool {outcome.name!r} returned a value of type {type(value).__name__}, not a str: its result is "
                "stringified with str() for the model (a text-only chat template renders other content as "
                "nothing). Return a str to choose the text yourself. This warning is shown once per tool.",
                UserWarning,
                stacklevel=3,
            )
        return text


def _describe(error: BaseException) -> str:
    """``str(error)``, or its class name when even that raises (an exception's own ``__str__`` may)."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001
        return f"<{type(error).__name__} whose str() raised>"
