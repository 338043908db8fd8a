"""Tests for trl_ppo_ext.models.offload: moving a frozen model on and off the GPU.

The control flow is tested on the CPU with stand-in modules (CUDA availability patched);
real transfers, including 4-bit bitsandbytes models, are in the ``gpu`` tests.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trl_ppo_ext.models.loading import load_reward_model
from trl_ppo_ext.models.offload import module_devices, on_device
from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class RecordingLinear(nn.Linear):
    """A Linear whose ``.to(device)`` only records the request (no second device here)."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves: list[str] = []

    def to(self, device, *args, **kwargs):
        self.moves.append(str(device))
        return self


class Unmovable(nn.Linear):
    """Refuses device moves the way transformers refuses some quantized models."""

    def __init__(self):
        super().__init__(2, 2)

    def to(self, *args, **kwargs):
        raise ValueError("Calling `to()` is not supported for this model")


@pytest.fixture
def fresh_log_once(monkeypatch):
    """Forget which one-time messages this process already logged."""
    monkeypatch.setattr("trl_ppo_ext._utils._LOGGED", set())


@pytest.fixture
def pretend_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only behaviour")
def test_without_cuda_it_is_a_no_op_logged_once(fresh_log_once, caplog):
    model = build_tiny_scorer(build_tiny_tokenizer())
    pointers = [p.data_ptr() for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger="trl_ppo_ext.models.offload"):
        for _ in range(2):
            with on_device(model, "cuda") as inside:
                assert inside is model and module_devices(model) == {torch.device("cpu")}
    assert [p.data_ptr() for p in model.parameters()] == pointers
    notes = [r for r in caplog.records if "offloading has no effect" in r.getMessage()]
    assert len(notes) == 1


def test_moves_there_and_back_even_when_the_block_raises(pretend_cuda):
    model = RecordingLinear()
    with on_device(model, "cuda"):
        assert model.moves == ["cuda"]
    assert model.moves == ["cuda", "cpu"]
    with pytest.raises(RuntimeError, match="scoring failed"), on_device(model, "cuda"):
        raise RuntimeError("scoring failed")
    assert model.moves == ["cuda", "cpu", "cuda", "cpu"]


def test_already_there_means_no_move(pretend_cuda):
    model = RecordingLinear()
    with on_device(model, "cpu"):
        pass
    assert model.moves == []


def test_unmovable_model_stays_put_with_one_warning(pretend_cuda, fresh_log_once, caplog):
    model = Unmovable()
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.models.offload"):
        for _ in range(2):
            with on_device(model, "cuda") as inside:
                assert inside is model and module_devices(model) == {torch.device("cpu")}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot be moved to cuda" in warnings[0]


def test_model_spread_over_devices_stays_put(pretend_cuda, fresh_log_once, caplog):
    model = nn.Sequential(RecordingLinear(), nn.Linear(2, 2, device="meta"))
    with caplog.at_level(logging.WARNING, logger="trl_ppo_ext.models.offload"), on_device(model, "cuda"):
        pass
    assert model[0].moves == []
    assert any("spread over" in r.getMessage() for r in caplog.records)


def test_4bit_reward_model_scores_inside_the_context(tmp_path):
    tok = build_tiny_tokenizer()
    build_tiny_scorer(tok, hidden_size=64).save_pretrained(tmp_path)
    model = load_reward_model(tmp_path, load_in_4bit=True, device_map="cpu")
    ids = torch.randint(6, len(tok), (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        with on_device(model, "cuda" if torch.cuda.is_available() else "cpu"):
            inside = model(ids.to(model.device)).logits.cpu()
        after = model(ids).logits
    assert module_devices(model) == {torch.device("cpu")}
    assert torch.equal(before, after)
    torch.testing.assert_close(inside, before, rtol=0, atol=2e-2)  # CUDA kernel vs CPU kernel


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
def test_fp32_model_leaves_no_gpu_memory_behind():
    model = build_tiny_scorer(build_tiny_tokenizer(), hidden_size=64)
    ids = torch.randint(6, 40, (2, 5))

    def scores_on_the_gpu() -> torch.Tensor:
        with torch.no_grad(), on_device(model, "cuda"):
            assert module_devices(model) == {torch.device("cuda", torch.cuda.current_device())}
            return model(ids.cuda()).logits.cpu()

    with torch.no_grad():
        expected = model(ids).logits
    # The process's first matmuls make cuBLAS allocate its workspace through PyTorch's
    # caching allocator, where it stays (counted in memory_allocated) for the life of the
    # handle: one round trip first, so the baseline already holds it.
    first = scores_on_the_gpu()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    again = scores_on_the_gpu()
    torch.cuda.synchronize()
    assert module_devices(model) == {torch.device("cpu")}
    assert torch.cuda.memory_allocated() == baseline
    assert torch.equal(again, first)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_4bit_model_loaded_on_cuda_round_trips_through_the_cpu(tmp_path):
    tok = build_tiny_tokenizer()
    build_tiny_scorer(tok, hidden_size=64).save_pretrained(tmp_path)
    model = load_reward_model(tmp_path, load_in_4bit=True)  # quantized on the GPU
    ids = torch.randint(6, len(tok), (2, 5)).cuda()
    with torch.no_grad():
        expected = model(ids).logits
        model.to("cpu")
        assert module_devices(model) == {torch.device("cpu")}
        with on_device(model, "cuda"):
            again = model(ids).logits
    assert module_devices(model) == {torch.device("cpu")}
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_trainer_scores_with_an_offloaded_4bit_reward_model_and_parks_it_again(tmp_path, make_trainer, make_models):
    from trl_ppo_ext.rollout import sequence_inputs

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    build_tiny_scorer(tok, hidden_size=64).save_pretrained(tmp_path / "rm")
    policy, ref, value, _ = make_models(tok)
    trainer = make_trainer(
        tok, model=policy, ref_model=ref, value_model=value,
        reward_model=load_reward_model(tmp_path / "rm", load_in_4bit=True),  # quantized on the GPU
        offload_reward_model=True, bf16=False, total_episodes=4,
    )
    cpu = {torch.device("cpu")}
    assert module_devices(trainer.reward_model) == cpu  # parked between scoring passes
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    assert module_devices(trainer.reward_model) == cpu
    inputs = sequence_inputs(rollout.queries, rollout.query_mask, rollout.responses, rollout.response_mask)
    with on_device(trainer.reward_model, "cuda"):  # the same pass with the model kept on the GPU
        expected = trainer.reward_scores(rollout, inputs).float()
    torch.testing.assert_close(rollout.scores, expected, rtol=0, atol=0)
    trainer.train()  # a whole update with the round trip inside
    assert module_devices(trainer.reward_model) == cpu
