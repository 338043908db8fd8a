"""A PRMTrainer-style process reward model as a reward function (issue 22): the PRM's input
built as PRMTrainer builds it, its step scores placed on the separator tokens of the policy's
completion (same vocabulary: the ids; another vocabulary: through text). Expected values by hand;
the trainer runs (returns at gamma = lam = 1, kl_coef = 0) are in test_process_reward_trainer.py."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaForTokenClassification

from trl_ppo_ext.rewards.process import ProcessRewardModel, prm_steps_text, separator_positions, token_text_ends
from trl_ppo_ext.tiny import build_tiny_tokenizer, tiny_llama_config

# build_tiny_tokenizer(): <pad> 0, <unk> 1, <bos> 2, <eos> 3, <user> 4, <assistant> 5, then w0 = 6 .. w39 = 45
REVERSED = [f"w{i}" for i in range(40)][::-1]  # another vocabulary: w39 = 6 .. w0 = 45


class CumsumPRM(nn.Module):
    """A token classifier whose P(label 1) at position t is S / (1 + S), S = the sum of the input
    ids up to t: it shows which ids the PRM read, in which order, and where it was read."""

    def __init__(self, num_labels=2):
        super().__init__()
        self.config = SimpleNamespace(num_labels=num_labels, _name_or_path="")
        self.anchor = nn.Parameter(torch.zeros(()))
        self.embedding_rows = 64
        self.calls = []

    def get_input_embeddings(self):
        return nn.Embedding(self.embedding_rows, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        self.calls.append(input_ids.clone())
        s = (input_ids * attention_mask).cumsum(1).float()
        logits = torch.zeros(*input_ids.shape, self.config.num_labels)
        logits[..., 1] = torch.log(s)
        return SimpleNamespace(logits=logits)


def _p(s):  # P(label 1) of CumsumPRM where the ids read so far sum to s
    return s / (1 + s)


def test_same_vocabulary_reads_the_policy_ids_after_bos_and_prompt():
    tok = build_tiny_tokenizer()
    prm = CumsumPRM()
    reward = ProcessRewardModel(prm, tok, tok, step_separator="w0")
    assert reward.text_tokenizer is None and reward.separator_ids == [6]
    # completion w5 w0 w7 <eos> = 11 6 13 3: one separator (index 1), then a final step "w7"
    out = reward(prompts=["w1 w2"], completions=["w5 w0 w7"], completion_ids=[[11, 6, 13, 3]])
    # PRM input: <bos> w1 w2 | w5 w0 w7 | w0 (the final step closed) = 2 7 8 11 6 13 6;
    # cumsum 2 9 17 28 34 47 53; read at 4 (the separator) and 6 (the appended one)
    assert prm.calls[0].tolist() == [[2, 7, 8, 11, 6, 13, 6]]
    assert [k for k, _ in out[0]] == [1, 3]  # the separator's token, then the completion's last (the EOS)
    assert out[0][0][1] == pytest.approx(_p(34), abs=1e-7) and out[0][1][1] == pytest.approx(_p(53), abs=1e-7)

    # final_step=False: only the separator; the ids up to the last word (PRMTrainer's rows have no EOS)
    only = ProcessRewardModel(CumsumPRM(), tok, tok, step_separator="w0", final_step=False)
    got = only(prompts=["w1 w2"], completions=["w5 w0 w7"], completion_ids=[[11, 6, 13, 3]])
    assert got == [[(1, pytest.approx(_p(34), abs=1e-7))]]
    assert only.model.calls[0].tolist() == [[2, 7, 8, 11, 6, 13]]


def test_completions_ending_on_a_separator_or_without_steps():
    tok = build_tiny_tokenizer()
    reward = ProcessRewardModel(CumsumPRM(), tok, tok, step_separator="w0")
    completions = [[11, 6, 3],   # "w5 w0 <eos>": the last step ends with its separator, nothing appended
                   [3],          # only the EOS: no step, no score
                   [6, 6]]       # two separators, no EOS
    out = reward(prompts=["w1", "w1", "w1"], completions=["", "", ""], completion_ids=completions)
    # rows (EOS dropped): 2 7 | 11 6 -> cumsum at 3: 2+7+11+6 = 26; 2 7; 2 7 | 6 6 -> at 2: 15, at 3: 21
    assert out == [[(1, pytest.approx(_p(26)))], [], [(0, pytest.approx(_p(15))), (1, pytest.approx(_p(21)))]]


def test_batches_pad_without_changing_a_score():
    tok = build_tiny_tokenizer()
    args = dict(prompts=["w1 w2 w3", "w1"], completions=["", ""], completion_ids=[[11, 6, 13, 6, 3], [6]])
    one = ProcessRewardModel(CumsumPRM(), tok, tok, step_separator="w0", batch_size=1)(**args)
    two = ProcessRewardModel(CumsumPRM(), tok, tok, step_separator="w0", batch_size=2)(**args)
    assert one == two
    # row 0: 2 7 8 9 | 11 6 13 6 (EOS dropped): separators at 1 and 3: cumsum 43, 62
    assert one[0] == [(1, pytest.approx(_p(43))), (3, pytest.approx(_p(62)))]


def test_conversational_prompts_use_the_prm_chat_template():
    tok = build_tiny_tokenizer()
    prm = CumsumPRM()
    reward = ProcessRewardModel(prm, tok, tok, step_separator="w0")
    reward(prompts=[[{"role": "user", "content": "w1"}]], completions=[[{"role": "assistant", "content": "w0"}]],
           completion_ids=[[6, 3]])
    # "<user> w1 <eos> <assistant> " after <bos>: 2 4 7 3 5, then the completion w0 (its EOS dropped)
    assert prm.calls[0].tolist() == [[2, 4, 7, 3, 5, 6]]
    bare = build_tiny_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="conversational but the PRM's tokenizer has no chat template"):
        ProcessRewardModel(CumsumPRM(), bare, bare, step_separator="w0")(
            prompts=[[{"role": "user", "content": "w1"}]], completions=[""], completion_ids=[[6]])


def test_another_vocabulary_goes_through_text_and_lands_on_the_policy_separator():
    policy, theirs = build_tiny_tokenizer(), build_tiny_tokenizer(REVERSED)
    prm = CumsumPRM()
    reward = ProcessRewardModel(prm, policy, theirs, step_separator="w0")
    assert reward.text_tokenizer is theirs and reward.separator_ids == [45]  # w0 in the PRM's vocabulary
    # policy ids w5 w0 w7 <eos> = 11 6 13 3, text "w5 w0 w7": steps "w5 " and " w7" (final)
    out = reward(prompts=["w1 w2"], completions=["w5 w0 w7"], completion_ids=[[11, 6, 13, 3]])
    # PRM ids: <bos> w1 w2 | w5 w0 | w7 w0 = 2 44 43 | 40 45 | 38 45; cumsum 2 46 89 129 174 212 257
    assert prm.calls[0].tolist() == [[2, 44, 43, 40, 45, 38, 45]]
    assert out == [[(1, pytest.approx(_p(174))), (3, pytest.approx(_p(257)))]]


def test_text_helpers_by_hand():
    assert prm_steps_text("a\nbb\nc", "\n") == (["a", "bb", "c"], [2, 5, None])
    assert prm_steps_text("a\nbb\n ", "\n") == (["a", "bb"], [2, 5])  # a blank last piece is no step
    assert prm_steps_text("a\nc", "\n", final_step=False) == (["a"], [2])
    assert prm_steps_text("", "\n") == ([], [])
    tok = build_tiny_tokenizer()
    assert token_text_ends([11, 6, 13, 3], tok) == [2, 5, 8, 8]  # "w5", "w5 w0", "w5 w0 w7", the EOS adds nothing
    assert separator_positions([5, 9, 6, 9], [9]) == [1, 3] and separator_positions([], [9]) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_labels=1), r"`model` has num_labels=1; a process reward model is a token classifier with 2 labels"),
    (dict(positive_label=2), r"positive_label=2 is not one of the model's 2 labels 0..1"),
    (dict(step_separator="\n"), r"step_separator='\\n' encodes to \[\].*nothing: it is not in the vocabulary"),
    (dict(step_separator="step"), r"step_separator='step' encodes to \[1\].*an unknown token"),
    (dict(step_separator=""), r"step_separator=''; pass PRMTrainer's step separator"),
    (dict(batch_size=0), r"batch_size=0; it must be an integer >= 1"),
])
def test_bad_arguments_are_named(kwargs, message):
    tok = build_tiny_tokenizer()
    model = CumsumPRM(num_labels=kwargs.pop("num_labels", 2))
    kwargs = {"step_separator": "w0", **kwargs}
    with pytest.raises(ValueError, match=message):
        ProcessRewardModel(model, tok, tok, **kwargs)


def test_a_prm_of_another_vocabulary_without_its_tokenizer_is_refused():
    prm = CumsumPRM()
    prm.embedding_rows = 10  # cannot hold the policy's 46 ids
    with pytest.raises(ValueError, match="has 10 token embeddings but the policy's tokenizer has 46 tokens"):
        ProcessRewardModel(prm, build_tiny_tokenizer(), step_separator="w0")


def test_a_sequence_classifier_output_is_refused_at_the_call():
    class Flat(CumsumPRM):
        def forward(self, input_ids, attention_mask, position_ids):
            return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 2))

    tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match=r"returned logits of shape \(1, 2\).*token classifier"):
        ProcessRewardModel(Flat(), tok, tok, step_separator="w0")(prompts=["w1"], completions=[""],
                                                                   completion_ids=[[6]])


def test_a_real_token_classifier_scores_as_a_direct_call():
    """A random tiny Llama token classifier: the scores equal its softmax on PRMTrainer's ids."""
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForTokenClassification(tiny_llama_config(tok, num_labels=2)).eval()
    reward = ProcessRewardModel(model, tok, tok, step_separator="w0")
    out = reward(prompts=["w1 w2", "w3"], completions=["", ""], completion_ids=[[11, 6, 13, 3], [6, 3]])
    with torch.no_grad():
        direct = model(torch.tensor([[2, 7, 8, 11, 6, 13, 6]])).logits.softmax(-1)[0, :, 1]
        short = model(torch.tensor([[2, 9, 6, 3]])).logits.softmax(-1)[0, :, 1]
    assert [k for k, _ in out[0]] == [1, 3] and [k for k, _ in out[1]] == [0]
    torch.testing.assert_close(torch.tensor([s for _, s in out[0]]), direct[[4, 6]], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor([s for _, s in out[1]]), short[[2]], rtol=0, atol=1e-6)


