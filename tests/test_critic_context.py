"""trl_ppo_ext.critic_context without a trainer, and the critic's prompt on the rollout's way: built by
hand-checked rules (context ids, then the prompt's real tokens, left padded), cut with its rows and
trimmed to its own extent, read at the same response states as the policy's sequence; the models take it
as ``value_inputs``."""

import pytest
import torch
from peft import LoraConfig

from trl_ppo_ext.critic_context import (
    CONTEXT_TEMPLATE,
    context_token_ids,
    critic_queries,
    with_critic_context,
)
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.policy_value import PolicyAndValue
from trl_ppo_ext.models.values import value_forward
from trl_ppo_ext.rollout import (
    SampledBatch,
    critic_sequence_inputs,
    forward_chunks,
    response_values,
    sequence_inputs,
    trimmed_to_extent,
)
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer, build_tiny_scorer, build_tiny_tokenizer

PAD = 0


def test_critic_queries_by_hand():
    queries = torch.tensor([[PAD, PAD, 5, 6], [7, 8, 9, 10], [PAD, PAD, PAD, 11]])
    mask = queries != PAD
    ids, m = critic_queries([[1, 2, 3], [], [4]], queries, mask, PAD)
    # rows: 1 2 3 | 5 6 (5 tokens); 7 8 9 10 (4); 4 | 11 (2): width 5, left padded
    assert ids.tolist() == [[1, 2, 3, 5, 6], [PAD, 7, 8, 9, 10], [PAD, PAD, PAD, 4, 11]]
    assert m.tolist() == [[True] * 5, [False] + [True] * 4, [False] * 3 + [True] * 2]
    assert queries.tolist()[0] == [PAD, PAD, 5, 6]  # the inputs are not changed


def test_context_ids_are_the_value_and_a_newline_without_special_tokens():
    tok = build_tiny_chat_tokenizer()  # byte-level, no merges: one id per byte
    (ids,) = context_token_ids(tok, ["42"], "answer")
    assert CONTEXT_TEMPLATE.format(context="42") == "42\n"
    assert tok.decode(ids) == "42\n" and len(ids) == 3
    words = build_tiny_tokenizer()
    assert context_token_ids(words, ["w3 w5", ""], "answer") == [words.convert_tokens_to_ids(["w3", "w5"]), []]
    with pytest.raises(TypeError, match=r"row 1 holds a NoneType \(None\)"):
        context_token_ids(words, ["w3", None], "answer")


def _sample() -> SampledBatch:
    queries = torch.tensor([[PAD, 5, 6], [7, 8, 9], [PAD, PAD, 11]])
    responses = torch.tensor([[12, 13, PAD], [14, PAD, PAD], [15, 16, 17]])
    return SampledBatch(queries=queries, query_mask=queries != PAD, responses=responses,
                        response_mask=responses != PAD, has_stop=torch.zeros(3, dtype=torch.bool),
                        extras={"answer": ["w1 w2 w3", "", "w4"]})


def test_the_batch_carries_the_critics_prompt_and_a_missing_column_is_named():
    tok = build_tiny_tokenizer()
    sample = _sample()
    privileged = with_critic_context(sample, tok, "answer")
    assert sample.critic_queries is None  # a new object
    w = tok.convert_tokens_to_ids
    assert privileged.critic_queries.tolist() == [[w("w1"), w("w2"), w("w3"), 5, 6], [PAD, PAD, 7, 8, 9],
                                                  [PAD, PAD, PAD, w("w4"), 11]]
    picked = privileged.select(torch.tensor([2, 0]))  # rows keep their own critic prompt
    assert picked.critic_queries.tolist() == [privileged.critic_queries[2].tolist(),
                                              privileged.critic_queries[0].tolist()]
    with pytest.raises(KeyError, match=r"critic_context_column='solution': the batch carries no such column"):
        with_critic_context(sample, tok, "solution")


