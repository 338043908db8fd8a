"""PPOConfig's vLLM fields (TRL GRPO's, from ``generation.arguments.VLLMArguments``): parsed from a
command line, checked at construction before anything of a run exists, and the transformers path
untouched when ``use_vllm`` is False. Runs in every environment (the vLLM training tests are
tests/test_vllm_trainer.py)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

from trl_ppo_ext import PPOConfig
from trl_ppo_ext.generation.arguments import VLLMArguments, vllm_installed

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
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
def test_server_mode_without_cuda_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode='server' with use_vllm=True needs CUDA.*colocate"):
        tiny_config(tmp_path, use_vllm=True, vllm_mode="server")


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
def test_use_vllm_without_vllm_names_the_extra(tmp_path):
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*trl-ppo-ext\[vllm\]"):
        tiny_config(tmp_path, use_vllm=True)


def test_use_vllm_false_keeps_the_transformers_path(make_trainer):
    trainer = make_trainer(total_episodes=4)
    assert trainer.engine is None
    sample = trainer.generate_rollout(next(iter(trainer.dataloader)))
    assert sample.engine_logprobs is None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 1 and not any(k.startswith("sampling/") for k in logs[0])
