"""A reward model with another tokenizer (issue 22): the completion is decoded, the text rebuilt
with the RM's chat template, re-tokenized and padded by the RM's tokenizer, and scored exactly as
the RM scores that text when called directly. The RM here reads characters; the policy, words."""

import math
import string

import pytest
import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.rewards.text import (
    TextRewardModel,
    completion_texts,
    resolve_reward_tokenizer,
    reward_model_inputs,
    reward_texts,
    same_vocabulary,
    score_texts,
)
from trl_ppo_ext.tiny import build_tiny_scorer, build_tiny_tokenizer

RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
RM_SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]


def char_tokenizer(padding_side="right", chat_template=RM_TEMPLATE):
    """One token per character of lowercase letters, digits, space, brackets and '|'."""
    chars = list(string.ascii_lowercase + string.digits + " []|")
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(RM_SPECIALS + chars)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]",
                                  padding_side=padding_side)
    tok.chat_template = chat_template
    return tok


@pytest.fixture
def policy_tok():
    return build_tiny_tokenizer()


def ids_of(tok, words):
    return [tok.convert_tokens_to_ids(w) for w in words.split()]


def test_same_vocabulary():
    assert same_vocabulary(build_tiny_tokenizer(), build_tiny_tokenizer(padding_side="right"))
    assert not same_vocabulary(build_tiny_tokenizer(), char_tokenizer())
    # the same strings under other ids is another vocabulary
    assert not same_vocabulary(build_tiny_tokenizer(), build_tiny_tokenizer(words=[f"w{i}" for i in range(39, -1, -1)]))
    grown = build_tiny_tokenizer()
    grown.add_tokens(["<tool>"])
    assert not same_vocabulary(grown, build_tiny_tokenizer())  # the policy can emit a token the RM lacks
    assert same_vocabulary(build_tiny_tokenizer(), grown)  # a token only the RM has is never fed to it


def test_a_pad_token_added_to_the_policys_tokenizer_keeps_the_id_path(tmp_path):
    # TRL's scripts: both tokenizers from the same files, then `add_special_tokens({"pad_token": "[PAD]"})`
    # on the policy's only; the RM's own tokenizer (loaded from its path) lacks [PAD], which is never read
    build_tiny_tokenizer().save_pretrained(tmp_path)
    policy_tok = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    policy_tok.add_special_tokens({"pad_token": "[PAD]"})
    rm_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert same_vocabulary(policy_tok, rm_tok)
    # the policy emitting another added token is a mismatch
    policy_tok.add_tokens(["<tool>"])
    assert not same_vocabulary(policy_tok, rm_tok)


def test_a_model_that_does_not_report_its_embeddings_reads_the_policys_ids():
    # custom PreTrainedModels may not implement get_input_embeddings (transformers raises
    # NotImplementedError): nothing can be checked, and the id path is what TRL's trainer does
    class Opaque(torch.nn.Module):
        config = None

        def get_input_embeddings(self):
            raise NotImplementedError("`get_input_embeddings` not auto-handled")

    assert resolve_reward_tokenizer(Opaque(), build_tiny_tokenizer()) is None


def test_conversational_text_is_rendered_with_the_rms_template_and_its_own_tokens(policy_tok):
    rm_tok = char_tokenizer()
    prompts = [[{"role": "user", "content": "w1 w2"}], [{"role": "user", "content": "w7"}]]
    completion_ids = [ids_of(policy_tok, "w3 w4 <eos>"), ids_of(policy_tok, "w15")]
    completions = completion_texts(completion_ids, policy_tok)
    assert completions == ["w3 w4", "w15"]  # EOS dropped
    texts = reward_texts(prompts, completions, rm_tok)
    assert texts == ["[user]w1 w2|[assistant]w3 w4|", "[user]w7|[assistant]w15|"]
    batch = reward_model_inputs(texts, rm_tok)
    vocab = rm_tok.get_vocab()
    # one id per character; right padding (the RM's side) after the 24 characters of row 1
    assert batch.input_ids[0].tolist() == [vocab[c] for c in texts[0]]
    assert len(texts[0]) == 29 and len(texts[1]) == 24  # 6 + 5 + 1 + 11 + 5 + 1; 6 + 2 + 1 + 11 + 3 + 1
    assert batch.attention_mask.sum(1).tolist() == [29, 24] and batch.attention_mask[1, 24:].eq(0).all()
    assert batch.input_ids[1, 24:].eq(rm_tok.pad_token_id).all()
    assert batch.last_index.tolist() == [28, 23] and batch.position_ids[1, :24].tolist() == list(range(24))


