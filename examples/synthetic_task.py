"""A synthetic RLHF task whose "true" preference fits in one sentence.

The rule (``Task.describe()``): an answer is good when it is made of the ten *nice* words
(kind, clear, true, ...) and stops with ``<eos>`` after 1 to ``max_words`` words. Its true
reward is the share of nice words among the answer's words, plus ``stop_bonus`` for stopping
in time. It ignores the prompt, which keeps it learnable by a tiny random Llama in a few
hundred PPO episodes on a CPU.

The pieces follow the usual RLHF pipeline, with the human replaced by ``true_reward``:

1. ``build_task`` -> a ``Task``: tokenizer with a chat template, prompts, the rule;
2. ``make_preference_pairs`` -> (prompt, chosen, rejected) rows that the rule ranks;
3. ``train_reward_model`` -> a tiny ``LlamaForSequenceClassification`` trained on them with
   TRL's ``RewardTrainer`` (loss ``-log sigmoid(r_chosen - r_rejected)``), and its held-out
   pair accuracy;
4. PPO against that reward model (``examples/ppo_lora.py``); ``Task.true_reward`` and
   ``score_with_reward_model`` measure the policy before and after.

Used by ``examples/ppo_lora.py`` and the tests (which put ``examples/`` on ``sys.path``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from datasets import Dataset

from trl_ppo_ext.models.policy_value import score_at
from trl_ppo_ext.tiny import SPECIAL_TOKENS, build_tiny_scorer, build_tiny_tokenizer

NICE_WORDS = ("kind", "clear", "true", "calm", "warm", "bright", "fair", "safe", "wise", "glad")
NASTY_WORDS = ("rude", "vague", "false", "angry", "cold", "dull", "unfair", "risky", "silly", "sad")
TOPICS = ("cats", "dogs", "rain", "music", "food", "trees", "books", "stars", "sea", "snow")
# Each "{}" is a topic; every word here is in the vocabulary.
PROMPT_PATTERNS = (
    "tell me about {}",
    "what is {}",
    "why {}",
    "how are {}",
    "please describe {}",
    "what about {}",
)
PROMPT_WORDS = ("tell", "me", "about", "what", "is", "why", "how", "are", "please", "describe")


@dataclass(frozen=True)
class Task:
    """The synthetic task: its tokenizer, prompts and true reward (see the module docstring)."""

    tokenizer: object  # PreTrainedTokenizerFast over SPECIAL_TOKENS + the words above
    seed: int = 0  # default seed of make_prompts / make_preference_pairs
    max_words: int = 6  # the answer must stop (emit <eos>) after at most this many words
    stop_bonus: float = 0.5  # added to the nice-word share for stopping in time
    nice_words: tuple[str, ...] = NICE_WORDS

    def describe(self) -> str:
        """The rule in one sentence."""
        return (
            f"A good answer uses only the nice words ({', '.join(self.nice_words)}) and stops with "
            f"<eos> after 1 to {self.max_words} words; true reward = share of nice words "
            f"+ {self.stop_bonus} for stopping in time."
        )

    def make_prompts(self, n: int, seed: int | None = None) -> list[list[dict]]:
        """``n`` one-turn conversations ``[{"role": "user", "content": "tell me about cats"}]``."""
        rng = random.Random(self.seed if seed is None else seed)
        return [
            [{"role": "user", "content": rng.choice(PROMPT_PATTERNS).format(rng.choice(TOPICS))}]
            for _ in range(n)
        ]

    def prompt_dataset(self, n: int, seed: int | None = None) -> Dataset:
        """``make_prompts`` as a ``Dataset`` with a conversational ``prompt`` column."""
        return Dataset.from_dict({"prompt": self.make_prompts(n, seed)})

    def answer_words(self, response: str | Sequence[int]) -> tuple[list[str], bool]:
        """The answer's words (tokens before the first ``<eos>``) and whether an ``<eos>`` ended it.

        Args:
            response: generated text (``"kind calm <eos>"``) or the generated token ids
                without padding (as a list or a 1-D tensor).
        """
        eos = self.tokenizer.eos_token
        if isinstance(response, str):
            tokens = response.split()
        else:
            tokens = self.tokenizer.convert_ids_to_tokens([int(i) for i in response])
        if eos in tokens:
            return tokens[: tokens.index(eos)], True
        return tokens, False

    def true_reward(self, prompt: str | list | None, response: str | Sequence[int]) -> float:
        """The rule, in plain Python: share of nice words + ``stop_bonus`` if it stopped in time.

        Args:
            prompt: the prompt (text or conversation). The rule ignores it; it is in the
                signature because a true preference in general depends on the question.
            response: generated text or token ids, see ``answer_words``.

        Returns:
            A float in ``[0, 1 + stop_bonus]``. An empty answer (``<eos>`` first) scores 0.

        Example: ``"kind calm rude <eos>"`` -> 2/3 + 0.5; ``"kind"`` (no ``<eos>``) -> 1.0.
        """
        words, stopped = self.answer_words(response)
        if not words:
            return 0.0
        nice = set(self.nice_words)
        share = sum(w in nice for w in words) / len(words)
        return share + (self.stop_bonus if stopped and len(words) <= self.max_words else 0.0)

    def token_rewards(self, response: Sequence[int]) -> list[float]:
        """The true reward spread over the response's tokens (a process reward).

        Each nice word gets its share ``1 / len(words)`` on its own token, the ``<eos>`` that
        stops the answer in time gets ``stop_bonus``, every other token 0, so the list sums to
        ``true_reward(None, response)``. An empty answer gets zeros, as its true reward is 0.

        Args:
            response: the generated token ids without padding (``completion_ids``).
        Returns:
            One float per token of ``response``.

        Example: ``"kind rude calm <eos>"`` -> ``[1/3, 0, 1/3, 0.5]`` (sum 2/3 + 0.5).
        """
        ids = [int(i) for i in response]
        words, stopped = self.answer_words(ids)
        out = [0.0] * len(ids)
        if not words:
            return out
        nice = set(self.nice_words)
        for k, word in enumerate(words):
            if word in nice:
                out[k] = 1.0 / len(words)
        if stopped and len(words) <= self.max_words:
            out[len(words)] = self.stop_bonus  # the <eos> right after the last word
        return out

    def prefix_token_rewards(self, response: Sequence[int]) -> list[float]:
        """The true reward spread over the tokens so that each token's reward depends only on
        the tokens up to it: word ``k`` gets ``share(words[:k + 1]) - share(words[:k])`` (the
        change of the nice-word share it causes, ``share([]) = 0``), the ``<eos>`` that stops
        in time gets ``stop_bonus``. The list sums to ``true_reward(None, response)`` as
        ``token_rewards`` does, but there a nice word's ``1 / len(words)`` depends on how many
        words come after it, which later tokens' returns never see.

        Example: ``"kind rude calm <eos>"`` -> ``[1, 1/2 - 1, 2/3 - 1/2, 0.5]`` (sum 2/3 + 0.5).
        """
        ids = [int(i) for i in response]
        words, stopped = self.answer_words(ids)
        out = [0.0] * len(ids)
        nice, count, before = set(self.nice_words), 0, 0.0
        for k, word in enumerate(words):
            count += word in nice
            share = count / (k + 1)
            out[k], before = share - before, share
        if words and stopped and len(words) <= self.max_words:
            out[len(words)] = self.stop_bonus
        return out

    def content_tokens(self) -> tuple[str, ...]:
        """Every token an answer can contain except ``<eos>`` (the end) and ``<pad>`` (padding)."""
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        skip = {self.tokenizer.eos_token, self.tokenizer.pad_token}
        return tuple(tok for tok, _ in vocab if tok not in skip)

    def sample_answer(self, rng: random.Random, max_tokens: int, *, cut_off_prob: float = 0.3) -> list[int]:
        """Token ids of a random answer, as a policy limited to ``max_tokens`` tokens makes them.

        With probability ``cut_off_prob`` the answer is cut off: ``max_tokens`` tokens and no
        ``<eos>`` (what a policy that never stops produces). Otherwise it has 0 to
        ``max_tokens - 1`` tokens followed by ``<eos>``. Each token is a nice word with a
        per-answer probability drawn uniformly from [0, 1] (spreading answers over the whole
        reward range), else any content token.
        """
        pool = self.content_tokens()
        niceness = rng.random()
        cut_off = rng.random() < cut_off_prob
        length = max_tokens if cut_off else rng.randint(0, max_tokens - 1)
        words = [rng.choice(self.nice_words) if rng.random() < niceness else rng.choice(pool)
                 for _ in range(length)]
        ids = self.tokenizer.convert_tokens_to_ids(words)
        return ids if cut_off else ids + [self.tokenizer.eos_token_id]

    def prompt_ids(self, conversation: list[dict]) -> list[int]:
        """Token ids of a prompt conversation rendered with the generation prompt."""
        out = self.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]


def build_task(seed: int = 0, *, max_words: int = 6, stop_bonus: float = 0.5,
               pad_equals_eos: bool = False) -> Task:
    """The task with its tokenizer: 6 special tokens + 40 words (46 ids), left padding.

    Args:
        seed: default seed of the task's random prompts and pairs.
        max_words: an answer stops in time with at most this many words before ``<eos>``.
        stop_bonus: reward for stopping in time.
        pad_equals_eos: make ``<eos>`` the pad token (to exercise pad == EOS handling).
    """
    words = list(NICE_WORDS + NASTY_WORDS + TOPICS + PROMPT_WORDS)
    assert len(set(words)) == len(words) and not set(words) & set(SPECIAL_TOKENS)
    tokenizer = build_tiny_tokenizer(words, pad_equals_eos=pad_equals_eos)
    return Task(tokenizer=tokenizer, seed=seed, max_words=max_words, stop_bonus=stop_bonus)


def make_preference_pairs(task: Task, n: int, seed: int | None = None, *,
                          max_answer_tokens: int = 10, cut_off_prob: float = 0.3) -> Dataset:
    """``n`` preference rows, chosen ranked strictly above rejected by ``task.true_reward``.

    Rows are in TRL's standard preference format with an explicit prompt, plus the token ids
    that ``RewardTrainer`` trains on::

        {"prompt":       "<user> what is rain <eos> <assistant> ",  # chat template + generation prompt
         "chosen":       "kind calm <eos>",                         # the answer as generated
         "rejected":     "dull kind sad rude cold safe why fair kind sad",  # cut off: no <eos>
         "chosen_ids":   prompt ids + answer ids,
         "rejected_ids": prompt ids + answer ids,
         "chosen_reward": 1.5, "rejected_reward": 0.4}

    Why the ids: ``RewardTrainer`` uses ``chosen_ids``/``rejected_ids`` as they are when both
    columns exist. From text alone it would append ``<eos>`` to every answer (the chat template
    closes each assistant turn; standard text gets ``eos_token`` appended), so the reward model
    would never see an answer that was cut off without stopping, which is what a fresh policy
    mostly generates, and would score those blind. The ids are exactly what the PPO trainer
    feeds the reward model: prompt with generation prompt, then the generated tokens.

    Args:
        task: the task (tokenizer, rule, prompts).
        n: number of rows.
        seed: default ``task.seed``.
        max_answer_tokens: the PPO ``response_length``: cut-off answers have this many tokens.
        cut_off_prob: share of answers cut off without ``<eos>`` (see ``Task.sample_answer``).

    Returns:
        A ``Dataset`` with the columns above. When the two answers tie, the second is drawn
        again (a tie carries no preference), so exactly ``n`` rows come back.
    """
    rng = random.Random(task.seed if seed is None else seed)
    prompts = task.make_prompts(n, seed=rng.randrange(2**31))
    rows = {k: [] for k in ("prompt", "chosen", "rejected", "chosen_ids", "rejected_ids",
                            "chosen_reward", "rejected_reward")}
    for prompt in prompts:
        answers = [task.sample_answer(rng, max_answer_tokens, cut_off_prob=cut_off_prob)]
        rewards = [task.true_reward(prompt, answers[0])]
        while len(answers) < 2 or math.isclose(rewards[0], rewards[1]):
            answers[1:] = [task.sample_answer(rng, max_answer_tokens, cut_off_prob=cut_off_prob)]
            rewards[1:] = [task.true_reward(prompt, answers[1])]
        hi, lo = (0, 1) if rewards[0] > rewards[1] else (1, 0)
        head = task.prompt_ids(prompt)
        rows["prompt"].append(task.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        for name, i in (("chosen", hi), ("rejected", lo)):
            rows[name].append(" ".join(task.tokenizer.convert_ids_to_tokens(answers[i])))
            rows[f"{name}_ids"].append(head + answers[i])
            rows[f"{name}_reward"].append(rewards[i])
    return Dataset.from_dict(rows)


def score_with_reward_model(model, tokenizer, prompts_ids: Sequence[Sequence[int]],
                            responses_ids: Sequence[Sequence[int]], *, batch_size: int = 64) -> list[float]:
    """Reward-model scores of ``prompt + response`` read at the last real token.

    The end of each sequence comes from the attention mask of a right-padded batch, never
    from searching for the pad id: with pad == EOS that search (what
    ``LlamaForSequenceClassification.forward`` does) reads the token before a final EOS.

    Args:
        model: a ``*ForSequenceClassification`` with ``num_labels=1`` (a backbone under
            ``model.base_model_prefix`` and a ``score`` head).
        tokenizer: gives the pad id used to fill the batch (any id would do: it is masked).
        prompts_ids: token ids of each prompt (as rendered for the policy), no padding.
        responses_ids: generated token ids of each response, no padding; an EOS, if
            generated, included.
        batch_size: sequences per forward pass.

    Returns:
        One float per (prompt, response), in order. The model's train/eval mode is restored.
    """
    if len(prompts_ids) != len(responses_ids):
        raise ValueError(
            f"score_with_reward_model: {len(prompts_ids)} prompts_ids but {len(responses_ids)} "
            "responses_ids; pass one prompt per response."
        )
    sequences = [[int(t) for t in p] + [int(t) for t in r] for p, r in zip(prompts_ids, responses_ids)]
    return score_sequences(model, sequences, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)


def score_sequences(model, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                    batch_size: int = 64) -> list[float]:
    """Scalar head of ``model`` at the last token of each (unpadded) sequence."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("score_sequences: an empty sequence has no last token to score.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start : start + batch_size]
                width = max(len(s) for s in chunk)
                input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
                attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, seq in enumerate(chunk):  # right padding: real tokens first
                    input_ids[row, : len(seq)] = torch.tensor(seq)
                    attention_mask[row, : len(seq)] = 1
                position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
                last = attention_mask.sum(-1) - 1  # (b,) index of the last real token
                batch = [t.to(device) for t in (input_ids, attention_mask, position_ids)]
                scores.extend(score_at(model, *batch, index=last.to(device)).tolist())
    finally:
        model.train(was_training)
    return scores


