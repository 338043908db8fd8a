"""``update``: the mini-batch counts, the finite-or-skip step and the statistics stack, on hand-built
tensors and a plain torch optimizer (the trainer runs of the whole update are in ``test_trainer*``)."""

from types import SimpleNamespace

import torch

from trl_ppo_ext.update import Stepper, mini_batch_counts, stack_stats, step_if_finite

ONE_PROCESS = SimpleNamespace(num_processes=1, scaler=None)


def test_mini_batch_counts_are_the_mini_batchs_loss_tokens_and_rows():
    loss_mask = torch.tensor([[True, True, False],   # row 0: 2 tokens
                              [True, False, False],  # row 1: 1 token (not in the mini-batch)
                              [True, True, True]])   # row 2: 3 tokens
    num_tokens, num_sequences = mini_batch_counts(loss_mask, torch.tensor([0, 2]), ONE_PROCESS)
    assert num_tokens.tolist() == [5.0]  # 2 + 3
    assert num_sequences.tolist() == [2.0]  # rows 0 and 2


def _stepper(param):
    optimizer = torch.optim.SGD([param], lr=0.5)
    return Stepper(ONE_PROCESS, None, None, optimizer, None, "grpo", False, None, False), optimizer


def test_a_finite_step_moves_the_parameter_and_a_nonfinite_one_changes_nothing():
    param = torch.nn.Parameter(torch.tensor([1.0]))
    stepper, _ = _stepper(param)
    param.grad = torch.tensor([2.0])
    assert step_if_finite(stepper, torch.tensor(2.0), torch.tensor(0.0), update=1) is True
    assert param.tolist() == [0.0]  # 1 - 0.5 * 2
    assert param.grad is None or param.grad.abs().sum() == 0  # zero_grad after the step

    param.grad = torch.tensor([2.0])
    assert step_if_finite(stepper, torch.tensor(2.0), torch.tensor(1.0), update=2) is False  # a NaN loss
    assert param.tolist() == [0.0] and (param.grad is None or param.grad.abs().sum() == 0)
    param.grad = torch.tensor([2.0])
    assert step_if_finite(stepper, torch.tensor(float("inf")), torch.tensor(0.0), update=3) is False  # inf norm
    assert param.tolist() == [0.0]


def test_stack_stats_gives_one_float_vector_per_statistic():
    stacked = stack_stats({"loss": [torch.tensor(1.0), torch.tensor([3.0])], "n": [torch.tensor(2)]})
    assert stacked["loss"].tolist() == [1.0, 3.0] and stacked["n"].dtype == torch.float32
