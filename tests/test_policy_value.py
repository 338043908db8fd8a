"""Forward helpers: logits of the last positions only, with a fallback for older models."""

from types import SimpleNamespace

import torch
from torch import nn

from trl_ppo_ext.models.policy_value import PolicyAndValue, lm_logits
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer, build_tiny_tokenizer


class NoLogitsToKeep(nn.Module):
    """A causal LM whose forward predates `logits_to_keep`: (B, L, V) with logits = ids."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=input_ids.float()[..., None].expand(-1, -1, 3))


def test_lm_logits_falls_back_to_all_positions():
    ids = torch.tensor([[5, 6, 7, 8]])
    out = lm_logits(NoLogitsToKeep(), ids, None, None, logits_to_keep=2)
    assert out.shape == (1, 4, 3)  # callers slice from the end, so the last 2 are still right
    assert out[0, -2:, 0].tolist() == [7.0, 8.0]


def test_policy_and_value_keep_the_same_last_positions():
    tok = build_tiny_tokenizer()
    pv = PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)).eval()
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    mask, pos = torch.ones_like(ids), torch.arange(5)[None]
    with torch.no_grad():
        full_logits, full_values = pv(input_ids=ids, attention_mask=mask, position_ids=pos)
        logits, values = pv(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=3)
    assert logits.shape[1] == values.shape[1] == 3
    torch.testing.assert_close(logits, full_logits[:, -3:], rtol=0, atol=1e-6)
    torch.testing.assert_close(values, full_values[:, -3:], rtol=0, atol=1e-6)
