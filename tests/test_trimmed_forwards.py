"""Issue 32: forwards on the tokens that exist.

A forward on a chunk cut to its rows' own extent (``rollout.trimmed_to_extent``) and put back
into ``(B, T)`` (``ScoringChunks.merge``) equals the full-width forward on every valid position,
for every model kind the trainer runs (causal LM, value model, reward model, ``PolicyAndValue``,
``SharedActorCritic``) and for Llama, GPT-2 (absolute positions) and OPT (learned positions
offset by 2); micro-batches of length-sorted or token-budget rows give the loss and the
gradient of one full-width batch.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext import functional as F
from trl_ppo_ext.advantages import PPOTargets
from trl_ppo_ext.batching import micro_batch_rows, token_budget_groups
from trl_ppo_ext.losses import ppo_loss
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.policy_value import PolicyAndValue
from trl_ppo_ext.rollout import (
    Rollout,
    SampledBatch,
    forward_chunks,
    forward_responses,
    reference_response_logprobs,
    reward_model_scores,
    row_extents,
    sequence_inputs,
    trimmed_to_extent,
    trimmed_together,
)

VOCAB = 64
PROMPT_LENGTHS = [3, 5, 2, 4, 1, 5]  # P = 7: two columns of left padding in every row
RESPONSE_LENGTHS = [2, 6, 1, 4, 3, 5]  # T = 9: three columns after every row's last token
P, T = 7, 9
TOL = dict(atol=1e-6, rtol=1e-6)


def _batch(pad_id: int = 1) -> SampledBatch:
    g = torch.Generator().manual_seed(0)
    B = len(PROMPT_LENGTHS)
    query_mask = torch.arange(P)[None, :] >= (P - torch.tensor(PROMPT_LENGTHS))[:, None]  # left padded
    response_mask = torch.arange(T)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    queries = torch.randint(2, VOCAB, (B, P), generator=g).masked_fill(~query_mask, pad_id)
    responses = torch.randint(2, VOCAB, (B, T), generator=g).masked_fill(~response_mask, pad_id)
    return SampledBatch(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                        has_stop=torch.ones(B, dtype=torch.bool), extras={"id": list(range(B))})


def _causal_lm(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64, max_position_embeddings=64))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64))


def _scorer(family: str, seed: int = 1):
    from transformers import (
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        OPTConfig,
        OPTForSequenceClassification,
    )

    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, num_labels=1, pad_token_id=1)
        return LlamaForSequenceClassification(config)
    if family == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, num_labels=1,
                            pad_token_id=1)
        return GPT2ForSequenceClassification(config)
    config = OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                       word_embed_proj_dim=32, max_position_embeddings=64, num_labels=1, pad_token_id=1)
    return OPTForSequenceClassification(config)


def _full_and_trimmed(sample, fn):
    """``fn(part, inputs)`` per chunk of 2 rows: full width in batch order, and trimmed from
    length-sorted rows, both merged back to batch order."""
    full = forward_chunks(sample, 2)
    trimmed = forward_chunks(sample, 2, trim=True, group_by_length=True)
    assert full.order is None and trimmed.order is not None
    widths = [part.responses.shape[1] for part, _ in trimmed]
    assert max(widths) == max(RESPONSE_LENGTHS) and min(widths) < max(widths)  # chunks really are cut
    assert all(part.queries.shape[1] <= max(PROMPT_LENGTHS) for part, _ in trimmed)
    return full.merge(fn(p, i) for p, i in full), trimmed.merge(fn(p, i) for p, i in trimmed)


FAMILIES = ["llama", "gpt2", "opt"]


def test_row_extents_and_trimming_keep_only_padding_out():
    sample = _batch()
    p_len, r_len = row_extents(sample.query_mask, sample.response_mask)
    assert p_len.tolist() == PROMPT_LENGTHS and r_len.tolist() == RESPONSE_LENGTHS
    part = trimmed_to_extent(sample.select(torch.tensor([0, 2])))  # prompts 3, 2; responses 2, 1
    assert part.queries.shape == (2, 3) and part.responses.shape == (2, 2)
    assert torch.equal(part.queries, sample.queries[[0, 2], 4:]) and part.extras == {"id": [0, 2]}
    # the positions of the kept tokens are those of the full sequence (left padding never counts)
    full_pos = sequence_inputs(sample.queries, sample.query_mask, sample.responses, sample.response_mask)[2][[0, 2]]
    cut_pos = sequence_inputs(part.queries, part.query_mask, part.responses, part.response_mask)[2]
    assert torch.equal(cut_pos, full_pos[:, 4 : 4 + 3 + 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_trimmed_reference_logprobs_equal_full_width(family):
    model, sample = _causal_lm(family).eval(), _batch()
    with torch.no_grad():
        full, trimmed = _full_and_trimmed(sample, lambda p, i: reference_response_logprobs(model, p, i, 0.7))
    keep = sample.response_mask
    assert trimmed.shape == (6, T)  # the caller (scored_rollout) masks what lies past a row's end
    torch.testing.assert_close(trimmed[keep], full[keep], **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_trimmed_reward_model_scores_equal_full_width(family):
    model, sample = _scorer(family, seed=2).eval(), _batch()
    with torch.no_grad():
        full, trimmed = _full_and_trimmed(sample, lambda p, i: reward_model_scores(model, p, i))
    assert trimmed.shape == (6,)
    torch.testing.assert_close(trimmed, full, **TOL)


def _policy_value(kind: str, family: str):
    if kind == "separate":
        return PolicyAndValue(_causal_lm(family), _scorer(family))
    targets = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"]}[family]
    model = SharedActorCritic(_causal_lm(family), lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                         lora_dropout=0.0))
    torch.manual_seed(5)
    for name, p in model.named_parameters():  # LoRA B starts at 0: make the adapter matter
        if p.requires_grad:
            p.data.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("kind", ["separate", "shared"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trimmed_policy_and_value_forward_equals_full_width(kind, family):
    """Old log-probs and values (``PolicyAndValue``: the value model's hidden states and head;
    ``SharedActorCritic``: the adapter and the value head on one backbone)."""
    model, sample = _policy_value(kind, family).eval(), _batch()

    def logprobs_and_values(part, inputs):
        logits, values = forward_responses(model, inputs, part.responses.shape[1], 0.7)
        return torch.stack([F.logprobs_from_logits(logits, part.valid_responses), values], dim=-1)

    with torch.no_grad():
        full, trimmed = _full_and_trimmed(sample, logprobs_and_values)
    keep = sample.response_mask
    assert trimmed.shape == (6, T, 2)
    torch.testing.assert_close(trimmed[keep], full[keep], **TOL)


# ---------------------------------------------------------------------- the update's micro-batches
def _rollout_and_targets(sample):
    g = torch.Generator().manual_seed(3)
    keep = sample.response_mask
    noise = lambda: torch.randn(keep.shape, generator=g).masked_fill(~keep, 0.0)  # noqa: E731
    rollout = Rollout(**{f: getattr(sample, f) for f in ("queries", "query_mask", "responses", "response_mask",
                                                          "has_stop")},
                      logprobs=noise() - 4.0, ref_logprobs=noise() - 4.0, values=noise(),
                      scores=torch.randn(keep.shape[0], generator=g))
    targets = PPOTargets(scores=rollout.scores, kl=noise(), non_score_rewards=noise(), rewards=noise(),
                         advantages=noise(), returns=noise(), raw_advantage_mean=torch.tensor(0.0),
                         raw_advantage_std=torch.tensor(1.0))
    return rollout, targets


def _loss(model, mb, adv, num_tokens, loss_type="dapo", num_sequences=None):
    """What ``PPOTrainer.compute_loss_terms`` computes on a micro-batch."""
    inputs = sequence_inputs(mb.queries, mb.query_mask, mb.responses, mb.response_mask)
    logits, values = forward_responses(model, inputs, mb.responses.shape[1], 0.7)
    new_logprobs = F.logprobs_from_logits(logits, mb.valid_responses)
    loss, _ = ppo_loss(new_logprobs, logits, values, old_logprobs=mb.logprobs, old_values=mb.values,
                       advantages=adv.advantages, returns=adv.returns, response_mask=mb.response_mask,
                       cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.01, num_tokens=num_tokens,
                       loss_type=loss_type, num_sequences=num_sequences, max_completion_length=T)
    return loss


def _loss_and_grads(model, rollout, targets, micro_batches, loss_type="dapo", trim=True):
    model.zero_grad()
    num_tokens = rollout.response_mask.sum().float()
    num_sequences = torch.tensor(float(rollout.batch_size))
    total = 0.0
    for rows in micro_batches:
        mb, adv = rollout.select(rows), targets.select(rows)
        if trim:
            mb, adv = trimmed_together(mb, adv)
        loss = _loss(model, mb, adv, num_tokens, loss_type, num_sequences if loss_type != "dapo" else None)
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_length_sorted_trimmed_micro_batches_give_the_full_batch_loss_and_gradients(loss_type):
    model = _policy_value("separate", "gpt2").eval()  # GPT-2 has dropout: no random masks
    rollout, targets = _rollout_and_targets(_batch())
    whole = _loss_and_grads(model, rollout, targets, [torch.arange(6)], loss_type, trim=False)
    p_len, r_len = row_extents(rollout.query_mask, rollout.response_mask)
    rows = micro_batch_rows(p_len, r_len, [slice(0, 2), slice(2, 4), slice(4, 6)])
    assert [r.tolist() for r in rows] == [[1, 5], [3, 4], [0, 2]]  # responses 6, 5 | 4, 3 | 2, 1
    _assert_same(_loss_and_grads(model, rollout, targets, rows, loss_type), whole)


@pytest.mark.parametrize("budget", [7, 16, 24, 60, 1000])
def test_token_budget_split_leaves_loss_and_gradients_unchanged(budget):
    model = _policy_value("shared", "llama").eval()
    rollout, targets = _rollout_and_targets(_batch())
    whole = _loss_and_grads(model, rollout, targets, [torch.arange(6)], trim=False)
    p_len, r_len = row_extents(rollout.query_mask, rollout.response_mask)
    rows = micro_batch_rows(p_len, r_len, [slice(0, 6)], max_tokens=budget)
    assert sorted(torch.cat(rows).tolist()) == list(range(6))
    for r in rows:  # every micro-batch within the budget, unless a single row exceeds it
        cost = len(r) * (int(p_len[r].max()) + int(r_len[r].max()))
        assert cost <= budget or len(r) == 1
    assert len(rows) == {7: 6, 16: 4, 24: 3, 60: 2, 1000: 1}[budget]
    _assert_same(_loss_and_grads(model, rollout, targets, rows), whole)


def test_token_budget_groups_by_hand():
    # rows longest first: (prompt, response) = (5, 6) (5, 5) (4, 4) (1, 3) (3, 2) (2, 1)
    p, r = [5, 5, 4, 1, 3, 2], [6, 5, 4, 3, 2, 1]
    # budget 16: [11] alone (2 x 11 = 22 > 16); [10] (2 x 10 > 16); [8, 4+...]: 2 x (4 + 4) = 16, a third
    # row gives 3 x 8 = 24 > 16; then (3, 2), (2, 1): 2 x (3 + 2) = 10
    assert token_budget_groups(p, r, 16) == [[0], [1], [2, 3], [4, 5]]
    assert token_budget_groups(p, r, 5) == [[0], [1], [2], [3], [4], [5]]  # every row over: one each
    assert token_budget_groups(p, r, 66) == [[0, 1, 2, 3, 4, 5]]  # 6 x 11


def test_unsorted_rows_keep_the_configured_order():
    p_len, r_len = torch.tensor([1, 2, 3, 4]), torch.tensor([4, 3, 2, 9])
    rows = micro_batch_rows(p_len, r_len, [slice(0, 3), slice(3, 4)], group_by_length=False)
    assert [r.tolist() for r in rows] == [[0, 1, 2], [3]]
    rows = micro_batch_rows(p_len, r_len, [slice(0, 3), slice(3, 4)])
    assert [r.tolist() for r in rows] == [[3, 0, 1], [2]]  # same sizes, longest first


def test_generation_stops_when_every_row_has_stopped():
    """The stop ids reach transformers' ``generate`` as its EOS ids: a chunk whose rows all
    emit EOS at once decodes one step, not ``response_length``."""
    from trl_ppo_ext.generation.transformers_generate import generate_responses, sampling_config
    from trl_ppo_ext.rollout import finalize_responses
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[tok.eos_token_id] = 100.0  # every row samples EOS first
    model.lm_head = head
    calls = []
    model.model.register_forward_hook(lambda *a: calls.append(1))
    queries = torch.randint(6, len(tok), (4, 3), generator=torch.Generator().manual_seed(0))
    stops = (tok.eos_token_id,)
    raw = generate_responses(model, queries, torch.ones_like(queries, dtype=torch.bool),
                             sampling_config(48, stops, tok.pad_token_id, 1.0), 48, tok.pad_token_id, chunk_size=4)
    responses, mask, _ = finalize_responses(raw, stops, tok.pad_token_id)
    assert mask.sum(1).tolist() == [1, 1, 1, 1] and (raw[:, 0] == tok.eos_token_id).all()
    assert len(calls) == 1  # the prompt's forward sampled the EOS; no decoding step followed


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_max_tokens_per_micro_batch_must_be_a_positive_integer(bad, tmp_path):
    from trl_ppo_ext import PPOConfig

    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch must be a positive integer or None, got"):
        PPOConfig(output_dir=str(tmp_path), max_tokens_per_micro_batch=bad, report_to=[])
    assert PPOConfig(output_dir=str(tmp_path), report_to=[]).max_tokens_per_micro_batch is None


def test_split_to_count_keeps_every_row_and_the_budget():
    from trl_ppo_ext.batching import split_to_count

    groups = [torch.tensor([0, 1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    out = split_to_count(groups, 5)
    assert [g.tolist() for g in out] == [[0], [1], [2, 3], [4], [5, 6]]  # halve the largest (first) each time
    with pytest.raises(ValueError, match="count=8"):
        split_to_count(groups, 8)
