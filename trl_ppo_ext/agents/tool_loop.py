r"""The batched multi-turn tool loop: token ids in, token ids out, any generation engine.

TRL 1.16 GRPO's ``_tool_call_loop`` (``trl/trainer/grpo_trainer.py``, G:1893-2191), for a
``generate(prefixes, max_new_tokens) -> (ids, logprobs)`` callable (the rollout sampler's
continuation, ``sampling.RolloutSampler``, or a trainer subclass's ``generate_continuations``):

1. Each prompt (a message list) is rendered with its rollout's tool schemas
   (``apply_chat_template(tools=..., add_generation_prompt=True, **chat_template_kwargs)``) and
   the chosen template (`support.check_tool_support`), and every row generates.
2. Each new turn is parsed with TRL's ``parse_response`` (``prefix=`` the ids before it).
   Malformed tool-call text parses as plain text: the turn has no tool call and the episode ends
   (not a failure).
3. The rows whose last turn called tools execute them (`tools.ToolExecutor`); the ``tool``
   messages become the suffix ids of `tool_suffix_ids`, and the next prefix is
   ``prompt + completion + suffix`` by concatenation: the ids are never re-tokenised. Suffix
   ids are environment tokens (``env_mask`` 0, log-prob NaN); they hold the template's glue,
   the results and the next assistant header.
4. The rows still calling tools generate together, and so on until a turn calls no tool, after
   ``max_tool_calling_iterations`` rounds of tools (None: no cap), or at the length budget.

The budget is ``response_length``, the whole multi-turn completion, tool tokens included (TRL's
``max_completion_length`` rule, G:2044-2070, G:2132-2144). A round of tool results that would
leave no room for one more model token, or reach ``max_model_len`` (the engine's context), is
dropped: its ``tool`` messages are taken back and the row leaves the loop ending on its tool
call (TRL PR #5521: "drop, don't truncate"). TRL drops only beyond the budget and may then keep
a suffix with no model token after it; here the row keeps at least one. The generation after
a tool round is asked for, and cut to, the budget that is left.

Notation: ``B`` rows (rollouts); ``L_b`` the completion length of row ``b``.

Example (a scripted ``generate``: a tool call, then the answer):

>>> from trl_ppo_ext.tiny import build_tiny_chat_tokenizer
>>> from trl_ppo_ext.agents.support import check_tool_support
>>> from trl_ppo_ext.agents.tools import tool_dict
>>> tok = build_tiny_chat_tokenizer()
>>> template = check_tool_support(tok)            # TRL's qwen3_training.jinja
>>> def double(x: int) -> str:
...     '''Double a number.
...
...     Args:
...         x: the number.
...     '''
...     return str(2 * x)
>>> turns = iter(['<tool_call>\n{"name": "double", "arguments": {"x": 21}}\n</tool_call><|im_end|>', "42<|im_end|>"])
>>> def generate(prefixes, max_new_tokens):
...     ids = [tok(next(turns)).input_ids for _ in prefixes]
...     return ids, [[-0.5] * len(row) for row in ids]
>>> result = run_tool_loop([[{"role": "user", "content": "Double 21."}]], tok, generate, response_length=200,
...                        tools=[[double]], tool_dicts=[tool_dict([double])], chat_template=template,
...                        chat_template_kwargs={"enable_thinking": False})
>>> [message["role"] for message in result.outputs["completions"][0]]
['assistant', 'tool', 'assistant']
>>> ids, mask = result.outputs["completion_ids"][0], result.outputs["env_mask"][0]
>>> tok.decode([i for i, m in zip(ids, mask) if m == 0])     # the environment tokens
'\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n'
>>> result.stats.metrics()["tools/call_frequency"]
1.0
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from .tools import ToolExecutor

__all__ = ["ToolLoopResult", "ToolLoopStats", "parse_turn", "render_prompt", "run_tool_loop", "tool_suffix_ids"]

Generate = Callable[[list[list[int]], list[int]], tuple[list[list[int]], list[list[float]]]]


def _as_ids(rendered) -> list[int]:
    # apply_chat_template(tokenize=True, return_dict=False) gives ids; a BatchEncoding on some versions
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    rendered = list(rendered)
    if rendered and isinstance(rendered[0], (list, tuple)):
        rendered = list(rendered[0])
    return [int(i) for i in rendered]


def render_prompt(processing_class, prompt: list[dict], tools: Sequence[Callable] = (),
                  chat_template: str | None = None, chat_template_kwargs: Mapping | None = None) -> list[int]:
    """The ids of ``prompt`` with its tools' schemas and the generation prompt (TRL G:1705-1746).

    ``tools or None``: an empty list renders no tool block (Llama 3 would write one for ``[]``).
    """
    return _as_ids(processing_class.apply_chat_template(
        prompt, tools=list(tools) or None, chat_template=chat_template, add_generation_prompt=True, tokenize=True,
        return_dict=False, **dict(chat_template_kwargs or {})))


def tool_suffix_ids(processing_class, tool_messages: list[dict], chat_template: str | None = None,
                    chat_template_kwargs: Mapping | None = None) -> list[int]:
    """The ids the template writes after an assistant turn that called tools: the ``tool``
    messages and the next assistant header (TRL's ``_get_tool_suffix_ids`` semantics).

    A dummy ``[user, assistant(tool_calls)]`` is rendered without and then with ``tool_messages``
    (and the generation prompt); the suffix is the difference. The shorter render is first cut
    after its last eos token: the model's turn ended on eos (Qwen3 writes ``<|im_end|>\\n``, and
    the ``\\n`` belongs to the suffix). The call in the dummy carries the first message's name
    (GPT-OSS writes it in the tool header).

    Raises:
        ValueError: the template re-renders the dummy turns when tool messages follow, so no
            suffix can be appended to the ids (check_tool_support chooses a template that does not).
    """
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    kwargs = dict(chat_template=chat_template, tokenize=True, return_dict=False, **dict(chat_template_kwargs or {}))
    before = _as_ids(processing_class.apply_chat_template(dummy, add_generation_prompt=False, **kwargs))
    after = _as_ids(processing_class.apply_chat_template(dummy + list(tool_messages), add_generation_prompt=True,
                                                         **kwargs))
    eos = processing_class.eos_token_id
    if eos in before:
        before = before[: len(before) - before[::-1].index(eos)]
    if after[: len(before)] != before:
        raise ValueError(
            "The chat template renders the turns before a tool message differently once the tool message follows "
            "(it is not prefix-preserving), so tool results cannot be appended to the ids: render with the template "
            "check_tool_support returns."
        )
    return after[len(before):]


def _parse_takes_tools(parse_response: Callable) -> bool:
    return "tools" in inspect.signature(parse_response).parameters  # TRL 1.16 on


def parse_turn(processing_class, ids: list[int], prefix: list[int], tools: Sequence[Callable] = (),
               parse_response: Callable | None = None) -> dict:
    """One generated turn as an assistant message, by TRL's ``parse_response`` (``prefix=`` the
    ids before the turn; ``tools=`` on TRL >= 1.16, which types the arguments by the schemas).
    Unparseable text falls back to ``{"role": "assistant", "content": <decoded text>}``."""
    if parse_response is None:
        from trl.chat_template_utils import parse_response
    if _parse_takes_tools(parse_response):
        return parse_response(processing_class, ids, prefix=prefix, tools=list(tools) or None)
    return parse_response(processing_class, ids, prefix=prefix)


@dataclass
class ToolLoopStats:
    """Counts of one loop on one process; add them over processes, then take `metrics`."""

    rollouts: int = 0  # episodes (rows)
    calls: int = 0  # tool calls executed (those of a dropped round included: they ran)
    failures: int = 0  # calls whose result is an {"error": ...}
    turns: int = 0  # generated turns, summed over episodes
    turns_max: int = 0  # the most turns of one episode
    exhausted: int = 0  # episodes that ended on a tool call because max_tool_calling_iterations was reached
    timed_out: int = 0  # episodes with a tool call that ran out of tool_timeout (its thread may still run)

    def __add__(self, other: ToolLoopStats) -> ToolLoopStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "turns_max"}
        return ToolLoopStats(**sums, turns_max=max(self.turns_max, other.turns_max))

    def metrics(self) -> dict[str, float]:
        """TRL's names: ``tools/call_frequency`` (calls per episode), ``tools/failure_frequency``
        (failures per call, 0 without calls); TRL async's ``rollout/turns_mean``,
        ``rollout/turns_max`` and ``tools/loop_exhausted_frac`` (episodes cut at the cap); ours
        ``tools/timed_out_frac`` (episodes with a call past ``tool_timeout``)."""
        n = max(self.rollouts, 1)
        return {
            "tools/call_frequency": self.calls / n,
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
            "rollout/turns_mean": self.turns / n,
            "rollout/turns_max": float(self.turns_max),
            "tools/loop_exhausted_frac": self.exhausted / n,
            "tools/timed_out_frac": self.timed_out / n,
        }


@dataclass
class ToolLoopResult:
    """The loop's episodes, as ``rollout_func`` returns them, and what happened in it."""

    outputs: dict  # prompt_ids, completion_ids, logprobs, env_mask (B rows each), completions (B message lists)
    stats: ToolLoopStats
    timed_out: list[bool] = field(default_factory=list)  # (B,) a tool of the row ran out of tool_timeout


