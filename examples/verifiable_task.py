"""A verifiable task for a tiny model: two numbers in, one number out, checked exactly.

A prompt asks for the larger (``max``) or the smaller (``min``) of two numbers from
``0 .. num_values - 1``::

    <user> max 3 17 <eos> <assistant>        answer: 17

rendered with the tiny chat template of ``trl_ppo_ext.tiny``; a correct completion is the
answer's one token followed by ``<eos>``. Every number is a word of the vocabulary, so a
model that has only memorised the pairs it saw gets other pairs wrong; what carries over
to held-out pairs (``split_pairs``) is an order on the number embeddings.

The warm-up data can be *noisy* (``sft_dataset(correct_fraction=...)``): a share of its
answers is the other operand, as from an annotator who mixed up max and min. A model
fine-tuned on it learns to answer with one of the two operands and picks the right one only
part of the time; an exact-answer reward can teach it which, which is what
``examples/ppo_verifiable.py`` shows.

The pieces:

1. ``build_task`` -> a ``VerifiableTask``: tokenizer, operation, prompts and answers;
2. ``split_pairs`` -> operand pairs for the SFT warm-up, for PPO, and held out from both;
3. ``sft_dataset`` (TRL's conversational prompt-completion format) and ``prompt_dataset``
   (``input_ids`` for PPO, with the ``prompt`` conversation and the ``answer`` that the
   reward functions receive as columns);
4. the reward functions, in TRL GRPO's calling convention: ``exact_answer`` (the
   verifiable reward) and ``format_reward`` (one number, then ``<eos>``); and a held-out
   metric, ``answered_other_operand``;
5. ``sft_warm_up``: TRL's ``SFTTrainer`` on the warm-up pairs.

Used by ``examples/ppo_verifiable.py`` and the tests (which put ``examples/`` on ``sys.path``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from datasets import Dataset

from trl_ppo_ext.tiny import build_tiny_tokenizer

# name -> the answer to (a, b)
OPERATIONS = {
    "max": lambda a, b: max(a, b),
    "min": lambda a, b: min(a, b),
}


@dataclass(frozen=True)
class VerifiableTask:
    """The task: tokenizer, the operation and the range of numbers (see the module docstring)."""

    tokenizer: object  # PreTrainedTokenizerFast over SPECIAL_TOKENS + operation words + numbers
    operation: str = "max"  # a key of OPERATIONS
    num_values: int = 20  # numbers are 0 .. num_values - 1, one token each

    def describe(self) -> str:
        """The task in one sentence."""
        what = {"max": "the larger of", "min": "the smaller of"}[self.operation]
        return (f"'{self.operation} a b' with a, b in 0..{self.num_values - 1}: answer {what} the two numbers "
                "as one number followed by <eos>.")

    def answer(self, a: int, b: int) -> int:
        return OPERATIONS[self.operation](a, b)

    def conversation(self, a: int, b: int) -> list[dict]:
        """The prompt ``[{"role": "user", "content": "max 3 17"}]``."""
        return [{"role": "user", "content": f"{self.operation} {a} {b}"}]

    def prompt_ids(self, a: int, b: int) -> list[int]:
        """Token ids of the prompt rendered with the generation prompt (ends with ``<assistant>``)."""
        out = self.tokenizer.apply_chat_template(self.conversation(a, b), tokenize=True, add_generation_prompt=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    @functools.cached_property
    def number_ids(self) -> frozenset[int]:
        """Token ids of the numbers."""
        return frozenset(self.tokenizer.convert_tokens_to_ids([str(v) for v in range(self.num_values)]))


def build_task(operation: str = "max", num_values: int = 20) -> VerifiableTask:
    """The task with its tokenizer: 6 special tokens, the operation words, then ``0 .. num_values - 1``."""
    if operation not in OPERATIONS:
        raise ValueError(f"operation={operation!r}: choose one of {sorted(OPERATIONS)}.")
    if num_values < 3:
        raise ValueError(f"num_values={num_values}: use at least 3 numbers.")
    words = list(OPERATIONS) + [str(v) for v in range(num_values)]
    return VerifiableTask(tokenizer=build_tiny_tokenizer(words), operation=operation, num_values=num_values)


@dataclass(frozen=True)
class PairSplit:
    """Ordered operand pairs ``(a, b)``, in three disjoint sets."""

    sft: list[tuple[int, int]]  # the SFT warm-up trains on these
    ppo: list[tuple[int, int]]  # PPO's prompts
    held_out: list[tuple[int, int]]  # seen by neither: the before/after accuracy


def split_pairs(task: VerifiableTask, *, num_sft: int, num_held_out: int, seed: int) -> PairSplit:
    """Every ordered pair ``(a, b)``, shuffled and cut into SFT, held-out and PPO pairs (the rest).

    Args:
        task: gives ``num_values`` (``num_values ** 2`` pairs in all).
        num_sft: pairs in the SFT warm-up.
        num_held_out: pairs held out from both SFT and PPO.
        seed: the shuffle.
    """
    total = task.num_values**2
    if num_sft < 1 or num_held_out < 1 or num_sft + num_held_out >= total:
        raise ValueError(
            f"num_sft={num_sft}, num_held_out={num_held_out}: both must be >= 1 and leave PPO at least one of the "
            f"{total} pairs (num_values={task.num_values})."
        )
    pairs = [(a, b) for a in range(task.num_values) for b in range(task.num_values)]
    random.Random(seed).shuffle(pairs)
    return PairSplit(sft=pairs[:num_sft], held_out=pairs[num_sft : num_sft + num_held_out],
                     ppo=pairs[num_sft + num_held_out :])


def sft_dataset(task: VerifiableTask, pairs: Sequence[tuple[int, int]], *, correct_fraction: float = 1.0,
                seed: int = 0) -> Dataset:
    """TRL's conversational prompt-completion rows: ``{"prompt": [user turn], "completion": [assistant turn]}``.

    ``SFTTrainer`` renders both with the chat template and trains on the completion's tokens
    only: ``"<assistant> 17 <eos>"`` minus the generation prompt, i.e. ``17 <eos>``.

    Args:
        task: the task.
        pairs: one row per operand pair.
        correct_fraction: each row's answer is right with this probability; otherwise it is
            the other operand (the min for ``max``), as from an annotator who mixed them up.
        seed: which rows are wrong.
    """
    rng = random.Random(seed)
    answers = []
    for a, b in pairs:
        right = task.answer(a, b)
        answers.append(right if rng.random() < correct_fraction else (b if right == a else a))
    return Dataset.from_dict({
        "prompt": [task.conversation(a, b) for a, b in pairs],
        "completion": [[{"role": "assistant", "content": str(x)}] for x in answers],
    })


def prompt_dataset(task: VerifiableTask, pairs: Sequence[tuple[int, int]]) -> Dataset:
    """PPO prompts: ``input_ids`` (chat template + generation prompt), and the columns the reward
    functions receive: ``prompt`` (the conversation, so completions arrive as messages, as in
    GRPO) and ``answer`` (the correct number, as text)."""
    return Dataset.from_dict({
        "input_ids": [task.prompt_ids(a, b) for a, b in pairs],
        "prompt": [task.conversation(a, b) for a, b in pairs],
        "answer": [str(task.answer(a, b)) for a, b in pairs],
    })


# ------------------------------------------------------------------------ reward functions
def completion_text(completion) -> str:
    """The text of a completion: a string, or ``[{"role": "assistant", "content": text}]``."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's text (special tokens removed, whitespace stripped) is exactly the
    answer, else 0.0. A completion cut off after the right number (``17 17 ...``) scores 0.

    Example:
        >>> exact_answer(completions=["17", " 17 ", "17 3", ""], answer=["17", "17", "17", "17"])
        [1.0, 1.0, 0.0, 0.0]
    """
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answer)]


def format_reward(completion_ids, *, number_ids: frozenset[int], eos_token_id: int, **kwargs) -> list[float]:
    """1.0 when the completion is one number token then the EOS, else 0.0; whether the number is
    right does not matter. Bind the vocabulary with ``make_format_reward``.

    Example (numbers 6..8, EOS 3):
        >>> format_reward([[7, 3], [7], [7, 7, 3], [3]], number_ids=frozenset({6, 7, 8}), eos_token_id=3)
        [1.0, 0.0, 0.0, 0.0]
    """
    return [float(len(ids) == 2 and ids[0] in number_ids and ids[1] == eos_token_id) for ids in completion_ids]


def make_format_reward(task: VerifiableTask):
    """``format_reward`` bound to the task's vocabulary (its metrics are named ``format_reward``)."""
    return functools.partial(format_reward, number_ids=task.number_ids, eos_token_id=task.tokenizer.eos_token_id)


