"""A task where the tool is the way to the reward: multiply two 2-digit numbers with a calculator.

A prompt is one user message, ``"23*47"``; the answer is the product, ``"1081"``. The policy is
a tiny Llama over the byte-level chat tokenizer of ``trl_ppo_ext.tiny`` (TRL's Qwen3 template),
which cannot multiply in its head, and the run passes it one tool, ``multiply``. An episode that
earns the reward calls the tool, reads its reply and copies the product::

    <|im_start|>system  # Tools ... multiply's schema ... <|im_end|>       (the template's, 650 bytes)
    <|im_start|>user 23*47<|im_end|>  <|im_start|>assistant <think> </think>
    <tool_call> {"name": "multiply", "arguments": {"a": 23, "b": 47}} </tool_call><|im_end|>   model
    <|im_start|>user <tool_response> 1081 </tool_response><|im_end|> <|im_start|>assistant ...  tool
    1081<|im_end|>                                                                           model

The warm-up (``demonstrations``) teaches both formats, the tool call and the answer, from
episodes of which only a share call the tool (``call_fraction``); the others answer at once with
a plausible wrong product, as from an annotator who guessed. The fine-tuned model calls the tool
about that share of the time; the exact-answer reward can teach it to call it always, which is
what ``examples/ppo_tools.py`` shows.

The pieces:

1. ``multiply``, the tool (TRL's contract: type hints and a Google-style docstring; short, since
   its schema is in every prompt);
2. ``build_task`` -> a ``ToolTask``: tokenizer, chat template, prompts, answers, the rendered
   episode of a demonstration; ``split_pairs`` -> pairs for the warm-up, for PPO, held out;
3. ``demonstrations`` (token ids and labels, built with the tool loop's own rendering helpers,
   so the warm-up sees the ids a rollout produces) and ``prompt_rows`` (the PPO rows);
4. the reward function, in TRL GRPO's calling convention for tools (``completions`` are message
   lists): ``correct_answer``; and ``called_tool``, a per-episode figure;
5. ``sft_warm_up``: TRL's ``SFTTrainer`` on the demonstrations;
6. ``Calculator``, the same tool as a TRL GRPO environment (``environment_factory=Calculator``:
   one instance per episode, ``reset(**row)``, the public method ``multiply``), and
   ``calculator_answer``, ``correct_answer`` read through the instances (``environments=``).

Used by ``examples/ppo_tools.py`` and the tests (which put ``examples/`` on ``sys.path``).
Importing it builds nothing: the tokenizer is made by ``build_task``.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from datasets import Dataset

from trl_ppo_ext.agents.support import check_tool_support
from trl_ppo_ext.agents.tool_loop import render_prompt, tool_suffix_ids
from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

# The template's switch for Qwen3's thinking block: off, so an answer follows the header directly.
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
LOW, HIGH = 32, 99  # two-digit factors with four-digit products: every episode of a kind has one length


def multiply(a: int, b: int) -> str:
    """Multiply two numbers.

    Args:
        a: a number.
        b: a number.
    """
    return str(a * b)


@dataclass(frozen=True)
class ToolTask:
    """The task: the chat tokenizer and the template the tool loop renders with."""

    tokenizer: object  # the byte-level chat tokenizer (trl_ppo_ext.tiny.build_tiny_chat_tokenizer)
    chat_template: str  # the template check_tool_support chose (TRL's prefix-preserving Qwen3)

    @staticmethod
    def describe() -> str:
        return (f"'a*b' with a, b in {LOW}..{HIGH}: answer the product; the tool multiply(a, b) computes it, and "
                "the policy cannot.")

    @staticmethod
    def conversation(a: int, b: int) -> list[dict]:
        """The prompt ``[{"role": "user", "content": "23*47"}]``."""
        return [{"role": "user", "content": f"{a}*{b}"}]

    @staticmethod
    def answer(a: int, b: int) -> str:
        return str(a * b)

    @staticmethod
    def call_text(a: int, b: int) -> str:
        """The model's turn that calls the tool, as Qwen3 writes it (TRL's parser reads it)."""
        return f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'

    def prompt_ids(self, a: int, b: int) -> list[int]:
        """The prompt as the tool loop renders it: the tool's schema, the user turn, the header."""
        return render_prompt(self.tokenizer, self.conversation(a, b), [multiply], self.chat_template,
                             CHAT_TEMPLATE_KWARGS)

    def episode(self, a: int, b: int, *, call: bool, guess: str | None = None) -> tuple[list[int], list[int]]:
        """``(completion_ids, model_mask)`` of a demonstration: with ``call`` the tool call, the
        tool's reply (suffix ids, ``model_mask`` 0) and the product; else ``guess`` at once.
        The ids are those the tool loop builds for the same turns (prompt + turn + suffix)."""
        tok = self.tokenizer
        if not call:
            ids = tok(f"{guess}<|im_end|>", add_special_tokens=False).input_ids
            return ids, [1] * len(ids)
        turn = tok(self.call_text(a, b), add_special_tokens=False).input_ids
        reply = [{"role": "tool", "name": "multiply", "content": multiply(a, b)}]
        suffix = tool_suffix_ids(tok, reply, self.chat_template, CHAT_TEMPLATE_KWARGS)
        answer = tok(f"{self.answer(a, b)}<|im_end|>", add_special_tokens=False).input_ids
        return turn + suffix + answer, [1] * len(turn) + [0] * len(suffix) + [1] * len(answer)


