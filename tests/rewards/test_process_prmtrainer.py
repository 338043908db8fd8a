"""ProcessRewardModel builds the input TRL's PRMTrainer trained on: its ``tokenize_row`` gives the
same ids, and its labelled positions are where the step scores are read. PRMTrainer is in TRL
1.12 and earlier (CI's TRL 1.12 environment runs this in process); under a newer TRL the test
runs it in /work/venv112 when that interpreter exists, else skips."""

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trl_ppo_ext.rewards.process import ProcessRewardModel
from trl_ppo_ext.tiny import build_tiny_tokenizer

TRL112_PYTHON = Path("/work/venv112/bin/python")

TOKENIZE = """
import json, sys
from transformers import AutoTokenizer
from trl.experimental.prm import PRMTrainer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = json.loads(sys.argv[2])
out = [PRMTrainer.tokenize_row(row, tok, sys.argv[3], max_length=None, max_completion_length=None,
                               train_on_last_step_only=False, is_eval=False) for row in rows]
print(json.dumps(out))
"""


class RecordingPRM(nn.Module):
    """Records its input ids; P(label 1) = 0.5 everywhere."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_labels=2, _name_or_path="")
        self.anchor = nn.Parameter(torch.zeros(()))
        self.inputs = []

    def get_input_embeddings(self):
        return nn.Embedding(64, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        self.inputs += [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 2))


def _installed_prm_trainer():
    try:
        found = importlib.util.find_spec("trl.experimental.prm") is not None
    except ModuleNotFoundError:
        return None
    if not found:
        return None
    from trl.experimental.prm import PRMTrainer

    return PRMTrainer


def prm_trainer_rows(tokenizer, rows, separator, tmp_path):
    prm_trainer = _installed_prm_trainer()
    if prm_trainer is not None:
        return [prm_trainer.tokenize_row(row, tokenizer, separator, max_length=None, max_completion_length=None,
                                         train_on_last_step_only=False, is_eval=False) for row in rows]
    if not TRL112_PYTHON.exists():
        pytest.skip(f"{TRL112_PYTHON} (TRL 1.12, which has PRMTrainer) is not installed")
    tokenizer.save_pretrained(tmp_path / "tok")
    done = subprocess.run([str(TRL112_PYTHON), "-c", TOKENIZE, str(tmp_path / "tok"), json.dumps(rows), separator],
                          capture_output=True, text=True, timeout=300,
                          env={"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode and "No module named 'trl.experimental.prm'" in done.stderr:
        pytest.skip("this TRL 1.12 has no trl.experimental.prm")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("other_vocabulary", [False, True])
def test_the_prm_input_is_prmtrainers_tokenize_row(tmp_path, other_vocabulary):
    policy = build_tiny_tokenizer()
    theirs = build_tiny_tokenizer([f"w{i}" for i in range(40)][::-1]) if other_vocabulary else policy
    # policy completions: "w5 w0 w7" + <eos> (a final step), "w3 w0 w0 w9 w0" + <eos> (an empty step, ends on w0)
    w = policy.convert_tokens_to_ids
    completion_ids = [[w("w5"), w("w0"), w("w7"), 3], [w("w3"), w("w0"), w("w0"), w("w9"), w("w0"), 3]]
    prompts = ["w1 w2", "w4"]
    # the same completions as PRMTrainer's dataset rows: the steps split on the separator
    rows = [{"prompt": "w1 w2", "completions": ["w5 ", " w7"], "labels": [True, False]},
            {"prompt": "w4", "completions": ["w3 ", " ", " w9 "], "labels": [True, True, False]}]
    expected = prm_trainer_rows(theirs, rows, "w0", tmp_path)
    prm = RecordingPRM()
    reward = ProcessRewardModel(prm, policy, theirs, step_separator="w0")
    assert (reward.text_tokenizer is not None) == other_vocabulary
    out = reward(prompts=prompts, completions=["", ""], completion_ids=completion_ids)
    assert prm.inputs == [row["input_ids"] for row in expected]
    # the scores are read where PRMTrainer put labels (one per step); they land on the policy's w0 tokens,
    # the final step without one on the last token
    assert [len(o) for o in out] == [sum(lab != -100 for lab in row["labels"]) for row in expected]
    assert [[k for k, _ in o] for o in out] == [[1, 3], [1, 2, 4]]
