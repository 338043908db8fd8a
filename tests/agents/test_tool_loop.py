"""agents/tool_loop.py: the batched multi-turn loop, token ids in and out, on scripted turns.

Every episode runs on the tiny byte-level tokenizer with TRL's Qwen3 template (swapped for its
training variant by check_tool_support) and a scripted generate (see conftest). Expected ids are
the tokenization of texts written out here by hand from the template, never the loop's own
rendering."""

import asyncio
import math
import threading

import pytest
import torch

from trl_ppo_ext.agents.tool_loop import ToolLoopStats, run_tool_loop, tool_suffix_ids
from trl_ppo_ext.agents.tools import ToolExecutor, tool_dict
from trl_ppo_ext.episodes import pad_episodes, rollout_outputs

NO_THINK = {"enable_thinking": False}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 12.<|im_end|>"
# what the training template writes after a turn that called tools, with enable_thinking=False:
# glue, the result, and the next assistant header with its empty think block
SUFFIX_12 = ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
HEADER = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # how each prompt ends


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def prompts(*questions):
    return [[{"role": "user", "content": q}] for q in questions]


def loop(tok, generate, questions, tools=(multiply,), executor=None, **kwargs):
    kwargs.setdefault("response_length", 400)
    rows = prompts(*questions)
    return run_tool_loop(rows, tok, generate, tools=[list(tools)] * len(rows),
                         tool_dicts=[tool_dict(tools)] * len(rows), executor=executor,
                         chat_template=tok.training_template, chat_template_kwargs=NO_THINK, **kwargs)


def nan_positions(values):
    return [i for i, v in enumerate(values) if math.isnan(v)]


# ---------------------------------------------------------------- single turn
def test_a_turn_without_tool_call_is_the_whole_episode(chat_tok, scripted):
    generate = scripted(chat_tok, {"Q0": [ANSWER]})
    result = loop(chat_tok, generate, ["Q0"])
    out = result.outputs
    prompt_text = chat_tok.decode(out["prompt_ids"][0])
    assert prompt_text.endswith("<|im_start|>user\nQ0<|im_end|>\n" + HEADER)
    assert '"name": "multiply"' in prompt_text and "<tools>" in prompt_text     # the schema is shown
    assert out["completion_ids"] == [ids(chat_tok, ANSWER)]
    assert out["env_mask"] == [[1] * len(ids(chat_tok, ANSWER))]
    assert out["logprobs"][0] == [-1 - i / 1000 for i in range(len(ids(chat_tok, ANSWER)))]
    assert out["completions"] == [[{"role": "assistant", "content": "The answer is 12."}]]
    assert result.stats == ToolLoopStats(rollouts=1, calls=0, failures=0, turns=1, turns_max=1, exhausted=0)
    assert generate.calls[0][1] == [400]                          # the first turn may use the whole budget


# ---------------------------------------------------------------- one tool round
def test_a_tool_call_is_executed_and_the_ids_are_the_concatenation(chat_tok, scripted):
    generate = scripted(chat_tok, {"Q1": [CALL, ANSWER]})
    out = loop(chat_tok, generate, ["Q1"]).outputs
    call, suffix, answer = ids(chat_tok, CALL), ids(chat_tok, SUFFIX_12), ids(chat_tok, ANSWER)
    assert out["completion_ids"] == [call + suffix + answer]
    assert out["env_mask"] == [[1] * len(call) + [0] * len(suffix) + [1] * len(answer)]
    logprobs = out["logprobs"][0]
    assert nan_positions(logprobs) == list(range(len(call), len(call) + len(suffix)))   # exactly the suffix
    assert logprobs[: len(call)] == [-1 - i / 1000 for i in range(len(call))]
    assert logprobs[len(call) + len(suffix):] == [-2 - i / 1000 for i in range(len(answer))]
    # the second turn continues the ids it was given, never a re-tokenisation
    (prefix,), (limit,) = generate.calls[1]
    assert prefix == out["prompt_ids"][0] + call + suffix
    assert limit == 400 - len(call) - len(suffix)
    assert out["completions"] == [[
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "The answer is 12."},
    ]]


def test_the_episode_reads_as_the_template_renders_its_messages(chat_tok, scripted):
    # token-in-token-out agrees with the template on the whole history: the sampler saw what the
    # messages say (the last turn's "\n" after <|im_end|> is the template's, not generated)
    out = loop(chat_tok, scripted(chat_tok, {"Q1": [CALL, ANSWER]}), ["Q1"]).outputs
    history = prompts("Q1")[0] + out["completions"][0]
    rendered = chat_tok.apply_chat_template(history, tools=[multiply], chat_template=chat_tok.training_template,
                                            tokenize=False, **NO_THINK)
    assert chat_tok.decode(out["prompt_ids"][0] + out["completion_ids"][0]) + "\n" == rendered


