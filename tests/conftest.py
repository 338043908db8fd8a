"""Fixtures shared by the trainer tests: a tiny tokenizer, prompts, models, a PPOConfig, and the
one way a test builds a ``PPOTrainer``. Test modules never import this file; they ask for the
fixtures by name.

``tok``
    A tiny tokenizer (``build_tiny_tokenizer()``: ``<pad>`` pads, on the left), new for each test.
    A test that needs another one (pad == eos, right padding, more words) builds it with
    ``trl_ppo_ext.tiny.build_tiny_tokenizer`` and hands it to the builder.
``make_prompts(tokenizer, n=16, min_len=2, max_len=5, seed=0)``
    A ``Dataset`` of ``n`` random tokenized prompts (``input_ids`` only).
``make_models(tokenizer, **llama_config) -> (policy, ref_policy, value_model, reward_model)``
    The four tiny models (seeds 0, 0, 1, 2: the reference starts equal to the policy).
``make_config(**overrides) -> PPOConfig``
    A config for a CPU run of a few seconds, writing to ``tmp_path / "out"``.
``make_trainer(tok=None, *, cls=PPOTrainer, args=None, model=, ref_model=, value_model=,
             reward_model=, train_dataset=, **kwargs)``
    The trainer builder. What is not given is the tiny default: a fresh ``build_tiny_tokenizer()``
    for ``tok`` (the ``processing_class``), ``make_models(tok)``'s model for each model keyword,
    ``make_prompts(tok)`` for ``train_dataset``, ``make_config(**overrides)`` for ``args``. Anything
    given is passed through as is: ``ref_model=None`` reaches the trainer as None. ``kwargs``
    that are ``PPOTrainer`` keywords (``peft_config``, ``reward_funcs``, ``eval_dataset``,
    ``eval_metrics``, ``optimizers``, ``callbacks``, ``data_collator``) go to the trainer, the
    rest are config overrides (``output_dir=...`` included); overrides beside ``args`` are an
    error. ``cls`` is a ``PPOTrainer`` subclass to build instead. The constructor's errors
    propagate, so a test of a bad input uses the builder too.
``trainer_builder(root)``
    The same builder writing under ``root`` instead of ``tmp_path``: for module-scoped fixtures,
    which cannot use the per-test ``make_trainer``.
``assert_metrics(trainer, n_updates)``
    Every one of ``n_updates`` logged updates has every expected metric, all finite.
``record_optimizer_steps(trainer) -> list``
    Counts the torch optimizer's real steps; the list gets one count per logged update.
``two_process_runs -> (OUT, CompletedProcess)``
    One DDP launch of ``tests/scripts/ppo_two_process.py`` on 2 CPU processes (gloo), once per
    session: ``tiny_setup.TWO_PROCESS_MODES`` (tests/test_distributed.py) then
    ``tiny_setup.DDP_REFERENCE_MODES`` (tests/end_to_end/test_fsdp2.py's DDP reference), each writing
    ``OUT/<mode>/rank<k>.json`` (``rank<k>.error`` for the one that raised: no mode after it runs).

The plain functions behind these live in ``tests/scripts/tiny_setup.py``, which the subprocess
scripts beside it import directly (they run outside pytest).
"""

import inspect
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# The plain set-up functions sit beside the subprocess scripts, which import them the same way.
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import tiny_setup

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.tiny import build_tiny_tokenizer


def pytest_addoption(parser):
    parser.addoption("--launches", action="store_true",
                     help="also run the tests marked `launches` (multi-process launches and whole training "
                          "runs in subprocesses: DeepSpeed, FSDP2, DDP, SIGKILL/SIGTERM, the learning examples)")


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    if not config.getoption("--launches"):
        skips["launches"] = pytest.mark.skip(
            reason="a launch of its own (several processes, or a whole run in a subprocess): "
                   "run with --launches, as CI does")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_threads():
    # The CI machine has 2 cores; oversubscription makes tiny-model tests slow and noisy.
    torch.set_num_threads(2)
    yield


# ---------------------------------------------------------------- the pieces of a tiny run
@pytest.fixture
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def make_prompts():
    return tiny_setup.prompt_dataset


@pytest.fixture(scope="session")
def make_models():
    return tiny_setup.tiny_models