def pair_accuracy(model, task: Task, pairs: Dataset, *, batch_size: int = 64) -> float:
    """Fraction of ``pairs`` whose ``chosen_ids`` the model scores strictly above ``rejected_ids``."""
    pad = task.tokenizer.pad_token_id
    chosen = score_sequences(model, pairs["chosen_ids"], pad_token_id=pad, batch_size=batch_size)
    rejected = score_sequences(model, pairs["rejected_ids"], pad_token_id=pad, batch_size=batch_size)
    return sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)


def _no_checkpointing(config_cls) -> dict:
    """Turn activation (gradient) checkpointing off: TRL's configs default it to True.

    transformers 5 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` and
    warns (FutureWarning) when only the old name is set, which TRL's default does.
    """
    names = {f.name for f in dataclasses.fields(config_cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: False}


def train_reward_model(task: Task, pairs_train: Dataset, pairs_eval: Dataset, output_dir: str, *,
                       epochs: float = 3, seed: int = 0, learning_rate: float = 3e-3,
                       batch_size: int = 32, hidden_size: int = 32, num_layers: int = 2,
                       max_steps: int = -1, progress: bool = False):
    """Train a tiny reward model with TRL's ``RewardTrainer``; return it and its held-out accuracy.

    Args:
        task: gives the tokenizer (``processing_class``) and the scorer's vocabulary.
        pairs_train, pairs_eval: rows from ``make_preference_pairs``.
        output_dir: the Trainer's directory; nothing is saved there (``save_strategy="no"``).
        epochs: passes over ``pairs_train``.
        seed: seed of the scorer's random init and of the Trainer's shuffling.
        learning_rate, batch_size: AdamW step size; pairs per step (each is 2 sequences).
        hidden_size, num_layers: size of the ``LlamaForSequenceClassification``.
        max_steps: if > 0, stop after this many steps (for quick tests).
        progress: show the Trainer's progress bar (its logs, every 50 steps, are then
            written under the bar); False prints only those logs.

    Returns:
        ``(model, eval_pair_accuracy)``: the trained model in eval mode, and the fraction of
        ``pairs_eval`` it ranks right, computed by ``pair_accuracy`` (not the Trainer's metric).

    If the task's pad token is ``<eos>``, the reward model gets its own tokenizer copy with
    ``<pad>`` as pad (same ids otherwise): ``LlamaForSequenceClassification`` reads the
    rightmost token that is not the pad id, so with pad == EOS it would never see the final
    ``<eos>`` and could not tell an answer that stopped from one that was cut off.

    Speed: 4000 pairs x 3 epochs take about 15-20 s on one CPU thread. On a busy 2-core
    machine ``torch.set_num_threads(1)`` can be several times faster than two threads.
    """
    from trl import RewardConfig, RewardTrainer

    tokenizer = task.tokenizer
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.pad_token = "<pad>"

    model = build_tiny_scorer(tokenizer, seed=seed, hidden_size=hidden_size,
                              num_layers=num_layers, num_heads=4)
    args = RewardConfig(
        output_dir=output_dir,
        num_train_epochs=epochs,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        bf16=False,  # RewardConfig's default is bf16=True; the tiny model trains in fp32
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=50,
        disable_tqdm=not progress,
        dataloader_pin_memory=False,  # pinning warns on a machine without an accelerator
        **_no_checkpointing(RewardConfig),
    )
    # With chosen_ids/rejected_ids present, RewardTrainer trains on them as they are; the
    # other columns are dropped by remove_unused_columns.
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=pairs_train)
    trainer.train()
    model = trainer.model.eval()
    return model, pair_accuracy(model, task, pairs_eval)
