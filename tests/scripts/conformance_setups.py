"""Model set-ups users bring to a TRL PPO script, and one run of either trainer on them.

tests/end_to_end/test_conformance.py runs every row of its matrix through :func:`run` twice, once with
``trl_ppo_ext.PPOTrainer`` and once with TRL's own (where TRL 1.12 or older is installed);
tests/end_to_end/test_deepspeed.py runs the "llama+custom-critic" row under "fp32" inside its ZeRO-3 launch
(``ppo_deepspeed.py --also-conformance``, the models built beforehand by :func:`build_row_models`).
Run as a script, it is the issue-18 report: a custom critic under the default config
(``python tests/scripts/conformance_setups.py [--trainer trl] [--row SETUP VARIATION] [--out DIR]``;
``--matrix ours trl`` prints the whole matrix as a table).

Every model is built here, from a config in code: tiny Llama, GPT-2 (absolute positions,
tied embeddings), OPT, Qwen2, and two custom ``PreTrainedModel`` scorers that set nothing TRL
does not read (a ``base_model_prefix`` backbone and a ``score`` head; no
``supports_gradient_checkpointing``, no ``config_class``, no ``_no_split_modules``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    LlamaConfig,
    LlamaModel,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.modeling_outputs import BaseModelOutput

from trl_ppo_ext.models.policy_value import is_checkpointing
from trl_ppo_ext.tiny import build_tiny_tokenizer, random_word_prompts

HIDDEN, LAYERS, HEADS = 32, 2, 4


# ---------------------------------------------------------------- family configs
def family_config(family: str, tok, **extra) -> PretrainedConfig:
    """A tiny config of ``family`` ("llama", "gpt2", "opt", "qwen2") with ``tok``'s special ids."""
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vocab = len(tok)
    if family == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           max_position_embeddings=128, tie_word_embeddings=False, **ids, **extra)
    if family == "gpt2":  # learned absolute positions, LM head tied to the input embedding
        return GPT2Config(vocab_size=vocab, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=128,
                          tie_word_embeddings=True, **ids, **extra)
    if family == "opt":
        return OPTConfig(vocab_size=vocab, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN, max_position_embeddings=128,
                         **ids, **extra)
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                           max_position_embeddings=128, tie_word_embeddings=False, **ids, **extra)
    raise ValueError(f"family={family!r}: expected one of 'llama', 'gpt2', 'opt', 'qwen2'")


# LoRA targets per family (TRL scripts pass --lora_target_modules for models that are not Llama-like).
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "opt": ["q_proj", "v_proj"],
                "qwen2": ["q_proj", "v_proj"]}


def causal_lm(family: str, tok, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, tok))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def sequence_scorer(family: str, tok, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(family_config(family, tok, num_labels=1))


# ---------------------------------------------------------------- custom scorers
class LlamaBackboneCritic(PreTrainedModel):
    """A critic as users write one: a transformers backbone plus a ``score`` head, in a
    ``PreTrainedModel`` that does not declare ``supports_gradient_checkpointing``."""

    base_model_prefix = "backbone"

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.backbone = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.score(hidden)


class FeatureConfig(PretrainedConfig):
    model_type = "ppo_conformance_feature_scorer"

    def __init__(self, vocab_size: int = 64, hidden_size: int = HIDDEN, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kwargs)


class RunningMeanBackbone(nn.Module):
    """Features of the tokens so far: ``h_t = tanh(W mean(emb(x_1..x_t) over attended tokens))``.

    Fills ``last_hidden_state`` and, when asked (TRL asks), ``hidden_states``; accepts and
    ignores the keywords a transformers backbone takes (positions, cache, return_dict).
    """

    def __init__(self, config: FeatureConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, **ignored):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        mask = mask.to(self.embed.weight.dtype)[..., None]  # (B, L, 1)
        summed = (self.embed(input_ids) * mask).cumsum(1)  # (B, L, H)
        mean = summed / mask.cumsum(1).clamp(min=1.0)
        hidden = torch.tanh(self.proj(mean))
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=(mean, hidden) if output_hidden_states else None)


