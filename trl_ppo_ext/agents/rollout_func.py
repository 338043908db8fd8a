r"""``tools`` and ``environment_factory`` as one ``rollout_func``: what a trainer builds at
construction and calls once per rollout batch.

`AgentRollout` puts the pieces together as TRL 1.16 GRPO's trainer does: the construction
checks (`support.check_tool_support`, the environments' probes), and per batch the pool and
``reset`` (`environments.Environments`), each rollout's tool dict (`tools.tool_dict`) and the
tool loop (`tool_loop.run_tool_loop`). Its result is a ``rollout_func`` dict
(``trl_ppo_ext.episodes.rollout_outputs`` checks it) whose extra keys reach the reward
functions as TRL passes them: ``completions`` (one message list per rollout), ``prompts`` (the
prompts after ``reset``) and, with environments, ``environments`` (the instances, one per
completion).

Example (an environment whose method is the tool and whose ``get_reward`` is the reward):

>>> from trl_ppo_ext.tiny import build_tiny_chat_tokenizer
>>> class Vault:
...     def reset(self, code, **row):
...         self.code, self.opened = code, False
...     def try_code(self, code: int) -> str:
...         '''Try to open the vault.
...
...         Args:
...             code: the code to try.
...         '''
...         self.opened = code == self.code
...         return "open" if self.opened else "locked"
...     def get_reward(self) -> float:
...         return float(self.opened)
>>> tok = build_tiny_chat_tokenizer()
>>> rollout = AgentRollout(tok, environment_factory=Vault, response_length=300)
>>> call = '<tool_call>\n{"name": "try_code", "arguments": {"code": 7}}\n</tool_call><|im_end|>'
>>> script = iter([[call, call], ["Done.<|im_end|>", "Done.<|im_end|>"]])
>>> def generate(prefixes, max_new_tokens):
...     ids = [tok(text).input_ids for text in next(script)]
...     return ids, [[0.0] * len(row) for row in ids]
>>> rows = [{"prompt": [{"role": "user", "content": "Open it."}], "code": code} for code in (7, 8)]
>>> out = rollout(rows, generate)
>>> [c[1]["content"] for c in out["completions"]], rollout.reward_functions()[0](environments=out["environments"])
(['open', 'locked'], [1.0, 0.0])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

from .adapters import StepEnvironment
from .environments import TIMED_OUT_COLUMN, Environments, environment_methods
from .support import check_tool_support
from .tool_loop import Generate, ToolLoopStats, run_tool_loop
from .tools import ToolExecutor, tool_dict

__all__ = ["AgentRollout"]


class AgentRollout:
    """The multi-turn rollout of a run with ``tools`` and/or ``environment_factory``.

    Args:
        processing_class: the policy's tokenizer; gets its response parser here.
        tools: standalone tools (sync or async functions with type hints and a Google-style
            docstring, as TRL requires), or None.
        environment_factory: a callable or a ``{name: factory}`` dict, or None.
        response_length: the budget of a whole completion, tool tokens included.
        max_tool_calling_iterations: rounds of tool calls per episode; None: no cap (TRL).
        chat_template_kwargs: passed to every render (a dict; ``{"enable_thinking": False}``).
        tool_timeout: seconds one tool call may take; None: no limit (TRL).
        max_model_len: the engine's context length (None: only the budget is checked).
        sample_row: a dataset row to probe each environment's ``reset`` with (None: not called).

    Raises:
        ValueError: neither tools nor environment_factory; and what `check_tool_support` and
            `Environments` raise.
    """

    def __init__(self, processing_class, *, tools: Sequence[Callable] | None = None,
                 environment_factory: Callable | Mapping[str, Callable] | None = None, response_length: int,
                 max_tool_calling_iterations: int | None = None, chat_template_kwargs: Mapping | None = None,
                 tool_timeout: float | None = None, max_model_len: int | None = None,
                 sample_row: Mapping | None = None):
        if not tools and environment_factory is None:
            raise ValueError("AgentRollout needs tools or an environment_factory")
        self.processing_class = processing_class
        self.chat_template = check_tool_support(processing_class, environments=environment_factory is not None)
        self.tools = list(tools or [])
        self.environments = None if environment_factory is None else Environments(environment_factory, sample_row)
        self.executor = ToolExecutor(tool_timeout)
        self.response_length = response_length
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_model_len = max_model_len
        self.last_stats = ToolLoopStats()
        self._warned_timeout = False  # the one-time warning that a timed-out rollout is not judged by get_reward

    def reward_functions(self) -> list[Callable]:
        """The environments' ``get_reward`` as reward functions (weight 1 each; see
        `environments.Environments.reward_functions`); empty without environments."""
        return [] if self.environments is None else self.environments.reward_functions()

    def __call__(self, rows: Sequence[Mapping], generate: Generate) -> dict:
        """Roll out one batch (:meth:`run` in slot 0); `last_stats` holds the loop's counts."""
        outputs, self.last_stats = self.run(rows, generate)
        return outputs

    def run(self, rows: Sequence[Mapping], generate: Generate, slot: int = 0) -> tuple[dict, ToolLoopStats]:
        """Roll out one batch; safe to call from two threads at once with different ``slot``s.

        Args:
            rows: (B,) the batch's dataset rows with every column (``prompt`` a message list;
                with environments it may be absent: an empty user message, ``reset`` gives the task).
            generate: the trainer's ``generate_continuations(prefixes, max_new_tokens)``.
            slot: the environment pool the batch draws its instances from
                (`environments.Environments.draw`): batches alive at the same time use different slots.

        Returns:
            The ``rollout_func`` dict: ``prompt_ids``, ``completion_ids``, ``logprobs``,
            ``env_mask``, ``completions``, ``prompts``, and ``environments`` and ``tool_timed_out``
            (``(B,)`` bool: a tool call of the rollout ran out of ``tool_timeout``, so its
            environment rewards are None) when an ``environment_factory`` is set; and the loop's counts.

        Raises:
            ValueError: a row whose prompt is not a message list.
        """
        for b, row in enumerate(rows):
            prompt = row.get("prompt")
            if not (prompt is None and self.environments is not None) and not isinstance(prompt, list):
                raise ValueError(
                    f"Row {b}'s prompt is a {type(prompt).__name__}: tools need conversational prompts, a list of "
                    '{"role": ..., "content": ...} messages, so that the chat template can show the tool schemas.'
                )
        if self.environments is None:
            environments, prompts = None, [list(row["prompt"]) for row in rows]
            tools = [self.tools] * len(rows)
            dicts = [tool_dict(self.tools) for _ in rows]
        else:
            batch = self.environments.start_batch(rows, slot=slot)
            environments, prompts = batch.environments, batch.prompts
            tools = [self.tools + self.environments.tools_of[name] for name in batch.names]
            dicts = [tool_dict(self.tools, environment_methods(env)) for env in environments]
        result = run_tool_loop(
            prompts, self.processing_class, _telling_turns(generate, environments),
            response_length=self.response_length, tools=tools, tool_dicts=dicts, executor=self.executor,
            chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs,
            max_tool_calling_iterations=self.max_tool_calling_iterations, max_model_len=self.max_model_len)
        if environments is not None:
            for environment, timed_out in zip(environments, result.timed_out):
                if timed_out:  # a thread of it may still be running: never reset it for another rollout
                    self.environments.retire(environment)
        outputs = {**result.outputs, "prompts": prompts}
        if environments is not None:
            outputs["environments"] = environments
            # the environment rewards judge the episode the model had, not what an abandoned thread does later
            outputs[TIMED_OUT_COLUMN] = list(result.timed_out)
            if any(result.timed_out) and self.reward_functions() and not self._warned_timeout:
                self._warned_timeout = True
                warnings.warn(
                    f"{sum(result.timed_out)} of {len(rows)} rollouts had a tool call past tool_timeout="
                    f"{self.executor.tool_timeout} s; its thread may still change the environment, so get_reward is "
                    "not called for them: they are unscorable for the environment rewards (None; counted in "
                    "tools/timed_out_frac). Raise tool_timeout, or make the tools return in time. Shown once.",
                    UserWarning, stacklevel=2)
        return outputs, result.stats

    def close(self) -> None:
        """Stop the tool event loop (a daemon thread; optional at exit)."""
        self.executor.close()


def _telling_turns(generate: Generate, environments: Sequence | None) -> Generate:
    """``generate`` that first tells each adapter environment (`adapters.StepEnvironment`) which
    model turn is about to be generated, so that its steps are booked on the turn that called them.

    The tool loop's ``k``-th call of ``generate`` (from 0) generates turn ``k`` of every row it
    continues, and the tool calls run before call ``k + 1`` are those of turn ``k``: every row
    still in the loop has had exactly the same number of turns. Setting ``turn`` on a row that has
    left the loop changes nothing: it runs no more steps.
    """
    adapters = [env for env in environments or () if isinstance(env, StepEnvironment)]
    if not adapters:
        return generate
    calls = 0

    def turn_generate(prefixes, max_new_tokens):
        nonlocal calls
        for environment in adapters:
            environment.turn = calls
        calls += 1
        return generate(prefixes, max_new_tokens)

    return turn_generate
