"""Rewards beyond one reward model: Python reward functions, verifiable rewards, several combined.

A *reward* is either a sequence-classifier model (read at the last valid response token, as
the trainer reads ``reward_model``) or a Python callable with TRL GRPO's calling convention::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)
        -> list[float | None]     # one per completion; None: "does not apply here"

``prompts`` are the dataset's ``prompt`` column when it has one (text, or a message list for
conversational data), else the decoded prompt tokens; ``completions`` are the decoded responses
(without special tokens), or ``[{"role": "assistant", "content": text}]`` when the prompts are
conversational; ``completion_ids`` the valid response ids (through the EOS). ``async def``
functions run concurrently with each other.

The scores of one completion combine as a weighted sum over the rewards that apply to it
(``PPOConfig.reward_weights``, default 1 each). A completion to which no reward applies is
unscorable (TRL GRPO's rule): its score reads 0, and every estimator leaves it out of its
statistics and gives it advantage 0 (``advantages.scored_rows``), with a warning; NaN or inf pass
through to the non-finite guard, as an RM's would.

Beyond one number per completion: per-token rewards (a function may return, per
completion, ``(token_index, reward)`` pairs or one value per token: :func:`token_rewards`,
:func:`evaluate_rewards_per_token`), per-turn rewards (:class:`TurnRewards`, one value per model
turn of an episode, each on its turn's last token), a process reward model's step scores on the step separators
(``process.process_rewards``), reward models with their own tokenizer (``Reward.tokenizer``,
:func:`with_reward_tokenizers`; the text path is :mod:`trl_ppo_ext.rewards.text`), and
:func:`remote_reward` (:mod:`trl_ppo_ext.rewards.remote`), usable today.

Notation: ``B`` completions, ``T`` response tokens, ``F`` rewards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import functional as F

# `trl_ppo_ext.remote_reward` is the public path; the client lives in its own module
from .remote import RemoteReward, RemoteRewardError, remote_reward

__all__ = [
    "Reward", "RemoteReward", "RemoteRewardError", "TurnRewards", "build_rewards", "call_functions", "check_outputs",
    "check_reward_heads", "combine_scores", "evaluate_rewards", "evaluate_rewards_per_token", "is_token_level",
    "nonfinite_rewards", "processing_class_entries", "remote_reward", "reward_function_kwargs",
    "reward_name", "rewards_per_token", "token_rewards", "turn_positions", "values_and_mask",
    "with_reward_tokenizers",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reward:
    """One reward source: its name (for metrics), the model or callable, and its weight."""

    name: str
    source: nn.Module | Callable
    weight: float
    # a model's own tokenizer when its vocabulary is not the policy's (see `reward_text`); None: it
    # reads the policy's token ids as they are
    tokenizer: object | None = None

    @property
    def is_model(self) -> bool:
        return isinstance(self.source, nn.Module)

    @property
    def is_async(self) -> bool:
        return _is_async(self.source)


def _is_async(fn) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_name(source) -> str:
    """``__name__`` of a function (through ``functools.partial``), the last part of a model's
    ``name_or_path``, else the class name."""
    if isinstance(source, nn.Module):
        path = getattr(getattr(source, "config", None), "_name_or_path", "") or ""
        return path.rstrip("/").split("/")[-1] or type(source).__name__
    while isinstance(source, functools.partial):
        source = source.func
    return getattr(source, "__name__", None) or type(source).__name__


def build_rewards(reward_model, reward_funcs, reward_weights: Sequence[float] | None,
                  environment_rewards: Sequence[Callable] = ()) -> list[Reward]:
    """``reward_model`` (first, if given), ``reward_funcs`` (one or a list) and the environments'
    ``get_reward`` functions (``environment_rewards``, last, weight 1 each: ``reward_weights``
    counts the others only, TRL GRPO's rule) as ``Reward``s.

    Raises ``ValueError`` when there is no reward at all, when ``reward_weights`` does not have
    one weight per reward, or when an entry is neither a model nor a callable.
    """
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [
        reward_funcs]
    sources = ([reward_model] if reward_model is not None else []) + funcs
    if not sources and not environment_rewards:
        raise ValueError(
            "No reward: pass `reward_model` (a sequence classifier with num_labels=1), `reward_funcs` (a callable "
            "or a list of callables/models), or both; or an `environment_factory` whose environments define "
            "`get_reward`."
        )
    for i, source in enumerate(funcs):
        if not isinstance(source, nn.Module) and not callable(source):
            raise ValueError(
                f"reward_funcs[{i}] is a {type(source).__name__}; each reward must be a sequence-classifier model or "
                "a callable fn(prompts, completions, completion_ids, **columns) -> list[float | None]."
            )
    if reward_weights is None:
        weights = [1.0] * len(sources)
    elif len(reward_weights) != len(sources):
        names = [reward_name(s) for s in sources]
        raise ValueError(
            f"PPOConfig.reward_weights has {len(reward_weights)} weights {list(reward_weights)} but there are "
            f"{len(sources)} rewards {names} (reward_model first, then reward_funcs). Give one weight per reward."
        )
    else:
        weights = [float(w) for w in reward_weights]
    everything = sources + list(environment_rewards)
    weights = weights + [1.0] * len(environment_rewards)
    names = _unique_names(everything)
    return [Reward(name, source, weight) for name, source, weight in zip(names, everything, weights)]


def with_reward_tokenizers(rewards: Sequence[Reward], policy_tokenizer, reward_processing_classes=None) -> list[Reward]:
    """``rewards`` with each model's tokenizer attached when its vocabulary is not the policy's.

    Args:
        reward_processing_classes: GRPO's meaning, one entry per reward *model* in the order of
            ``rewards`` (``reward_model`` first, then the models among ``reward_funcs``); None (or
            a None entry) = the model's own tokenizer from its path when loadable, else the
            policy's ids. A single tokenizer stands for a list of one.
    Returns:
        The same rewards; a model whose tokenizer differs gets it as ``Reward.tokenizer`` (the text
        path, :mod:`trl_ppo_ext.rewards.text`), one that shares the policy's vocabulary keeps None
        (the id path, bit-identical to a run without the argument).
    Raises:
        ValueError for a wrong number of entries, or a model whose ids cannot be the policy's and
        whose tokenizer is neither given nor loadable (see ``resolve_reward_tokenizer``).
    """
    from .text import resolve_reward_tokenizer

    tokenizers = iter(processing_class_entries(rewards, reward_processing_classes))
    return [
        replace(r, tokenizer=resolve_reward_tokenizer(r.source, policy_tokenizer, next(tokenizers),
                                                      where=f"reward model {r.name!r}")) if r.is_model else r
        for r in rewards
    ]


def processing_class_entries(rewards: Sequence[Reward], reward_processing_classes=None) -> list:
    """GRPO's ``reward_processing_classes`` as one entry per reward *model* of ``rewards``, in
    order: None -> all None, a single tokenizer -> a list of one. Raises ``ValueError`` naming the
    models when the count differs."""
    models = [r for r in rewards if r.is_model]
    given = reward_processing_classes
    if given is None:
        return [None] * len(models)
    given = list(given) if isinstance(given, (list, tuple)) else [given]
    if len(given) != len(models):
        raise ValueError(
            f"reward_processing_classes has {len(given)} entries but there are {len(models)} reward models "
            f"{[r.name for r in models]} (reward_model first, then the models in reward_funcs). Give one tokenizer (or "
            "None) per reward model."
        )
    return given


def _unique_names(sources) -> list[str]:
    names = [reward_name(s) for s in sources]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def combine_scores(values: torch.Tensor, applies: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each completion's rewards over those that apply to it.

    Args:
        values: ``(B, F)`` float, each reward's value (anything where ``applies`` is False).
        applies: ``(B, F)`` bool, False where a function returned None.
        weights: ``(F,)`` float.
    Returns:
        ``(B,)`` float: ``sum_f weights[f] * values[b, f]`` over ``f`` with ``applies[b, f]``; 0 for a
        row where nothing applies. NaN/inf in an applying value stay (the non-finite guard sees them).

    Example:
        >>> combine_scores(torch.tensor([[1., 5.], [2., 0.]]), torch.tensor([[True, True], [True, False]]),
        ...                torch.tensor([1., 0.5]))
        tensor([3.5000, 2.0000])
    """
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(applies, values * weights.to(values), zero).sum(dim=1)


def check_outputs(name: str, outputs, expected: int, update: int, token_level: bool = False) -> list:
    """A reward function's return value as ``expected`` floats or Nones, or a ``ValueError`` that
    names the function, what it returned and the update. ``token_level=True`` also lets a
    completion's list/1-D tensor through as it is (checked by :func:`token_rewards`)."""
    if isinstance(outputs, torch.Tensor):
        outputs = outputs.tolist()
    try:
        outputs = list(outputs)
    except TypeError:
        raise ValueError(
            f"Reward function {name!r} returned {outputs!r} ({type(outputs).__name__}) at update {update}; it must "
            f"return a list of {expected} floats (or None where it does not apply), one per completion."
        ) from None
    if len(outputs) != expected:
        raise ValueError(
            f"Reward function {name!r} returned {len(outputs)} values at update {update}, expected {expected} (one per "
            f"completion); first values: {outputs[:4]!r}."
        )
    checked = []
    for i, value in enumerate(outputs):
        if value is None or (token_level and is_token_level(value)):
            checked.append(value)
            continue
        if not isinstance(value, (int, float)) and not _is_number(value):
            raise ValueError(
                f"Reward function {name!r} returned {value!r} ({type(value).__name__}) for completion {i} at update "
                f"{update}; each value must be a number, or None where the reward does not apply."
            )
        checked.append(float(value))
    return checked


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return hasattr(value, "__float__")


def call_functions(rewards: Sequence[Reward], kwargs: dict, expected: int, update: int,
                   token_level: bool = False) -> list[list]:
    """Call every reward function with ``kwargs``; ``async`` ones run concurrently.

    Returns one checked list per function, in order (:func:`check_outputs`, ``token_level`` as
    there). An exception inside a function is re-raised as ``RuntimeError`` naming the function
    and the update (the original is chained).
    """
    results: dict[int, object] = {}
    pending = [(i, r) for i, r in enumerate(rewards) if r.is_async]
    for i, r in enumerate(rewards):
        if not r.is_async:
            results[i] = _guarded(r.name, update, lambda r=r: r.source(**kwargs))
    if pending:
        outputs = _run_async([r.source(**kwargs) for _, r in pending], [r.name for _, r in pending], update)
        results.update({i: out for (i, _), out in zip(pending, outputs)})
    return [check_outputs(r.name, results[i], expected, update, token_level) for i, r in enumerate(rewards)]


def _guarded(name: str, update: int, call):
    try:
        return call()
    except Exception as err:
        raise RuntimeError(f"Reward function {name!r} raised {type(err).__name__} at update {update}: {err}") from err


def _run_async(coroutines: list, names: list[str], update: int) -> list:
    """Await ``coroutines`` together; from inside a running event loop (a notebook), in a thread."""

    async def gather():
        outs = await asyncio.gather(*coroutines, return_exceptions=True)
        for name, out in zip(names, outs):
            if isinstance(out, Exception):
                raise RuntimeError(
                    f"Reward function {name!r} raised {type(out).__name__} at update {update}: {out}"
                ) from out
        return outs

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def values_and_mask(columns: list[list[float | None]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked per-function lists -> ``(values (B, F) float32, applies (B, F) bool)``."""
    rows = list(zip(*columns))
    applies = torch.tensor([[v is not None for v in row] for row in rows], dtype=torch.bool, device=device)
    values = torch.tensor([[math.nan if v is None else v for v in row] for row in rows], dtype=torch.float32,
                          device=device)
    return values, applies


def evaluate_rewards(
    rewards: Sequence[Reward], model_scores: Callable[[Reward], torch.Tensor], function_kwargs: Callable[[], dict],
    batch_size: int, update: int, device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every reward on a batch of ``B`` completions, and their weighted sum.

    Args:
        rewards: from :func:`build_rewards`, ``F`` of them.
        model_scores: ``reward -> (B,)`` scores of a model reward (the caller runs the model).
        function_kwargs: ``() -> dict``, the keyword arguments of the reward functions; called
            only when there is a function.
        update: the update number, for error messages.
    Returns:
        ``(scores (B,) float32, values (B, F) float32, applies (B, F) bool)``: the weighted sum
        (:func:`combine_scores`), each reward's value (NaN where it does not apply) and where it
        applies. A completion no reward applies to scores 0, with a warning (the estimators
        leave it out: ``advantages.scored_rows``).
    """
    return _evaluate(rewards, model_scores, function_kwargs, batch_size, update, device)[:3]


# ---------------------------------------------------------------- per-turn rewards
class TurnRewards(float):
    """One completion's rewards, one per model turn: the ``i``-th lands on the last token of the
    episode's ``i``-th model turn (the ``i``-th run of the policy's tokens between environment
    tokens; a completion without turns is one turn, its last valid token).

    Return it per completion from a reward function (or from an environment's ``get_reward``,
    where a plain list means the same): ``TurnRewards([0.0, -0.1, 1.0])``. It is a ``float``
    whose value is the sum, the episode's return, so whatever reads a number (TRL GRPO, a
    sequence-level path here, the critic-free estimators' sequence score) reads the sum.

    The list may be shorter than the episode's turns: the turns after it get no reward (an
    environment's steps end with the last tool call; the model's answer after it is a turn with
    no step). A longer list is an error naming the reward (:func:`token_rewards`).

    Args:
        rewards: the per-turn rewards, numbers (NaN and inf pass through to the non-finite guard).

    Raises:
        ValueError: an entry that is not a number (None included: give 0.0 to a turn without reward).

    Example:
        >>> r = TurnRewards([0.5, 1.0])
        >>> r.turns, float(r), r
        ((0.5, 1.0), 1.5, TurnRewards([0.5, 1.0]))
    """

    turns: tuple[float, ...]

    def __new__(cls, rewards: Sequence[float] | torch.Tensor = ()):
        entries = rewards.tolist() if isinstance(rewards, torch.Tensor) else list(rewards)
        for i, value in enumerate(entries):
            if isinstance(value, bool) or not _is_number(value):
                raise ValueError(
                    f"TurnRewards takes one number per model turn; entry {i} is {value!r} ({type(value).__name__}). "
                    "Give 0.0 to a turn without reward."
                )
        turns = tuple(float(v) for v in entries)
        self = super().__new__(cls, sum(turns))
        self.turns = turns
        return self

    def __reduce__(self):  # pickles (a process gathering outputs) as its turns, not as its sum
        return (TurnRewards, (self.turns,))

    def __repr__(self) -> str:
        return f"TurnRewards({list(self.turns)!r})"


def turn_positions(response_mask: torch.Tensor, action_mask: torch.Tensor | None = None) -> list[list[int]]:
    """The column of each model turn's last token, per row: where a per-turn reward lands.

    Args:
        response_mask: bool ``(B, T)``. action_mask: bool ``(B, T)`` or None (no turns: each
            row is one turn ending at its last valid token).
    Returns:
        ``B`` lists of columns, in turn order (``functional.turn_ends``); empty for a row with no
        valid (action) token.

    Example:
        >>> turn_positions(torch.tensor([[True] * 5]), torch.tensor([[True, True, False, True, False]]))
        [[1, 3]]
    """
    if action_mask is None:  # one turn, ending at the last valid token
        return [torch.nonzero(m).flatten().tolist()[-1:] for m in response_mask.cpu()]
    return [torch.nonzero(row).flatten().tolist() for row in F.turn_ends(action_mask & response_mask).cpu()]


# ---------------------------------------------------------------- per-token (process) rewards
def is_token_level(output) -> bool:
    """Whether one completion's reward is placed on tokens rather than read as one number: a
    list/tuple (pairs or dense values), a 1-D tensor, or a :class:`TurnRewards`, as opposed to
    a plain number or None (a sequence reward)."""
    return isinstance(output, (list, tuple, TurnRewards)) or (isinstance(output, torch.Tensor) and output.dim() == 1)


def token_rewards(outputs: Sequence, response_mask: torch.Tensor, name: str = "reward",
                  action_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One reward's per-completion outputs placed on the response tokens.

    Each completion's output is one of:

    - a number: a sequence reward, placed on the last valid token (as the trainer places scores;
      in an episode with turns the last action token);
    - a list of ``(token_index, reward)`` pairs: each reward on the ``token_index``-th valid token
      of the completion (0 = the first response token, as in ``completion_ids``); rewards named
      for the same token add up;
    - a dense list (or 1-D tensor) of numbers, one per valid token;
    - a :class:`TurnRewards`: its ``i``-th value on the last token of the ``i``-th model turn
      (:func:`turn_positions`: a run of ``action_mask``; without one, the last valid token);
    - None: the reward does not apply (a row of zeros, ``applies`` False).

    Args:
        outputs: ``B`` outputs, one per completion.
        response_mask: bool ``(B, T)``, True = the token counts (the valid tokens of a row, in order).
        name: the reward's name, for errors.
        action_mask: bool ``(B, T)`` inside ``response_mask``, the tokens the policy sampled in an
            episode with turns (None: all of them). Indices still count every response token (as
            ``completion_ids`` does); a non-zero reward on a token outside ``action_mask`` is an
            error, checked once per batch for every function together where the rewards are
            evaluated (:func:`evaluate_rewards_per_token`, ``functional.check_rewards_on_actions``):
            GAE never reads one there.
    Returns:
        ``(rewards (B, T) float32 on response_mask's device, applies (B,) bool)``; ``rewards`` is 0
        wherever ``response_mask`` is False. A row with no valid token gets nothing (as
        ``functional.shaped_rewards``).
    Raises:
        ValueError naming the reward, the completion and the index when an index lies outside the
        completion's valid tokens, a dense list has the wrong length, a ``TurnRewards`` has more
        values than the completion has turns, or an entry is not a number.

    Equivalent naive loop (``cols[b]`` = positions of row ``b``'s valid tokens)::

        for b, out in enumerate(outputs):
            if number: rewards[b, cols[b][-1]] += out
            elif pairs: for k, r in out: rewards[b, cols[b][k]] += r
            elif dense: for k, r in enumerate(out): rewards[b, cols[b][k]] += r
            elif turns: for i, r in enumerate(out.turns): rewards[b, turn_positions(...)[b][i]] += r

    Example:
        >>> mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
        >>> token_rewards([[(0, 0.5), (2, 1.0)], 2.0], mask)[0]
        tensor([[0.5000, 0.0000, 1.0000, 0.0000],
                [0.0000, 2.0000, 0.0000, 0.0000]])
    """
    if len(outputs) != response_mask.shape[0]:
        raise ValueError(f"Reward {name!r} returned {len(outputs)} outputs for {response_mask.shape[0]} completions.")
    cols = [torch.nonzero(m).flatten().tolist() for m in response_mask.cpu()]  # valid positions per row
    last_action = None if action_mask is None else [  # where a number goes: the row's last action token
        (torch.nonzero(m).flatten().tolist() or [None])[-1] for m in action_mask.cpu()]
    turns = None  # each row's turn ends, found once when some output is per turn
    rows, places, values = [], [], []
    for b, out in enumerate(outputs):
        if isinstance(out, TurnRewards):
            turns = turns if turns is not None else turn_positions(response_mask, action_mask)
            if len(out.turns) > len(turns[b]):
                raise ValueError(
                    f"Reward {name!r} returned {len(out.turns)} per-turn rewards {list(out.turns)[:8]} for completion "
                    f"{b}, which has {len(turns[b])} model turns (runs of the policy's tokens between environment "
                    "tokens). Give at most one reward per turn, in turn order; the turns after the list get none."
                )
            rows += [b] * len(out.turns)
            places += turns[b][: len(out.turns)]
            values += list(out.turns)
            continue
        for k, value in _token_entries(name, b, out, len(cols[b])):
            rows.append(b)
            sequence_reward = not is_token_level(out)
            places.append(last_action[b] if sequence_reward and last_action is not None else cols[b][k])
            values.append(value)
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    if rows:
        rewards.index_put_((torch.tensor(rows), torch.tensor(places)), torch.tensor(values, dtype=torch.float32),
                           accumulate=True)
    applies = torch.tensor([out is not None for out in outputs], dtype=torch.bool)
    return rewards.to(response_mask.device), applies.to(response_mask.device)


def _token_entries(name: str, b: int, out, length: int) -> list[tuple[int, float]]:
    """``[(valid-token index, reward), ...]`` of completion ``b``'s output (``length`` valid tokens)."""
    if out is None or (not is_token_level(out) and length == 0):
        return []
    if not is_token_level(out):
        return [(length - 1, _number(name, b, out))]
    entries = out.tolist() if isinstance(out, torch.Tensor) else list(out)
    if all(isinstance(e, (list, tuple)) and len(e) == 2 for e in entries):
        pairs = [(k, _number(name, b, r)) for k, r in entries]
        for k, _ in pairs:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < length:
                raise ValueError(
                    f"Reward {name!r} placed a reward on token index {k!r} of completion {b}, which has {length} valid "
                    f"tokens; indices count the completion's tokens from 0 (as completion_ids), so use 0..{length - 1}."
                )
        return pairs
    if len(entries) != length:
        raise ValueError(
            f"Reward {name!r} returned {len(entries)} per-token values for completion {b}, which has {length} valid "
            "tokens; a dense list needs one value per token, or return (token_index, reward) pairs."
        )
    return [(k, _number(name, b, r)) for k, r in enumerate(entries)]


def _number(name: str, b: int, value) -> float:
    if isinstance(value, bool) or not _is_number(value):
        raise ValueError(
            f"Reward {name!r} returned {value!r} ({type(value).__name__}) for completion {b}; a reward is a number, a "
            "list of (token_index, number) pairs, a list of one number per token, a TurnRewards, or None."
        )
    return float(value)


def evaluate_rewards_per_token(
    rewards: Sequence[Reward], model_scores: Callable[[Reward], torch.Tensor], function_kwargs: Callable[[], dict],
    response_mask: torch.Tensor, update: int, action_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`evaluate_rewards` where a reward function may also return per-token rewards.

    A function none of whose outputs is token-level, and every model, count as there (the
    sequence ``scores``, bit-identical). A function with any token-level output (a list or 1-D
    tensor for some completion) has *all* its outputs placed by :func:`token_rewards` (its numbers
    on the last valid token) and weighted into ``token_rewards`` instead of ``scores``; its column
    of ``values`` is each completion's sum over tokens (NaN where it returned None), for metrics.

    Args:
        response_mask: bool ``(B, T)``. action_mask: bool ``(B, T)`` or None, as
            :func:`token_rewards`. Others as :func:`evaluate_rewards`.
    Returns:
        ``(scores (B,), values (B, F), applies (B, F), token_rewards (B, T) float32 or None)``;
        ``token_rewards`` is None when no function returned a token-level output, else
        ``sum_f weight_f * token_rewards_f`` over the rows where ``f`` applies (0 off the mask),
        to add to the shaped rewards.
    Raises:
        ValueError: a function put a non-zero reward on a token outside ``action_mask`` (checked once
            for the batch, on every token-level function's rewards together; the error names the
            first offending function, its row and index: ``functional.check_rewards_on_actions``).
    """
    return _evaluate(rewards, model_scores, function_kwargs, response_mask.shape[0], update, response_mask.device,
                     response_mask, action_mask)


def _evaluate(rewards, model_scores, function_kwargs, batch_size: int, update: int, device,
              response_mask: torch.Tensor | None = None, action_mask: torch.Tensor | None = None):
    """Both evaluations in one place; ``response_mask`` None: no token-level output is allowed
    (:func:`check_outputs` refuses it), so every function goes to ``scores`` as it always did."""
    values: list = [None] * len(rewards)  # (B,) float32 per reward
    applies: list = [None] * len(rewards)  # (B,) bool per reward
    in_scores = [True] * len(rewards)
    total = None  # (B, T) float32
    placed_by: list[tuple[str, torch.Tensor]] = []  # each token-level function's (B, T), checked together below
    for k, reward in enumerate(rewards):
        if reward.is_model:
            values[k] = model_scores(reward).float().to(device)  # stays on the device: no host round trip
            applies[k] = torch.ones(batch_size, dtype=torch.bool, device=device)
    functions = [k for k, r in enumerate(rewards) if not r.is_model]
    if functions:
        outputs = call_functions([rewards[k] for k in functions], function_kwargs(), batch_size, update,
                                 token_level=response_mask is not None)
        for k, out in zip(functions, outputs):
            if any(is_token_level(o) for o in out):
                placed, applies[k] = token_rewards(out, response_mask, rewards[k].name, action_mask)
                placed_by.append((rewards[k].name, placed))
                values[k] = torch.where(applies[k], placed.sum(1), math.nan)
                part = torch.where(applies[k][:, None], rewards[k].weight * placed, 0.0)
                total = part if total is None else total + part
                in_scores[k] = False
            else:
                column, mask = values_and_mask([out], device)
                values[k], applies[k] = column[:, 0], mask[:, 0]
    if placed_by and action_mask is not None:  # once per batch, naming the function (GAE never reads one there)
        names, placed_all = zip(*placed_by)
        F.check_rewards_on_actions(torch.stack(placed_all), response_mask, action_mask, list(names))
    values, applies = torch.stack(values, dim=1), torch.stack(applies, dim=1)
    none_apply = int((~applies.any(dim=1)).sum()) if functions else 0  # only a function can return None
    if none_apply:
        logger.warning(
            "%d of %d completions got no reward: every reward function returned None for them. They are unscorable "
            "(TRL GRPO's rule): out of their group's baseline, with advantage 0 and no value target (counted in "
            "the metric rewards/unscored). Make a reward apply to every completion you want trained on.",
            none_apply, batch_size,
        )
    weights = torch.tensor([r.weight for r in rewards], device=device)
    counted = applies & torch.tensor(in_scores, dtype=torch.bool, device=device)
    return combine_scores(values, counted, weights), values, applies, total


def say_nonfinite_rewards(rollout, names: Sequence[str], update: int, batch_size: int) -> str | None:
    """:func:`nonfinite_rewards` of a scored rollout (``reward_values`` / ``reward_applies``, ``(B, F)``),
    warned once with what it costs: a non-finite score makes the update's loss non-finite, so its
    optimizer steps are skipped and all ``batch_size`` completions of the update are lost. The cause
    returned is what the skipped step and the non-finite guard name; None when every value is finite
    or the rollout has no per-reward values."""
    if rollout.reward_values is None:
        return None
    cause = nonfinite_rewards(rollout.reward_values, rollout.reward_applies, names)
    if cause is not None:
        logger.warning(
            "Update %d: %s (of %d completions on this process). A non-finite score makes the update's loss "
            "non-finite: its optimizer steps are skipped, so the whole update's %d completions are lost (the "
            "non-finite guard, nonfinite_halt_after, halts a run of such updates). Return a finite number, or "
            "None where a reward does not apply.", update, cause, rollout.batch_size, batch_size)
    return cause


def nonfinite_rewards(values: torch.Tensor, applies: torch.Tensor, names: Sequence[str]) -> str | None:
    """Which reward returned a NaN or inf, for which completions: the cause a non-finite guard names.

    Args:
        values: ``(B, F)`` each reward's value (``Rollout.reward_values``). applies: ``(B, F)`` bool.
        names: the ``F`` rewards' names.
    Returns:
        ``"reward 'f' returned nan for completions [1, 5]; ..."`` (a reward's first values, at most
        8 rows each), or None when every applying value is finite. Reads the values on the host.

    Example:
        >>> nonfinite_rewards(torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]]),
        ...                   torch.ones(2, 2, dtype=torch.bool), ["acc", "judge"])
        "reward 'acc' returned inf for completion [1]; reward 'judge' returned nan for completion [0]"
    """
    bad = applies & ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    parts = []
    for f, name in enumerate(names):
        rows = bad[:, f].nonzero().flatten().tolist()
        if not rows:
            continue
        kinds = sorted({repr(float(v)) for v in values[rows, f].tolist()})
        shown = rows[:8] + (["..."] if len(rows) > 8 else [])
        noun = "completion" if len(rows) == 1 else "completions"
        parts.append(f"reward {name!r} returned {' and '.join(kinds)} for {noun} {shown}".replace("'...'", "..."))
    return "; ".join(parts)


def reward_function_kwargs(tokenizer, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                           extras: dict, trainer_state=None, logged: dict | None = None) -> dict:
    """The keyword arguments of a reward function (TRL GRPO's convention) for ``B`` completions.

    Args:
        tokenizer: the policy's; decodes what the dataset does not give as text.
        prompt_ids, completion_ids: ``B`` lists of each row's real prompt ids and valid response
            ids (``rollout.valid_token_ids``).
        extras: the batch's other dataset columns, ``B`` values each; a ``prompt`` column is
            taken as the prompts (text or conversations), else the prompt ids are decoded.
        trainer_state: passed on as ``trainer_state``. logged: ``RewardLogs.kwargs()`` (GRPO's
            ``log_metric`` / ``log_extra``), merged last.
    Returns:
        ``{"prompts", "completions", "completion_ids", "trainer_state", <column>..., <logged>...}``;
        completions are decoded without special tokens, as assistant messages when the prompts
        are conversations.

    Example:
        >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
        >>> tok = build_tiny_tokenizer()  # w0=6, w1=7, <eos>=3
        >>> kwargs = reward_function_kwargs(tok, [[6]], [[7, 3]], {"answer": ["w1"]})
        >>> kwargs["prompts"], kwargs["completions"], kwargs["answer"]
        (['w0'], ['w1'], ['w1'])
    """
    prompts = extras.get("prompt")
    if prompts is None:
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = bool(prompts) and isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {k: v for k, v in extras.items() if k not in ("prompt", "completion", "completion_ids")}
    return {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
            "trainer_state": trainer_state, **columns, **(logged or {})}


def check_reward_heads(rewards: Sequence[Reward], reward_model=None) -> None:
    """Every reward model of ``rewards`` (``reward_model``, first when given, or one in
    ``reward_funcs``) has a score head of one output.

    Raises:
        ValueError: naming the argument (``reward_model`` or ``reward_funcs[i]``), the head's
            width and how to load the model with one label.

    Example:
        >>> check_reward_heads(build_rewards(None, [lambda completions, **kw: [0.0] * len(completions)], None))
    """
    from ..models.prepare import scalar_head_outputs

    from_funcs = list(rewards[1:]) if reward_model is not None else list(rewards)
    for reward in rewards:
        outputs = scalar_head_outputs(reward.source) if reward.is_model else 1
        if outputs != 1:
            where = ("`reward_model`" if reward.source is reward_model
                     else f"`reward_funcs[{from_funcs.index(reward)}]`")
            raise ValueError(
                f"{where}'s score head has {outputs} outputs ({reward.name}); PPO needs a scalar score. Load it "
                "with AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)."
            )


def rewards_per_token(
    rewards: Sequence[Reward], model_scores: Callable[[Reward, Callable[[], dict]], torch.Tensor],
    function_kwargs: Callable[[], dict], response_mask: torch.Tensor, update: int,
    action_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A sampled batch's rewards as the trainer scores them: :func:`evaluate_rewards_per_token`
    with the reward functions' keyword arguments built once (``function_kwargs`` is called at
    most once, also when a model reads them through text: ``model_scores(reward, kwargs)``).

    Returns:
        ``(scores (B,), values (B, F), applies (B, F), token_rewards (B, T) float32 or None)``
        as :func:`evaluate_rewards_per_token`, except that a run with a reward function gets
        zeros where no function returned a token-level output (adding them changes no bit),
        so every process logs the same metrics whichever of them got one; None without any.

    Example:
        >>> rewards = build_rewards(None, [lambda completions, **kw: [[(0, 1.0)] for _ in completions]], None)
        >>> mask = torch.tensor([[True, True]])
        >>> rewards_per_token(rewards, None, lambda: {"completions": ["a"]}, mask, update=1)[3]
        tensor([[1., 0.]])
    """
    kwargs = functools.cache(function_kwargs)  # decoded once per batch, for the functions and any text RM
    scores, values, applies, token = evaluate_rewards_per_token(
        rewards, lambda reward: model_scores(reward, kwargs), kwargs, response_mask, update, action_mask)
    if token is None and any(not r.is_model for r in rewards):
        token = torch.zeros(response_mask.shape, device=response_mask.device)
    return scores, values, applies, token
