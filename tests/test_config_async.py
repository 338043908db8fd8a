"""PPOConfig's asynchronous-rollout fields (``max_staleness``, ``off_policy_correction``,
``off_policy_cap``, ``vllm_server_weight_sync``): off by default, each refusal names the field, the
value and what to do. The accepted asynchronous set-up needs vLLM installed (it is skipped elsewhere)."""

import sys
from pathlib import Path

import pytest

from trl_ppo_ext.generation.arguments import vllm_installed

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from tiny_setup import tiny_config  # noqa: E402


def test_the_defaults_are_the_synchronous_run(tmp_path):
    args = tiny_config(tmp_path)
    assert args.max_staleness == 0 and args.off_policy_correction == "none"
    assert args.off_policy_cap == 3.0 and args.vllm_server_weight_sync == "auto"
    assert args.vllm_server_weight_dir is None


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_max_staleness_must_be_a_non_negative_int(tmp_path, value):
    with pytest.raises(ValueError, match=rf"max_staleness must be an int >= 0.*got {value!r}"):
        tiny_config(tmp_path, max_staleness=value)


def test_max_staleness_needs_the_server_engine(tmp_path):
    with pytest.raises(ValueError, match=r"max_staleness=1 .*use_vllm=True and vllm_mode='server' \(got "
                                         r"use_vllm=False, vllm_mode='colocate'\)"):
        tiny_config(tmp_path, max_staleness=1)


def test_max_staleness_refuses_the_nccl_push_and_a_smaller_rollout_age(tmp_path):
    server = dict(use_vllm=True, vllm_mode="server", max_staleness=2)
    with pytest.raises(ValueError, match="max_staleness=2 with vllm_server_weight_sync='nccl'"):
        tiny_config(tmp_path, vllm_server_weight_sync="nccl", **server)
    with pytest.raises(ValueError, match="max_rollout_age=1 is below max_staleness=2"):
        tiny_config(tmp_path, max_rollout_age=1, **server)


def test_an_unknown_sync_or_correction_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vllm_server_weight_sync must be one of.*got 'gloo'"):
        tiny_config(tmp_path, vllm_server_weight_sync="gloo")
    with pytest.raises(ValueError, match="off_policy_correction must be one of.*got 'is'"):
        tiny_config(tmp_path, off_policy_correction="is")


def test_an_off_policy_correction_needs_engine_logprobs_a_cap_and_no_second_correction(tmp_path):
    with pytest.raises(ValueError, match="off_policy_correction='tis' .*needs use_vllm=True"):
        tiny_config(tmp_path, off_policy_correction="tis")
    with pytest.raises(ValueError, match="off_policy_cap must be a finite number >= 1, got 0.5"):
        tiny_config(tmp_path, off_policy_correction="decoupled", off_policy_cap=0.5)
    with pytest.raises(ValueError, match="both weight the policy loss.*vllm_importance_sampling_correction=False"):
        tiny_config(tmp_path, use_vllm=True, off_policy_correction="decoupled")


@pytest.mark.skipif(not vllm_installed(), reason="use_vllm=True needs vLLM installed")
def test_an_asynchronous_server_run_with_a_correction_is_accepted(tmp_path):
    args = tiny_config(tmp_path, use_vllm=True, vllm_mode="server", max_staleness=2, off_policy_correction="decoupled",
                       vllm_importance_sampling_correction=False)
    assert args.max_staleness == 2 and args.off_policy_correction == "decoupled"
