"""gradients.clip_grad_norm_: torch's clipping, bit for bit, minus the factor-1 multiply."""

import math

import pytest
import torch

from trl_ppo_ext import gradients


def _params(scale: float, seed: int = 0, shapes=((3, 4), (5,), (2, 2, 2))):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * scale
        params.append(p)
    return params


def _copy(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("scale", [1e-3, 0.2, 1.0, 7.0, 1e4])
@pytest.mark.parametrize("max_norm", [0.5, 1.0, 3.0])
def test_same_norm_and_gradients_as_torch(scale, max_norm):
    ours, theirs = _params(scale), None
    theirs = _copy(ours)
    norm = gradients.clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_norm_is_the_two_norm_of_all_gradients_and_clipping_hits_max_norm():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # sqrt(9 + 16) = 5
    norm = gradients.clip_grad_norm_([p, q], 1.0)
    assert norm.item() == pytest.approx(5.0, abs=0)
    coef = 1.0 / (5.0 + 1e-6)
    assert p.grad.tolist() == pytest.approx([3.0 * coef, 0.0], rel=1e-6)
    assert q.grad.item() == pytest.approx(4.0 * coef, rel=1e-6)
    total = math.sqrt(p.grad.pow(2).sum().item() + q.grad.pow(2).sum().item())
    assert total == pytest.approx(1.0, rel=1e-5)


def test_below_max_norm_the_gradients_are_not_written():
    params = _params(1e-3)
    before = [p.grad.data_ptr() for p in params]
    values = [p.grad.clone() for p in params]
    calls = []
    original = torch.nn.utils.clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        gradients.clip_grad_norm_(params, 1.0)
    finally:
        torch.nn.utils.clip_grads_with_norm_ = original
    assert calls == []
    assert [p.grad.data_ptr() for p in params] == before
    assert all(torch.equal(p.grad, v) for p, v in zip(params, values))


@pytest.mark.parametrize("max_norm", [None, 0, 0.0])
def test_no_clipping_asked_returns_the_norm_and_leaves_gradients(max_norm):
    params = _params(10.0)
    values = [p.grad.clone() for p in params]
    norm = gradients.clip_grad_norm_(params, max_norm)
    expected = torch.linalg.vector_norm(torch.cat([v.flatten() for v in values]))
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert all(torch.equal(p.grad, v) for p, v in zip(params, values))


def test_parameters_without_gradient_are_ignored_and_none_gives_zero():
    params = _params(2.0)
    params.append(torch.nn.Parameter(torch.ones(3)))  # grad None
    theirs = _copy(params)
    assert torch.equal(gradients.clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert params[-1].grad is None
    assert gradients.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


def test_non_finite_norms():
    inf_params = _params(1.0)
    inf_params[0].grad[0, 0] = float("inf")
    norm = gradients.clip_grad_norm_(inf_params, 1.0)
    assert math.isinf(norm.item())
    # inf norm: factor 1 / inf = 0, as torch does; the inf entry becomes nan (inf * 0)
    assert torch.equal(inf_params[1].grad, torch.zeros_like(inf_params[1].grad))
    nan_params = _params(1.0)
    nan_params[0].grad[0, 0] = float("nan")
    values = [p.grad.clone() for p in nan_params]
    norm = gradients.clip_grad_norm_(nan_params, 1.0)
    assert math.isnan(norm.item())
    for p, v in zip(nan_params, values):  # left as they were; the trainer skips the step
        assert torch.equal(p.grad.nan_to_num(), v.nan_to_num())


# ---------------------------------------------------------------- the trainer's clipping and fp16 skip
class _Accelerator:
    """What clip_gradients reads of accelerate's Accelerator on one device."""

    def __init__(self, distributed_type="NO", engine_norm=None):
        self.distributed_type, self.device, self.engine_norm = distributed_type, torch.device("cpu"), engine_norm
        self.unscaled = 0

    def unscale_gradients(self):
        self.unscaled += 1

    def clip_grad_norm_(self, params, max_norm):
        return self.engine_norm if params is None else torch.nn.utils.clip_grad_norm_(params, max_norm)


def _model_with_grads():
    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 1, bias=False))
    model[0].weight.grad = torch.tensor([[3.0, 0.0]])
    model[1].weight.grad = torch.tensor([[4.0]])
    model[1].weight.requires_grad_(False)  # frozen: not clipped, not counted
    return model


def test_clip_gradients_unscales_then_clips_the_trainable_gradients_only():
    acc, model = _Accelerator(), _model_with_grads()
    norm = gradients.clip_gradients(acc, model, max_grad_norm=1.5)
    assert acc.unscaled == 1 and norm.dtype == torch.float32 and norm.item() == 3.0  # sqrt(3^2 + 0^2)
    torch.testing.assert_close(model[0].weight.grad, torch.tensor([[1.5, 0.0]]), rtol=0, atol=1e-5)  # 3 * 1.5/3
    assert model[1].weight.grad.tolist() == [[4.0]]


def test_clip_gradients_under_deepspeed_reports_the_engines_norm():
    norm = gradients.clip_gradients(_Accelerator(engine_norm=2.5), _model_with_grads(), 1.0, deepspeed=True)
    assert norm.item() == 2.5
    assert math.isnan(gradients.clip_gradients(_Accelerator(engine_norm=None), _model_with_grads(), 1.0,
                                               deepspeed=True).item())


@pytest.mark.parametrize("grad, scale_after", [(1.0, 512.0), (math.inf, 512.0)])
def test_skip_scaler_step_backs_the_scale_off_and_lets_the_next_step_unscale(grad, scale_after):
    p = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    wrapped = type("Wrapped", (), {"optimizer": optimizer})()  # accelerate's AcceleratedOptimizer holds it
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(p.sum() * grad).backward()
    scaler.unscale_(optimizer)
    assert gradients.scaler_found_inf(scaler, wrapped) is (grad == math.inf)
    gradients.skip_scaler_step(scaler, wrapped)
    assert scaler.get_scale() == scale_after  # backoff factor 0.5, as GradScaler.update after an overflow
    optimizer.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(optimizer)  # raised "unscale_() has already been called" without the update
    gradients.skip_scaler_step(None, wrapped)  # no scaler (bf16/fp32): nothing to do