def template_pieces(tokenizer, chat_template: str) -> list[str]:
    """The fixed text the template writes around a prompt and a tool reply (the system block with
    the tool's schema, the role names, the blank lines), in pieces between the tokenizer's added
    tokens and the variable text (digits, ``*``), longest first; pieces of one character left out."""
    prompt = tokenizer.apply_chat_template(ToolTask.conversation(0, 0), tools=[multiply], chat_template=chat_template,
                                           add_generation_prompt=True, tokenize=False, **CHAT_TEMPLATE_KWARGS)
    reply = [{"role": "tool", "name": "multiply", "content": "0"}]
    suffix = tokenizer.decode(tool_suffix_ids(tokenizer, reply, chat_template, CHAT_TEMPLATE_KWARGS))
    text = prompt + ToolTask.call_text(0, 0) + suffix
    splitter = "|".join(re.escape(t) for t in sorted(tokenizer.get_added_vocab(), key=len, reverse=True))
    pieces = {p for p in re.split(f"{splitter}|[0-9*]", text) if len(p) > 1}
    return sorted(pieces, key=len, reverse=True)


def build_task() -> ToolTask:
    """The chat tokenizer, with the template's fixed text as whole tokens, and the template TRL's
    tool loop uses with it.

    Byte by byte (``build_tiny_chat_tokenizer``), a prompt is 676 ids, 650 of them the system block
    that Qwen3's template writes to show the tool's schema; the warm-up and every PPO forward would
    spend nearly all their time on it (an SFT step of 16 rows took 1.2 s on one core). A real
    tokenizer's merges shorten such text several times; here each fixed piece of the template
    (``template_pieces``) becomes one added token, and a prompt is a few dozen ids. The variable
    text (the factors, the tool's reply, the model's tool call and answer) stays one id per byte,
    and every text still round-trips exactly: TRL's parser reads the decoded text as before.
    """
    from transformers import AddedToken

    tok = build_tiny_chat_tokenizer()
    template = check_tool_support(tok)
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in template_pieces(tok, template)])
    return ToolTask(tokenizer=tok, chat_template=check_tool_support(tok))


@dataclass(frozen=True)
class PairSplit:
    sft: list[tuple[int, int]]
    ppo: list[tuple[int, int]]
    held_out: list[tuple[int, int]]


