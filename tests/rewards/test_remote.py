"""remote_reward against a real HTTP server on 127.0.0.1: OpenRLHF's request and reply, batches
in order, and each failure (slow, 5xx, 4xx, malformed, dropped) either retried or a clear error
that names the URL, never a wrong reward. Timeouts are 0.2 s and backoff 0, so the file is fast."""

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_ppo_ext.rewards.scoring import RemoteRewardError, remote_reward  # the public path
from trl_ppo_ext.tiny import build_tiny_tokenizer

FAST = dict(timeout=0.2, backoff=0.0)


class RewardServer:
    """A reward service on a free port of 127.0.0.1. Each request takes the next action of
    ``script`` (then ``"ok"`` for ever): ``ok`` answers one reward per query (the number of words
    in it), ``slow`` answers only after ``release`` is set (or 2 s), ``500``/``400`` answer that status,
    ``not_json``/``no_key``/``short``/``text`` answer a malformed 200, ``extras`` adds
    OpenRLHF's ``extra_logs`` (the word counts, a number, and two entries of wrong shapes),
    ``drop`` closes the connection without a reply, ``cut`` sends half a body and closes.
    ``requests`` records every decoded request body, in arrival order."""

    def __init__(self):
        self.script, self.requests, self.release = [], [], threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append({"path": self.path, "payload": payload,
                                            "auth": self.headers.get("Authorization")})
                    action = server.script.pop(0) if server.script else "ok"
                server.act(self, action, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @staticmethod
    def rewards(payload):
        return [float(len(q.split())) for q in payload["query"]]

    def act(self, handler, action, payload):
        if action == "drop":
            handler.close_connection = True
            return
        if action == "slow":
            self.release.wait(timeout=2)
        body = {
            "ok": {"rewards": self.rewards(payload), "scores": self.rewards(payload), "extra_logs": {}},
            "cut": {"rewards": self.rewards(payload)},
            "slow": {"rewards": self.rewards(payload)},
            "no_key": {"scores": self.rewards(payload)},
            "short": {"rewards": self.rewards(payload)[:-1]},
            "text": {"rewards": ["high"] * len(payload["query"])},
            "extras": {"rewards": self.rewards(payload),
                       "extra_logs": {"words": self.rewards(payload), "version": 3, "bad": "x",
                                      "short": self.rewards(payload)[:-1]}},
        }.get(action)
        status = int(action) if action.isdigit() else 200
        raw = b"<html>oops" if action == "not_json" else json.dumps(body or {"error": "boom"}).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(raw)))
            handler.end_headers()
            handler.wfile.write(raw[: len(raw) // 2] if action == "cut" else raw)
        except OSError:  # the client gave up (slow): nothing to answer
            pass
        if action == "cut":
            handler.close_connection = True

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    with RewardServer() as s:
        yield s


def call(fn, prompts, completions, **kwargs):
    return asyncio.run(fn(prompts=prompts, completions=completions, **kwargs))


PROMPTS = ["a b", "c", "d e f", "g", "h i"]
COMPLETIONS = [" x", " y z", " w", " v u t", " s"]
# words in prompt + completion: "a b x" 3, "c y z" 3, "d e f w" 4, "g v u t" 4, "h i s" 3
EXPECTED = [3.0, 3.0, 4.0, 4.0, 3.0]


# ---------------------------------------------------------------- normal use
def test_openrlhf_request_and_reply(server):
    fn = remote_reward(server.url, label_key="answer", columns=["level"], headers={"Authorization": "Bearer t"},
                       **FAST)
    rewards = call(fn, PROMPTS[:2], COMPLETIONS[:2], completion_ids=[[1], [2, 3]], answer=["7", "8"],
                   level=[1, 2], trainer_state=object())
    assert rewards == [3.0, 3.0]
    (request,) = server.requests
    assert request["path"] == "/get_reward" and request["auth"] == "Bearer t"
    assert request["payload"] == {"query": ["a b x", "c y z"], "prompts": ["a b", "c"], "labels": ["7", "8"],
                                  "completions": [" x", " y z"], "level": [1, 2]}


def test_batches_split_in_order(server):
    fn = remote_reward(server.url, batch_size=2, max_concurrent_requests=3, **FAST)
    assert call(fn, PROMPTS, COMPLETIONS) == EXPECTED
    # 5 rows in batches of 2: [0, 1], [2, 3], [4]; arrival order may differ, the reply order may not
    sent = sorted(r["payload"]["prompts"] for r in server.requests)
    assert sent == [["a b", "c"], ["d e f", "g"], ["h i"]]


def test_labels_default_to_empty_strings_and_null_means_does_not_apply(server):
    fn = remote_reward(server.url, **FAST)
    call(fn, ["p"], ["q"])
    assert server.requests[0]["payload"]["labels"] == [""]
    assert fn.parse_reply(b'{"rewards": [null, 2, 0.5]}', 3) == [None, 2.0, 0.5]
    assert math.isnan(fn.parse_reply(b'{"rewards": [NaN]}', 1)[0])  # left to the non-finite guard


def test_conversational_prompts_are_rendered_with_the_tokenizers_chat_template(server):
    tok = build_tiny_tokenizer()
    fn = remote_reward(server.url, tokenizer=tok, **FAST)
    messages = [{"role": "user", "content": "w1 w2"}]
    eos = tok.eos_token_id
    w3 = tok.convert_tokens_to_ids("w3")
    call(fn, [messages], [[{"role": "assistant", "content": "w3"}]], completion_ids=[[w3, eos]])
    payload = server.requests[0]["payload"]
    # TINY_CHAT_TEMPLATE: "<user> w1 w2 <eos> " then the generation prompt "<assistant> "
    assert payload["prompts"] == ["<user> w1 w2 <eos> <assistant> "]
    # the query ends with the ids decoded with their special tokens, as OpenRLHF's does
    assert payload["query"] == ["<user> w1 w2 <eos> <assistant> w3 <eos>"]
    assert payload["completions"] == ["w3"]
    with pytest.raises(ValueError, match="conversational.*pass `tokenizer=`"):
        call(remote_reward(server.url, **FAST), [messages], ["w3"])


# ---------------------------------------------------------------- failures: retried
def test_slow_server_times_out_then_the_retry_succeeds(server):
    server.script = ["slow"]
    assert call(remote_reward(server.url, max_retries=1, **FAST), PROMPTS[:1], COMPLETIONS[:1]) == [3.0]
    assert len(server.requests) == 2  # the slow attempt and its retry


def test_slow_server_gives_up_with_the_url_and_the_timeout(server):
    server.script = ["slow"] * 3
    fn = remote_reward(server.url, max_retries=2, **FAST)
    with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 3 times .*no complete reply within "
                                                r"timeout=0.2 s"):
        call(fn, PROMPTS[:1], COMPLETIONS[:1])
    assert len(server.requests) == 3


def test_a_500_is_retried_then_named_with_its_status(server):
    server.script = ["500"]
    assert call(remote_reward(server.url, max_retries=1, **FAST), PROMPTS[:1], COMPLETIONS[:1]) == [3.0]
    server.script = ["503", "500"]
    with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 2 times.*HTTP 500 Internal Server Error: "
                                                r"'\{\"error\": \"boom\"\}'"):
        call(remote_reward(server.url, max_retries=1, **FAST), PROMPTS[:1], COMPLETIONS[:1])


