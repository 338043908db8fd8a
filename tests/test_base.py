"""Parity of our own base (``trl_ppo_ext._base``, used where TRL has no PPO trainer) with TRL's
PPO classes: config fields, ``HfArgumentParser`` behaviour, model-card attributes, and a short
run on each base giving the same files, weights and log history.

Where the installed TRL has PPO (1.0 - 1.12) both bases are compared directly, the own one
forced with ``TRL_PPO_EXT_OWN_BASE=1`` in a subprocess. Where it has none (1.13 on), the
config is compared with ``TRL_1_12_PPO_FIELDS``, a table of TRL 1.12's values kept here.
"""

import json
import os
import subprocess
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from trl_ppo_ext import _base, _compat
from trl_ppo_ext.reporting import TIMING_KEYS

ROOT = Path(__file__).parents[1]
TRL_HAS_PPO = _compat.trl_has_ppo()
needs_trl_ppo = pytest.mark.skipif(not TRL_HAS_PPO, reason="the installed TRL has no PPO trainer to compare with")

# TRL 1.12's PPOConfig, read off trl/experimental/ppo/ppo_config.py: name -> (type, default).
# 33 PPO fields plus the learning_rate it overrides (TrainingArguments: 5e-5).
TRL_1_12_PPO_FIELDS = {
    "learning_rate": (float, 3e-6),
    "dataset_num_proc": (int | None, None),
    "num_mini_batches": (int, 1),
    "total_episodes": (int | None, None),
    "local_rollout_forward_batch_size": (int, 64),
    "num_sample_generations": (int, 10),
    "response_length": (int, 53),
    "stop_token": (typing.Literal["eos"] | None, None),
    "stop_token_id": (int | None, None),
    "temperature": (float, 0.7),
    "missing_eos_penalty": (float | None, None),
    "sft_model_path": (str, "EleutherAI/pythia-160m"),
    "world_size": (int | None, None),
    "num_total_batches": (int | None, None),
    "micro_batch_size": (int | None, None),
    "local_batch_size": (int | None, None),
    "batch_size": (int | None, None),
    "local_mini_batch_size": (int | None, None),
    "mini_batch_size": (int | None, None),
    "push_to_hub": (bool, False),
    "reward_model_path": (str, "EleutherAI/pythia-160m"),
    "model_adapter_name": (str | None, None),
    "ref_adapter_name": (str | None, None),
    "num_ppo_epochs": (int, 4),
    "whiten_rewards": (bool, False),
    "kl_coef": (float, 0.05),
    "kl_estimator": (typing.Literal["k1", "k3"], "k1"),
    "cliprange": (float, 0.2),
    "vf_coef": (float, 0.1),
    "cliprange_value": (float, 0.2),
    "gamma": (float, 1.0),
    "lam": (float, 0.95),
    "ds3_gather_for_generation": (bool, True),
}
# What TRL's base config changes in TrainingArguments (every TRL 1.x): name -> (type, default).
TRL_BASE_CONFIG_FIELDS = {
    "logging_steps": (float, 10),
    "gradient_checkpointing": (bool, True),
    "bf16": (bool | None, None),
    "lr_scheduler_kwargs": (dict | str | None, None),
    "use_liger_kernel": (bool, False),
    "torch_empty_cache_steps": (int | None, None),
}


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _table(cls) -> dict:
    """name -> (type, default) of every dataclass field. Types as declared: HfArgumentParser
    rewrites ``Field.type`` in place when it parses a dataclass (``int | None`` becomes ``int``),
    so after any test that parsed a config the fields no longer say what the class declares."""
    declared = typing.get_type_hints(cls)
    return {f.name: (declared[f.name], _default(f)) for f in fields(cls)}


# --------------------------------------------------------------------------- config
def test_config_has_trl_1_12_ppo_fields_and_base_defaults():
    ours = _table(_base.PPOConfigBase)
    for table in (TRL_1_12_PPO_FIELDS, TRL_BASE_CONFIG_FIELDS):
        assert {k: ours[k] for k in table} == table
    # nothing else differs from TrainingArguments
    plain = _table(TrainingArguments)
    extra = set(ours) - set(plain) - set(TRL_1_12_PPO_FIELDS)
    assert not extra, f"fields TRL 1.12's PPOConfig does not have: {sorted(extra)}"
    changed = {k for k in plain if ours[k] != plain[k]} - set(TRL_1_12_PPO_FIELDS) - set(TRL_BASE_CONFIG_FIELDS)
    assert not changed, f"TrainingArguments defaults changed: {sorted(changed)}"


@needs_trl_ppo
def test_config_matches_trls_ppo_config_field_for_field():
    theirs = _table(_compat.load_trl_ppo()[1])
    ours = _table(_base.PPOConfigBase)
    assert list(ours) == list(theirs), "same names in the same order (the --help order)"
    assert {k: v for k, v in ours.items() if v != theirs[k]} == {}
    # and the table kept for TRL versions without PPO is TRL's
    assert {k: theirs[k] for k in TRL_1_12_PPO_FIELDS} == TRL_1_12_PPO_FIELDS


