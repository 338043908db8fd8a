"""The server engine's client side against a local fake vLLM server on 127.0.0.1: the requests it
sends (one per prompt, each with its own seed from the caller's RNG, pure sampling, ids in and
out), how it reads the answers, and its timeout and error paths (bounded retries, the URL named).
A real ``trl vllm-serve`` needs vLLM; tests/generation/test_vllm_server.py runs one where it can."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_ppo_ext.generation import VLLMArguments, build_vllm_engine, sample_responses
from trl_ppo_ext.generation.base import SamplingSettings, request_seeds
from trl_ppo_ext.generation.vllm_server import ServerError, VLLMServerEngine

SETTINGS = SamplingSettings(max_tokens=4, temperature=0.7, stop_token_ids=(3,))


class FakeVLLM(BaseHTTPRequestHandler):
    """Answers as vLLM's OpenAI server does for the fields the engine reads. The completion is a
    function of the request: [first prompt id + 1, seed % 7 + 10, 3], log-probs -0.5 each."""

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._answer(200, {})
        elif self.path == "/v1/models":
            self._answer(200, {"data": [{"id": "tiny-policy"}]})
        else:
            self._answer(404, {"error": "no such route"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        behaviour = self.server.behaviour
        self.server.requests.append(payload)
        if behaviour == "slow":
            time.sleep(2.0)
        if behaviour in ("error500", "error400"):
            self._answer(int(behaviour[-3:]), {"error": "engine is unhappy"})
            return
        ids = [payload["prompt"][0] + 1, payload["seed"] % 7 + 10, 3]
        reason = "stop"
        if behaviour == "length":  # the context (--max-model-len) ran out after 2 tokens, before any stop id
            ids, reason = ids[:2], "length"
        logprobs = None if behaviour == "no_logprobs" else {"token_logprobs": [-0.5] * len(ids)}
        self._answer(200, {"choices": [{"token_ids": ids, "logprobs": logprobs, "finish_reason": reason}]})


@pytest.fixture
def fake_server():
    """A fake server on 127.0.0.1 (a free port); its ``behaviour`` may be set by the test."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    server.behaviour, server.requests = "ok", []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_one_seeded_request_per_prompt(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=5)
    assert engine.model_name == "tiny-policy"
    samples = engine.generate([[20, 21], [30], [20, 21]], SETTINGS, torch.Generator().manual_seed(5))
    seeds = request_seeds(3, torch.Generator().manual_seed(5))
    assert samples.completion_ids == [[21, seeds[0] % 7 + 10, 3], [31, seeds[1] % 7 + 10, 3],
                                      [21, seeds[2] % 7 + 10, 3]]
    assert samples.logprobs == [[-0.5] * 3] * 3
    sent = sorted(fake_server.requests, key=lambda p: seeds.index(p["seed"]))
    assert [p["seed"] for p in sent] == seeds  # each prompt its own seed, even the repeated one
    first = sent[0]
    assert (first["prompt"], first["model"], first["max_tokens"], first["temperature"]) == (
        [20, 21], "tiny-policy", 4, 0.7)
    assert (first["top_p"], first["top_k"], first["min_p"], first["repetition_penalty"]) == (1.0, 0, 0.0, 1.0)
    assert (first["stop_token_ids"], first["ignore_eos"], first["logprobs"], first["n"]) == ([3], True, 0, 1)
    assert first["return_token_ids"] is True


def test_an_unreachable_server_is_named_after_the_timeout():
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"http://127.0.0.1:{port} did not answer .*within "
                                              r"vllm_server_timeout=1.5 s.*trl vllm-serve"):
        VLLMServerEngine(f"http://127.0.0.1:{port}", timeout=1.5)
    assert time.monotonic() - start < 10


def test_a_silent_server_times_out_with_bounded_retries(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=0.5, retries=1, backoff=0.01)
    fake_server.behaviour = "slow"
    with pytest.raises(ConnectionError, match=rf"No answer from the vLLM server at {_url(fake_server)}"
                                              r"/v1/completions within 0.5 s"):
        engine.generate([[20]], SETTINGS)
    assert len(fake_server.requests) == 2  # the request and one retry, no more


