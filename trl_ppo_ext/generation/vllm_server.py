"""Sampling through a running vLLM server (``trl vllm-serve``, which runs ``vllm serve`` with TRL's
flags): the ``"server"`` mode of ``VLLMArguments``.

Generation is plain HTTP against vLLM's OpenAI-compatible ``/v1/completions`` (prompt token ids
in, token ids and sampled-token log-probs out), one request per prompt so that each carries its
own seed, sent concurrently. Every call has a timeout and a bounded number of retries, and every
error names the URL. The server must return processed log-probs (after the temperature), as
``trl vllm-serve`` sets up (``--logprobs-mode processed_logprobs``).

Weights go as TRL sends them: through TRL's ``VLLMClient`` over vLLM's NCCL weight-transfer
engine (the server started with ``--weight-transfer-config '{"backend": "nccl"}'``, as
``trl vllm-serve`` does); that needs CUDA on the trainer's side. A LoRA policy goes as merged
weights of its policy adapter.

Example (no server needed: the error an HTTP error status becomes):

>>> from trl_ppo_ext.generation.vllm_server import ServerError
>>> issubclass(ServerError, RuntimeError)
True
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .base import EngineSamples, GenerationEngine, SamplingSettings, check_vllm_temperature, request_seeds
from .weights import _is_peft, policy_weights

logger = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The vLLM server answered with an error status."""


