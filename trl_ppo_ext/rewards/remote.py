"""A reward served over HTTP, as a reward function in TRL GRPO's convention.

``remote_reward(url)`` returns an ``async`` callable for ``PPOTrainer(reward_funcs=...)`` that
speaks OpenRLHF's remote reward-model protocol (``--remote_rm_url``), so services written for
OpenRLHF (``openrlhf.cli.serve_rm``, rule-based reward servers) work as they are.

Request: one ``POST`` of JSON per batch of at most ``batch_size`` completions, in order::

    {"query":       [prompt + completion, ...],   # the text an RM scores
     "prompts":     [prompt, ...],
     "labels":      [label, ...],                 # dataset column `label_key`; "" without one
     "completions": [completion, ...],            # the completion alone (an extra key)
     <column>:      [value, ...], ...}            # each of `columns`, when asked for

Reply: JSON with ``"rewards"`` (``score_key``): one entry per completion of the request, in
its order: a number; JSON ``null`` ("does not apply", a reward function's None); or per-token
rewards, a list of numbers (one per completion token) or of ``[token_index, number]``
pairs, placed by the trainer as a reward function's lists (``rewards.token_rewards``).
OpenRLHF's ``"extra_logs"`` (``{name: one number per completion, or one number}``) are
logged through the trainer's ``log_metric`` (TRL GRPO's) as ``rewards/<name of this
function>/<name>``: the mean over the call's completions. An entry of another shape is
skipped with a warning (it is not a reward). Other keys (``"scores"``) are ignored.

Failures: a timeout, a refused or dropped connection, or HTTP 408/429/5xx is retried up to
``max_retries`` times, waiting ``backoff * 2**k`` seconds (at most ``max_backoff``) before
retry ``k + 1``; then a :class:`RemoteRewardError` names the URL and the last failure. An
attempt has one deadline, ``timeout`` seconds for connect, send, status line, headers and body
together, however slowly the server sends; so one request gives up after at most
``(max_retries + 1) * timeout`` seconds plus the backoffs, ``sum(min(backoff * 2**k, max_backoff)
for k < max_retries)``. Any other HTTP status, a body that is not JSON, a missing key, a wrong
count or a non-number (or an integer too large for a float) is an error at once: a reply that
cannot be read as one number per completion is never used.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from .logs import KWARG_NAMES

logger = logging.getLogger(__name__)

# Statuses worth another try: request timeout, rate limit, and every server-side error.
RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
_MAX_REPLY_BYTES = 64 * 2**20  # a reply larger than this is not a list of rewards
_EXCERPT = 200  # characters of a reply quoted in an error
_LARGEST_FLOAT_INT = int(sys.float_info.max)  # an int above it overflows float()


class RemoteRewardError(RuntimeError):
    """A remote reward service failed or answered something that is not one reward per completion."""


class RemoteReward:
    """The callable :func:`remote_reward` returns; see the module docstring for the protocol.

    ``__name__`` (``name``) is what the trainer logs it as: ``rewards/<name>/mean``.
    """

    def __init__(
        self, url: str, *, tokenizer=None, label_key: str | None = None, columns: Sequence[str] = (),
        score_key: str = "rewards", batch_size: int = 64, max_concurrent_requests: int = 4,
        timeout: float = 60.0, max_retries: int = 3, backoff: float = 1.0, max_backoff: float = 30.0,
        headers: dict[str, str] | None = None, name: str = "remote_reward",
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote_reward: url={url!r} is not an http(s) URL; pass e.g. "
                             "'http://127.0.0.1:5000/get_reward'.")
        for arg, value, low in (("batch_size", batch_size, 1), ("max_concurrent_requests", max_concurrent_requests, 1),
                                ("max_retries", max_retries, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"remote_reward: {arg}={value!r}; it must be an integer >= {low}.")
        for arg, value in (("timeout", timeout), ("backoff", backoff), ("max_backoff", max_backoff)):
            if not value >= 0 or (arg == "timeout" and value == 0):
                raise ValueError(f"remote_reward: {arg}={value!r}; it must be a number of seconds "
                                 f"{'> 0' if arg == 'timeout' else '>= 0'}.")
        self.url, self._parts = url, parts
        self.tokenizer, self.label_key, self.columns = tokenizer, label_key, tuple(columns)
        self.score_key, self.batch_size, self.max_concurrent_requests = score_key, batch_size, max_concurrent_requests
        self.timeout, self.max_retries, self.backoff, self.max_backoff = timeout, max_retries, backoff, max_backoff
        self.headers = dict(headers or {})
        self.__name__ = name

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, name={self.__name__!r})"

    async def __call__(self, prompts, completions, completion_ids=None, log_metric=None,
                       **columns) -> list[float | list | None]:
        """Rewards for ``completions`` (GRPO's convention), one per completion, in order; the
        replies' ``extra_logs`` go to ``log_metric`` when the trainer passes one."""
        payloads = self.payloads(prompts, completions, completion_ids, columns)
        limit = asyncio.Semaphore(self.max_concurrent_requests)

        async def post(payload):
            async with limit:
                return await self._post_with_retries(payload)

        replies = await asyncio.gather(*(post(p) for p in payloads))
        if log_metric is not None:
            for name, mean in _mean_extra_logs(replies).items():
                log_metric(f"rewards/{self.__name__}/{name}", mean)
        return [reward for reply in replies for reward in reply.rewards]

    # ------------------------------------------------------------ the request
    def payloads(self, prompts, completions, completion_ids=None, columns: dict | None = None) -> list[dict]:
        """The JSON bodies for one call: consecutive slices of at most ``batch_size`` rows."""
        columns = columns or {}
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"remote_reward({self.url}): {len(prompts)} prompts for {n} completions.")
        wanted = ([self.label_key] if self.label_key is not None else []) + list(self.columns)
        missing = [k for k in wanted if k not in columns]
        if missing:
            raise ValueError(
                f"remote_reward({self.url}): dataset column(s) {missing} (label_key/columns) are not in the batch; "
                f"its columns are {sorted(k for k in columns if k not in ('trainer_state', *KWARG_NAMES))}."
            )
        prompt_texts = [self._prompt_text(p) for p in prompts]
        completion_texts = [_completion_text(c) for c in completions]
        if self.tokenizer is not None and completion_ids is not None:
            # OpenRLHF decodes the sampled ids with their special tokens (an RM trained on EOS reads it)
            query_ends = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        else:
            query_ends = completion_texts
        rows = {
            "query": [p + c for p, c in zip(prompt_texts, query_ends)],
            "prompts": prompt_texts,
            "labels": list(columns[self.label_key]) if self.label_key is not None else [""] * n,
            "completions": completion_texts,
            **{k: list(columns[k]) for k in self.columns},
        }
        return [{k: v[s:s + self.batch_size] for k, v in rows.items()} for s in range(0, n, self.batch_size)]

    def _prompt_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise ValueError(
                f"remote_reward({self.url}): the prompts are conversational (message lists) and the service reads "
                "text; pass `tokenizer=` (the policy's) so they are rendered with its chat template."
            )
        return self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------ the reply
    async def _post_with_retries(self, payload: dict) -> Reply:
        try:
            body = json.dumps(payload).encode()
        except (TypeError, ValueError) as err:
            raise ValueError(f"remote_reward({self.url}): the request is not JSON-serializable ({err}); send only "
                             "JSON-serializable dataset columns (`label_key`, `columns`).") from err
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                logger.warning("Remote reward %s: %s; retry %d of %d in %.2f s.", self.url, last, attempt,
                               self.max_retries, delay)
                await asyncio.sleep(delay)
            try:
                status, reason, reply = await asyncio.to_thread(
                    post_json, self._parts, body, self.headers, self.timeout)
            except TimeoutError:
                last = f"no complete reply within timeout={self.timeout} s"
                continue
            except (OSError, http.client.HTTPException) as err:  # refused, reset, closed mid-reply
                last = f"connection failed ({type(err).__name__}: {err})"
                continue
            if status in RETRY_STATUSES:
                last = f"HTTP {status} {reason}: {_excerpt(reply)}"
                continue
            if not 200 <= status < 300:
                raise RemoteRewardError(f"Remote reward {self.url} answered HTTP {status} {reason}: {_excerpt(reply)} "
                                        "(not retried: the request itself was refused).")
            return self.read_reply(reply, len(payload["query"]))
        raise RemoteRewardError(
            f"Remote reward {self.url} failed {self.max_retries + 1} times (max_retries={self.max_retries}); last: "
            f"{last}. Check the service, or raise `timeout`/`max_retries`."
        )

    def parse_reply(self, reply: bytes, expected: int) -> list[float | list | None]:
        """The rewards of one reply, or a :class:`RemoteRewardError` naming the URL and the problem."""
        return self.read_reply(reply, expected).rewards

    def read_reply(self, reply: bytes, expected: int) -> Reply:
        """One reply's rewards (see :meth:`parse_reply`) and its readable ``extra_logs``."""
        try:
            data = json.loads(reply)
        except ValueError:
            raise RemoteRewardError(f"Remote reward {self.url} replied with a body that is not JSON: "
                                    f"{_excerpt(reply)}") from None
        if not isinstance(data, dict) or self.score_key not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise RemoteRewardError(f"Remote reward {self.url} replied without {self.score_key!r} (score_key); it "
                                    f"sent {keys}.")
        values = data[self.score_key]
        if not isinstance(values, list) or len(values) != expected:
            got = f"{len(values)} values" if isinstance(values, list) else repr(values)[:_EXCERPT]
            raise RemoteRewardError(f"Remote reward {self.url} replied with {got} in {self.score_key!r} for "
                                    f"{expected} completions; it must send one reward (a number, null or a per-token "
                                    "list) per completion, in order.")
        return Reply([self._entry(v, i) for i, v in enumerate(values)], self._extra_logs(data, expected))

    def _extra_logs(self, data: dict, expected: int) -> dict[str, tuple[float, int]]:
        """``{name: (sum, count)}`` of the reply's ``extra_logs``: per name one number per
        completion, or one number (counted once). Other shapes are skipped with a warning."""
        logs = data.get("extra_logs")
        if logs is None:
            return {}
        if not isinstance(logs, dict):
            logger.warning("Remote reward %s: extra_logs is %s, not an object; not logged.", self.url,
                           type(logs).__name__)
            return {}
        out = {}
        for name, value in logs.items():
            if not _fits_a_float(value):
                logger.warning("Remote reward %s: extra_logs[%r] holds an integer too large for a float; not "
                               "logged.", self.url, name)
            elif _is_json_number(value):
                out[name] = (float(value), 1)
            elif isinstance(value, list) and len(value) == expected and all(map(_is_json_number, value)):
                out[name] = (sum(float(v) for v in value), expected)
            else:
                logger.warning("Remote reward %s: extra_logs[%r] is not one number per completion (%d) nor one "
                               "number; not logged.", self.url, name, expected)
        return out

    def _entry(self, value, i: int):
        """One completion's reward: None, a float, a list of floats (dense per-token) or of
        ``(int, float)`` pairs; anything else is a :class:`RemoteRewardError`."""
        try:
            if value is None or _is_json_number(value):
                return None if value is None else float(value)
            if isinstance(value, list):
                if all(_is_json_number(v) for v in value):
                    return [float(v) for v in value]
                if all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                       and _is_json_number(p[1]) for p in value):
                    return [(p[0], float(p[1])) for p in value]
        except OverflowError:  # a JSON integer of hundreds of digits: Python reads it, a float cannot hold it
            raise RemoteRewardError(
                f"Remote reward {self.url} replied {_excerpt(repr(value).encode())} for completion {i} of the "
                "request: an integer too large for a float (beyond ~1.8e308); each reward must be a finite number."
            ) from None
        raise RemoteRewardError(
            f"Remote reward {self.url} replied {value!r} for completion {i} of the request; each reward must be a "
            "number (or null where it does not apply), or per-token rewards: a list of numbers, one per token, or "
            "of [token_index, number] pairs."
        )


