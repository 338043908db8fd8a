"""Weights to a real vLLM server on 127.0.0.1 without CUDA, as files: the server then samples what
a transformers forward of the pushed policy computes (its sampled-token log-probs match), for the
LoRA adapter (one server-side adapter per version, an older version still sampled exactly) and for
full weights reloaded in place. Also the choice between NCCL and files, and the refusals, which
need no server. The server process is ours and is stopped at the end of the module. Runs where
vLLM is installed (the choice and refusal tests everywhere)."""

import os
import time

import pytest
import tiny_setup
import torch

from trl_ppo_ext.generation.arguments import vllm_installed
from trl_ppo_ext.generation.base import SamplingSettings
from trl_ppo_ext.generation.server_weights import adapter_name, choose_server_weight_sync
from trl_ppo_ext.generation.weights import write_checkpoint
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (see docs/vllm.md)")

PROMPTS = [[6, 7, 8], [9, 10], [6, 7, 8, 11, 12, 13], [12, 9]]
SETTINGS = SamplingSettings(max_tokens=8, temperature=0.7)
STARTUP_SECONDS = 240


def _tiny_policy():
    return build_tiny_causal_lm(build_tiny_tokenizer(), hidden_size=128, num_heads=2, num_layers=2,
                                max_position_embeddings=64)


def _lora_policy(base, seed):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("value", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    _randomize_lora_b(model, seed)
    return model


def _randomize_lora_b(model, seed, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)



def _max_logprob_gap(policy, samples) -> float:
    """Largest |log pi_server - log pi_transformers| over the sampled tokens."""
    gap = 0.0
    with torch.no_grad():
        for prompt, ids, logprobs in zip(PROMPTS, samples.completion_ids, samples.logprobs):
            logits = policy(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            reference = torch.log_softmax(logits / SETTINGS.temperature, dim=-1).gather(1, torch.tensor(ids)[:, None])
            gap = max(gap, (reference[:, 0] - torch.tensor(logprobs)).abs().max().item())
    return gap


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(url, base policy)``: a vLLM server of a tiny fp32 policy with LoRA and its dev endpoints."""
    root = tmp_path_factory.mktemp("vllm_server_weights")
    policy = _tiny_policy()
    folder = write_checkpoint(policy, str(root / "policy"))
    port = tiny_setup.free_port()
    with tiny_setup.server_process(tiny_setup.lora_server_command(folder, port), root / "server.log",
                                   VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as process:
        yield f"http://127.0.0.1:{port}", policy, process, root


def _engine(served, **kwargs):
    from trl_ppo_ext.generation.server_weights import VLLMServerFileEngine

    url, _, process, root = served
    try:
        return VLLMServerFileEngine(url, timeout=STARTUP_SECONDS, folder=str(root / "pushed"), **kwargs)
    except ConnectionError:
        log = (root / "server.log").read_text()[-3000:]
        pytest.fail(f"the server did not start (exit code {process.poll()}):\n{log}")


# The adapter test runs first: it needs the server's base weights to be the checkpoint's (the
# full-weights test below replaces them).
@needs_vllm
def test_adapter_versions_are_sampled_as_transformers_and_peft_compute_them(served):
    policy = _lora_policy(_tiny_policy(), seed=1)  # the served base (same seed), LoRA on a copy
    engine = _engine(served, sync="adapter", adapter="default")
    start = time.monotonic()
    assert engine.load_policy(policy, version=1)
    print(f"adapter push (stage + load): {time.monotonic() - start:.3f} s")
    v1 = engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(0))
    assert _max_logprob_gap(policy, v1) < 1e-3

    # versions 2 and 3 staged beside 1 (the trainer's thread), 1 still sampled exactly when asked for
    times = []
    for version in (2, 3):
        _randomize_lora_b(policy, seed=version)
        start = time.monotonic()
        engine.stage_policy(policy, version)
        engine.use_version(version)
        times.append(time.monotonic() - start)
    print(f"adapter push of a new version (stage + load): {min(times):.3f}-{max(times):.3f} s")
    engine.use_version(1)
    again = engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(0))
    assert again.completion_ids == v1.completion_ids
    engine.use_version(3)
    v3 = engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(0))
    assert _max_logprob_gap(policy, v3) < 1e-3
    assert v3.completion_ids != v1.completion_ids

    engine.release_below(3)
    served_models = {m["id"] for m in engine._call("/v1/models", None)["data"]}
    assert adapter_name(3) in served_models and not {adapter_name(1), adapter_name(2)} & served_models
    assert sorted(os.listdir(engine.push.folder)) == ["adapter-v3"]
    engine.close()
    assert not os.path.exists(os.path.join(engine.push.folder, "adapter-v3"))


@needs_vllm
def test_async_rollouts_through_the_server_are_sampled_by_the_version_they_record(served):
    """The producer thread samples through the server while the consumer "updates" the adapter and
    stages each new version: every batch's log-probs are those of the policy version it records."""
    from trl_ppo_ext.async_rollouts import RolloutProducer

    policy = _lora_policy(_tiny_policy(), seed=10)
    engine = _engine(served, sync="adapter", adapter="default")
    snapshots = {}

    def stage(version):  # the trainer's thread, after an update
        snapshots[version] = {k: v.detach().clone() for k, v in policy.state_dict().items() if "lora_B" in k}
        engine.stage_policy(policy, version)

    def sample(version, index):  # the producer's thread
        engine.use_version(version)
        return engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(index))

    stage(0)
    got = []
    with RolloutProducer(sample, max_staleness=1) as producer:
        for k in range(4):
            got.append(producer.get(timeout=120))
            _randomize_lora_b(policy, seed=20 + k)  # the update
            stage(k + 1)
            producer.publish(k + 1)
            engine.release_below(producer.needed_version())
    assert [(b.index, b.version, b.staleness) for b in got] == [(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 2, 1)]
    for item in got:
        policy.load_state_dict(snapshots[item.version], strict=False)
        assert _max_logprob_gap(policy, item.batch) < 1e-3
    engine.close()


@needs_vllm
def test_full_weights_reloaded_from_a_file_are_sampled_as_transformers_computes_them(served):
    policy = _tiny_policy()  # the served checkpoint's weights (same seed)
    engine = _engine(served, sync="files")
    before = engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(0))
    assert _max_logprob_gap(policy, before) < 1e-3  # the checkpoint as served
    gen = torch.Generator().manual_seed(3)
    times = []
    for version in (1, 2, 3):
        with torch.no_grad():  # an "update": every weight moves
            for param in policy.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        start = time.monotonic()
        assert engine.load_policy(policy, version)
        times.append(time.monotonic() - start)
    print(f"full-weights push (write + reload): {min(times):.3f}-{max(times):.3f} s")
    after = engine.generate(PROMPTS, SETTINGS, torch.Generator().manual_seed(0))
    gap = _max_logprob_gap(policy, after)
    print(f"max |log pi_server - log pi_transformers| after 3 pushes: {gap:.2e}")
    assert gap < 1e-3
    assert after.completion_ids != before.completion_ids
    assert sorted(os.listdir(engine.push.folder)) == ["weights-v3"]  # the older files released
    with pytest.raises(KeyError, match="never staged"):
        engine.use_version(1)
    engine.close()


