"""trl_ppo_ext.critic_epochs without a trainer: the epochs of an update, which are value-only, the
figures logged apart, and the critic's gradients averaged over processes (a stand-in accelerator; the
two-process run is tests/test_distributed.py's ``critic`` mode)."""

from types import SimpleNamespace

import torch
from torch import nn

from trl_ppo_ext.critic_epochs import (
    STATS_PREFIX,
    average_critic_gradients,
    critic_epoch_statistics,
    is_value_only,
    total_epochs,
)


def test_the_epochs_of_an_update():
    assert total_epochs(SimpleNamespace(num_ppo_epochs=4, num_critic_epochs=None)) == 4
    args = SimpleNamespace(num_ppo_epochs=2, num_critic_epochs=5)
    assert total_epochs(args) == 5
    assert [is_value_only(e, args) for e in range(5)] == [False, False, True, True, True]


def test_the_figures_are_the_prefixed_statistics_means_only():
    stats = {"vf_loss": torch.tensor([9.0]), "grad_norm": torch.tensor([9.0]),
             STATS_PREFIX + "vf_loss": torch.tensor([1.0, 2.0, 6.0]), STATS_PREFIX + "vf_clipfrac": torch.tensor([0.5])}
    figures = critic_epoch_statistics(stats)
    assert {k: v.item() for k, v in figures.items()} == {"loss/value_critic_epochs_avg": 3.0,
                                                          "val/clipfrac_critic_epochs_avg": 0.5}


class _TwoProcesses:
    """A stand-in for the accelerator of process 0 of 2, whose partner holds ``other``: ``reduce`` of the
    k-th collective returns the mean (or sum) with the partner's k-th tensor."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, other):
        self.other = list(other)

    def reduce(self, tensor, reduction):
        partner = self.other.pop(0)
        return (tensor + partner) / (2 if reduction == "mean" else 1)


def _model():
    model = nn.ModuleDict({"policy": nn.Linear(2, 2), "value_model": nn.Linear(2, 1)})
    model.value_model.weight.grad = torch.tensor([[2.0, 4.0]])  # the bias has no gradient here
    model.policy.weight.grad = torch.ones(2, 2)
    return model


def test_the_critics_gradients_are_averaged_and_the_policys_left_alone():
    model = _model()
    # the partner's flat gradient (weight then bias) and its "had a gradient" flags
    partner = [torch.tensor([0.0, 2.0, 1.0]), torch.tensor([1.0, 1.0])]
    average_critic_gradients(_TwoProcesses(partner), model)
    assert model.value_model.weight.grad.tolist() == [[1.0, 3.0]]  # (2 + 0) / 2, (4 + 2) / 2
    assert model.value_model.bias.grad.tolist() == [0.5]  # zeros here, 1 there: the mean
    assert torch.equal(model.policy.weight.grad, torch.ones(2, 2))


def test_a_parameter_without_a_gradient_anywhere_keeps_none_and_one_process_is_left_alone():
    model = _model()
    average_critic_gradients(_TwoProcesses([torch.tensor([2.0, 4.0, 0.0]), torch.tensor([1.0, 0.0])]), model)
    assert model.value_model.bias.grad is None and model.value_model.weight.grad.tolist() == [[2.0, 4.0]]
    model = _model()
    average_critic_gradients(SimpleNamespace(num_processes=1), model)
    assert model.value_model.weight.grad.tolist() == [[2.0, 4.0]] and model.value_model.bias.grad is None