def test_transformers_root_gives_the_same_fields_as_trls_base_config():
    """The last resort (no TRL base config) keeps names, types, defaults and the bf16 rule."""
    fallback = _base.make_config_base(_base.TransformersRootConfig)
    assert _table(fallback) == _table(_base.make_config_base(_base.config_root()))
    assert fallback(output_dir="x", fp16=False, use_cpu=True).bf16 is True  # unset -> not fp16
    assert fallback(output_dir="x", bf16=False).bf16 is False


def _parse(cls, argv):
    (config,) = HfArgumentParser(cls).parse_args_into_dataclasses(argv)
    return config


ARGV = ["--output_dir", "o", "--bf16", "False", "--stop_token", "eos", "--response_length", "7",
        "--kl_estimator", "k3", "--missing_eos_penalty", "1.5", "--num_mini_batches", "2", "--whiten_rewards",
        "--ds3_gather_for_generation", "False", "--total_episodes", "100"]


def test_argument_parser_reads_ppo_fields():
    config = _parse(_base.PPOConfigBase, ARGV)
    assert (config.stop_token, config.response_length, config.kl_estimator, config.missing_eos_penalty) == (
        "eos", 7, "k3", 1.5)
    assert (config.num_mini_batches, config.whiten_rewards, config.ds3_gather_for_generation) == (2, True, False)
    assert (config.total_episodes, config.learning_rate, config.logging_steps) == (100, 3e-6, 10)
    with pytest.raises(SystemExit):  # choices come from the Literal types
        _parse(_base.PPOConfigBase, ["--output_dir", "o", "--kl_estimator", "k2"])


@needs_trl_ppo
def test_argument_parser_gives_trls_values():
    theirs, ours = _parse(_compat.load_trl_ppo()[1], ARGV), _parse(_base.PPOConfigBase, ARGV)
    assert ours.to_dict() == theirs.to_dict()


@pytest.mark.parametrize("make", [lambda: _base.PPOConfigBase,
                                  lambda: _base.make_config_base(_base.TransformersRootConfig)])
def test_help_renders(make):
    # argparse formats every help text with %; one stray % breaks --help (see TRL's base config)
    cls = make()
    text = " ".join(HfArgumentParser(cls).format_help().split())  # argparse wraps lines: compare words
    assert [f.name for f in fields(cls) if f.init and f"--{f.name} " not in text] == []
    # a help text with a percent sign comes out whole, and so does one of PPO's own fields
    assert "Reduces memory at the cost of ~20% slower training." in text
    penalty = " ".join(next(f for f in fields(cls) if f.name == "missing_eos_penalty").metadata["help"].split())
    assert penalty in text


# --------------------------------------------------------------------------- trainer
def test_model_card_attributes():
    parts = _base.PPOTrainerParts
    assert (parts._name, parts._tag_names) == ("PPO", ["trl", "ppo"])
    assert parts._paper["id"] == "1909.08593"
    assert parts._paper["title"] == "Fine-Tuning Language Models from Human Preferences"
    assert "arXiv:1909.08593" in parts._paper["citation"]


@needs_trl_ppo
def test_model_card_attributes_match_trls_trainer():
    theirs = _compat.load_trl_ppo()[0]
    assert (_base.PPOTrainerParts._name, _base.PPOTrainerParts._tag_names) == (theirs._name, theirs._tag_names)
    assert {k: theirs._paper[k] for k in ("title", "id")} == {k: _base.ZIEGLER_2019[k] for k in ("title", "id")}