def test_token_classifiers_among_the_rewards_become_process_reward_functions():
    from trl_ppo_ext.rewards.process import is_token_classifier, with_process_reward_models
    from trl_ppo_ext.rewards.scoring import build_rewards
    from trl_ppo_ext.tiny import build_tiny_scorer

    policy, theirs = build_tiny_tokenizer(), build_tiny_tokenizer(REVERSED)
    torch.manual_seed(0)
    prm = LlamaForTokenClassification(tiny_llama_config(theirs, num_labels=2))
    rm = build_tiny_scorer(policy)
    assert is_token_classifier(prm) and not is_token_classifier(rm) and not is_token_classifier(CumsumPRM())

    def check(completions, **kwargs):
        return [1.0] * len(completions)

    rewards = build_rewards(prm, [check, rm], [2.0, 1.0, 0.5])
    out, remaining = with_process_reward_models(rewards, policy, [theirs, None], step_separator="w0")
    assert [r.name for r in out] == [r.name for r in rewards] and [r.weight for r in out] == [2.0, 1.0, 0.5]
    assert isinstance(out[0].source, ProcessRewardModel) and not out[0].is_model
    assert out[0].source.text_tokenizer is theirs and out[0].source.model is prm  # its entry: its tokenizer
    assert out[1] is rewards[1] and out[2] is rewards[2] and remaining == [None]  # the RM keeps its entry
    assert with_process_reward_models(rewards, policy, None, "w0")[1] is None
    with pytest.raises(ValueError, match=r"reward_processing_classes has 1 entries but there are 2 reward models"):
        with_process_reward_models(rewards, policy, [theirs], "w0")