def test_trimming_cuts_the_critics_prompt_to_its_own_extent():
    privileged = with_critic_context(_sample(), build_tiny_tokenizer(), "answer")
    part = trimmed_to_extent(privileged.select(torch.tensor([1, 2])))
    # rows 1 and 2: prompts of 3 and 1 tokens -> 3 columns; critic prompts of 3 and 2 -> 3 of 5; responses 1, 3
    assert part.queries.shape[1] == 3 and part.responses.shape[1] == 3
    assert part.critic_queries.tolist() == [[7, 8, 9], [PAD, privileged.critic_queries[2, 3].item(), 11]]
    part = trimmed_to_extent(privileged.select(torch.tensor([0])))
    assert part.queries.shape[1] == 2 and part.critic_queries.shape[1] == 5 and part.responses.shape[1] == 2
    # the chunks of the scoring forwards carry the rows' critic prompts, in length order
    chunks = forward_chunks(privileged, 2, trim=True, group_by_length=True)
    rows = chunks.order.tolist()
    for (chunk, _), first in zip(chunks, (0, 2)):
        for i, row in enumerate(rows[first:first + 2]):
            real = privileged.critic_queries[row][privileged.critic_query_mask[row]]
            assert chunk.critic_queries[i][chunk.critic_query_mask[i]].tolist() == real.tolist()


def test_a_left_prefix_keeps_the_response_states_where_they_were():
    """The values read at the last T + 1 positions of the critic's sequence are those of each response state:
    the same positions as the policy's sequence, each one after the context and the prompt."""
    tok = build_tiny_tokenizer()
    pair = PolicyAndValue(build_tiny_causal_lm(tok), build_tiny_scorer(tok)).eval()
    sample = with_critic_context(_sample(), tok, "answer")
    inputs = critic_sequence_inputs(sample)
    T = sample.responses.shape[1]
    with torch.no_grad():
        values = response_values(value_forward(pair, *inputs, keep=T + 1), T)
        for b in range(3):
            ids = torch.cat([sample.critic_queries[b][sample.critic_query_mask[b]],
                             sample.responses[b][sample.response_mask[b]]])[None]
            n = int(sample.response_mask[b].sum())
            alone = pair.value_model.score(pair.value_model.model(input_ids=ids).last_hidden_state)[0, :, 0]
            torch.testing.assert_close(values[b, :n], alone[-n - 1:-1], rtol=0, atol=2e-6)
        # the models' forward takes the same sequence as value_inputs; the logits stay the policy's
        policy_inputs = sequence_inputs(sample.queries, sample.query_mask, sample.responses, sample.response_mask)
        logits, with_context = pair(*policy_inputs, logits_to_keep=T + 1, value_inputs=inputs)
        plain_logits, plain = pair(*policy_inputs, logits_to_keep=T + 1)
    assert torch.equal(logits, plain_logits) and not torch.allclose(with_context, plain)
    torch.testing.assert_close(response_values(with_context, T), values, rtol=0, atol=0)


def test_the_shared_value_head_refuses_value_inputs_and_the_value_adapter_reads_them():
    tok = build_tiny_tokenizer()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    sample = with_critic_context(_sample(), tok, "answer")
    inputs = sequence_inputs(sample.queries, sample.query_mask, sample.responses, sample.response_mask)
    shared = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=lora)
    with pytest.raises(ValueError, match=r"value_inputs .*\(the shared value head on the policy's last hidden state\)"):
        shared(*inputs, value_inputs=critic_sequence_inputs(sample))
    adapter = SharedActorCritic(build_tiny_causal_lm(tok), lora_config=lora, value_lora_config=lora).eval()
    with torch.no_grad():
        logits, values = adapter(*inputs, logits_to_keep=4, value_inputs=critic_sequence_inputs(sample))
        alone = value_forward(adapter, *critic_sequence_inputs(sample), keep=4)
        plain_logits, _ = adapter(*inputs, logits_to_keep=4)
    assert torch.equal(values, alone) and torch.equal(logits, plain_logits)