def _parity_run(out: Path, own_base: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONHASHSEED": "0",  # TRL's model card and PEFT's adapter_config list sets
           "TRL_PPO_EXT_OWN_BASE": "1" if own_base else "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "ppo_base_parity.py"), str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["own_base"] is own_base, summary["base"]
    return summary


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def _strip_citation(card: str) -> str:
    """The model card with PPO's bibtex entry cut out: ours is written independently. (PEFT's
    adapter card has none.)"""
    if "Cite PPO as:" not in card:
        return card
    start = card.index("Cite PPO as:")
    end = card.index("```", card.index("```bibtex", start) + 3)
    return card[:start] + card[end:]


def _compare_file(a: Path, b: Path) -> str | None:
    """None when equal; else what differs."""
    if a.suffix == ".safetensors":
        from safetensors.torch import load_file

        return None if _same_tensors(load_file(a), load_file(b)) else "tensors differ"
    if a.name == "training_args.bin":
        ta, tb = (torch.load(p, weights_only=False).to_dict() for p in (a, b))
        return None if _without(ta, "output_dir") == _without(tb, "output_dir") else "config differs"
    if a.name.startswith("rng_state"):
        # Python's and NumPy's generators are not seeded by the trainer (torch's is): compare torch's
        ta, tb = (torch.load(p, weights_only=False)["torch"] for p in (a, b))
        return None if torch.equal(ta, tb) else "torch RNG state differs"
    if a.suffix == ".pt":
        return None if _same_tensors(torch.load(a, weights_only=False), torch.load(b, weights_only=False)) \
            else "tensors differ"
    if a.name == "README.md":
        return None if _strip_citation(a.read_text()) == _strip_citation(b.read_text()) else "model card differs"
    if a.name == "run_manifest.json":
        ma, mb = (json.loads(p.read_text()) for p in (a, b))
        for m in (ma, mb):
            m.pop("started_at"), m.pop("stopped_at"), m["hyperparameters"].pop("output_dir")
        return None if ma == mb else "manifest differs"
    if a.name == "trainer_state.json":
        sa, sb = (json.loads(p.read_text()) for p in (a, b))
        for s in (sa, sb):
            s["log_history"] = [_without(h, *TIMING_KEYS) for h in s["log_history"]]
        return None if sa == sb else "trainer state differs"
    return None if a.read_bytes() == b.read_bytes() else "bytes differ"


@needs_trl_ppo
@pytest.mark.slow
def test_a_run_on_our_base_equals_a_run_on_trls(tmp_path):
    """Same files, same weights, same optimizer state, same logs, same model card."""
    trl_run, own_run = _parity_run(tmp_path / "trl", False), _parity_run(tmp_path / "own", True)
    for setup in ("full", "peft"):
        a, b = trl_run[setup], own_run[setup]
        assert (a["files"], a["final_files"], a["output_dir_files"]) == (b["files"], b["final_files"],
                                                                          b["output_dir_files"])
        assert [_without(h, *TIMING_KEYS) for h in a["log_history"]] == [
            _without(h, *TIMING_KEYS) for h in b["log_history"]]
        assert len(a["log_history"]) == 2
        weights = "adapter_model.safetensors" if setup == "peft" else "model.safetensors"
        assert weights in a["final_files"] and "README.md" in a["output_dir_files"]
        differ = {}
        for path in sorted((tmp_path / "trl" / setup).rglob("*")):
            if path.is_file():
                other = tmp_path / "own" / setup / path.relative_to(tmp_path / "trl" / setup)
                problem = _compare_file(path, other)
                if problem:
                    differ[str(path.relative_to(tmp_path / "trl"))] = problem
        assert differ == {}


def _resume_run(out: Path, mode: str, own_base: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "TRL_PPO_EXT_OWN_BASE": "1" if own_base else "0"}
    return subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "ppo_resume.py"), str(out), mode],
                          capture_output=True, text=True, env=env, timeout=600)


@needs_trl_ppo
@pytest.mark.slow
def test_a_checkpoint_written_on_trls_base_resumes_on_ours(tmp_path):
    """What an upgrade from TRL 1.12 to 1.13+ does to a run in progress (CI also runs it across
    real TRL versions, see .ci/run)."""
    straight = _resume_run(tmp_path, "straight", own_base=False)
    killed = _resume_run(tmp_path, "killed", own_base=False)
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert killed.returncode == -9, killed.stderr[-4000:]
    resumed = _resume_run(tmp_path, "resume", own_base=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = torch.load(tmp_path / "final_params_straight.pt")
    b = torch.load(tmp_path / "final_params_resume.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs_a = json.loads((tmp_path / "logs_straight.json").read_text())
    logs_b = json.loads((tmp_path / "logs_resume.json").read_text())
    assert [_without(h, *TIMING_KEYS) for h in logs_a] == [_without(h, *TIMING_KEYS) for h in logs_b]


@pytest.mark.slow
def test_transformers_trainer_as_last_resort_trains_and_saves(tmp_path):
    """Without TRL's base trainer and base config, our classes stand on transformers' own."""
    code = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("trl.trainer.base_trainer", "trl.trainer.base_config"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(ROOT / "tests" / "scripts")!r})
from pathlib import Path
import transformers
from tiny_setup import prompt_dataset, tiny_config, tiny_models
from trl_ppo_ext import PPOConfig, PPOTrainer, _compat, _base
from trl_ppo_ext.tiny import build_tiny_tokenizer
assert _base.trainer_root() is transformers.Trainer and _base.config_root() is _base.TransformersRootConfig
assert issubclass(PPOTrainer, transformers.Trainer) and issubclass(PPOConfig, _base.TransformersRootConfig)
tok = build_tiny_tokenizer(pad_equals_eos=True)
policy, ref, value, reward = tiny_models(tok)
args = tiny_config(Path({str(tmp_path)!r}), save_strategy="steps", save_steps=1)
trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                     train_dataset=prompt_dataset(tok), value_model=value)
trainer.train()
trainer.save_model()
print(_compat.base_description())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRL_PPO_EXT_OWN_BASE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TransformersRootConfig/Trainer" in proc.stdout
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2" / "trainer_state.json").exists()