def test_server_errors_are_retried_and_named(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=5, retries=2, backoff=0.01)
    fake_server.behaviour = "error500"
    with pytest.raises(ServerError, match=rf"{_url(fake_server)}/v1/completions answered HTTP 500"):
        engine.generate([[20]], SETTINGS)
    assert len(fake_server.requests) == 3
    fake_server.behaviour, fake_server.requests[:] = "error400", []
    with pytest.raises(ServerError, match="HTTP 400"):
        engine.generate([[20]], SETTINGS)
    assert len(fake_server.requests) == 1  # a client error is not retried


def test_an_answer_without_logprobs_is_refused(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=5)
    fake_server.behaviour = "no_logprobs"
    with pytest.raises(ServerError, match="returned no log-prob per sampled token"):
        engine.generate([[20]], SETTINGS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; CUDA pushes over NCCL")
def test_pushing_weights_without_cuda_says_what_to_do(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=5)
    with pytest.raises(NotImplementedError, match=rf"{_url(fake_server)} over NCCL.*use vllm_mode='colocate'"):
        engine.load_policy(torch.nn.Linear(2, 2), version=1)
    assert engine.policy_version is None


def test_the_config_builds_a_server_engine_and_the_batch_comes_back_padded(fake_server):
    port = fake_server.server_address[1]
    args = VLLMArguments(vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
                         vllm_server_timeout=5)
    engine = build_vllm_engine(args, policy=None)
    assert isinstance(engine, VLLMServerEngine) and engine.base_url == f"http://127.0.0.1:{port}"
    queries = torch.tensor([[0, 20, 21], [30, 31, 32]])
    query_mask = torch.tensor([[False, True, True], [True, True, True]])
    settings = SamplingSettings(max_tokens=5, temperature=1.0, stop_token_ids=(3,))
    responses, logprobs, sampled = sample_responses(engine, queries, query_mask, settings, pad_token_id=0,
                                                    generator=torch.Generator().manual_seed(2))
    assert sampled.tolist() == [[True] * 3 + [False] * 2] * 2
    seeds = request_seeds(2, torch.Generator().manual_seed(2))
    # the fake answers [first prompt id + 1, seed % 7 + 10, 3]: the real prompt tokens were sent
    assert responses.tolist() == [[21, seeds[0] % 7 + 10, 3, 0, 0], [31, seeds[1] % 7 + 10, 3, 0, 0]]
    assert torch.equal(torch.isnan(logprobs), torch.tensor([[False] * 3 + [True] * 2] * 2))
    assert sorted(p["prompt"] for p in fake_server.requests) == [[20, 21], [30, 31, 32]]


def test_an_answer_ended_for_length_is_a_truncated_response_of_the_tokens_it_holds(fake_server):
    from trl_ppo_ext.rollout import finalize_responses

    engine = VLLMServerEngine(_url(fake_server), timeout=5)
    fake_server.behaviour = "length"
    queries = torch.tensor([[20, 21], [30, 31]])
    # pad id 3 = the stop id (pad == EOS): a pad read as a token would be a sampled stop
    raw, logprobs, sampled = sample_responses(engine, queries, queries != 0, SETTINGS, pad_token_id=3,
                                              generator=torch.Generator().manual_seed(2))
    seeds = request_seeds(2, torch.Generator().manual_seed(2))
    assert raw.tolist() == [[21, seeds[0] % 7 + 10, 3, 3], [31, seeds[1] % 7 + 10, 3, 3]]
    responses, mask, has_stop = finalize_responses(raw, SETTINGS.stop_token_ids, 3, sampled)
    assert mask.tolist() == [[True, True, False, False]] * 2  # the 2 tokens the server sent
    assert has_stop.tolist() == [False, False]  # truncated, not finished
    assert not torch.isnan(logprobs[mask]).any()
    assert engine.generate([[20]], SETTINGS).finish_reasons == ["length"]


def test_a_temperature_vllm_cannot_score_is_refused_before_any_request(fake_server):
    engine = VLLMServerEngine(_url(fake_server), timeout=5)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"temperature=0.001 is below 0.01.*use_vllm=False"):
        engine.generate([[20]], SamplingSettings(max_tokens=4, temperature=0.001))
    assert fake_server.requests == [] and torch.equal(rng, torch.get_rng_state())