def test_the_output_is_a_valid_rollout_func_result(chat_tok, scripted):
    out = loop(chat_tok, scripted(chat_tok, {"Q0": [ANSWER], "Q1": [CALL, ANSWER]}), ["Q0", "Q1"]).outputs
    checked = rollout_outputs(out, num_prompts=2, response_length=400)
    assert list(checked.extra) == ["completions"]
    _, response_mask, action_mask, sampler_logprobs = pad_episodes(checked, pad_token_id=chat_tok.pad_token_id)
    expected = torch.zeros(2, 400, dtype=torch.bool)
    for b, row in enumerate(out["env_mask"]):
        expected[b, : len(row)] = torch.tensor(row, dtype=torch.bool)
    assert torch.equal(action_mask, expected)
    assert torch.equal(torch.isnan(sampler_logprobs), ~action_mask)


def test_several_calls_in_one_turn_give_one_tool_message_each(chat_tok, scripted):
    two = ('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
           '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 7}}\n</tool_call><|im_end|>')
    suffix = ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n7\n</tool_response>"
              "<|im_end|>\n" + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    result = loop(chat_tok, scripted(chat_tok, {"Q": [two, ANSWER]}), ["Q"])
    out = result.outputs
    assert [m["content"] for m in out["completions"][0][1:3]] == ["12", "7"]
    assert out["completion_ids"][0] == ids(chat_tok, two) + ids(chat_tok, suffix) + ids(chat_tok, ANSWER)
    assert result.stats.calls == 2


def _parse_types_arguments() -> bool:
    from trl.chat_template_utils import parse_response

    from trl_ppo_ext.agents.tool_loop import _parse_takes_tools

    return _parse_takes_tools(parse_response)


@pytest.mark.skipif(not _parse_types_arguments(), reason="parse_response(tools=) needs TRL >= 1.16")
def test_tool_arguments_are_typed_by_the_tools_schema(chat_tok, scripted):
    # parse_response(tools=...) (TRL 1.16) turns "3" into 3 for an int parameter: untyped,
    # multiply("3", 4) would answer "3333"
    quoted = CALL.replace('"a": 3', '"a": "3"')
    out = loop(chat_tok, scripted(chat_tok, {"Q": [quoted, ANSWER]}), ["Q"]).outputs
    assert out["completions"][0][1]["content"] == "12"


# ---------------------------------------------------------------- batching and the end of the loop
def test_rows_still_calling_tools_continue_together(chat_tok, scripted):
    generate = scripted(chat_tok, {"Q0": [ANSWER], "Q1": [CALL, ANSWER], "Q2": [CALL, CALL, ANSWER]})
    result = loop(chat_tok, generate, ["Q0", "Q1", "Q2"])
    assert [len(prefixes) for prefixes, _ in generate.calls] == [3, 2, 1]
    assert [len(c) for c in result.outputs["completions"]] == [1, 3, 5]
    assert result.stats == ToolLoopStats(rollouts=3, calls=3, failures=0, turns=6, turns_max=3, exhausted=0)
    assert result.stats.metrics() == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0,
                                      "rollout/turns_mean": 2.0, "rollout/turns_max": 3.0,
                                      "tools/loop_exhausted_frac": 0.0, "tools/timed_out_frac": 0.0}


def test_no_cap_lets_an_episode_call_tools_until_it_answers(chat_tok, scripted):
    result = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, CALL, CALL, ANSWER]}), ["Q"])
    assert result.stats.turns == 4 and result.stats.calls == 3 and result.stats.exhausted == 0


def test_the_iteration_cap_ends_the_episode_on_an_unexecuted_tool_call(chat_tok, scripted):
    executed = []

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        executed.append((a, b))
        return str(a * b)

    generate = scripted(chat_tok, {"Q0": [ANSWER], "Q2": [CALL, CALL, ANSWER]})
    result = loop(chat_tok, generate, ["Q0", "Q2"], tools=(multiply,), max_tool_calling_iterations=1)
    call, suffix = ids(chat_tok, CALL), ids(chat_tok, SUFFIX_12)
    assert result.outputs["completion_ids"][1] == call + suffix + call
    assert [m["role"] for m in result.outputs["completions"][1]] == ["assistant", "tool", "assistant"]
    assert executed == [(3, 4)] and len(generate.calls) == 2
    assert result.stats.exhausted == 1 and result.stats.metrics()["tools/loop_exhausted_frac"] == 0.5


