"""PPOConfig's vLLM fields (TRL GRPO's, from ``generation.arguments.VLLMArguments``): parsed from a
command line, checked at construction before anything of a run exists, and the transformers path
untouched when ``use_vllm`` is False. Runs in every environment (the vLLM training tests are
tests/generation/test_vllm_trainer.py)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.generation.arguments import VLLMArguments, vllm_installed
from trl_ppo_ext.generation.base import EngineSamples, GenerationEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_setup import tiny_config  # noqa: E402


def test_every_vllm_field_is_a_ppo_config_field_with_its_default(tmp_path):
    args = tiny_config(tmp_path)
    for f in dataclasses.fields(VLLMArguments):
        assert getattr(args, f.name) == f.default, f.name
    assert args.use_vllm is False and args.vllm_mode == "colocate"


def test_the_fields_carry_trl_grpo_names_and_defaults(tmp_path):
    grpo = pytest.importorskip("trl").GRPOConfig
    theirs = {f.name: f.default for f in dataclasses.fields(grpo)}
    for f in dataclasses.fields(VLLMArguments):
        assert f.name in theirs, f.name
        if f.name != "vllm_importance_sampling_cap":
            assert theirs[f.name] == f.default, (f.name, theirs[f.name], f.default)


def test_command_line_parses_the_vllm_fields(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--vllm_mode", "colocate",
            "--vllm_importance_sampling_mode", "token_truncate", "--vllm_importance_sampling_clip_max", "2.5",
            "--vllm_importance_sampling_correction", "false", "--vllm_gpu_memory_utilization", "0.5"]
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(argv)
    assert (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max) == ("token_truncate", 2.5)
    assert args.vllm_importance_sampling_correction is False and args.vllm_gpu_memory_utilization == 0.5
    assert args.use_vllm is False


def test_the_inherited_field_checks_run(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode must be one of"):
        tiny_config(tmp_path, vllm_mode="remote")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        tiny_config(tmp_path, vllm_importance_sampling_mode="token")


def test_use_vllm_refuses_near_greedy_temperature(tmp_path):
    with pytest.raises(ValueError, match=r"temperature=0.001 with use_vllm=True.*>= 0.01.*use_vllm=False"):
        tiny_config(tmp_path, use_vllm=True, temperature=0.001)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_server_mode_with_an_nccl_push_without_cuda_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode='server' .*'nccl' needs CUDA.*'auto'.*colocate"):
        tiny_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_weight_sync="nccl")


@pytest.mark.skipif(not vllm_installed(), reason="use_vllm=True needs vLLM installed")
def test_server_mode_without_cuda_is_accepted_with_a_file_push(tmp_path):
    args = tiny_config(tmp_path, use_vllm=True, vllm_mode="server")  # "auto": adapter or weight files
    assert args.vllm_server_weight_sync == "auto"


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
def test_use_vllm_without_vllm_names_the_extra(tmp_path):
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*pip install 'vllm>=0.22' requests"):
        tiny_config(tmp_path, use_vllm=True)


def test_use_vllm_false_keeps_the_transformers_path(make_trainer):
    trainer = make_trainer(total_episodes=4)
    assert trainer.engine is None
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    assert sample.engine_logprobs is None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 1 and not any(k.startswith("sampling/") for k in logs[0])


class ScriptedEngine(GenerationEngine):
    """An engine without vLLM: answers every prompt with ``completion`` and log-prob ``logprob``
    per token; records pushes, sleeps and closing."""

    def __init__(self, completion, logprob=-1.0):
        self.completion, self.logprob = list(completion), logprob
        self.pushes, self.sleeps, self.closed, self.settings = [], 0, False, None

    def generate(self, prompts, settings, generator=None):
        self.settings = settings
        return EngineSamples([self.completion[: settings.max_tokens] for _ in prompts],
                             [[self.logprob] * min(len(self.completion), settings.max_tokens) for _ in prompts])

    def _push_policy(self, policy, version):
        self.pushes.append(version)

    def sleep(self):
        self.sleeps += 1

    def close(self):
        self.closed = True


def _with_engine(trainer, engine):
    trainer.args.use_vllm = True  # as PPOConfig(use_vllm=True) where vLLM is installed
    trainer.engine = engine
    return trainer


def test_rollout_through_an_engine_pushes_once_per_version_and_keeps_its_logprobs(make_trainer):
    trainer = make_trainer(total_episodes=8)
    eos = trainer.processing_class.eos_token_id
    engine = ScriptedEngine([7, 8, eos, 9], logprob=-0.5)  # stops at <eos>: 3 tokens count
    _with_engine(trainer, engine)
    batch = next(iter(trainer.dataloader))
    first = trainer.generate_rollout(batch)
    trainer.generate_rollout(batch)
    assert engine.pushes == [0] and engine.sleeps == 2  # same policy version: no second push
    assert engine.settings.max_tokens == trainer.args.response_length
    assert engine.settings.temperature == trainer.args.temperature
    assert engine.settings.stop_token_ids == tuple(trainer.stop_token_ids)
    T = trainer.args.response_length
    assert first.response_mask.tolist() == [[True] * 3 + [False] * (T - 3)] * first.batch_size
    assert first.responses[:, :3].tolist() == [[7, 8, eos]] * first.batch_size
    assert first.engine_logprobs.tolist() == [[-0.5] * 3 + [0.0] * (T - 3)] * first.batch_size  # 0 off the mask
    assert first.has_stop.all()
    greedy = trainer.generate_rollout(batch, temperature=0.0)  # below vLLM's floor: transformers samples
    assert greedy.engine_logprobs is None and engine.pushes == [0]


@pytest.mark.parametrize("warmup, pushes", [(0, [0, 1, 2, 3]), (2, [0, 3])])
def test_the_engine_gets_weights_only_when_the_policy_moved(make_trainer, warmup, pushes):
    """4 updates of one optimizer step each. Without a warm-up every update moves the policy: a push
    before each rollout, versioned by the global step. With critic_warmup_steps=2 updates 1 and 2
    train the critic only, so rollouts 2 and 3 reuse version 0; update 3's step makes version 3
    (the global step it ends at), pushed before rollout 4."""
    trainer = make_trainer(total_episodes=16, critic_warmup_steps=warmup)
    engine = ScriptedEngine([7, 8, 9], logprob=-1.0)
    _with_engine(trainer, engine)
    trainer.train()
    assert trainer.state.global_step == 4
    assert engine.pushes == pushes


def test_training_through_an_engine_logs_the_sampling_keys_and_closes_it(make_trainer):
    trainer = make_trainer(total_episodes=8)  # 2 updates of 4
    engine = ScriptedEngine([7, 8, 9], logprob=-1.0)
    _with_engine(trainer, engine)
    trainer.train()
    assert engine.pushes == [0, 1] and engine.closed and trainer.engine is None
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    for h in logs:
        mean, high = h["sampling/sampling_logp_difference/mean"], h["sampling/sampling_logp_difference/max"]
        assert 0 < mean <= high  # the scripted -1.0 is not the tiny policy's log-prob
        assert h["sampling/importance_sampling_ratio/min"] <= h["sampling/importance_sampling_ratio/mean"]
        assert h["sampling/importance_sampling_ratio/mean"] <= h["sampling/importance_sampling_ratio/max"] <= 3.0


def test_the_engine_is_closed_when_training_fails(make_trainer):
    class Broken(RuntimeError):
        pass

    trainer = make_trainer(total_episodes=8)
    engine = ScriptedEngine([7, 8, 9])
    _with_engine(trainer, engine)

    def fail(update):
        raise Broken("update failed")

    trainer.run_update = fail
    with pytest.raises(Broken):
        trainer.train()
    assert engine.closed and trainer.engine is None
