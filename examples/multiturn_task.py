"""A two-turn task for a tiny model: answer, hear the environment's verdict, sign off.

An episode is one conversation rendered with the tiny chat template of ``trl_ppo_ext.tiny``::

    <user> tell me about cats <eos> <assistant>      the prompt
    kind clear rude                                  answer 1: the policy, up to 3 tokens
    <user> good good bad now close <eos> <assistant> the environment's reply (environment tokens)
    thanks <eos>                                     answer 2: the policy, what is left of the budget

The environment judges each word of the first answer (``good`` for a *nice* word, ``bad`` for
any other, ``none`` for a word not given) and asks the policy to close. The reward comes once, at
the end of the episode, and depends on both answers::

    reward = (share of nice words in answer 1 + share of closing words in answer 2) / 2

(0 .. 1; a turn without words scores 0 for its half; ``<eos>`` ends a turn and is not a word).
The two answers want different words (nice words, then ``thanks``/``bye``/``cheers``), so one
policy has to tell the turns apart from their context, and the credit for answer 1 must travel
back from the last token across the environment's eight tokens: what GAE over the policy's own
tokens is for (``docs/episodes.md``).

The pieces:

1. ``build_task`` -> a ``MultiTurnTask``: tokenizer, prompts, the environment's reply, the rule;
2. ``prompt_dataset``: PPO prompt rows (``input_ids`` and the conversational ``prompt`` column
   that ``rollout_func`` receives);
3. ``make_rollout_func``: the episode loop in TRL 1.16 GRPO's ``rollout_func`` contract, the
   policy's turns sampled with ``trainer.generate_continuations``;
4. ``multiturn_reward``: the reward function (GRPO's calling convention), reading the
   ``first_answer`` / ``second_answer`` columns the rollout function returns.

Used by ``examples/ppo_multiturn.py``, ``benchmarks/sample_efficiency/`` (task ``multiturn``)
and the tests (which put ``examples/`` on ``sys.path``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from datasets import Dataset

from trl_ppo_ext.tiny import build_tiny_tokenizer

NICE_WORDS = ("kind", "clear", "true", "calm", "warm", "bright", "fair", "safe", "wise", "glad")
NASTY_WORDS = ("rude", "vague", "false", "angry", "cold", "dull", "unfair", "risky", "silly", "sad")
CLOSING_WORDS = ("thanks", "bye", "cheers")
TOPICS = ("cats", "dogs", "rain", "music", "food", "trees", "books", "stars", "sea", "snow")
HELD_OUT_TOPICS = ("sea", "snow")  # the before/after evaluation asks about these; training never does
PROMPT_PATTERNS = ("tell me about {}", "what is {}", "why {}", "how are {}", "please describe {}", "what about {}")
PROMPT_WORDS = ("tell", "me", "about", "what", "is", "why", "how", "are", "please", "describe")
FEEDBACK_WORDS = ("good", "bad", "none", "now", "close")  # the environment's words


@dataclass(frozen=True)
class MultiTurnTask:
    """The task: its tokenizer and the sizes of the turns (see the module docstring)."""

    tokenizer: object  # PreTrainedTokenizerFast over SPECIAL_TOKENS + the words above
    first_turn_tokens: int = 3  # answer 1's budget; the environment judges this many words

    def describe(self) -> str:
        """The task in one sentence."""
        return (f"answer with up to {self.first_turn_tokens} nice words, hear the environment's verdict "
                f"({self.reply_length} environment tokens), then close with one of {', '.join(CLOSING_WORDS)}; "
                "reward at the end = (nice share of answer 1 + closing share of answer 2) / 2.")

    @property
    def reply_length(self) -> int:
        """Tokens of every environment reply: ``<user>``, one verdict per word, ``now close <eos> <assistant>``."""
        return self.first_turn_tokens + 5

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        words = ("<eos>", "<user>", "<assistant>", *FEEDBACK_WORDS)
        return dict(zip(words, self.tokenizer.convert_tokens_to_ids(list(words))))

    @functools.cached_property
    def nice_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.convert_tokens_to_ids(list(NICE_WORDS)))

    @functools.cached_property
    def closing_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.convert_tokens_to_ids(list(CLOSING_WORDS)))

    def prompt_ids(self, conversation: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the generation prompt (ends with ``<assistant>``)."""
        out = self.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    def words(self, answer: Sequence[int]) -> list[int]:
        """The words of a turn: its ids up to the first ``<eos>`` (excluded)."""
        eos = self._ids["<eos>"]
        answer = list(answer)
        return answer[: answer.index(eos)] if eos in answer else answer

    def reply(self, first_answer: Sequence[int]) -> list[int]:
        """The environment's reply to answer 1: ``<user>``, ``good``/``bad`` per word (``none`` past its
        last word), ``now close <eos> <assistant>``; always ``reply_length`` ids."""
        ids, words = self._ids, self.words(first_answer)
        verdicts = [ids["good"] if w in self.nice_ids else ids["bad"] for w in words[: self.first_turn_tokens]]
        verdicts += [ids["none"]] * (self.first_turn_tokens - len(verdicts))
        return [ids["<user>"], *verdicts, ids["now"], ids["close"], ids["<eos>"], ids["<assistant>"]]

    def turn_scores(self, first_answer: Sequence[int], second_answer: Sequence[int]) -> tuple[float, float]:
        """``(nice share of answer 1, closing share of answer 2)``, each 0 for a turn without words."""
        first, second = self.words(first_answer), self.words(second_answer)
        nice = sum(w in self.nice_ids for w in first) / len(first) if first else 0.0
        closing = sum(w in self.closing_ids for w in second) / len(second) if second else 0.0
        return nice, closing

    def reward(self, first_answer: Sequence[int], second_answer: Sequence[int]) -> float:
        """The episode's reward: the mean of the two turn scores (0 .. 1)."""
        return sum(self.turn_scores(first_answer, second_answer)) / 2


