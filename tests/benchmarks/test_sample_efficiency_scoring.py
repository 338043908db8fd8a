"""benchmarks/sample_efficiency/scoring.py: the response read after the prompt's marker and a rule
read as a reward model, by hand."""

import torch


def test_response_after_marker(se):
    # <user> a b <eos> <assistant> x y <eos> <pad> <pad>, marker 5, pad 0
    assert se.response_after_marker([4, 11, 12, 3, 5, 21, 22, 3, 0, 0], marker_id=5, pad_id=0) == [21, 22, 3]
    # the first marker ends the prompt; a generated marker or pad inside the response stays in it
    assert se.response_after_marker([0, 5, 7, 5, 0, 8, 0], marker_id=5, pad_id=0) == [7, 5, 0, 8]


def test_rule_reward_model_reads_like_a_reward_model(se):
    """TRL's get_reward reads ``getattr(model, base_model_prefix)(...).hidden_states[-1]`` through
    ``model.score`` at the last valid token: every position carries the sequence's rule value."""
    model = se._rule_reward_model_class()(lambda ids: float(sum(ids)))
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    out = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=ids != 0, position_ids=None,
                                                  return_dict=True, output_hidden_states=True, use_cache=False)
    logits = model.score(out.hidden_states[-1])
    assert logits.shape == (2, 3, 1)
    assert torch.equal(logits[..., 0], torch.tensor([[6.0, 6.0, 6.0], [4.0, 4.0, 4.0]]))