class FeatureScorer(PreTrainedModel):
    """A rule/feature scorer without any transformer layer (no checkpointing possible)."""

    base_model_prefix = "features"

    def __init__(self, config: FeatureConfig):
        super().__init__(config)
        self.features = RunningMeanBackbone(config)
        self.score = nn.Linear(config.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.score(self.features(input_ids, attention_mask).last_hidden_state)


def custom_scorer(kind: str, tok, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "custom-llama":
        return LlamaBackboneCritic(family_config("llama", tok))
    if kind == "custom-features":
        return FeatureScorer(FeatureConfig(vocab_size=len(tok)))
    raise ValueError(f"kind={kind!r}: expected 'custom-llama' or 'custom-features'")


# ---------------------------------------------------------------- set-ups and variations
@dataclass(frozen=True)
class Setup:
    """Who plays which role: a family name, or ``custom-*`` for the custom scorers.
    ``from_rm_path``: value and reward model loaded as TRL's docs show,
    ``AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1)``."""

    policy: str
    value: str
    reward: str
    from_rm_path: bool = False


SETUPS = {
    "llama": Setup("llama", "llama", "llama"),
    "gpt2": Setup("gpt2", "gpt2", "gpt2"),
    "opt": Setup("opt", "opt", "opt"),
    "qwen2": Setup("qwen2", "qwen2", "qwen2"),
    "qwen2-policy+llama-critic+gpt2-rm": Setup("qwen2", "llama", "gpt2"),
    "llama+custom-critic": Setup("llama", "custom-llama", "llama"),
    "gpt2+custom-critic+custom-rm": Setup("gpt2", "custom-features", "custom-features"),
    "llama+value-from-rm-path": Setup("llama", "llama", "llama", from_rm_path=True),
}

# PPOConfig overrides on top of the default config (see `ppo_config`); "peft" passes a LoraConfig.
VARIATIONS = {
    "default": {},
    "peft": {},
    "stop-eos": {"stop_token": "eos"},
    "fp32": {"bf16": False},
    "no-checkpointing": {"gradient_checkpointing": False},
}


# The matrix: every set-up under the default config, the variations on the set-ups they touch.
ROWS = [
    *[(name, "default") for name in SETUPS],
    ("llama", "peft"), ("gpt2", "peft"), ("opt", "peft"), ("llama+custom-critic", "peft"),
    ("llama", "stop-eos"), ("gpt2+custom-critic+custom-rm", "stop-eos"),
    ("llama", "fp32"), ("qwen2-policy+llama-critic+gpt2-rm", "fp32"),
    ("llama+custom-critic", "no-checkpointing"),
]


def build_models(setup: Setup, tok, rm_dir: Path | None = None):
    """``(policy, ref_policy, value_model, reward_model)``; the reference equals the policy."""

    def scorer(kind: str, seed: int):
        return custom_scorer(kind, tok, seed) if kind.startswith("custom") else sequence_scorer(kind, tok, seed)

    policy = causal_lm(setup.policy, tok, seed=0)
    ref = causal_lm(setup.policy, tok, seed=0)
    if setup.from_rm_path:
        scorer(setup.reward, seed=2).save_pretrained(rm_dir)
        value = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
        reward = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    else:
        value, reward = scorer(setup.value, seed=1), scorer(setup.reward, seed=2)
    return policy, ref, value, reward


def build_row_models(setup_name: str, root: Path):
    """``(tokenizer, (policy, ref_policy, value_model, reward_model))`` for a set-up, as :func:`run`
    builds them. A caller that trains other runs first in the same process builds them with this
    before any of those: under ZeRO-3, DeepSpeed's partitioning stays switched on for modules
    constructed after the first trainer."""
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    return tok, build_models(SETUPS[setup_name], tok, root / "rm")


def bf16_available() -> bool:
    """Whether this machine runs bf16 autocast (every recent CPU build of torch does)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except RuntimeError:
        return False


UPDATES, BATCH = 2, 4


def ppo_config(config_cls, out: Path, **overrides):
    """TRL's default PPOConfig, shrunk only in size: 2 updates of 4 episodes, short responses,
    nothing written but what save_model writes. bf16 (the default) only where the platform has it."""
    kwargs = dict(
        output_dir=str(out), per_device_train_batch_size=BATCH,
        total_episodes=UPDATES * BATCH * int(os.environ.get("WORLD_SIZE", "1")),
        local_rollout_forward_batch_size=BATCH, response_length=6, num_sample_generations=0,
        report_to=[], save_strategy="no", disable_tqdm=True,
        # accelerate's CPU path, except under DeepSpeed (which picks its own device)
        use_cpu=not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true",
    )
    if not bf16_available():
        kwargs["bf16"] = False
    kwargs.update(overrides)
    return config_cls(**kwargs)


@dataclass
class Outcome:
    """What one run did: ``error`` is None when it trained, saved and reloaded."""

    updates: int = 0
    policy_moved: bool = False
    value_moved: bool = False
    reload_matches: bool = False
    policy_checkpointing: bool = False  # after training: checkpointing on in the policy's layers
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    trace: str = ""  # the innermost frames of the error

    @property
    def passed(self) -> bool:
        return self.error is None and self.updates == UPDATES and self.policy_moved and self.reload_matches


def _trainer_classes(which: str):
    if which == "ours":
        from trl_ppo_ext import PPOConfig, PPOTrainer

        return PPOTrainer, PPOConfig
    from trl_ppo_ext._compat import load_trl_ppo

    trainer, config, _ = load_trl_ppo()
    return trainer, config


def _reload_policy(saved: Path, setup: Setup, tok) -> nn.Module:
    """What a user does with the output: the saved policy (a peft adapter goes on a fresh base)."""
    if (saved / "adapter_config.json").is_file():
        from peft import PeftModel

        return PeftModel.from_pretrained(causal_lm(setup.policy, tok, seed=0), saved)
    return AutoModelForCausalLM.from_pretrained(saved)


def _gathered(model: nn.Module, trainer):
    """The full weights of ``model`` inside the block under DeepSpeed ZeRO-3; a no-op otherwise."""
    import contextlib

    if not getattr(trainer, "is_deepspeed_enabled", False):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def run(which: str, setup_name: str, variation: str, root: Path, models=None) -> Outcome:
    """Train ``UPDATES`` updates of ``which`` trainer ("ours" or "trl") on a set-up under one
    variation, save the policy, reload it, and compare its logits with the trained policy's.
    ``models``: what :func:`build_row_models` returned for this set-up, built earlier (default:
    built here)."""
    import logging

    from peft import LoraConfig

    trainer_cls, config_cls = _trainer_classes(which)
    setup = SETUPS[setup_name]
    root.mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logging.getLogger("trl_ppo_ext").addHandler(handler)
    try:
        tok, (policy, ref, value, reward) = build_row_models(setup_name, root) if models is None else models
        peft_config = None
        if variation == "peft":
            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[setup.policy],
                                     task_type="CAUSAL_LM")
            ref = None
        args = ppo_config(config_cls, root / "out", **VARIATIONS[variation])
        value_before = [p.detach().clone() for p in value.parameters()]
        trainer = trainer_cls(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                              value_model=value, train_dataset=random_word_prompts(tok, n=2 * BATCH),
                              peft_config=peft_config)
        trained = trainer.model.policy if hasattr(trainer.model, "policy") else trainer.policy_model
        policy_before = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
        trainer.train()
        outcome.updates = trainer.state.global_step  # both trainers count one step per update (logs: logging_steps)
        now = dict(trained.named_parameters())
        outcome.policy_checkpointing = is_checkpointing(trained)
        outcome.policy_moved = any(not torch.equal(p, now[n].detach()) for n, p in policy_before.items())
        outcome.value_moved = any(not torch.equal(a, b.detach()) for a, b in zip(value_before, value.parameters()))
        saved = root / "saved"
        trainer.save_model(str(saved))
        reloaded = _reload_policy(saved, setup, tok).eval()
        ids = torch.tensor([[7, 8, 9, 10]])
        # ZeRO-3 shards the trained weights, and from_pretrained shards the reloaded ones
        with torch.no_grad(), _gathered(trained, trainer), _gathered(reloaded, trainer):
            expected = trained.eval()(input_ids=ids).logits.float()
            got = reloaded(input_ids=ids).logits.float()
        outcome.reload_matches = torch.allclose(expected, got, rtol=0, atol=1e-5)
    except Exception as err:  # a row records its failure; the test asserts on it
        outcome.error = f"{type(err).__name__}: {err}"
        outcome.trace = traceback.format_exc(limit=-4)
    finally:
        logging.getLogger("trl_ppo_ext").removeHandler(handler)
    outcome.warnings = [r.getMessage() for r in records]
    return outcome


def print_matrix(trainers: list[str]) -> None:
    """Run every row under each of ``trainers`` and print a markdown table."""
    import time

    print("| set-up | variation | " + " | ".join(trainers) + " |")
    print("|---|---|" + "---|" * len(trainers))
    for setup_name, variation in ROWS:
        cells = []
        for which in trainers:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                outcome = run(which, setup_name, variation, Path(tmp))
            seconds = time.perf_counter() - start
            result = "pass" if outcome.passed else f"FAIL ({outcome.error})"
            cells.append(f"{result} [{seconds:.1f}s, checkpointing {'on' if outcome.policy_checkpointing else 'off'}]")
        print(f"| {setup_name} | {variation} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str]) -> int:
    """The issue's script: a Llama policy with a custom critic, TRL's default PPOConfig;
    ``--matrix ours [trl]``: the whole matrix as a table instead."""
    which = "trl" if "--trainer" in argv and argv[argv.index("--trainer") + 1] == "trl" else "ours"
    trainers = argv[argv.index("--matrix") + 1:] or ["ours"] if "--matrix" in argv else [which]
    from trl_ppo_ext import _compat

    if "trl" in trainers and not _compat.trl_has_ppo():  # say so before any row runs, not a traceback after
        print(f"--trainer trl / --matrix ... trl: {_compat.trl_ppo_hint()}", file=sys.stderr)
        return 2
    if "--matrix" in argv:
        print_matrix(trainers)
        return 0
    setup_name, variation = "llama+custom-critic", "default"
    if "--row" in argv:  # another row, e.g. under `accelerate launch` (every process writes to --out)
        setup_name, variation = argv[argv.index("--row") + 1: argv.index("--row") + 3]
    if "--out" in argv:
        outcome = run(which, setup_name, variation, Path(argv[argv.index("--out") + 1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run(which, setup_name, variation, Path(tmp))
    print(f"trainer={which} set-up={setup_name} config={variation} -> {'PASS' if outcome.passed else 'FAIL'}")
    print(f"  updates={outcome.updates} policy_moved={outcome.policy_moved} value_moved={outcome.value_moved} "
          f"reload_matches={outcome.reload_matches} policy_checkpointing={outcome.policy_checkpointing} "
          f"error={outcome.error}")
    for message in outcome.warnings:
        print(f"  warning: {message}")
    if outcome.error is not None:
        print(outcome.trace)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