def test_a_cap_of_zero_executes_no_tool(chat_tok, scripted):
    result = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, ANSWER]}), ["Q"], max_tool_calling_iterations=0)
    assert result.outputs["completion_ids"] == [ids(chat_tok, CALL)]
    assert (result.stats.calls, result.stats.turns, result.stats.exhausted) == (0, 1, 1)


def test_a_tool_result_that_would_overflow_the_budget_is_dropped(chat_tok, scripted):
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        return "x" * 500

    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call><|im_end|>'
    generate = scripted(chat_tok, {"Q": [call, ANSWER]})
    result = loop(chat_tok, generate, ["Q"], tools=(lookup,), response_length=300)
    out = result.outputs
    assert out["completion_ids"] == [ids(chat_tok, call)] and out["env_mask"] == [[1] * len(ids(chat_tok, call))]
    assert [m["role"] for m in out["completions"][0]] == ["assistant"]     # the tool message is taken back
    assert len(generate.calls) == 1
    assert (result.stats.calls, result.stats.exhausted) == (1, 0)           # it ran; the cap did not end it


def test_a_tool_round_must_leave_room_for_one_model_token(chat_tok, scripted):
    call, suffix = ids(chat_tok, CALL), ids(chat_tok, SUFFIX_12)
    full = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, ANSWER]}), ["Q"], response_length=len(call) + len(suffix))
    assert full.outputs["completion_ids"] == [call]                         # no room left: dropped
    one = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, ANSWER]}), ["Q"], response_length=len(call) + len(suffix) + 1)
    assert one.outputs["completion_ids"] == [call + suffix + ids(chat_tok, "T")]


def test_the_generation_after_a_tool_round_is_cut_to_the_budget_left(chat_tok, scripted):
    script = scripted(chat_tok, {"Q": [CALL, ANSWER]})

    def ignores_the_limit(prefixes, max_new_tokens):
        return script(prefixes, [10**6] * len(prefixes))

    call, suffix = ids(chat_tok, CALL), ids(chat_tok, SUFFIX_12)
    budget = len(call) + len(suffix) + 5
    out = loop(chat_tok, ignores_the_limit, ["Q"], response_length=budget).outputs
    assert out["completion_ids"] == [call + suffix + ids(chat_tok, "The a")]
    assert len(out["completion_ids"][0]) == len(out["logprobs"][0]) == len(out["env_mask"][0]) == budget
    assert out["completions"][0][-1] == {"role": "assistant", "content": "The a"}


def test_the_engine_context_also_bounds_a_tool_round(chat_tok, scripted):
    generate = scripted(chat_tok, {"Q": [CALL, ANSWER]})
    prompt_length = len(loop(chat_tok, scripted(chat_tok, {"Q": [ANSWER]}), ["Q"]).outputs["prompt_ids"][0])
    call, suffix = ids(chat_tok, CALL), ids(chat_tok, SUFFIX_12)
    result = loop(chat_tok, generate, ["Q"], max_model_len=prompt_length + len(call) + len(suffix))
    assert result.outputs["completion_ids"] == [call] and len(generate.calls) == 1
    with pytest.raises(ValueError, match="leaves no room to generate in max_model_len"):
        loop(chat_tok, scripted(chat_tok, {"Q": [ANSWER]}), ["Q"], max_model_len=prompt_length)


def test_an_empty_generation_after_a_tool_round_ends_the_episode(chat_tok, scripted):
    out = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, ""]}), ["Q"]).outputs
    assert out["completion_ids"] == [ids(chat_tok, CALL) + ids(chat_tok, SUFFIX_12)]
    assert [m["role"] for m in out["completions"][0]] == ["assistant", "tool"]


# ---------------------------------------------------------------- bad calls
def test_malformed_tool_call_text_is_plain_text_and_ends_the_episode(chat_tok, scripted):
    bad = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}\n</tool_call><|im_end|>'   # a } short
    result = loop(chat_tok, scripted(chat_tok, {"Q": [bad, ANSWER]}), ["Q"])
    assert result.outputs["completions"] == [[{"role": "assistant", "content": bad.removesuffix("<|im_end|>")}]]
    assert result.outputs["completion_ids"] == [ids(chat_tok, bad)]
    assert (result.stats.calls, result.stats.failures, result.stats.turns) == (0, 0, 1)    # not a failure