def test_plain_prompts_are_prompt_plus_completion(policy_tok):
    completions = completion_texts([ids_of(policy_tok, "w3 <eos>")], policy_tok)
    assert reward_texts(["w1 w2 "], completions, char_tokenizer()) == ["w1 w2 w3"]


def test_left_padding_puts_the_real_tokens_last_with_positions_from_zero():
    batch = reward_model_inputs(["ab", "abcd"], char_tokenizer(padding_side="left"))
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]] and batch.last_index.tolist() == [3, 3]


def test_an_rm_of_another_vocabulary_scores_exactly_what_it_scores_on_the_rendered_text(policy_tok):
    rm_tok = char_tokenizer()
    rm = build_tiny_scorer(rm_tok, seed=3).eval()
    prompts = [[{"role": "user", "content": "w1 w2"}], [{"role": "user", "content": "w7"}],
               [{"role": "user", "content": "w9 w9 w9"}]]
    completion_ids = [ids_of(policy_tok, "w3 w4 <eos>"), ids_of(policy_tok, "w15"), ids_of(policy_tok, "w0 <eos>")]
    texts = reward_texts(prompts, completion_texts(completion_ids, policy_tok), rm_tok)
    scores = score_texts(rm, rm_tok, texts, batch_size=2)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    # the RM called directly on the rendered text: its own tokenizer, padding and last-token pooling
    with torch.no_grad():
        direct = torch.cat([rm(**rm_tok(texts[s:s + 2], return_tensors="pt", padding=True,
                                        add_special_tokens=False)).logits[:, 0] for s in (0, 2)])
    torch.testing.assert_close(scores, direct, rtol=0, atol=0)
    # and row by row, without any padding: the same to float32 rounding
    with torch.no_grad():
        alone = torch.stack([rm(**rm_tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
                             for t in texts])
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-6)
    left_pad = score_texts(rm, char_tokenizer(padding_side="left"), texts, batch_size=3)
    torch.testing.assert_close(left_pad, alone, rtol=1e-5, atol=1e-6)  # the padding side does not change a score


def test_errors(policy_tok):
    with pytest.raises(ValueError, match="no chat template"):
        reward_texts([[{"role": "user", "content": "w1"}]], ["w2"], char_tokenizer(chat_template=None))
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        reward_texts(["a", "b"], ["c"], char_tokenizer())
    with pytest.raises(ValueError, match=r"text 1 \(''\) has no token"):
        reward_model_inputs(["a", ""], char_tokenizer())


def test_which_path_a_reward_model_takes(policy_tok, tmp_path):
    rm_tok = char_tokenizer()
    same_rm = build_tiny_scorer(policy_tok)
    char_rm = build_tiny_scorer(rm_tok)  # 43 embeddings
    # given: the id path when the vocabulary is the policy's, else the given tokenizer
    assert resolve_reward_tokenizer(same_rm, policy_tok, build_tiny_tokenizer()) is None
    assert resolve_reward_tokenizer(char_rm, policy_tok, rm_tok) is rm_tok
    # not given, nothing to load: the id path when the ids fit, an error when they cannot
    assert resolve_reward_tokenizer(same_rm, policy_tok) is None
    small_rm = build_tiny_scorer(build_tiny_tokenizer(words=["w0"]))  # 7 embeddings < 46 policy tokens
    with pytest.raises(ValueError, match=r"reward_funcs\[1\] has 7 token embeddings but the policy's tokenizer has 46 "
                                         r"tokens.*reward_processing_classes"):
        resolve_reward_tokenizer(small_rm, policy_tok, where="reward_funcs[1]")
    # not given, saved with its tokenizer: loaded from the model's path (GRPO's default)
    rm_tok.save_pretrained(tmp_path)
    char_rm.config._name_or_path = str(tmp_path)
    loaded = resolve_reward_tokenizer(char_rm, policy_tok)
    assert loaded is not None and same_vocabulary(loaded, rm_tok)