@pytest.fixture
def make_config(tmp_path):
    def make_config(**overrides):
        return tiny_setup.tiny_config(tmp_path, **overrides)

    return make_config


# ---------------------------------------------------------------- the trainer builder
class _NotGiven:
    def __repr__(self):
        return "<not given>"


NOT_GIVEN = _NotGiven()


class TrainerBuilder:
    """``make_trainer``: see the module docstring. Builds the defaults it is not given in
    tiny_setup's order (policy, reference, value, reward), so the global RNG the trainer starts
    from is the one the models' seeds leave, as when a test builds all four itself."""

    def __init__(self, root):
        self.root = Path(root)

    def __call__(self, tok=None, *, cls=PPOTrainer, args=None, model=NOT_GIVEN, ref_model=NOT_GIVEN,
                 value_model=NOT_GIVEN, reward_model=NOT_GIVEN, train_dataset=NOT_GIVEN, **kwargs):
        tok = build_tiny_tokenizer() if tok is None else tok
        keywords = set(inspect.signature(cls.__init__).parameters) - {"self", "args", "processing_class"}
        trainer_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in keywords}
        if args is not None and kwargs:
            raise TypeError(f"config overrides {sorted(kwargs)} given beside an explicit `args`")
        models = dict(model=model, ref_model=ref_model, value_model=value_model, reward_model=reward_model)
        for role, given in models.items():
            if given is NOT_GIVEN:
                models[role] = tiny_setup.tiny_model(role, tok)
        if args is None:
            args = tiny_setup.tiny_config(self.root, **kwargs)
        if train_dataset is NOT_GIVEN:
            train_dataset = tiny_setup.prompt_dataset(tok)
        return cls(args=args, processing_class=tok, train_dataset=train_dataset, **models, **trainer_kwargs)


@pytest.fixture
def make_trainer(tmp_path):
    return TrainerBuilder(tmp_path)


@pytest.fixture(scope="session")
def trainer_builder():
    return TrainerBuilder


# ---------------------------------------------------------------- checks on a trainer
EXPECTED_METRICS = [
    "objective/scores", "objective/non_score_reward", "objective/rlhf_reward", "objective/kl",
    "objective/entropy", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
    "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/explained_variance", "val/ratio",
    "val/ratio_max", "val/advantage_mean", "val/advantage_std", "val/response_length", "val/eos_rate",
    "val/num_eos_tokens", "val/truncation_rate", "lr", "eps",
]


def _assert_metrics(trainer, n_updates):
    """Every update of ``trainer`` logged every expected metric, all finite."""
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == n_updates
    for entry in logs:
        missing = [k for k in EXPECTED_METRICS if k not in entry]
        assert not missing, f"missing metrics {missing}"
        bad = {k: entry[k] for k in EXPECTED_METRICS if not math.isfinite(entry[k])}
        assert not bad, f"non-finite metrics {bad}"


@pytest.fixture(scope="session")
def assert_metrics():
    return _assert_metrics


@pytest.fixture(scope="session")
def record_optimizer_steps():
    return tiny_setup.record_optimizer_steps



@pytest.fixture(scope="session")
def se():
    """The ``benchmarks/sample_efficiency/`` package (its public names), with ``examples/`` importable (its tasks)."""
    root = Path(__file__).resolve().parents[1]
    for path in (root / "benchmarks", root / "examples"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import sample_efficiency

    return sample_efficiency


@pytest.fixture
def needs_trl_grpo(se):
    """Skips a test of the benchmark's ``trl_grpo`` arm where TRL's own GRPOTrainer cannot run it
    (TRL < 1.16: the newest-TRL environment runs these)."""
    why = se.trl_grpo_ok()
    if why is not None:
        pytest.skip(f"needs TRL's GRPOTrainer: {why}")


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory):
    """See the module docstring; one launch (its ~10 s of start-up) for both test modules."""
    out = tmp_path_factory.mktemp("two_process")
    script = Path(__file__).parent / "scripts" / "ppo_two_process.py"
    modes = [*tiny_setup.TWO_PROCESS_MODES, *tiny_setup.DDP_REFERENCE_MODES]
    ddp = ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    return out, tiny_setup.launch_two_processes(ddp, [str(script), str(out), *modes], {"ACCELERATE_USE_CPU": "1"},
                                                timeout=1200)