@pytest.mark.parametrize("action", ["drop", "cut"])
def test_a_dropped_connection_is_retried_then_named(server, action):
    server.script = [action]
    assert call(remote_reward(server.url, max_retries=1, **FAST), PROMPTS[:1], COMPLETIONS[:1]) == [3.0]
    server.script = [action] * 2
    with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 2 times.*connection failed"):
        call(remote_reward(server.url, max_retries=1, **FAST), PROMPTS[:1], COMPLETIONS[:1])


def test_a_refused_connection_is_named():
    with RewardServer() as gone:
        url = gone.url
    with pytest.raises(RemoteRewardError, match=rf"{url} failed 2 times.*connection failed \(ConnectionRefused"):
        call(remote_reward(url, max_retries=1, **FAST), ["p"], ["q"])


# ---------------------------------------------------------------- failures: never retried, never used
@pytest.mark.parametrize("action, message", [
    ("400", r"answered HTTP 400 Bad Request: .*not retried"),
    ("not_json", r"replied with a body that is not JSON: '<html>oops'"),
    ("no_key", r"replied without 'rewards' \(score_key\); it sent \['scores'\]"),
    ("short", r"replied with 1 values in 'rewards' for 2 completions"),
    ("text", r"replied 'high' for completion 0 of the request; each reward must be a number"),
])
def test_a_malformed_reply_is_an_error_naming_the_url(server, action, message):
    server.script = [action]
    with pytest.raises(RemoteRewardError, match=rf"Remote reward {server.url} {message}"):
        call(remote_reward(server.url, max_retries=3, **FAST), PROMPTS[:2], COMPLETIONS[:2])
    assert len(server.requests) == 1