def answered_other_operand(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the answer is the operand that is *not* the right one (the min for ``max``): the
    warm-up's wrong habit (see ``sft_dataset``). 0.0 otherwise, and for ``a == b``.

    A held-out metric, not a reward: ``prompts`` are texts such as ``"max 3 17"`` (chat markers
    around them are skipped) or conversations, ``completions`` texts (a final ``<eos>`` is
    ignored) or messages.

    Example:
        >>> answered_other_operand(["max 3 17", "<user> max 3 17 <assistant>", "max 5 5"], ["3 <eos>", "17", "5"])
        [1.0, 0.0, 0.0]
    """
    out = []
    for prompt, completion in zip(prompts, completions):
        words = completion_text(prompt).split()
        start = next(i for i, w in enumerate(words) if w in OPERATIONS)
        operation, a, b = words[start : start + 3]
        answer = completion_text(completion).replace("<eos>", " ").strip()
        right = str(OPERATIONS[operation](int(a), int(b)))
        other = b if right == a else a
        out.append(float(a != b and answer == other))
    return out


# ---------------------------------------------------------------------------- SFT warm-up
def sft_warm_up(task: VerifiableTask, model, pairs: Sequence[tuple[int, int]], output_dir: str, *, max_steps: int,
                learning_rate: float, correct_fraction: float = 1.0, batch_size: int = 32, seed: int = 0,
                progress: bool = False):
    """Fine-tune ``model`` in place on ``pairs`` with TRL's ``SFTTrainer`` (loss on the completion only).

    Args:
        task: gives the tokenizer (``processing_class``) and the answers.
        model: a causal LM over ``task.tokenizer``'s vocabulary; every weight is trained.
        pairs: the SFT pairs, one row each (``sft_dataset``).
        output_dir: the Trainer's directory; nothing is saved there (``save_strategy="no"``).
        max_steps: optimizer steps (batches of ``batch_size`` rows, repeating epochs).
        learning_rate: AdamW step size, constant.
        correct_fraction, seed: the share of right answers in the rows and which rows are
            wrong (``sft_dataset``); ``seed`` also seeds the Trainer's shuffling.
        progress: show the Trainer's progress bar.

    Returns:
        The model, in eval mode.
    """
    from synthetic_task import _no_checkpointing
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        seed=seed,
        bf16=False,  # the tiny model trains in fp32
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=max(1, max_steps // 4),
        disable_tqdm=not progress,
        dataloader_pin_memory=False,  # pinning warns on a machine without an accelerator
        **_no_checkpointing(SFTConfig),
    )
    trainer = SFTTrainer(model=model, args=args, processing_class=task.tokenizer,
                         train_dataset=sft_dataset(task, pairs, correct_fraction=correct_fraction, seed=seed))
    trainer.train()
    return trainer.model.eval()