# ---------------------------------------------------------------- in the trainer, today
def test_a_ppo_run_scores_with_an_rm_of_another_vocabulary_through_reward_funcs(make_trainer, tok):
    rm_tok = char_tokenizer()
    rm = build_tiny_scorer(rm_tok, seed=3).eval()
    w = tok.convert_tokens_to_ids
    data = Dataset.from_dict({"input_ids": [[w("w1"), w("w2")]] * 8,
                              "prompt": [[{"role": "user", "content": "w1 w2"}]] * 8})
    fn = TextRewardModel(rm, rm_tok, batch_size=4, name="char_rm")
    trainer = make_trainer(tok, reward_model=None, reward_funcs=[fn], train_dataset=data, total_episodes=8)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    responses = [r[m].tolist() for r, m in zip(rollout.responses, rollout.response_mask)]
    # by hand: the RM's template around the prompt and the completion decoded without special tokens
    texts = [f"[user]w1 w2|[assistant]{tok.decode(ids, skip_special_tokens=True)}|" for ids in responses]
    with torch.no_grad():
        direct = rm(**rm_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits[:, 0]
    torch.testing.assert_close(rollout.scores, direct, rtol=0, atol=0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(math.isfinite(h["rewards/char_rm/mean"]) for h in logs)


def test_text_reward_model_names_and_arguments():
    rm = build_tiny_scorer(char_tokenizer())
    rm.config._name_or_path = "org/char-rm"
    assert TextRewardModel(rm, char_tokenizer()).__name__ == "char-rm"
    with pytest.raises(ValueError, match="batch_size=0; it must be an integer >= 1"):
        TextRewardModel(rm, char_tokenizer(), batch_size=0)


def test_reward_tokenizers_are_attached_to_the_models_that_need_them(policy_tok):
    from trl_ppo_ext.rewards.scoring import build_rewards, with_reward_tokenizers

    rm_tok = char_tokenizer()
    same_rm, char_rm = build_tiny_scorer(policy_tok), build_tiny_scorer(rm_tok)

    def ones(completions, **kwargs):
        return [1.0] * len(completions)

    rewards = build_rewards(same_rm, [ones, char_rm], None)
    attached = with_reward_tokenizers(rewards, policy_tok, [None, rm_tok])
    assert [r.tokenizer for r in attached] == [None, None, rm_tok]  # the id path, a function, the text path
    assert [r.source for r in attached] == [r.source for r in rewards]
    assert with_reward_tokenizers(rewards, policy_tok, [policy_tok, build_tiny_tokenizer()])[2].tokenizer is None
    with pytest.raises(ValueError, match=r"reward_processing_classes has 1 entries but there are 2 reward models"):
        with_reward_tokenizers(rewards, policy_tok, [rm_tok])
    # no tokenizer for the character RM, nothing to load, and 43 embeddings < 46 policy tokens: never silent
    with pytest.raises(ValueError, match=r"reward model 'LlamaForSequenceClassification_2' has 43 token embeddings"):
        with_reward_tokenizers(rewards, policy_tok)


# ---------------------------------------------------------------- in the trainer: reward_processing_classes
def test_a_ppo_run_scores_a_reward_model_of_another_vocabulary_on_its_rendered_text(make_trainer, tok):
    rm_tok = char_tokenizer()
    rm = build_tiny_scorer(rm_tok, seed=3).eval()
    w = tok.convert_tokens_to_ids
    data = Dataset.from_dict({"input_ids": [[w("w1"), w("w2")]] * 8,
                              "prompt": [[{"role": "user", "content": "w1 w2"}]] * 8})
    # the RM as the trainer's reward_model, its tokenizer in GRPO's reward_processing_classes
    trainer = make_trainer(tok, reward_model=rm, reward_processing_classes=[rm_tok], train_dataset=data,
                           total_episodes=8, local_rollout_forward_batch_size=3)
    assert trainer.rewards[0].tokenizer is rm_tok
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    responses = [r[m].tolist() for r, m in zip(rollout.responses, rollout.response_mask)]
    # by hand: the RM's template around the prompt and the completion decoded without special tokens
    texts = [f"[user]w1 w2|[assistant]{tok.decode(ids, skip_special_tokens=True)}|" for ids in responses]
    assert len(texts) == 4  # one batch of per_device_train_batch_size rows, scored in chunks of 3 (3, 1)
    with torch.no_grad():  # the RM called directly on the rendered text, chunk by chunk
        direct = torch.cat([rm(**rm_tok(texts[s:s + 3], return_tensors="pt", padding=True,
                                        add_special_tokens=False)).logits[:, 0] for s in (0, 3)])
    torch.testing.assert_close(rollout.scores, direct, rtol=0, atol=0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2 and all(math.isfinite(h["objective/scores"]) for h in logs)


def test_a_reward_model_of_another_vocabulary_without_its_tokenizer_is_refused_at_construction(make_trainer, tok):
    small_rm = build_tiny_scorer(build_tiny_tokenizer(words=["w0"]))  # 7 embeddings < 46 policy tokens
    with pytest.raises(ValueError, match=r"has 7 token embeddings but the policy's tokenizer has 46 tokens.*"
                                         r"reward_processing_classes"):
        make_trainer(tok, reward_model=small_rm)


def test_a_same_vocabulary_tokenizer_keeps_the_id_path_bit_identical(make_trainer, tok, monkeypatch, tmp_path):
    def final_weights(**kwargs):
        torch.manual_seed(0)
        trainer = make_trainer(tok, total_episodes=8, output_dir=str(tmp_path / str(len(kwargs))), **kwargs)
        trainer.train()
        return {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}

    plain = final_weights()

    def no_text_path(*args, **kwargs):
        raise AssertionError("a reward model of the policy's vocabulary went through text")

    monkeypatch.setattr(PPOTrainer, "reward_text_scores", no_text_path)
    given = final_weights(reward_processing_classes=[build_tiny_tokenizer(padding_side="right")])
    assert plain.keys() == given.keys() and all(torch.equal(plain[k], given[k]) for k in plain)


# ---------------------------------------------------------------- the same vocabulary, another rendering
ROLE_WORDS = [f"w{i}" for i in range(40)] + ["USER", "BOT", "Q", "A"]
USER_BOT = ("{% for m in messages %}{% if m['role'] == 'user' %}USER {{ m['content'] }} {% else %}BOT "
            "{{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}BOT {% endif %}")
Q_A = USER_BOT.replace("USER", "Q").replace("BOT", "A")


def test_the_same_vocabulary_under_another_chat_template_takes_the_text_path():
    from trl_ppo_ext.rewards.text import same_rendering

    policy_tok = build_tiny_tokenizer(words=ROLE_WORDS, chat_template=USER_BOT)
    rm_tok = build_tiny_tokenizer(words=ROLE_WORDS, chat_template=Q_A)
    rm = build_tiny_scorer(rm_tok)
    assert same_vocabulary(policy_tok, rm_tok) and not same_rendering(policy_tok, rm_tok)
    assert resolve_reward_tokenizer(rm, policy_tok, rm_tok) is rm_tok  # its own template, through text
    twin = build_tiny_tokenizer(words=ROLE_WORDS, chat_template=USER_BOT, padding_side="right")
    assert same_rendering(policy_tok, twin) and resolve_reward_tokenizer(rm, policy_tok, twin) is None
    # no template on one side only is another rendering too
    assert resolve_reward_tokenizer(rm, policy_tok, build_tiny_tokenizer(words=ROLE_WORDS, chat_template=None)) \
        is not None


def test_the_same_vocabulary_with_another_plain_prompt_format_takes_the_text_path(tmp_path):
    from tokenizers import processors

    from trl_ppo_ext.rewards.text import same_rendering

    policy_tok = build_tiny_tokenizer()
    rm_tok = build_tiny_tokenizer()
    # the RM's tokenizer starts plain text with <bos> (a post-processor, as Llama's does): the policy's ids lack it
    rm_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
        ("<bos>", rm_tok.bos_token_id)])
    assert rm_tok("w1 w2")["input_ids"] == [2, 7, 8] and policy_tok("w1 w2")["input_ids"] == [7, 8]
    assert same_vocabulary(policy_tok, rm_tok) and not same_rendering(policy_tok, rm_tok)
    assert resolve_reward_tokenizer(build_tiny_scorer(rm_tok), policy_tok, rm_tok) is rm_tok


def test_a_ppo_run_scores_a_same_vocabulary_rm_on_its_own_chat_template(make_trainer):
    policy_tok = build_tiny_tokenizer(words=ROLE_WORDS, chat_template=USER_BOT)
    rm_tok = build_tiny_tokenizer(words=ROLE_WORDS, chat_template=Q_A, padding_side="right")
    rm = build_tiny_scorer(rm_tok, seed=3).eval()
    w = policy_tok.convert_tokens_to_ids
    data = Dataset.from_dict({"input_ids": [[w("USER"), w("w1"), w("w2"), w("BOT")]] * 4,
                              "prompt": [[{"role": "user", "content": "w1 w2"}]] * 4})
    trainer = make_trainer(policy_tok, reward_model=rm, reward_processing_classes=[rm_tok], train_dataset=data,
                           total_episodes=4)
    assert trainer.rewards[0].tokenizer is rm_tok
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    responses = [r[m].tolist() for r, m in zip(rollout.responses, rollout.response_mask)]
    # by hand: the RM's own template, "Q <prompt> A <completion> ", never the policy's USER/BOT ids
    texts = [f"Q w1 w2 A {policy_tok.decode(ids, skip_special_tokens=True)} " for ids in responses]
    with torch.no_grad():
        direct = rm(**rm_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits[:, 0]
    torch.testing.assert_close(rollout.scores, direct, rtol=0, atol=0)


# ---------------------------------------------------------------- plain prompts: the word boundary kept
def metaspace_tokenizer(words):
    """A SentencePiece-style tokenizer: words carry their leading space as '▁' (Metaspace), and the
    decoder turns '▁' back into spaces and drops the first one -- so a completion decoded alone
    loses the space before its first word."""
    from tokenizers import decoders

    pieces = ["<pad>", "<unk>", "<bos>", "<eos>"] + [f"▁{w}" for w in words]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>")


@pytest.mark.parametrize("kind", ["word_level", "sentencepiece"])
def test_plain_prompt_and_completion_keep_their_word_boundary(kind):
    from trl_ppo_ext.rewards.text import plain_reward_texts

    tok = build_tiny_tokenizer() if kind == "word_level" else metaspace_tokenizer([f"w{i}" for i in range(40)])
    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt_ids = [ids("w13 w14"), ids("w2")]
    completion_ids = [ids("w7 w8") + [tok.eos_token_id], ids("w3")]
    # decoded apart and glued (GRPO's strings): "w13 w14" + "w7 w8" -> "w13 w14w7 w8", one unknown word
    glued = [a + b for a, b in zip(tok.batch_decode(prompt_ids, skip_special_tokens=True),
                                   completion_texts(completion_ids, tok))]
    assert glued == ["w13 w14w7 w8", "w2w3"]
    prompts = tok.batch_decode(prompt_ids, skip_special_tokens=True)  # no prompt column: the decoded ids
    assert plain_reward_texts(prompts, prompt_ids, completion_ids, tok) == ["w13 w14 w7 w8", "w2 w3"]
    # a prompt column of strings keeps its own text; the boundary comes from the ids
    assert plain_reward_texts(["w13  w14 ", "w2"], prompt_ids, completion_ids, tok) == ["w13  w14 w7 w8", "w2 w3"]


def test_a_ppo_run_scores_plain_prompts_with_every_word_of_the_text(make_trainer, tok):
    rm_tok = char_tokenizer()
    rm = build_tiny_scorer(rm_tok, seed=3).eval()
    w = tok.convert_tokens_to_ids
    data = Dataset.from_dict({"input_ids": [[w("w1"), w("w14")]] * 4})  # plain prompts, no prompt column
    trainer = make_trainer(tok, reward_model=rm, reward_processing_classes=[rm_tok], train_dataset=data,
                           total_episodes=4)
    rollout = trainer.score_rollout(trainer.generate_rollout(next(iter(trainer.dataloader))))
    responses = [r[m].tolist() for r, m in zip(rollout.responses, rollout.response_mask)]
    # by hand: the whole sequence decoded as the policy's tokenizer decodes it: "w1 w14 <words>"
    texts = [tok.decode([w("w1"), w("w14")] + ids, skip_special_tokens=True) for ids in responses]
    assert all(t.startswith("w1 w14 ") for t in texts if t != "w1 w14")
    with torch.no_grad():
        direct = rm(**rm_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits[:, 0]
    torch.testing.assert_close(rollout.scores, direct, rtol=0, atol=0)


# ---------------------------------------------------------------- texts longer than the RM reads
def gpt2_scorer(tok, n_positions):
    """A tiny GPT-2 reward model: learned positions, so a text past n_positions is an index error."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(4)
    config = GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=16, n_layer=1, n_head=2, num_labels=1,
                        pad_token_id=tok.pad_token_id)
    return GPT2ForSequenceClassification(config).eval()


def test_a_text_longer_than_the_rm_reads_is_cut_on_the_left_with_one_warning(caplog, monkeypatch):
    from trl_ppo_ext.rewards import text as reward_text

    rm_tok = char_tokenizer()
    rm = gpt2_scorer(rm_tok, n_positions=8)
    texts = ["abcdefghijkl", "xyz"]  # 12 characters (tokens) > 8: position 8 is an index error for GPT-2
    monkeypatch.setattr(reward_text, "_warned_truncation", [], raising=False)  # this test sees the first warning
    with caplog.at_level("WARNING", logger="trl_ppo_ext.rewards.text"):
        scores = score_texts(rm, rm_tok, texts, batch_size=2)
        score_texts(rm, rm_tok, texts, batch_size=2)
    # the last 8 tokens, where the score is read: what the RM scores on "efghijkl" alone
    with torch.no_grad():
        alone = torch.stack([rm(**rm_tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
                             for t in ("efghijkl", "xyz")])
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-6)
    assert caplog.text.count("longer than the 8 tokens it reads") == 1