class Reply(NamedTuple):
    """One reply: ``rewards`` (one entry per completion) and ``extra_logs`` as ``{name: (sum, count)}``."""

    rewards: list
    extra_logs: dict


def _mean_extra_logs(replies: Sequence[Reply]) -> dict[str, float]:
    """Each ``extra_logs`` name's mean over the completions of every reply that sent it."""
    sums: dict[str, list[float]] = {}
    for reply in replies:
        for name, (total, count) in reply.extra_logs.items():
            acc = sums.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += count
    return {name: total / count for name, (total, count) in sums.items()}


def _is_json_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits_a_float(value) -> bool:
    """False for an int (or a list holding one) beyond float's range, which ``float()`` refuses."""
    values = value if isinstance(value, list) else [value]
    return not any(isinstance(v, int) and abs(v) > _LARGEST_FLOAT_INT for v in values)


def _completion_text(completion) -> str:
    """A completion as the trainer passes it: text, or ``[{"role": "assistant", "content": text}]``."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


def _excerpt(reply: bytes) -> str:
    text = reply.decode("utf-8", errors="replace")
    return repr(text[:_EXCERPT] + ("..." if len(text) > _EXCERPT else ""))


def post_json(parts, body: bytes, headers: dict, timeout: float) -> tuple[int, str, bytes]:
    """POST ``body`` as JSON; ``(status, reason, reply body)``.

    ``timeout`` is one deadline for the whole exchange: connect, send, the status line, the
    headers and the body. Every socket read gets only what is left of it (:class:`_DeadlineSocket`),
    so a server that trickles its reply a byte at a time still times out at ``timeout``.
    Raises ``TimeoutError`` when it runs out, ``OSError``/``http.client.HTTPException`` when the
    connection fails or closes mid-reply. No proxy is used (``http.client`` directly).
    """
    deadline = time.monotonic() + timeout
    make = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = make(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.connect()
        connection.sock.settimeout(_left(deadline))  # sendall: its timeout bounds the whole send
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("POST", path, body=body,
                           headers={"Content-Type": "application/json", "Accept": "application/json", **headers})
        # read the reply through a socket whose every recv is held to the deadline (http.client's
        # buffered reads make many recvs per line or per read(n), each with the socket's full timeout)
        response = http.client.HTTPResponse(_DeadlineSocket(connection.sock, deadline), method="POST")
        response.begin()
        chunks, size = [], 0
        while not response.isclosed():  # it closes itself once the whole body is read
            chunk = response.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > _MAX_REPLY_BYTES:
                raise RemoteRewardError(f"Remote reward {parts.geturl()} sent a reply larger than {_MAX_REPLY_BYTES} "
                                        "bytes; it must be one list of rewards.")
            chunks.append(chunk)
        if response.length:  # closed before Content-Length bytes came (read(amt) does not raise for it)
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return response.status, response.reason, b"".join(chunks)
    finally:
        connection.close()


class _DeadlineSocket:
    """What ``http.client.HTTPResponse`` reads a reply from: ``sock``, with every receive given
    only the time left until ``deadline`` (a ``TimeoutError`` once none is left)."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str = "rb"):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._sock.recv_into(buffer)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def remote_reward(url: str, **kwargs) -> RemoteReward:
    """An ``async`` reward function (GRPO's convention) that asks an HTTP service for rewards.

    Args:
        url: the service's endpoint, e.g. ``"http://127.0.0.1:5000/get_reward"`` (OpenRLHF's
            ``serve_rm``).
        tokenizer: the policy's tokenizer, optional. With it, conversational prompts are rendered
            with its chat template (needed for them), and ``query`` ends with the completion ids
            decoded *with* special tokens, exactly as OpenRLHF builds it; without it, ``query`` is
            the prompt text followed by the completion text.
        label_key: the dataset column sent as ``labels`` (OpenRLHF's ``--label_key``); default
            None sends ``""`` per row.
        columns: further dataset columns sent under their own names (JSON-serializable).
        score_key: the reply's key holding the rewards (default ``"rewards"``).
        batch_size: at most this many completions per request (default 64); order is kept.
        max_concurrent_requests: requests of one call in flight at once (default 4).
        timeout: seconds one attempt may take in all, from connect to the last byte of the body,
            however slowly the server sends (default 60).
        max_retries: further attempts after a timeout, a connection failure or HTTP 408/429/5xx
            (default 3); ``backoff`` (default 1 s) doubles between them, up to ``max_backoff``
            (default 30 s). A request gives up within ``(max_retries + 1) * timeout`` seconds
            plus those waits (with the defaults: 4 * 60 + 1 + 2 + 4 = 247 s).
        headers: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``).
        name: the reward's name in the logs, ``rewards/<name>/mean`` (default ``"remote_reward"``).

    Returns:
        A :class:`RemoteReward`: ``await fn(prompts=..., completions=..., completion_ids=...,
        **columns)`` gives one float (or None for a JSON null) per completion.

    Example:
        >>> fn = remote_reward("http://127.0.0.1:5000/get_reward", batch_size=16, timeout=30)
        >>> fn.__name__
        'remote_reward'
        >>> fn.payloads(["1 + 1 = "], ["2"])
        [{'query': ['1 + 1 = 2'], 'prompts': ['1 + 1 = '], 'labels': [''], 'completions': ['2']}]
    """
    return RemoteReward(url, **kwargs)