def split_pairs(*, num_sft: int, num_ppo: int, num_held_out: int, seed: int = 0) -> PairSplit:
    """Three disjoint random sets of factor pairs (``LOW..HIGH`` squared: 8100 pairs)."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    if num_sft + num_ppo + num_held_out > len(pairs):
        raise ValueError(f"num_sft={num_sft}, num_ppo={num_ppo}, num_held_out={num_held_out}: more than the "
                         f"{len(pairs)} pairs there are.")
    random.Random(seed).shuffle(pairs)
    return PairSplit(sft=pairs[:num_sft], ppo=pairs[num_sft : num_sft + num_ppo],
                     held_out=pairs[num_sft + num_ppo : num_sft + num_ppo + num_held_out])


# ------------------------------------------------------------------------------- datasets
def demonstrations(task: ToolTask, pairs: Sequence[tuple[int, int]], *, call_fraction: float,
                   seed: int = 0) -> Dataset:
    """Warm-up rows ``input_ids`` (prompt + episode) and ``labels`` (-100 on the prompt and the
    tool's reply: the loss is on the model's own tokens). A ``call_fraction`` share of the rows
    (drawn with ``seed``) call the tool; the others answer the product of another random pair."""
    rng = random.Random(seed)
    rows = {"input_ids": [], "labels": []}
    for a, b in pairs:
        call = rng.random() < call_fraction
        guess = task.answer(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
        prompt = task.prompt_ids(a, b)
        ids, model_mask = task.episode(a, b, call=call, guess=guess)
        rows["input_ids"].append(prompt + ids)
        rows["labels"].append([-100] * len(prompt) + [i if m else -100 for i, m in zip(ids, model_mask)])
    return Dataset.from_dict(rows)


def prompt_rows(task: ToolTask, pairs: Sequence[tuple[int, int]]) -> Dataset:
    """PPO rows as a GRPO user brings them to a tool run: the ``prompt`` conversation (the
    trainer renders it with the tool's schema) and the ``answer`` the reward reads."""
    return Dataset.from_dict({"prompt": [task.conversation(a, b) for a, b in pairs],
                              "answer": [task.answer(a, b) for a, b in pairs]})


# ------------------------------------------------------------------------ reward functions
def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the episode's last message is an answer (an assistant turn without a tool call)
    whose text, stripped, is the product; else 0.0. ``completions``: one message list per episode.

    Example:
        >>> call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}
        >>> done = [{"role": "assistant", "content": "1081"}]
        >>> correct_answer([done, [call], [call, {"role": "tool", "content": "1081"}, *done]], ["1081"] * 3)
        [1.0, 0.0, 1.0]
    """
    return [float(c[-1]["role"] == "assistant" and not c[-1].get("tool_calls")
                  and (c[-1].get("content") or "").strip() == a) for c, a in zip(completions, answer)]


def called_tool(completions) -> list[float]:
    """1.0 for an episode with a tool reply in it, else 0.0 (a per-episode figure, not a reward).

    Example:
        >>> called_tool([[{"role": "assistant", "content": "7"}], [{"role": "tool", "content": "7"}]])
        [0.0, 1.0]
    """
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


def factors(prompt) -> tuple[int, int]:
    """The factors of a prompt conversation (``"23*47"`` -> ``(23, 47)``)."""
    a, b = re.fullmatch(r"\s*(\d+)\*(\d+)\s*", prompt[-1]["content"]).groups()
    return int(a), int(b)


# ------------------------------------------------------------------------------ environment
class Calculator:
    """The task as a TRL GRPO ``environment_factory`` environment: ``environment_factory=Calculator``.

    The trainer makes one instance per concurrent episode and calls ``reset(**row)`` with the
    episode's dataset row (``prompt_rows``: ``prompt`` and ``answer``) before it starts; the public
    method ``multiply`` is the episode's tool, with the same schema as the function ``multiply``
    (so the prompt is the same, id for id, as in a run with ``tools=[multiply]``).

    There is no ``get_reward``: TRL calls it without arguments, so it could judge only what the
    environment saw (the tool calls), never the final answer, which is plain text after the last
    call. The reward is ``calculator_answer``, a reward function that reads the episode's messages
    and its instance (``environments=``), as TRL reward functions do.

    Attributes, after ``reset``:
        factors: ``(a, b)`` of the episode's prompt ``"a*b"``; product: ``a * b``, the right answer.
        calls: the ``(a, b)`` of each call to ``multiply`` that returned a product, in order.

    Example:
        >>> env = Calculator()
        >>> env.reset(prompt=[{"role": "user", "content": "23*47"}], answer="1081") is None
        True
        >>> env.multiply(23, 47), env.product, env.calls
        ('1081', 1081, [(23, 47)])
    """

    def reset(self, prompt, **row) -> None:
        """Start an episode: keep the prompt's factors, forget the calls; None leaves the prompt as it is."""
        self.factors = factors(prompt)
        self.product = self.factors[0] * self.factors[1]
        self.calls: list[tuple[int, int]] = []
        return None

    def multiply(self, a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: a number.
            b: a number.
        """
        product = str(a * b)
        self.calls.append((a, b))  # after the product: a call that raises (bad arguments) is not kept
        return product


def calculator_answer(completions, environments, **kwargs) -> list[float]:
    """``correct_answer`` for a run with ``environment_factory=Calculator``: 1.0 when the episode's
    last message is an answer (no tool call) whose text, stripped, is the product of its
    environment's factors; else 0.0. ``environments``: the episodes' instances, in order.

    Example:
        >>> env = Calculator()
        >>> _ = env.reset(prompt=[{"role": "user", "content": "23*47"}])
        >>> calculator_answer([[{"role": "assistant", "content": "1081"}], [{"role": "assistant", "content": "1018"}]],
        ...                   [env, env])
        [1.0, 0.0]
    """
    return [float(c[-1]["role"] == "assistant" and not c[-1].get("tool_calls")
                  and (c[-1].get("content") or "").strip() == str(env.product))
            for c, env in zip(completions, environments)]


# ---------------------------------------------------------------------------- SFT warm-up
def sft_warm_up(task: ToolTask, model, rows: Dataset, output_dir: str, *, max_steps: int, learning_rate: float,
                lr_scheduler_type: str = "cosine", warmup_ratio: float = 0.1, batch_size: int = 16, seed: int = 0,
                progress: bool = False):
    """Fine-tune ``model`` in place on ``rows`` (``demonstrations``) with TRL's ``SFTTrainer``:
    pre-tokenised rows with ``labels``, so the loss is on the model's tokens only. The learning
    rate rises linearly over the first ``warmup_ratio`` of the steps, then follows
    ``lr_scheduler_type`` (transformers' names: ``"cosine"`` decays it to 0, ``"constant"`` keeps it).

    Returns:
        The model, in eval mode.
    """
    from synthetic_task import _no_checkpointing
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
        learning_rate=learning_rate, lr_scheduler_type=lr_scheduler_type,
        warmup_steps=round(warmup_ratio * max_steps),  # steps, not a ratio: older transformers take ints only
        seed=seed, bf16=False, report_to=[], save_strategy="no", eval_strategy="no",
        logging_steps=max(1, max_steps // 4), disable_tqdm=not progress, dataloader_pin_memory=False,
        max_length=None,  # rows are prompt + episode, ~60 ids: nothing is cut
        **_no_checkpointing(SFTConfig),
    )
    trainer = SFTTrainer(model=model, args=args, processing_class=task.tokenizer, train_dataset=rows)
    trainer.train()
    return trainer.model.eval()


@functools.cache
def prompt_length() -> int:
    """The length of every rendered prompt (the factors have two digits each)."""
    return len(build_task().prompt_ids(LOW, HIGH))