def test_through_text_finds_a_separator_merged_into_another_token():
    # a policy token "w5w0" holds the separator's text; the id path sees no w0 id in it
    tok = build_tiny_tokenizer([f"w{i}" for i in range(40)] + ["w5w0"])
    merged, w7, w0 = tok.convert_tokens_to_ids(["w5w0", "w7", "w0"])
    by_ids = ProcessRewardModel(CumsumPRM(), tok, tok, step_separator="w0")
    prm = CumsumPRM()
    by_text = ProcessRewardModel(prm, tok, tok, step_separator="w0", through_text=True)
    assert by_ids.text_tokenizer is None and by_text.text_tokenizer is tok
    args = dict(prompts=["w1"], completions=["w5w0 w7"], completion_ids=[[merged, w7, 3]])
    assert [k for k, _ in by_ids(**args)[0]] == [2]  # only the final step, on the last token
    out = by_text(**args)
    # text "w5w0 w7" split on "w0": steps "w5" and " w7" (final); PRM ids <bos> w1 | w5 w0 | w7 w0
    assert prm.calls[0].tolist() == [[2, 7, 11, w0, w7, w0]]
    # cumsum 2 9 20 26 39 45: read at 3 and 5; the first lands on the merged token (its text ends the separator)
    assert out == [[(0, pytest.approx(_p(26))), (2, pytest.approx(_p(45)))]]



def test_a_prm_past_its_maximum_length_scores_the_steps_that_fit():
    from transformers import GPT2Config, GPT2ForTokenClassification

    from trl_ppo_ext.rewards.process import ProcessRewardModel

    tok = build_tiny_tokenizer(words=[f"w{i}" for i in range(40)] + ["|"])
    torch.manual_seed(5)
    prm = GPT2ForTokenClassification(GPT2Config(vocab_size=len(tok), n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                                num_labels=2, pad_token_id=tok.pad_token_id))
    fn = ProcessRewardModel(prm, tok, tok, step_separator="|")
    w = tok.convert_tokens_to_ids
    # <bos> w1 (2 tokens), then steps "w2 w3 |" (ends at 4), "w4 w5 |" (7), "w6 w7 |" (10 > 8: cut)
    completion = [w(t) for t in "w2 w3 | w4 w5 | w6 w7 |".split()]
    (pairs,) = fn(prompts=["w1"], completions=["..."], completion_ids=[completion])
    assert [i for i, _ in pairs] == [2, 5]  # the third step's separator lies past the 8 positions
    # the scores PRMTrainer's truncated row gives: input_ids[:8], read at 4 and 7
    row = [tok.bos_token_id, w("w1")] + completion[:6]
    with torch.no_grad():
        probs = prm(input_ids=torch.tensor([row])).logits.softmax(-1)[0, :, 1]
    assert [s for _, s in pairs] == pytest.approx([probs[4].item(), probs[7].item()], abs=1e-6)
