"""remote_reward's per-token replies (issue 22): a service may answer, per completion, a list
of numbers (one per token) or of [token_index, number] pairs; they reach the tokens they name as
a reward function's lists do. A real server on 127.0.0.1; expected values by hand."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_ppo_ext.rewards.scoring import RemoteRewardError, Reward, evaluate_rewards_per_token, remote_reward


class TokenServer:
    """Answers each query with ``reply(payload)`` as ``{"rewards": ...}``."""

    def __init__(self, reply):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                raw = json.dumps({"rewards": reply(payload), "extra_logs": {"x": [1] * len(payload["query"])}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def test_per_token_replies_reach_the_tokens_they_name():
    # completion 0: pairs (token 0 gets 0.5, token 2 gets 1); completion 1: dense, one per token;
    # completion 2: a number (last token); completion 3: null
    reply = [[[0, 0.5], [2, 1]], [0.25, -1, 2], 3, None]
    with TokenServer(lambda payload: reply) as server:
        fn = remote_reward(server.url, timeout=5.0, backoff=0.0, batch_size=8)
        mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False], [True, False, False]])
        kwargs = {"prompts": ["a"] * 4, "completions": ["x", "y", "z", "w"], "completion_ids": [[1]] * 4}
        scores, values, applies, tokens = evaluate_rewards_per_token(
            [Reward("remote", fn, 2.0)], None, lambda: kwargs, mask, update=1)
    # weight 2: row 0: 1 on token 0, 2 on token 2; row 1: 0.5, -2, 4; row 2: 6 on its last valid token (1)
    assert tokens.tolist() == [[1.0, 0.0, 2.0], [0.5, -2.0, 4.0], [0.0, 6.0, 0.0], [0.0, 0.0, 0.0]]
    assert scores.tolist() == [0.0] * 4 and applies[:, 0].tolist() == [True, True, True, False]
    assert values[:3, 0].tolist() == [1.5, 1.25, 3.0]  # each row's sum over tokens, unweighted


def test_parse_reply_keeps_lists_and_refuses_what_is_not_a_reward():
    fn = remote_reward("http://127.0.0.1:1/x")
    assert fn.parse_reply(b'{"rewards": [[1, 2.5], [[0, 1], [3, -2]], [], 4]}', 4) == [
        [1.0, 2.5], [(0, 1.0), (3, -2.0)], [], 4.0]
    for bad in ('[[1, "a"]]', '[[[0.5, 1]]]', '[[[0, 1, 2]]]', '[[true]]', '[[[true, 1]]]', '[{"a": 1}]'):
        with pytest.raises(RemoteRewardError, match=r"for completion 0 of the request; .*\[token_index, number\]"):
            fn.parse_reply(f'{{"rewards": {bad}}}'.encode(), 1)


def test_a_wrong_token_index_from_the_service_names_the_reward():
    with TokenServer(lambda payload: [[[5, 1.0]]]) as server:
        fn = remote_reward(server.url, timeout=5.0, backoff=0.0)
        with pytest.raises(ValueError, match=r"Reward 'remote_reward' placed a reward on token index 5 of "
                                             r"completion 0, which has 2 valid tokens"):
            evaluate_rewards_per_token([Reward("remote_reward", fn, 1.0)], None,
                                       lambda: {"prompts": ["a"], "completions": ["x"]},
                                       torch.tensor([[True, True]]), update=1)
    assert asyncio.iscoroutinefunction(type(fn).__call__)
