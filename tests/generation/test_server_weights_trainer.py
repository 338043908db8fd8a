"""PPOTrainer on a CPU with a real vLLM server on 127.0.0.1 (``vllm_mode="server"``): the engine the
config builds pushes the policy's LoRA adapter as files (``server_weights.VLLMServerFileEngine``, no
CUDA), and after every push the server samples what the trainer's policy computes: at each of two
updates the server's sampled-token log-probs agree with the trainer's forward within 1e-3 (fp32)
while the policy moves. The server process is ours and is stopped at the end of the module. Runs
where vLLM is installed; skipped elsewhere."""

import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.generation.arguments import vllm_installed
from trl_ppo_ext.generation.weights import write_checkpoint
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (see docs/vllm.md)")

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import tiny_setup  # noqa: E402
from tiny_setup import VLLM_SHAPES, prompt_dataset, tiny_config  # noqa: E402

LOGP_BOUND = 1e-3  # fp32, as the colocated engine's trainer tests
STARTUP_SECONDS = 240
LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The URL of a vLLM server of the tiny base policy (fp32) that loads LoRA adapters at run time."""
    root = tmp_path_factory.mktemp("vllm_server_trainer")
    folder = write_checkpoint(build_tiny_causal_lm(build_tiny_tokenizer(pad_equals_eos=True), seed=0, **VLLM_SHAPES),
                              str(root / "policy"))
    port = tiny_setup.free_port()
    with tiny_setup.server_process(tiny_setup.lora_server_command(folder, port), root / "server.log",
                                   VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as process:
        yield f"http://127.0.0.1:{port}", process, root


def _trainer(server, tmp_path, with_value=True, **overrides):
    from trl_ppo_ext import PPOTrainer

    url, process, root = server
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    ac = SharedActorCritic(build_tiny_causal_lm(tok, seed=0, **VLLM_SHAPES), lora_config=LORA, with_value=with_value)
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=STARTUP_SECONDS,
                    total_episodes=8, temperature=1.0, learning_rate=1e-2)
    args = tiny_config(tmp_path, **{**settings, **overrides})
    if process.poll() is not None:
        pytest.fail(f"the server exited ({process.poll()}):\n{(root / 'server.log').read_text()[-3000:]}")
    try:
        return PPOTrainer(args=args, processing_class=tok, model=ac, ref_model=None,
                          reward_model=build_tiny_scorer(tok, seed=2, **VLLM_SHAPES),
                          train_dataset=prompt_dataset(tok, n=8))
    except ConnectionError:
        log = (root / "server.log").read_text()[-3000:]
        pytest.fail(f"the server did not start (exit code {process.poll()}):\n{log}")


def _policy_params(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped.policy.named_parameters()
            if v.requires_grad and ".value." not in k}


def test_a_cpu_trainer_trains_a_lora_policy_through_the_server_with_adapter_files(server, tmp_path):
    from trl_ppo_ext.generation.server_weights import AdapterFilePush, VLLMServerFileEngine

    trainer = _trainer(server, tmp_path)
    engine = trainer.engine
    assert isinstance(engine, VLLMServerFileEngine) and isinstance(engine.push, AdapterFilePush)
    served = []
    activate = engine.push.activate
    engine.push.activate = lambda version: served.append(version) or activate(version)
    before = _policy_params(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    diffs = [h["sampling/sampling_logp_difference/max"] for h in logs]
    print("server (adapter files), logp difference max per update:", diffs)
    assert all(d < LOGP_BOUND for d in diffs), diffs  # the server sampled the trainer's weights of that update
    assert served == [0, 1]  # update 1 sampled the starting adapter, update 2 the adapter after one update
    moved = max((v - before[k]).abs().max().item() for k, v in _policy_params(trainer).items())
    assert moved > 1e-4, "the policy did not move"
    assert trainer.engine is None  # train() closed it (its adapter versions unloaded, its files deleted)


def test_an_asynchronous_run_trains_batches_at_most_max_staleness_versions_old(server, tmp_path):
    trainer = _trainer(server, tmp_path, max_staleness=1, total_episodes=12, off_policy_correction="decoupled",
                       vllm_importance_sampling_correction=False)
    before = _policy_params(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 3
    # batch 0 is sampled by the starting weights; batch k >= 1 by the weights of update k - 1: one version old
    assert [h["async/staleness"] for h in logs] == [0.0, 1.0, 1.0] == [h["policy/lag"] for h in logs]
    assert logs[0]["sampling/sampling_logp_difference/max"] < LOGP_BOUND  # staleness 0: the trainer's weights
    assert all(0 <= h["off_policy/capped_frac"] <= 1 for h in logs)
    print("async: logp gap per update", [h["off_policy/logp_gap_mean"] for h in logs],
          "waited for rollouts", [round(h["async/wait_for_rollout_s"], 3) for h in logs])
    moved = max((v - before[k]).abs().max().item() for k, v in _policy_params(trainer).items())
    assert moved > 1e-4, "the policy did not move"
    assert trainer.engine is None and trainer.sampler._producer is None  # train() stopped the thread


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A vLLM server of the tiny chat policy (a context long enough for a tool episode), LoRA at run time."""
    from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

    root = tmp_path_factory.mktemp("vllm_chat_server")
    model = build_tiny_causal_lm(build_tiny_chat_tokenizer(), seed=0, **CHAT_SHAPES)
    folder = write_checkpoint(model, str(root / "policy"))
    port = tiny_setup.free_port()
    with tiny_setup.server_process(tiny_setup.lora_server_command(folder, port, max_model_len=1024),
                                   root / "server.log", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as process:
        yield f"http://127.0.0.1:{port}", process, root


CHAT_SHAPES = {**VLLM_SHAPES, "max_position_embeddings": 1024}


def test_tool_episodes_are_sampled_ahead_on_the_server_at_their_batchs_version(chat_server, tmp_path):
    # each episode: a scripted tool call (the tiny policy never writes one), the tool's reply, then the
    # policy's answer sampled on the server, all on the producer thread while the trainer updates
    from tiny_setup import TOOL_CALL, multiply, tool_config, tool_dataset

    from trl_ppo_ext import PPOTrainer
    from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

    threads = []

    class Scripted(PPOTrainer):
        def generate_continuations(self, prefixes, max_new_tokens, temperature=None, **kwargs):
            import threading

            threads.append(threading.current_thread().name)
            tok = self.processing_class
            if all("<tool_response>" in tok.decode(p) for p in prefixes):
                return super().generate_continuations(prefixes, max_new_tokens, temperature, **kwargs)
            ids = [tok(TOOL_CALL.format(name="multiply", args='{"a": 6, "b": 7}'), add_special_tokens=False).input_ids
                   for _ in prefixes]
            return ids, [[float("nan")] * len(row) for row in ids]  # scripted: no sampler log-prob

    url, process, root = chat_server
    if process.poll() is not None:
        pytest.fail(f"the server exited ({process.poll()}):\n{(root / 'server.log').read_text()[-3000:]}")
    tok = build_tiny_chat_tokenizer()
    # the scripted turns have no sampler log-probs: no correction weighs the loss with them
    args = tool_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                       vllm_server_timeout=STARTUP_SECONDS, vllm_max_model_length=1024, max_staleness=1,
                       total_episodes=6, temperature=1.0, learning_rate=1e-2, off_policy_correction="none",
                       vllm_importance_sampling_correction=False)
    trainer = Scripted(args=args, processing_class=tok, model=build_tiny_causal_lm(tok, seed=0, **CHAT_SHAPES),
                       reward_funcs=[lambda completions, **kw: [float(len(str(c)) % 3) for c in completions]],
                       train_dataset=tool_dataset(6), tools=[multiply], peft_config=LORA)
    before = _policy_params(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness" in h]
    assert [h["async/staleness"] for h in logs] == [0.0, 1.0, 1.0] == [h["policy/lag"] for h in logs]
    assert all(h["tools/call_frequency"] == 1.0 for h in logs)  # one call per episode, each batch's own
    assert set(threads) == {"rollout-producer"}  # every turn sampled on the producer thread
    moved = max((v - before[k]).abs().max().item() for k, v in _policy_params(trainer).items())
    assert moved > 1e-4, "the policy did not move"
    assert trainer.engine is None and trainer.sampler._producer is None


def test_groups_of_samples_train_with_a_critic_free_estimator_when_sampled_ahead(server, tmp_path):
    # 2 prompts x num_generations=2 per batch, advantage_estimator="grpo": each group is sampled in one batch
    trainer = _trainer(server, tmp_path, with_value=False, max_staleness=1, total_episodes=12, num_generations=2,
                       advantage_estimator="grpo", off_policy_correction="tis",
                       vllm_importance_sampling_correction=False)
    seen = []
    score = trainer.score_rollout
    trainer.score_rollout = lambda sample: seen.append(sample.queries.clone()) or score(sample)
    before = _policy_params(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness" in h]
    assert [h["async/staleness"] for h in logs] == [0.0, 1.0, 1.0]
    for queries in seen:  # the two samples of a prompt on adjacent rows of the same batch
        assert len(queries) == 4 and torch.equal(queries[0], queries[1]) and torch.equal(queries[2], queries[3])
    moved = max((v - before[k]).abs().max().item() for k, v in _policy_params(trainer).items())
    assert moved > 1e-4, "the policy did not move"