def test_metrics_by_hand_three_rollouts_two_calls_one_bad_argument(chat_tok, scripted):
    bad_argument = CALL.replace('"b": 4', '"c": 4')
    generate = scripted(chat_tok, {"Q0": [ANSWER], "Q1": [CALL, ANSWER], "Q2": [bad_argument, ANSWER]})
    result = loop(chat_tok, generate, ["Q0", "Q1", "Q2"])
    error = result.outputs["completions"][2][1]["content"]
    assert error.startswith("{'error': ") and "unexpected keyword argument 'c'" in error
    assert error in chat_tok.decode(result.outputs["completion_ids"][2])      # the model reads the error
    metrics = result.stats.metrics()
    assert metrics["tools/call_frequency"] == pytest.approx(2 / 3)            # 2 calls / 3 rollouts
    assert metrics["tools/failure_frequency"] == pytest.approx(1 / 2)         # 1 failure / 2 calls
    assert metrics["rollout/turns_mean"] == pytest.approx(5 / 3)              # 1 + 2 + 2 turns


def test_an_unknown_tool_is_a_failure_the_model_reads(chat_tok, scripted):
    unknown = CALL.replace('"multiply"', '"divide"')
    result = loop(chat_tok, scripted(chat_tok, {"Q": [unknown, ANSWER]}), ["Q"])
    assert result.outputs["completions"][0][1] == {"role": "tool", "name": "divide",
                                                   "content": "{'error': 'Tool divide not found.'}"}
    assert (result.stats.calls, result.stats.failures) == (1, 1)


def test_a_tool_that_hangs_times_out_and_the_row_is_flagged(chat_tok, scripted):
    release = threading.Event()

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        release.wait(10)
        return str(a * b)

    generate = scripted(chat_tok, {"Q0": [ANSWER], "Q1": [CALL, ANSWER]})
    result = loop(chat_tok, generate, ["Q0", "Q1"], tools=(multiply,), executor=ToolExecutor(tool_timeout=0.2))
    release.set()
    assert result.outputs["completions"][1][1]["content"] == "{'error': 'Tool multiply timed out after 0.2 s.'}"
    assert result.timed_out == [False, True] and result.stats.failures == 1 and result.stats.timed_out == 1
    assert result.outputs["completions"][1][-1]["content"] == "The answer is 12."     # the episode goes on


def test_async_tools_and_non_string_results_in_the_loop(chat_tok, scripted):
    async def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        await asyncio.sleep(0)
        return a * b

    executor = ToolExecutor()
    with pytest.warns(UserWarning, match="returned a value of type int"):
        out = loop(chat_tok, scripted(chat_tok, {"Q": [CALL, ANSWER]}), ["Q"], tools=(multiply,),
                   executor=executor).outputs
    executor.close()
    assert out["completion_ids"] == [ids(chat_tok, CALL) + ids(chat_tok, SUFFIX_12) + ids(chat_tok, ANSWER)]


# ---------------------------------------------------------------- pieces
def test_the_suffix_of_two_tool_messages_without_template_kwargs(chat_tok):
    messages = [{"role": "tool", "name": "multiply", "content": "12"}, {"role": "tool", "name": "add", "content": "7"}]
    suffix = tool_suffix_ids(chat_tok, messages, chat_template=chat_tok.training_template)
    assert chat_tok.decode(suffix) == ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n7"
                                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_is_not_prefix_preserving_cannot_give_a_suffix(chat_tok):
    # TRL's original qwen3.jinja drops the think block of a turn once a tool message follows it
    with pytest.raises(ValueError, match="not prefix-preserving"):
        tool_suffix_ids(chat_tok, [{"role": "tool", "name": "multiply", "content": "12"}])


def test_stats_add_over_processes_then_give_the_metrics():
    a = ToolLoopStats(rollouts=2, calls=3, failures=1, turns=5, turns_max=3, exhausted=1, timed_out=1)
    b = ToolLoopStats(rollouts=2, calls=1, failures=0, turns=2, turns_max=1, exhausted=0)
    assert a + b == ToolLoopStats(rollouts=4, calls=4, failures=1, turns=7, turns_max=3, exhausted=1, timed_out=1)
    assert (a + b).metrics() == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.25,
                                 "rollout/turns_mean": 1.75, "rollout/turns_max": 3.0,
                                 "tools/loop_exhausted_frac": 0.25, "tools/timed_out_frac": 0.25}
    assert ToolLoopStats(rollouts=2).metrics()["tools/failure_frequency"] == 0.0     # no calls: 0, as TRL


@pytest.mark.parametrize("bad", [dict(response_length=0), dict(max_tool_calling_iterations=-1)])
def test_bad_settings_are_refused(chat_tok, scripted, bad):
    with pytest.raises(ValueError):
        loop(chat_tok, scripted(chat_tok, {"Q": [ANSWER]}), ["Q"], **bad)