def test_one_bad_batch_fails_the_whole_call(server):
    server.script = ["ok", "short"]
    with pytest.raises(RemoteRewardError, match="replied with 1 values"):
        call(remote_reward(server.url, batch_size=2, max_concurrent_requests=1, **FAST), PROMPTS[:4],
             COMPLETIONS[:4])


def test_booleans_are_not_rewards():
    fn = remote_reward("http://127.0.0.1:1/x")
    with pytest.raises(RemoteRewardError, match="replied True for completion 1"):
        fn.parse_reply(b'{"rewards": [1, true]}', 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(url="ftp://host/x"), r"url='ftp://host/x' is not an http\(s\) URL"),
    (dict(url="http://h/x", batch_size=0), r"batch_size=0; it must be an integer >= 1"),
    (dict(url="http://h/x", max_retries=-1), r"max_retries=-1; it must be an integer >= 0"),
    (dict(url="http://h/x", timeout=0), r"timeout=0; it must be a number of seconds > 0"),
    (dict(url="http://h/x", backoff=-1), r"backoff=-1; it must be a number of seconds >= 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        remote_reward(**kwargs)


def test_missing_and_unserializable_columns_are_named():
    fn = remote_reward("http://127.0.0.1:1/x", label_key="solution")
    with pytest.raises(ValueError, match=r"column\(s\) \['solution'\].*its columns are \['answer'\]"):
        fn.payloads(["p"], ["c"], columns={"answer": ["1"], "trainer_state": None})
    fn = remote_reward("http://127.0.0.1:1/x", columns=["blob"], max_retries=0)
    with pytest.raises(ValueError, match="not JSON-serializable"):
        call(fn, ["p"], ["c"], blob=[object()])


def test_extra_logs_reach_log_metric_as_means_over_the_completions(server, caplog):
    server.script = ["extras"] * 3
    fn = remote_reward(server.url, batch_size=2, name="judge", **FAST)  # 3 requests: 2 + 2 + 1 completions
    logged = []
    with caplog.at_level("WARNING", logger="trl_ppo_ext.rewards.remote"):
        assert call(fn, PROMPTS, COMPLETIONS, log_metric=lambda n, v: logged.append((n, v))) == EXPECTED
    # per completion (3, 3, 4, 4, 3 words): their mean; one number per reply: counted once per reply
    assert sorted(logged) == [("rewards/judge/version", 3.0), ("rewards/judge/words", sum(EXPECTED) / 5)]
    assert "extra_logs['bad']" in caplog.text and "extra_logs['short']" in caplog.text
    assert call(fn, PROMPTS, COMPLETIONS) == EXPECTED  # without a log_metric (called by hand): rewards only


# ---------------------------------------------------------------- in the trainer
def test_a_ppo_run_trains_on_a_remote_reward(make_trainer, tok, server):
    fn = remote_reward(server.url, batch_size=3, max_concurrent_requests=1, **FAST)  # arrival order = row order
    trainer = make_trainer(tok, reward_model=None, reward_funcs=[fn], total_episodes=8)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    kwargs = trainer.reward_function_kwargs(rollout)
    sent = [q for r in server.requests for q in r["payload"]["query"]]
    # the server saw each completion after its prompt, and its word counts are the scores
    assert sent == [p + c for p, c in zip(kwargs["prompts"], kwargs["completions"])]
    assert rollout.scores.tolist() == [float(len(q.split())) for q in sent]
    before = len(server.requests)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(math.isfinite(h["rewards/remote_reward/mean"]) for h in logs)
    # two updates of 4 completions in requests of at most 3: 2 requests per update
    assert len(server.requests) - before == 4


# ---------------------------------------------------------------- one deadline per attempt
class TrickleServer:
    """A raw TCP server on 127.0.0.1 that reads one request, then sends a 200 reply of 45 body bytes
    (``Content-Length: 45``) one byte every ``gap`` seconds -- its status line and headers too when
    ``head=True``. Every byte comes well inside the client's timeout; the whole reply does not.
    It stops at ``stop`` (teardown) or when the client hangs up, so it never outlives its test."""

    BODY = json.dumps({"rewards": [3.0], "pad": "x" * 16}).encode()  # 45 bytes

    def __init__(self, gap: float, head: bool = False):
        import socket

        assert len(self.BODY) == 45
        self.gap, self.head, self.stop = gap, head, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/get_reward"
        self.thread = threading.Thread(target=self.serve, daemon=True)

    def serve(self):
        self.listener.settimeout(5)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            head, _, body = received.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            headers = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 45\r\n\r\n"
            if not self.head:
                conn.sendall(headers)
            for byte in (headers if self.head else b"") + self.BODY:
                if self.stop.wait(self.gap):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:  # the client gave up: done
                    return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.listener.close()
        self.thread.join(timeout=5)


@pytest.mark.parametrize("head", [False, True], ids=["body", "status_line_and_headers"])
def test_a_trickling_server_is_held_to_one_deadline_per_attempt(head):
    import time

    # 45 body bytes (and ~80 header bytes with head=True) at one per 0.05 s: the body alone needs
    # 2.25 s; every byte arrives well inside timeout=0.4 s, so a per-read timeout never fires
    with TrickleServer(gap=0.05, head=head) as server:
        fn = remote_reward(server.url, timeout=0.4, max_retries=0)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 1 times.*no complete reply within "
                                                    r"timeout=0.4 s"):
            call(fn, ["p"], ["q"])
        elapsed = time.monotonic() - started
    assert elapsed < 0.4 + 0.3, elapsed  # the deadline, plus scheduling slack on a busy machine