def _http_text(url: str, payload: dict | None, timeout: float) -> str:
    """GET (``payload`` None) or POST JSON to ``url``; the answer's text (vLLM answers some calls in
    plain text, some with an empty body).

    Raises ``ServerError`` on an HTTP error status, ``ConnectionError`` when the server cannot be
    reached or does not answer within ``timeout`` seconds; both name the URL."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        body = err.read().decode(errors="replace")[:500]
        raise ServerError(f"The vLLM server at {url} answered HTTP {err.code}: {body}") from err
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"No answer from the vLLM server at {url} within {timeout} s: {reason}") from err


def _http_json(url: str, payload: dict | None, timeout: float) -> dict:
    """:func:`_http_text`, its answer decoded as JSON."""
    return json.loads(_http_text(url, payload, timeout))


def wait_for_server(base_url: str, timeout: float, interval: float = 1.0) -> None:
    """Poll ``{base_url}/health`` until it answers 200, for at most ``timeout`` seconds.

    Raises ``ConnectionError`` naming the URL and what to do when it never does."""
    deadline = time.monotonic() + timeout
    url = f"{base_url}/health"
    while True:
        remaining = deadline - time.monotonic()
        try:
            request = urllib.request.Request(url)
            with urllib.request.urlopen(request, timeout=max(min(remaining, 10.0), 0.1)) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
            pass
        if time.monotonic() + interval > deadline:
            raise ConnectionError(
                f"The vLLM server at {base_url} did not answer {url} within vllm_server_timeout={timeout} s. Start it "
                "first (`trl vllm-serve --model <policy>`), or check vllm_server_base_url / vllm_server_host / "
                "vllm_server_port."
            )
        time.sleep(interval)


def _with_retries(call, retries: int, backoff: float):
    """``call()``, retried up to ``retries`` more times on ``ConnectionError`` or a 5xx answer."""
    for attempt in range(retries + 1):
        try:
            return call()
        except (ConnectionError, ServerError) as err:
            server_side = isinstance(err, ConnectionError) or " HTTP 5" in str(err)
            if attempt == retries or not server_side:
                raise
            time.sleep(backoff * 2**attempt)


class VLLMServerEngine(GenerationEngine):
    """Samples through a vLLM server at ``base_url``.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"`` (``VLLMArguments.vllm_server_url``).
        timeout: seconds to wait for the server's health check at start, and for each request.
        group_port: port of the NCCL group that carries weights (``vllm_group_port``).
        adapter: the policy adapter of a ``PeftModel`` policy (merged into the pushed weights).
        retries: extra attempts of a request after a connection error or a 5xx answer.
        max_concurrency: requests in flight at once.
    """

    def __init__(self, base_url: str, *, timeout: float = 240.0, group_port: int = 51216,
                 adapter: str | None = None, retries: int = 2, max_concurrency: int = 16, backoff: float = 1.0):
        self.base_url = base_url.rstrip("/")
        self.timeout, self.group_port, self.adapter = timeout, group_port, adapter
        self.retries, self.max_concurrency, self.backoff = retries, max_concurrency, backoff
        self._weight_client = None
        wait_for_server(self.base_url, timeout)
        models = self._call("/v1/models", None)["data"]
        if not models:
            raise ServerError(f"The vLLM server at {self.base_url} serves no model (GET /v1/models is empty).")
        self.model_name = models[0]["id"]

    def _call(self, path: str, payload: dict | None) -> dict:
        url = f"{self.base_url}{path}"
        return _with_retries(lambda: _http_json(url, payload, self.timeout), self.retries, self.backoff)

    def completion_payload(self, prompt: list[int], settings: SamplingSettings, seed: int) -> dict:
        """The ``/v1/completions`` request of one prompt: sampling at the temperature through the
        run's filters, the sampled token's log-prob, ids in and out, stopping at the rollout's stop
        ids only."""
        return {
            "model": self.model_name, "prompt": prompt, "n": 1, "max_tokens": settings.max_tokens,
            "temperature": settings.temperature, **settings.filter_params(),
            "min_tokens": 0, "stop_token_ids": list(settings.stop_token_ids), "ignore_eos": True, "logprobs": 0,
            "seed": seed, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }

    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 generator: torch.Generator | None = None) -> EngineSamples:
        check_vllm_temperature(settings.temperature)
        seeds = request_seeds(len(prompts), generator)

        def one(index: int) -> tuple[list[int], list[float], str | None]:
            answer = self._call("/v1/completions", self.completion_payload(prompts[index], settings, seeds[index]))
            choice = answer["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if logprobs is None or len(logprobs) != len(ids):
                raise ServerError(f"The vLLM server at {self.base_url} returned no log-prob per sampled token; it "
                                  "must be a vLLM server (`trl vllm-serve`) that honours `logprobs`.")
            # "length" before max_tokens: the server's context (--max-model-len) ran out; the row is a
            # truncated response of these ids (EngineSamples.sampled_mask), never padded to max_tokens
            return ids, [float("nan") if v is None else float(v) for v in logprobs], choice.get("finish_reason")

        if not prompts:
            return EngineSamples(completion_ids=[], logprobs=[], finish_reasons=[])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            answers = list(pool.map(one, range(len(prompts))))
        return EngineSamples(completion_ids=[a[0] for a in answers], logprobs=[a[1] for a in answers],
                             finish_reasons=[a[2] for a in answers])

    def _push_policy(self, policy: nn.Module, version: int) -> None:
        if not torch.cuda.is_available():
            raise NotImplementedError(
                f"vllm_mode='server' pushes the policy's weights to {self.base_url} over NCCL (vLLM's weight-"
                "transfer engine), which needs a CUDA device on the trainer's side. Without CUDA, use "
                "server_weights.VLLMServerFileEngine (PPOConfig.vllm_server_weight_sync='auto', 'adapter' or "
                "'files'), or use vllm_mode='colocate'."
            )
        client = self._client()
        adapter = self.adapter or (policy.active_adapter if _is_peft(policy) else None)
        device = torch.device("cuda", torch.cuda.current_device())
        weights = [(name, t.to(device)) for name, t in policy_weights(policy, adapter)]
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]
        client.update_named_params(metadata, iter(weights))
        client.reset_prefix_cache()

    def _client(self):
        """TRL's ``VLLMClient`` and its NCCL group with the server, made at the first push."""
        if self._weight_client is None:
            from trl.generation.vllm_client import VLLMClient

            client = VLLMClient(base_url=self.base_url, group_port=self.group_port, connection_timeout=self.timeout)
            client.init_communicator(device=torch.cuda.current_device())
            self._weight_client = client
        return self._weight_client

    def close(self) -> None:
        if self._weight_client is not None:
            self._weight_client.close_communicator()
            self._weight_client = None