def test_nccl_where_cuda_is_files_elsewhere():
    from peft import LoraConfig, get_peft_model

    plain = _tiny_policy()
    assert choose_server_weight_sync(plain, None, cuda=True) == "nccl"
    assert choose_server_weight_sync(plain, None, cuda=False) == "files"
    lora = get_peft_model(_tiny_policy(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert choose_server_weight_sync(lora, "default", cuda=False) == "adapter"
    on_head = get_peft_model(_tiny_policy(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert choose_server_weight_sync(on_head, "default", cuda=False) == "files"  # vLLM refuses lm_head adapters
    assert choose_server_weight_sync(lora, "default", "files", cuda=True) == "files"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_server_weight_sync(plain, None, "nccl", cuda=False)
    with pytest.raises(ValueError, match="must be 'auto'"):
        choose_server_weight_sync(plain, None, "gloo")


def test_an_adapter_push_refuses_what_vllm_cannot_load(tmp_path):
    from peft import LoraConfig, get_peft_model

    from trl_ppo_ext.generation.server_weights import AdapterFilePush

    push = AdapterFilePush("http://127.0.0.1:9", "default", str(tmp_path))  # never contacted
    with pytest.raises(ValueError, match="needs a peft.PeftModel"):
        push.stage(_tiny_policy(), 1)
    on_head = get_peft_model(_tiny_policy(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="FullFilePush"):
        push.stage(on_head, 1)
    with pytest.raises(KeyError, match="never staged"):
        push.activate(1)
    lora = get_peft_model(_tiny_policy(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    push.stage(lora, 1)
    assert sorted(os.listdir(tmp_path / "adapter-v1")) == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(ValueError, match="staged already"):
        push.stage(lora, 1)
    push.release(below=2)  # nothing was loaded: no request; the files go
    assert os.listdir(tmp_path) == []


def test_full_weights_are_written_whole_under_checkpoint_names(tmp_path):
    from safetensors.torch import load_file

    from trl_ppo_ext.generation.server_weights import FullFilePush

    policy = _tiny_policy()
    push = FullFilePush("http://127.0.0.1:9", str(tmp_path))  # never contacted
    folder = push.stage(policy, 4)
    assert os.listdir(folder) == ["model.safetensors"]  # no partial file left
    written = load_file(os.path.join(folder, "model.safetensors"))
    expected = dict(policy.named_parameters())
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k].detach()) for k in written)


def test_process_0_loads_a_version_at_its_push_and_another_process_follows_it_by_name(tmp_path):
    """``VLLMServerFileEngine.push_version`` is ``stage`` + ``load``, ``follow_version`` is ``follow``:
    checked on the pushes (the engine itself waits for a server when built)."""
    from peft import LoraConfig, get_peft_model

    from trl_ppo_ext.generation.server_weights import AdapterFilePush

    requests = []  # what each process sends the server, recorded instead of sent
    lead, follower = (AdapterFilePush("http://127.0.0.1:9", "default", str(tmp_path / name)) for name in ("p0", "p1"))
    for push in (lead, follower):
        push._post = lambda path, payload, push=push: requests.append((push, path, payload["lora_name"]))
    lora = get_peft_model(_tiny_policy(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lead.stage(lora, 3)
    lead.load(3)  # loaded now, on the trainer's thread, before the others follow
    assert requests == [(lead, "/v1/load_lora_adapter", "policy-v3")]
    follower.follow(3)
    assert follower.activate(3) == lead.activate(3) == "policy-v3"
    assert len(requests) == 1  # the follower loads nothing; the lead's version was loaded already
    follower.release(below=4)  # the follower forgets it; only process 0 unloads it
    lead.release(below=4)
    assert requests[1:] == [(lead, "/v1/unload_lora_adapter", "policy-v3")]
    with pytest.raises(KeyError, match="never staged"):
        follower.activate(3)  # released: no longer followed