def test_the_retries_total_is_bounded_by_attempts_times_timeout_plus_the_backoffs():
    import time

    # two attempts of 0.3 s each and one backoff of 0.1 s: at most 0.7 s (plus slack), never the 2.25 s
    # a trickled reply takes; the second attempt is never answered (the server serves one request)
    with TrickleServer(gap=0.05) as server:
        fn = remote_reward(server.url, timeout=0.3, max_retries=1, backoff=0.1)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 2 times"):
            call(fn, ["p"], ["q"])
        elapsed = time.monotonic() - started
    assert elapsed < 2 * 0.3 + 0.1 + 0.3, elapsed


def test_an_integer_too_large_for_a_float_is_an_error_naming_the_url_and_the_completion():
    fn = remote_reward("http://127.0.0.1:1/x")
    huge = "1" + "0" * 400  # 1e400 as a JSON integer: Python reads it, float() cannot hold it
    for reply in (f'{{"rewards": [1, {huge}]}}', f'{{"rewards": [1, [0.5, {huge}]]}}',
                  f'{{"rewards": [1, [[0, {huge}]]]}}'):
        with pytest.raises(RemoteRewardError, match=r"Remote reward http://127.0.0.1:1/x replied '.*1000.*' for "
                                                    r"completion 1 of the request.*too large"):
            fn.parse_reply(reply.encode(), 2)
    # in extra_logs it is not a number a metric can hold: skipped, as other entries of a wrong shape
    assert fn.read_reply(f'{{"rewards": [1], "extra_logs": {{"big": {huge}, "ok": 2}}}}'.encode(), 1).extra_logs \
        == {"ok": (2.0, 1)}