def _turn(ids, logprobs, limit: int) -> tuple[list[int], list[float]]:
    ids = [int(i) for i in ids][:limit]
    logprobs = [math.nan] * len(ids) if logprobs is None else [math.nan if v is None else float(v) for v in logprobs]
    return ids, logprobs[: len(ids)] + [math.nan] * (len(ids) - len(logprobs))


def run_tool_loop(
    prompts: Sequence[list[dict]],
    processing_class,
    generate: Generate,
    *,
    response_length: int,
    tools: Sequence[Sequence[Callable]],
    tool_dicts: Sequence[Mapping[str, Callable]],
    executor: ToolExecutor | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping | None = None,
    max_tool_calling_iterations: int | None = None,
    max_model_len: int | None = None,
) -> ToolLoopResult:
    """Roll out ``B`` multi-turn tool episodes (module docstring).

    Args:
        prompts: (B,) message lists (after any environment ``reset``); not modified.
        processing_class: the policy's tokenizer, with its response parser set
            (`support.check_tool_support`).
        generate: ``generate(prefixes, max_new_tokens) -> (new ids, log-probs)``, one row per
            prefix, each at most its ``max_new_tokens`` long (longer rows are cut).
        response_length: the budget of a whole completion, tool tokens included.
        tools: (B,) the tools whose schemas each prompt shows.
        tool_dicts: (B,) each rollout's ``name -> callable`` (`tools.tool_dict`).
        executor: runs the calls (its ``tool_timeout``); default one without a timeout.
        chat_template: the template to render with (None: the tokenizer's).
        chat_template_kwargs: passed to every render (``{"enable_thinking": False}``).
        max_tool_calling_iterations: rounds of tool calls per episode; None: no cap.
        max_model_len: the engine's context length, or None for no check beyond the budget.

    Returns:
        `ToolLoopResult`: ``outputs`` holds ``prompt_ids`` (B, prompt length),
        ``completion_ids`` (B, L_b <= response_length), ``logprobs`` (B, L_b; NaN on environment
        tokens), ``env_mask`` (B, L_b; 1 = sampled by the policy) and ``completions`` (B message
        lists: assistant turns and tool messages, what TRL hands reward functions).
    """
    if response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {response_length}")
    if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
        raise ValueError(f"max_tool_calling_iterations must be None or >= 0, got {max_tool_calling_iterations}")
    if not (len(prompts) == len(tools) == len(tool_dicts)):
        raise ValueError(f"prompts, tools and tool_dicts must have one entry per row: {len(prompts)}, {len(tools)}, "
                         f"{len(tool_dicts)}")
    from trl.chat_template_utils import parse_response

    executor = executor or ToolExecutor()
    render = dict(chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    prompt_ids = [render_prompt(processing_class, p, t, **render) for p, t in zip(prompts, tools)]
    context = [math.inf if max_model_len is None else max_model_len - len(p) for p in prompt_ids]
    if min(context) < 1:
        longest = max(map(len, prompt_ids))
        raise ValueError(f"A prompt of {longest} tokens leaves no room to generate in max_model_len={max_model_len}")
    limits = [int(min(response_length, room)) for room in context]
    new_ids, new_logprobs = generate(prompt_ids, limits)
    first = [_turn(i, lp, n) for i, lp, n in zip(new_ids, new_logprobs, limits)]
    completion_ids = [ids for ids, _ in first]
    logprobs = [lps for _, lps in first]
    env_mask = [[1] * len(ids) for ids in completion_ids]
    completions = [[parse_turn(processing_class, ids, p, t, parse_response)]
                   for ids, p, t in zip(completion_ids, prompt_ids, tools)]
    stats = ToolLoopStats(rollouts=len(prompts), turns=len(prompts))
    turns = [1] * len(prompts)
    timed_out = [False] * len(prompts)
    pending = {b: c[-1]["tool_calls"] for b, c in enumerate(completions) if c[-1].get("tool_calls")}
    rounds = 0
    while pending and (max_tool_calling_iterations is None or rounds < max_tool_calling_iterations):
        continuing = []  # (row, next prefix, suffix length)
        for b, calls in pending.items():
            results = executor.execute(calls, tool_dicts[b])
            stats.calls += results.calls
            stats.failures += results.failures
            timed_out[b] |= bool(results.timed_out)
            suffix = tool_suffix_ids(processing_class, results.messages, **render)
            prefix = prompt_ids[b] + completion_ids[b] + suffix
            if len(prefix) - len(prompt_ids[b]) >= response_length or \
                    (max_model_len is not None and len(prefix) >= max_model_len):
                continue  # dropped: the results are not kept, the episode ends on its tool call
            completions[b].extend(results.messages)
            continuing.append((b, prefix, len(suffix)))
        pending = {}
        if not continuing:
            break
        limits = [int(min(response_length - (len(prefix) - len(prompt_ids[b])),
                          math.inf if max_model_len is None else max_model_len - len(prefix)))
                  for b, prefix, _ in continuing]
        new_ids, new_logprobs = generate([prefix for _, prefix, _ in continuing], limits)
        for (b, prefix, n_suffix), ids, lps, limit in zip(continuing, new_ids, new_logprobs, limits):
            ids, lps = _turn(ids, lps, limit)
            completion_ids[b] = prefix[len(prompt_ids[b]):] + ids
            env_mask[b] += [0] * n_suffix + [1] * len(ids)
            logprobs[b] += [math.nan] * n_suffix + lps
            turns[b] += 1
            stats.turns += 1
            if ids:  # nothing generated: nothing to parse, the episode ends
                message = parse_turn(processing_class, ids, prefix, tools[b], parse_response)
                completions[b].append(message)
                if message.get("tool_calls"):
                    pending[b] = message["tool_calls"]
        rounds += 1
    stats.exhausted = len(pending)  # still calling tools when the cap stopped the loop
    stats.turns_max = max(turns, default=0)
    stats.timed_out = sum(timed_out)
    outputs = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
               "env_mask": env_mask, "completions": completions}
    return ToolLoopResult(outputs, stats, timed_out)