def build_task(first_turn_tokens: int = 3) -> MultiTurnTask:
    """The task with its tokenizer: 6 special tokens, then the words of this module."""
    if first_turn_tokens < 1:
        raise ValueError(f"first_turn_tokens={first_turn_tokens}: give the first answer at least one token.")
    words = [*NICE_WORDS, *NASTY_WORDS, *CLOSING_WORDS, *TOPICS, *PROMPT_WORDS, *FEEDBACK_WORDS]
    return MultiTurnTask(tokenizer=build_tiny_tokenizer(words), first_turn_tokens=first_turn_tokens)


def conversations(held_out: bool) -> list[list[dict]]:
    """Every prompt pattern about the training topics (``held_out=False``: 48) or the held-out ones (12)."""
    topics = [t for t in TOPICS if (t in HELD_OUT_TOPICS) == held_out]
    return [[{"role": "user", "content": p.format(t)}] for t in topics for p in PROMPT_PATTERNS]


def prompt_dataset(task: MultiTurnTask, held_out: bool = False, repeats: int = 1) -> Dataset:
    """PPO prompt rows, each conversation ``repeats`` times: ``input_ids`` (chat template +
    generation prompt) and ``prompt`` (the conversation, what ``rollout_func`` receives)."""
    rows = conversations(held_out) * repeats
    return Dataset.from_dict({"input_ids": [task.prompt_ids(c) for c in rows], "prompt": rows})


def make_rollout_func(task: MultiTurnTask):
    """The episode loop as a ``rollout_func(prompts, trainer)`` (TRL 1.16 GRPO's contract).

    Per batch: render the prompts, sample answer 1 (``task.first_turn_tokens`` at most) with
    ``trainer.generate_continuations``, append the environment's reply, sample answer 2 with
    what is left of ``trainer.args.response_length``. Returns ``prompt_ids``, ``completion_ids``
    (answer 1 + reply + answer 2), the sampler's ``logprobs`` (0.0 at environment tokens, as
    TRL's own loop writes; never read), ``env_mask`` (1 on the policy's tokens), and the columns
    ``first_answer`` / ``second_answer`` (token ids) for ``multiturn_reward``."""

    def rollout_func(prompts, trainer):
        prompt_ids = [task.prompt_ids(p) for p in prompts]
        first, first_logprobs = trainer.generate_continuations(prompt_ids, task.first_turn_tokens)
        replies = [task.reply(a) for a in first]
        budgets = [trainer.args.response_length - len(a) - len(r) for a, r in zip(first, replies)]
        second, second_logprobs = trainer.generate_continuations(
            [p + a + r for p, a, r in zip(prompt_ids, first, replies)], budgets)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [a + r + b for a, r, b in zip(first, replies, second)],
            "logprobs": [la + [0.0] * len(r) + lb for la, r, lb in zip(first_logprobs, replies, second_logprobs)],
            "env_mask": [[1] * len(a) + [0] * len(r) + [1] * len(b) for a, r, b in zip(first, replies, second)],
            "first_answer": first,
            "second_answer": second,
        }

    return rollout_func


def multiturn_reward(first_answer, second_answer, *, task: MultiTurnTask, **kwargs) -> list[float]:
    """The episode reward of each row (``MultiTurnTask.reward``), in GRPO's calling convention:
    the rollout function's ``first_answer`` / ``second_answer`` columns arrive as keywords.
    Bind the task with ``make_reward``."""
    return [task.reward(a, b) for a, b in zip(first_answer, second_answer)]


def make_reward(task: MultiTurnTask):
    """``multiturn_reward`` bound to ``task`` (its metrics are named ``multiturn_reward``)."""
    return functools.partial(multiturn_reward, task=task)
