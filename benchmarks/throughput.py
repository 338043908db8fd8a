"""PPO update throughput: TRL's own trainer vs ours (separate models, shared LoRA actor-critic),
and (``--vllm``) ours sampling with transformers' ``generate`` vs with a colocated vLLM engine.

    python benchmarks/throughput.py [--sizes tiny,100m] [--repeats 5] [--updates N] [--contenders a,b]
        [--ppo-epochs 1] [--threads 1] [--device cpu|cuda] [--bf16] [--vllm [--enforce-eager]]

Five contenders by default, same random Llama-shaped models (tiny: hidden 32, 2 layers, 46-token
vocabulary; 100m: hidden 768, 12 layers, 12 heads, intermediate 2048, 8000-token
vocabulary, 97.2M parameters per policy, 91.1M per value/reward model), same prompts
(64 prompts of 12 random words each: every contender's dataloader draws its own order, and
equal lengths make each update the same work for all of them), seeds and PPO settings: B=4 per update,
response_length=32, stop_token="eos", no missing-EOS penalty, num_mini_batches=1,
num_ppo_epochs=1 (``--ppo-epochs``; TRL's default is 4), TRL's other defaults (lr 3e-6,
max_grad_norm 1.0, which only ours applies, ...), fp32, bf16=False (``--bf16``, CUDA only:
``bf16=True``, i.e. accelerate's bf16 autocast over the fp32 models):

  upstream  ``trl.experimental.ppo.PPOTrainer`` with its ``PPOConfig``: separate fp32 policy,
            reference, value model and reward model;
  separate  ``trl_ppo_ext.PPOTrainer`` with the same four separate models;
  shared    ``trl_ppo_ext.PPOTrainer`` with a ``SharedActorCritic`` (LoRA r=16 on q/k/v/o +
            value head on one base; reference = the disabled adapter), the same reward model,
            ``value_model=None, ref_model=None``;
  separate_nockpt, shared_nockpt
            the two above with ``gradient_checkpointing=False``. The other contenders keep
            TRL's default ``gradient_checkpointing=True``, which this package applies to the
            policy and the value model; upstream accepts it and never applies it.
  shared_vlora
            ``shared`` with a value adapter of its own (``value_lora_config``, the same rank
            and targets): a second backbone pass for the values (not in the default run).
  shared_branch_mid, shared_branch_3q
            ``shared_vlora`` with the critic branching from the policy's pass (``value_branch_layer``,
            ``models.branch_critic``) at the middle layer or at 3/4 of the layers (6 or 9 of the 100m
            size's 12): its adapter on the layers above only, costing those layers instead of a second
            backbone pass (not in the default run; ``_kl0`` arms as below).
  shared_grpo, shared_kl0, shared_vlora_kl0
            the forward-savings arms (not in the default run): the shared LoRA layout with
            ``advantage_estimator="grpo"``, ``num_generations=4`` (``--num-generations``) and
            ``kl_coef=0`` (no critic), and ``shared`` / ``shared_vlora`` with ``kl_coef=0``. A
            ``_scored`` suffix runs the same arm with every scoring forward of the code before
            the forward savings (the reference's and the old log-probs'; ``trainer.scoring`` forced), so
            ``X / X_scored``, paired per repeat, is what the skipped forwards save; those ratios
            are printed as ``forward savings``.
  trl_grpo  TRL 1.16's ``GRPOTrainer`` (TRL >= 1.13; not in the default run) on the same policy
            with the same LoRA, the same reward model (``reward_funcs=[model]``), the prompts as
            text, ``num_generations=4``, ``beta=0`` (its default: no reference), one optimizer
            step of B completions per generation (``per_device_train_batch_size`` = micro,
            ``gradient_accumulation_steps`` = B / micro, ``num_iterations=1``), the same
            temperature, completion length, seed and learning rate. Its ``generate`` phase is its
            ``_generate_and_score_completions`` (sampling, any log-prob forward and the reward);
            its update is the rest. Compare ``shared_grpo`` with it: ``grpo / TRL GRPO`` ratios.

The random models are built once per size; every run trains deep copies of them. The
contenders alternate inside one process (the machine is shared and its load drifts): each
repeat builds fresh trainers in a rotating order and, for each, runs ``updates + 1``
updates through ``train()`` (``--updates``; default 5 timed updates for tiny, 1 for 100m).
The first update is a warm-up; the clock runs from the end of update 1 to the end of the
last one (``on_step_end``), so construction and warm-up are excluded and each timed
interval is one whole update cycle, including upstream's ``gc.collect()`` calls.
Throughput = episodes (B per update) or valid response tokens (up to and including the
first EOS) per second of timed updates; the table shows medians over repeats, the ratios
ours/upstream in each repeat (the two ran back to back, under the same load) and their median
over repeats, which the ratio lines report.

Phases are timed by wrapping, never by changing either trainer: ours through a subclass
that times ``generate_rollout``, ``score_rollout`` (split into the policy+value forward,
reference and reward-model forwards), ``compute_advantages`` and ``ppo_update``;
upstream's by swapping its module-level ``batch_generation``, ``forward`` (no-grad calls
only: the reference) and ``get_reward`` (value and reward model) and its ``gc`` module
while its ``train()`` runs. Upstream's "update" is the rest of its update time: the PPO
forward/backward/optimizer step plus its inline GAE and metrics. In both, the update is
split further by shadowing ``accelerator.backward``, ``accelerator.clip_grad_norm_`` and
``optimizer.step`` on the trainer's own instances.

``--device`` defaults to ``cuda`` when torch sees a GPU (``use_cpu=True`` otherwise). CUDA
kernels run asynchronously, so on CUDA every clock reading (phase start and end, update
end) first calls ``torch.cuda.synchronize()``: a phase is charged for the kernels it
launched, not for the ones still queued from the phase before.

``--flops`` times nothing: it counts the matmul FLOPs (``torch.utils.flop_counter``) of one
update per contender, split into generation, scoring and the PPO update, i.e. the work each
trainer asks for whatever the machine's load.

``--reward python``: every contender but upstream scores with ``cheap_reward`` (a reward computed
from the completion ids in Python) instead of the reward model. ``--rollout-chunk`` sets
``local_rollout_forward_batch_size`` (ours' rows per ``generate`` call; default ``--micro``; ours score in
chunks of ``PPOConfig.scoring_batch_size``, by default the micro-batch): TRL GRPO generates the whole batch
in one call, and on one CPU thread calls of a few rows cost several times the CPU of one call for the batch.
Every table also reports episodes per second of the
process's own CPU time (``time.process_time``) over the same timed updates, and with a ``trl_grpo`` arm
the paired CPU-time ratios to it: on a machine that other jobs share they move far less than wall time.

``--threads`` defaults to 1 (CPU only): on a shared 2-core machine two intra-op threads
oversubscribe the cores and made generation 5-8x slower in trials (100m: ~10 s with 1
thread, 68-82 s with 2, at a load average of ~6).

The last lines are ``throughput ratio <contender>/upstream: <x.xx>``, the checkpointing-off arms
first and the default config (``separate``, ``shared``) last: the median paired episodes/s
ratio, for 100m when it ran, else the last size. Timings are never asserted.

``--vllm`` (vLLM installed; the 100m size, whose head_dim 64 vLLM's CPU attention takes): the
contenders are ours, separate and shared, each with ``use_vllm=False`` and ``use_vllm=True``
(``vllm_mode="colocate"``, TRL GRPO's defaults, the importance-sampling correction on), same
models, prompts and seeds, alternating in one process; the engine is built with the trainer
(not timed) and its first, compiling call falls in the warm-up update. "generate" then
includes pushing the updated weights to the engine. The last lines are the vLLM/transformers
ratios of episodes/s and of generation seconds per rollout. ``--enforce-eager`` builds the
engines without compilation or CUDA graphs.

The upstream contender needs a TRL that has a PPO trainer (1.0 - 1.12; 1.13 removed it). With
a newer TRL it is left out, the run says so, ratios are taken to ``separate`` and the last
lines are ``throughput ratio <contender>/separate: <x.xx>``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext, redirect_stdout
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
# Read when transformers/TRL are first imported (lazily, inside the functions below).
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                      ("TRL_EXPERIMENTAL_SILENCE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

SIZES = {  # words: ordinary words in the tokenizer (+6 special tokens = vocabulary)
    "tiny": dict(words=40, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64),
    "100m": dict(words=7994, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048),
}
DEFAULT_UPDATES = {"tiny": 5, "100m": 1}  # timed updates per run, after one warm-up
# Every contender, in table order. A "_nockpt" contender is its base with gradient_checkpointing=False
# (upstream accepts the flag and never applies it, so it needs no such arm); "_vllm": use_vllm=True.
CONTENDERS = ("upstream", "separate_full", "separate", "shared_full", "shared", "separate_nockpt", "shared_nockpt",
              "shared_vlora", "separate_vllm", "shared_vllm", "shared_grpo", "shared_grpo_scored", "shared_kl0",
              "shared_kl0_scored", "shared_vlora_kl0", "shared_vlora_kl0_scored", "shared_branch_mid",
              "shared_branch_mid_kl0", "shared_branch_3q", "shared_branch_3q_kl0", "trl_grpo")
DEFAULT_CONTENDERS = ("upstream", "separate_full", "separate", "shared_full", "shared", "separate_nockpt",
                      "shared_nockpt")
VLLM_CONTENDERS = ("separate", "separate_vllm", "shared", "shared_vllm")
LABELS = {"upstream": "upstream TRL", "separate": "ours, separate", "shared": "ours, shared LoRA",
          "separate_full": "separate, full wd", "shared_full": "shared, full wd",
          "separate_nockpt": "separate, no ckpt", "shared_nockpt": "shared, no ckpt",
          "shared_vlora": "shared, value LoRA",
          "separate_vllm": "separate + vLLM", "shared_vllm": "shared + vLLM",
          "shared_grpo": "grpo, kl 0", "shared_grpo_scored": "grpo, kl 0, scored", "shared_kl0": "shared, kl 0",
          "shared_kl0_scored": "shared, kl 0, scored", "shared_vlora_kl0": "value LoRA, kl 0",
          "shared_vlora_kl0_scored": "vLoRA, kl 0, scored", "shared_branch_mid": "branch at 1/2",
          "shared_branch_mid_kl0": "branch 1/2, kl 0", "shared_branch_3q": "branch at 3/4",
          "shared_branch_3q_kl0": "branch 3/4, kl 0", "trl_grpo": "TRL 1.16 GRPO"}
# where the branch critic arms branch, as a fraction of the decoder's layers (value_branch_layer = int(N * f))
BRANCH_AT = {"shared_branch_mid": 1 / 2, "shared_branch_3q": 3 / 4}
NUM_GENERATIONS = 4  # --num-generations: samples per prompt of the grpo arm (it must divide --micro's batch)
BATCH, RESPONSE_LENGTH, PROMPT_LENGTHS, N_PROMPTS, SEED = 4, 32, (12, 12), 64, 0
MICRO = BATCH  # per_device_train_batch_size (--micro); gradient accumulation BATCH // MICRO
CHUNK = MICRO  # local_rollout_forward_batch_size (--rollout-chunk): prompts per generate call
# (ours score in chunks of PPOConfig.scoring_batch_size, default the micro-batch at most CHUNK)
WORKLOAD = "fixed"  # --workload: "fixed" (random policies: rows rarely stop) or "early_stop"
REWARD = "model"  # --reward: "model" (the random reward model) or "python" (cheap_reward, no reward model)
# ours before trimming: every forward at prompt + response_length width, rows in rollout/shuffled order
FULL_WIDTH = {"trim_forwards": False, "group_by_length_in_batches": False}
LORA_R, LORA_ALPHA = 16, 32
TOP_PHASES = ("generate", "score", "advantages", "update", "gc", "other")
SCORE_PARTS = ("score.policy", "score.ref", "score.value", "score.reward")
UPDATE_PARTS = ("update.backward", "update.clip", "update.step")
UPDATE_LABELS = {"update.backward": "backward", "update.clip": "grad clip", "update.step": "optimizer step"}
SCORE_LABELS = {"score.policy": "policy+value", "score.ref": "reference", "score.value": "value",
                "score.reward": "reward"}


# ---------------------------------------------------------------------------- clock
class Clock:
    """Phase intervals, token counts and update ends, as ``time.perf_counter()`` stamps.

    On CUDA (``device="cuda"``) every reading waits for the queued kernels first
    (``torch.cuda.synchronize``), so each interval holds the GPU work launched inside it.
    """

    def __init__(self, device: str = "cpu"):
        self.intervals: list[tuple[str, float, float]] = []  # (phase, start, stop)
        self.tokens: list[tuple[float, int]] = []  # (stamp, valid response tokens generated)
        self.step_ends: list[float] = []
        self.step_cpu_ends: list[float] = []  # time.process_time() at the same update ends
        self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def now(self) -> float:
        """``time.perf_counter()`` once the device has finished what was launched."""
        self._sync()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.intervals.append((name, start, self.now()))

    def count_tokens(self, n: int) -> None:
        self.tokens.append((self.now(), n))

    def summary(self, batch_size: int, remainder: str = "other") -> dict:
        """Totals over the timed updates (all but the first): seconds, episodes, tokens, phases.

        The time no timed phase covers goes to ``remainder`` (upstream's ``train()`` is one
        function, so its PPO update is what remains after generation, scoring and gc).
        """
        if len(self.step_ends) < 2:
            raise RuntimeError(f"need at least 2 finished updates to time one, got {len(self.step_ends)}")
        begin, end = self.step_ends[0], self.step_ends[-1]
        seconds = end - begin
        updates = len(self.step_ends) - 1
        phases = defaultdict(float)
        for name, start, stop in self.intervals:
            if start >= begin and stop <= end:
                phases[name] += stop - start
        phases[remainder] += seconds - sum(phases[p] for p in TOP_PHASES)
        return {
            "seconds": seconds, "updates": updates, "episodes": updates * batch_size,
            "cpu_seconds": self.step_cpu_ends[-1] - self.step_cpu_ends[0],
            "tokens": sum(n for stamp, n in self.tokens if begin <= stamp <= end),
            "phases": dict(phases),
        }


def valid_response_tokens(responses: torch.Tensor, stop_token_id: int) -> int:
    """Tokens up to and including the first stop token, or the whole row without one.

    ``responses`` (B, T). Equivalent to ``sum(row.index(stop) + 1 if stop in row else T)``.
    """
    is_stop = responses == stop_token_id
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, responses.shape[1])
    return int(first.sum())


def step_clock_callback(clock: Clock):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_ends.append(clock.now())
            clock.step_cpu_ends.append(time.process_time())

    return StepClock()


# ---------------------------------------------------------------------------- ours, timed
def timed_ours_class():
    """``trl_ppo_ext.PPOTrainer`` with each phase inside ``self.clock``; behaviour unchanged."""
    from trl_ppo_ext import PPOTrainer

    class TimedPPOTrainer(PPOTrainer):
        clock: Clock

        def generate_rollout(self, *args, **kwargs):
            with self.clock.phase("generate"):
                rollout = super().generate_rollout(*args, **kwargs)
            self.clock.count_tokens(int(rollout.response_mask.sum()))
            return rollout

        def score_rollout(self, *args, **kwargs):
            with self.clock.phase("score"):
                return super().score_rollout(*args, **kwargs)

        def policy_logprobs_and_values(self, *args, **kwargs):
            with self.clock.phase("score.policy"):
                return super().policy_logprobs_and_values(*args, **kwargs)

        def reference_logprobs(self, *args, **kwargs):
            with self.clock.phase("score.ref"):
                return super().reference_logprobs(*args, **kwargs)

        def critic_values(self, *args, **kwargs):  # the critic's pass alone (the forward savings)
            with self.clock.phase("score.value"):
                return super().critic_values(*args, **kwargs)

        def reward_scores(self, *args, **kwargs):
            with self.clock.phase("score.reward"):
                return super().reward_scores(*args, **kwargs)

        def compute_advantages(self, *args, **kwargs):
            with self.clock.phase("advantages"):
                return super().compute_advantages(*args, **kwargs)

        def ppo_update(self, *args, **kwargs):
            with self.clock.phase("update"):
                return super().ppo_update(*args, **kwargs)

    return TimedPPOTrainer


# ---------------------------------------------------------------------------- upstream, timed
@contextmanager
def timed_upstream(trainer, clock: Clock):
    """Swap the module-level helpers upstream's ``train()`` calls for timed wrappers."""
    module = sys.modules[type(trainer).__module__]
    names = ("batch_generation", "forward", "get_reward", "gc")
    original = {name: getattr(module, name) for name in names}
    stop_token_id = trainer.stop_token_id

    def batch_generation(model, queries, *args, **kwargs):
        with clock.phase("generate"):
            query_responses, logits = original["batch_generation"](model, queries, *args, **kwargs)
        clock.count_tokens(valid_response_tokens(query_responses[:, queries.shape[1]:], stop_token_id))
        return query_responses, logits

    def forward(model, *args, **kwargs):
        if torch.is_grad_enabled():  # the PPO update's forward: part of "update"
            return original["forward"](model, *args, **kwargs)
        with clock.phase("score"), clock.phase("score.ref"):
            return original["forward"](model, *args, **kwargs)

    def get_reward(model, *args, **kwargs):
        part = "score.reward" if model is trainer.reward_model else "score.value"
        with clock.phase("score"), clock.phase(part):
            return original["get_reward"](model, *args, **kwargs)

    def collect(*args, **kwargs):
        with clock.phase("gc"):
            return original["gc"].collect(*args, **kwargs)

    replacements = {"batch_generation": batch_generation, "forward": forward, "get_reward": get_reward,
                    "gc": types.SimpleNamespace(collect=collect)}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(module, name, value)


@contextmanager
def timed_update_parts(trainer, clock: Clock):
    """Time backward, gradient clipping (norm included) and the optimizer step of either trainer,
    by shadowing the bound methods on its own ``accelerator`` and ``optimizer`` instances and
    (ours) ``gradients.clip_gradients`` where ``trl_ppo_ext.update`` calls it."""
    import trl_ppo_ext.update as ours_module
    from trl_ppo_ext import PPOTrainer

    # ours clips (and takes the norm) in gradients.clip_gradients, without accelerate's clip_grad_norm_
    ours = isinstance(trainer, PPOTrainer)
    clip = (ours_module, "clip_gradients") if ours else (trainer.accelerator, "clip_grad_norm_")
    targets = ((trainer.accelerator, "backward", "update.backward"),
               (*clip, "update.clip"),
               (trainer.optimizer, "step", "update.step"))

    def timed(method, phase):
        def wrapper(*args, **kwargs):
            with clock.phase(phase):
                return method(*args, **kwargs)
        return wrapper

    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, phase in targets:
        setattr(obj, name, timed(getattr(obj, name), phase))
    try:
        yield
    finally:
        for obj, name, original in originals:
            if isinstance(obj, types.ModuleType):
                setattr(obj, name, original)
            else:
                del obj.__dict__[name]  # the class's method shows through again


# ---------------------------------------------------------------------------- early-stop workload
@contextmanager
def early_stop_workload(tokenizer, enabled: bool):
    """While active (``--workload early_stop``), every ``generate`` of a Llama causal LM (the
    policy of every contender: TRL's ``batch_generation``, ours' ``generate_responses``, peft's
    ``generate`` under the shared layout) ends each row at a length drawn uniformly from
    ``ceil(0.1 T) .. T``: EOS is masked before that step and forced at it (an infinite EOS
    bias; the forwards that score the tokens are the models' own). The k-th ``generate`` call
    of a run draws from seed ``SEED + k``, so every contender's rollouts have the same lengths."""
    if not enabled:
        yield
        return
    from transformers import GenerationMixin, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    eos, calls = tokenizer.eos_token_id, [0]

    class ForcedLengths(LogitsProcessor):
        def __init__(self, lengths: torch.Tensor, prompt_width: int):
            self.lengths, self.prompt_width = lengths, prompt_width

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_width  # tokens generated before this one
            now = (self.lengths.to(scores.device) == step + 1)
            scores = scores.clone()
            scores[~now, eos] = -float("inf")
            scores[now] = -float("inf")
            scores[now, eos] = 0.0
            return scores

    def generate(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        g = torch.Generator().manual_seed(SEED + calls[0])
        calls[0] += 1
        low = max(1, -(-RESPONSE_LENGTH // 10))
        lengths = torch.randint(low, RESPONSE_LENGTH + 1, (input_ids.shape[0],), generator=g)
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(ForcedLengths(lengths, input_ids.shape[1]))
        return GenerationMixin.generate(self, *args, logits_processor=processors, **kwargs)

    LlamaForCausalLM.generate = generate
    try:
        yield
    finally:
        del LlamaForCausalLM.generate  # GenerationMixin's shows through again


# ---------------------------------------------------------------------------- set-up
def cheap_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """``--reward python``: a reward computed in Python from the ids, no model (TRL's reward-function
    signature): the completion's number of distinct token ids over 100."""
    return [len(set(ids)) / 100 for ids in completion_ids]


def reward_inputs() -> dict:
    """What a trainer of ours gets besides the policy (``--reward``): the reward model, or the Python reward."""
    return {"reward_model": None, "reward_funcs": [cheap_reward]} if REWARD == "python" else {}


def config_kwargs(output_dir: str, updates: int, ppo_epochs: int, device: str = "cpu", bf16: bool = False) -> dict:
    """The PPO settings every contender gets (TRL's defaults otherwise, e.g. lr 3e-6)."""
    return dict(use_cpu=device == "cpu",
        output_dir=output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=BATCH // MICRO,
        total_episodes=BATCH * (updates + 1), response_length=RESPONSE_LENGTH, num_ppo_epochs=ppo_epochs,
        num_mini_batches=1, local_rollout_forward_batch_size=CHUNK, stop_token="eos", missing_eos_penalty=None,
        report_to=[], disable_tqdm=True, num_sample_generations=0, save_strategy="no", logging_steps=1,
        seed=SEED, bf16=bf16,
    )


class PristineModels:
    """The random models of one size, built once (policy seed 0, value 1, reward 2); every
    run trains deep copies, so all contenders and repeats start from identical weights."""

    def __init__(self, tokenizer, model_kwargs: dict):
        from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_scorer

        self.policy = build_tiny_causal_lm(tokenizer, seed=0, **model_kwargs)
        self.value = build_tiny_scorer(tokenizer, seed=1, **model_kwargs)
        self.reward = build_tiny_scorer(tokenizer, seed=2, **model_kwargs)

    def fresh(self, name: str):
        return copy.deepcopy(getattr(self, name))


def build_trainer(contender: str, tokenizer, dataset, models: PristineModels, cfg: dict, clock: Clock,
                  engine_kwargs: dict | None = None):
    """A fresh trainer on fresh copies of the models; ``clock`` sees its update ends. A
    ``*_vllm`` contender is its base contender with ``use_vllm=True``."""
    from peft import LoraConfig
    from transformers import PrinterCallback

    from trl_ppo_ext import PPOConfig
    from trl_ppo_ext.models.actor_critic import SharedActorCritic

    common = dict(processing_class=tokenizer, train_dataset=dataset, callbacks=[step_clock_callback(clock)])
    if contender == "trl_grpo":  # before the suffixes below ("_grpo" is ours' arm)
        trainer = build_trl_grpo(tokenizer, dataset, models, cfg, clock)
        trainer.remove_callback(PrinterCallback)
        return trainer
    if contender.endswith("_vllm"):
        contender, cfg = contender.removesuffix("_vllm"), {**cfg, "use_vllm": True}
    if contender.endswith("_nockpt"):
        contender, cfg = contender.removesuffix("_nockpt"), {**cfg, "gradient_checkpointing": False}
    if contender.endswith("_full"):
        contender, cfg = contender.removesuffix("_full"), {**cfg, **FULL_WIDTH}
    scored = contender.endswith("_scored")  # every scoring forward of the code before the forward savings
    contender = contender.removesuffix("_scored")
    if contender.endswith("_kl0"):
        contender, cfg = contender.removesuffix("_kl0"), {**cfg, "kl_coef": 0.0}
    if contender.endswith("_grpo"):
        contender, cfg = contender.removesuffix("_grpo"), {**cfg, "kl_coef": 0.0, "advantage_estimator": "grpo",
                                                            "num_generations": NUM_GENERATIONS}
    if contender == "upstream":
        from trl_ppo_ext._compat import TRLPPOConfig, TRLPPOTrainer  # TRL 1.0 - 1.12 only

        trainer = TRLPPOTrainer(args=TRLPPOConfig(**cfg), model=models.fresh("policy"),
                                ref_model=models.fresh("policy"), value_model=models.fresh("value"),
                                reward_model=models.fresh("reward"), **common)
    elif contender == "separate":
        cls = timed_ours_class()
        cls.clock, cls.vllm_engine_kwargs = clock, engine_kwargs
        rewards = reward_inputs() or {"reward_model": models.fresh("reward")}
        trainer = cls(args=PPOConfig(**cfg), model=models.fresh("policy"), ref_model=models.fresh("policy"),
                      value_model=models.fresh("value"), **rewards, **common)
    else:
        lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
        cls = timed_ours_class()
        cls.clock, cls.vllm_engine_kwargs = clock, engine_kwargs
        value_lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=lora.target_modules)
        config = PPOConfig(**cfg)
        policy = models.fresh("policy")
        branch = int(policy.config.num_hidden_layers * BRANCH_AT[contender]) if contender in BRANCH_AT else None
        own_adapter = contender == "shared_vlora" or branch is not None
        model = SharedActorCritic(policy, lora_config=lora, with_value=config.trains_critic,
                                  value_lora_config=value_lora if own_adapter else None, value_branch_layer=branch)
        rewards = reward_inputs() or {"reward_model": models.fresh("reward")}
        trainer = cls(args=config, model=model, ref_model=None, value_model=None, **rewards, **common)
    if scored and hasattr(trainer, "scoring"):  # code before the forward savings (which has no `scoring`) always scores
        from trl_ppo_ext.scoring_plan import ScoringPlan

        trainer.scoring = ScoringPlan(reference=True, old_logprobs=True)
    trainer.remove_callback(PrinterCallback)  # it prints every update's metrics dict
    return trainer


def build_trl_grpo(tokenizer, dataset, models: PristineModels, cfg: dict, clock: Clock):
    """TRL's ``GRPOTrainer`` with this benchmark's policy, LoRA, reward model, prompts (decoded to
    text) and budget; its ``_generate_and_score_completions`` timed as the ``generate`` phase, and the
    completions' valid tokens counted."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_ppo_ext import PPOConfig

    ours = PPOConfig(**cfg)  # the defaults ours runs with (learning rate, temperature, checkpointing)
    prompts = Dataset.from_dict({"prompt": tokenizer.batch_decode([list(ids) for ids in dataset["input_ids"]],
                                                                  skip_special_tokens=True)})
    config = GRPOConfig(
        output_dir=cfg["output_dir"], use_cpu=cfg["use_cpu"], bf16=cfg["bf16"], seed=cfg["seed"],
        per_device_train_batch_size=cfg["per_device_train_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"], num_generations=NUM_GENERATIONS,
        max_completion_length=cfg["response_length"], max_steps=cfg["total_episodes"] // BATCH, beta=0.0,
        num_iterations=1, temperature=ours.temperature, learning_rate=ours.learning_rate,
        max_grad_norm=ours.max_grad_norm, gradient_checkpointing=ours.gradient_checkpointing,
        report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=1)
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            with clock.phase("generate"):
                output = super()._generate_and_score_completions(inputs)
            clock.count_tokens(int(output["completion_mask"].sum()))
            return output

    rewards = ({"reward_funcs": [cheap_reward]} if REWARD == "python"
               else {"reward_funcs": [models.fresh("reward")], "reward_processing_classes": [tokenizer]})
    return TimedGRPOTrainer(model=models.fresh("policy"), args=config, train_dataset=prompts,
                            processing_class=tokenizer, peft_config=lora, callbacks=[step_clock_callback(clock)],
                            **rewards)


def run_once(contender: str, tokenizer, dataset, models: PristineModels, updates: int, args) -> dict:
    """Build a fresh trainer, train ``updates + 1`` updates, return the timed summary."""
    clock = Clock(args.device)
    with tempfile.TemporaryDirectory() as out:
        cfg = config_kwargs(out, updates, args.ppo_epochs, args.device, args.bf16)
        torch.manual_seed(SEED)
        np.random.seed(SEED)  # upstream shuffles mini-batches with numpy
        engine_kwargs = {"enforce_eager": True} if args.enforce_eager else None
        trainer = build_trainer(contender, tokenizer, dataset, models, cfg, clock, engine_kwargs)
        # Trainer (GRPO) builds its optimizer inside train(): its update is not split into parts
        parts = nullcontext() if contender == "trl_grpo" else timed_update_parts(trainer, clock)
        with parts, early_stop_workload(tokenizer, WORKLOAD == "early_stop"):
            if contender == "upstream":
                with timed_upstream(trainer, clock), redirect_stdout(io.StringIO()):  # "===training policy==="
                    trainer.train()
            else:
                trainer.train()
        del trainer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the next contender starts from the same allocator state
    return clock.summary(BATCH, remainder="update" if contender in ("upstream", "trl_grpo") else "other")


# ---------------------------------------------------------------------------- FLOPs
@contextmanager
def counted_phases(trainer, contender: str, counts: dict[str, float], active):
    """Add the matmul FLOPs (``torch.utils.flop_counter``) of each rollout phase to ``counts``
    while ``active()`` is true: ours' ``generate_rollout`` and ``score_rollout``; upstream's
    module-level ``batch_generation``, no-grad ``forward`` (the reference) and ``get_reward``
    (value and reward model). Whatever else the update does is its PPO update."""
    from torch.utils.flop_counter import FlopCounterMode

    def counting(fn, phase, no_grad_only=False):
        def wrapper(*args, **kwargs):
            if not active() or (no_grad_only and torch.is_grad_enabled()):
                return fn(*args, **kwargs)
            with FlopCounterMode(display=False) as counter:
                result = fn(*args, **kwargs)
            counts[phase] += counter.get_total_flops()
            return result
        return wrapper

    if contender == "upstream":
        owner = sys.modules[type(trainer).__module__]
        targets = [("batch_generation", "generate", False), ("forward", "score", True), ("get_reward", "score", False)]
    elif contender == "trl_grpo":  # its sampling, log-prob forwards and rewards are one method
        owner, targets = trainer, [("_generate_and_score_completions", "generate", False)]
    else:
        owner = trainer
        targets = [("generate_rollout", "generate", False), ("score_rollout", "score", False)]
    original = {name: getattr(owner, name) for name, _, _ in targets}
    for name, phase, no_grad_only in targets:
        setattr(owner, name, counting(original[name], phase, no_grad_only))
    try:
        yield
    finally:
        for name, fn in original.items():
            if contender == "upstream":
                setattr(owner, name, fn)
            else:
                del owner.__dict__[name]  # the class's method shows through again


def measure_flops(size: str, args, contenders) -> None:
    """Matmul GFLOP of one PPO update (the second; the first warms up) per contender and phase:
    a count of the work each trainer asks for, independent of the machine and its load."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import PrinterCallback, TrainerCallback

    from trl_ppo_ext.tiny import build_tiny_tokenizer, default_words, random_word_prompts

    spec = dict(SIZES[size])
    # room for the prompt and a long response (--response-length 256)
    spec["max_position_embeddings"] = max(256, PROMPT_LENGTHS[1] + RESPONSE_LENGTH + 8)
    tokenizer = build_tiny_tokenizer(words=default_words(spec.pop("words")))
    dataset = random_word_prompts(tokenizer, N_PROMPTS, *PROMPT_LENGTHS, seed=SEED)
    models = PristineModels(tokenizer, spec)
    print(f"\n== {size}: matmul GFLOP of one update (the second), B={BATCH} in micro-batches of {MICRO}, "
          f"rollout chunks of {CHUNK}, "
          f"T={RESPONSE_LENGTH}, workload {WORKLOAD}, reward {REWARD}, num_ppo_epochs={args.ppo_epochs} ==")
    print(f"{'contender':<18} | {'total':>8} | {'generate':>8} | {'score':>8} | {'update':>8} | total ratio")
    reference = None
    for contender in contenders:
        counts, ended = defaultdict(float), [0]
        whole = FlopCounterMode(display=False)

        class Boundaries(TrainerCallback):
            def on_step_end(self, *unused, **kwargs):
                ended[0] += 1
                if ended[0] == 1:
                    whole.__enter__()
                elif ended[0] == 2:
                    whole.__exit__(None, None, None)

        with tempfile.TemporaryDirectory() as out:
            cfg = config_kwargs(out, 1, args.ppo_epochs, args.device, args.bf16)
            torch.manual_seed(SEED)
            np.random.seed(SEED)
            trainer = build_trainer(contender, tokenizer, dataset, models, cfg, Clock(args.device))
            trainer.remove_callback(PrinterCallback)
            trainer.add_callback(Boundaries())
            with counted_phases(trainer, contender, counts, lambda: ended[0] == 1), redirect_stdout(io.StringIO()), \
                    early_stop_workload(tokenizer, WORKLOAD == "early_stop"):
                trainer.train()
        total = whole.get_total_flops() / 1e9
        reference = reference or total
        gen, score = counts["generate"] / 1e9, counts["score"] / 1e9
        print(f"{LABELS[contender]:<18} | {total:>8.2f} | {gen:>8.2f} | {score:>8.2f} | "
              f"{total - gen - score:>8.2f} | {total / reference:.2f}x")
        del trainer
        gc.collect()


# ---------------------------------------------------------------------------- report
def available_contenders() -> tuple[tuple[str, ...], str | None]:
    """The contenders this TRL can run, and why upstream is missing (None when it is not)."""
    from trl_ppo_ext import _compat

    if _compat.trl_has_ppo():
        return DEFAULT_CONTENDERS, None
    why = f"upstream TRL left out; ratios below are to 'ours, separate'. {_compat.trl_ppo_hint()}"
    return tuple(c for c in DEFAULT_CONTENDERS if c != "upstream"), why


def measure_size(size: str, args, contenders=CONTENDERS) -> tuple[dict[str, list[dict]], str]:
    """Every contender ``--repeats`` times, rotating the order each repeat; also returns the
    models' parameter counts, in words."""
    from trl_ppo_ext.tiny import build_tiny_tokenizer, default_words, random_word_prompts

    spec = dict(SIZES[size])
    # room for the prompt and a long response (--response-length 256)
    spec["max_position_embeddings"] = max(256, PROMPT_LENGTHS[1] + RESPONSE_LENGTH + 8)
    tokenizer = build_tiny_tokenizer(words=default_words(spec.pop("words")))
    dataset = random_word_prompts(tokenizer, N_PROMPTS, *PROMPT_LENGTHS, seed=SEED)
    models = PristineModels(tokenizer, spec)
    updates = args.updates or DEFAULT_UPDATES[size]
    results = defaultdict(list)
    for r in range(args.repeats):
        k = r % len(contenders)
        order = contenders[k:] + contenders[:k]
        for contender in order:
            s = run_once(contender, tokenizer, dataset, models, updates, args)
            results[contender].append(s)
            print(f"  [{size} repeat {r + 1}/{args.repeats}] {contender:>8}: "
                  f"{s['seconds'] / s['updates']:.3f} s/update, {s['episodes'] / s['seconds']:.3f} episodes/s",
                  flush=True)
    counts = {name: sum(p.numel() for p in getattr(models, name).parameters()) for name in ("policy", "value")}
    return results, f"policy {counts['policy']:,}, value/reward {counts['value']:,} parameters"


def median_of(runs: list[dict], fn) -> float:
    return statistics.median(fn(s) for s in runs)


def paired_ratios(results: dict[str, list[dict]], contender: str, ref: str, fn) -> list[float]:
    """``fn(run of contender) / fn(run of ref)`` for each repeat: the two ran back to back in one
    repeat, under the same machine load."""
    return [fn(o) / fn(u) for o, u in zip(results[contender], results[ref])]


def episodes_per_second(s: dict) -> float:
    return s["episodes"] / s["seconds"]


def print_size_table(size: str, results: dict[str, list[dict]], args, param_counts: str) -> dict[str, float]:
    """The throughput table and the phase table for one size; returns, by contender, the median
    over repeats of the paired episodes/s ratio to the first contender (upstream, or
    ours-separate without it)."""
    contenders = tuple(c for c in CONTENDERS if c in results)
    ref = contenders[0]
    eps = {c: median_of(results[c], episodes_per_second) for c in contenders}
    tps = {c: median_of(results[c], lambda s: s["tokens"] / s["seconds"]) for c in contenders}
    ratios = {c: statistics.median(paired_ratios(results, c, ref, episodes_per_second)) for c in contenders}
    print(f"\n== {size}: {param_counts}, B={BATCH} in micro-batches of {MICRO}, "
          f"rollout chunks of {CHUNK}, T={RESPONSE_LENGTH}, workload {WORKLOAD}, reward {REWARD}, "
          f"num_ppo_epochs={args.ppo_epochs}, {args.repeats} repeats x "
          f"{results[ref][0]['updates']} timed update(s) ==")
    print(f"{'contender':<18} | {'episodes/s':>10} | {'resp tok/s':>10} | {'s/update':>8} | "
          f"{'mean len':>8} | {'eps ratio':>9} | {'tok ratio':>9} | paired eps ratios (min-max)")
    print("-" * 118)
    for c in contenders:
        runs = results[c]
        mean_len = sum(s["tokens"] for s in runs) / sum(s["episodes"] for s in runs)
        paired = paired_ratios(results, c, ref, episodes_per_second)
        tok = statistics.median(paired_ratios(results, c, ref, lambda s: s["tokens"] / s["seconds"]))
        print(f"{LABELS[c]:<18} | {eps[c]:>10.3f} | {tps[c]:>10.1f} | "
              f"{median_of(runs, lambda s: s['seconds'] / s['updates']):>8.3f} | {mean_len:>8.1f} | "
              f"{ratios[c]:>8.2f}x | {tok:>8.2f}x | "
              + ", ".join(f"{p:.2f}" for p in paired) + f" ({min(paired):.2f}-{max(paired):.2f})")
    print("episodes/s, s/update: medians over repeats; ratios: median over repeats of the ratio to "
          f"'{LABELS[ref]}' in the same repeat")
    print_cpu_table(results, contenders, ref)
    print_phase_table(results)
    print_vllm_ratios(results)
    print_forward_savings(results)
    return ratios


def episodes_per_cpu_second(s: dict) -> float:
    return s["episodes"] / s["cpu_seconds"]


def print_cpu_table(results: dict[str, list[dict]], contenders: tuple[str, ...], ref: str) -> None:
    """Episodes per second of the process's own CPU time (``time.process_time``, every thread of it)
    over the same timed updates: what a run costs the cores it ran on, much less moved than wall
    time by other jobs time-sharing them (one thread pinned to one core: about the wall time of an
    idle machine, less the time spent waiting for memory that other jobs' traffic adds)."""
    print(f"\n{'contender':<18} | {'eps/CPU-s':>10} | {'CPU-s/upd':>9} | {'cpu/wall':>8} | {'ratio':>7} | "
          "paired ratios (CPU time)")
    for c in contenders:
        paired = paired_ratios(results, c, ref, episodes_per_cpu_second)
        share = median_of(results[c], lambda s: s["cpu_seconds"] / s["seconds"])
        print(f"{LABELS[c]:<18} | {median_of(results[c], episodes_per_cpu_second):>10.3f} | "
              f"{median_of(results[c], lambda s: s['cpu_seconds'] / s['updates']):>9.3f} | {share:>8.2f} | "
              f"{statistics.median(paired):>6.2f}x | " + ", ".join(f"{p:.2f}" for p in paired))
    print("eps/CPU-s: episodes per second of the process's CPU time (medians over repeats); cpu/wall: the "
          "share of the wall time the process ran; ratios: to the same reference, paired per repeat")
    if "trl_grpo" in results:
        for c in (c for c in contenders if c != "trl_grpo"):
            paired = paired_ratios(results, c, "trl_grpo", episodes_per_cpu_second)
            print(f"CPU-time ratio {c}/trl_grpo: {statistics.median(paired):.2f} (paired "
                  + ", ".join(f"{p:.2f}" for p in paired) + ")")


def print_forward_savings(results: dict[str, list[dict]]) -> None:
    """For each forward-savings arm, run both ways: ``X / X_scored`` episodes/s, paired per repeat (median, range)."""
    for c in (c for c in CONTENDERS if f"{c}_scored" in results and c in results):
        paired = paired_ratios(results, c, f"{c}_scored", episodes_per_second)
        print(f"forward savings {c}/{c}_scored: {statistics.median(paired):.2f}x episodes/s "
              f"(paired {', '.join(f'{p:.2f}' for p in paired)})")


def print_vllm_ratios(results: dict[str, list[dict]]) -> None:
    """For each layout run both ways: vLLM/transformers ratios of median episodes/s and median
    generation seconds per rollout (one rollout per update)."""
    for base in ("separate", "shared"):
        if base not in results or f"{base}_vllm" not in results:
            continue
        hf, vllm = results[base], results[f"{base}_vllm"]
        eps = [median_of(r, lambda s: s["episodes"] / s["seconds"]) for r in (hf, vllm)]
        gen = [median_of(r, lambda s: s["phases"].get("generate", 0.0) / s["updates"]) for r in (hf, vllm)]
        print(f"{base}: generation s per rollout transformers {gen[0]:.3f}, vLLM {gen[1]:.3f} "
              f"({gen[0] / gen[1]:.2f}x faster); episodes/s {eps[0]:.3f} vs {eps[1]:.3f}: "
              f"throughput ratio {base} vllm/transformers: {eps[1] / eps[0]:.2f}")


def print_phase_table(results: dict[str, list[dict]]) -> None:
    """Seconds per update in each phase (median over repeats) and its share of the update."""
    def per_update(s, phase):
        return s["phases"].get(phase, 0.0) / s["updates"]

    print("\nphase time per update, s (share of the update), median over repeats:")
    header = " | ".join(f"{p:>14}" for p in TOP_PHASES)
    print(f"{'contender':<18} | {header}")
    for c in (c for c in CONTENDERS if c in results):
        runs = results[c]
        cells = []
        for p in TOP_PHASES:
            sec = median_of(runs, lambda s, p=p: per_update(s, p))
            share = median_of(runs, lambda s, p=p: s["phases"].get(p, 0.0) / s["seconds"])
            cells.append(f"{sec:>7.3f} ({share:>4.0%})")
        print(f"{LABELS[c]:<18} | " + " | ".join(cells))
    print("scoring forwards per update, s:")
    for c in (c for c in CONTENDERS if c in results):
        parts = [f"{SCORE_LABELS[p]} {median_of(results[c], lambda s, p=p: per_update(s, p)):.3f}"
                 for p in SCORE_PARTS if any(p in s["phases"] for s in results[c])]
        print(f"  {LABELS[c]:<18} " + ", ".join(parts))
    print("update parts per update, s (forward+loss+rest = update - the others):")
    for c in (c for c in CONTENDERS if c in results):
        parts = {p: median_of(results[c], lambda s, p=p: per_update(s, p)) for p in UPDATE_PARTS}
        rest = median_of(results[c], lambda s: per_update(s, "update") - sum(per_update(s, p) for p in UPDATE_PARTS))
        print(f"  {LABELS[c]:<18} " + ", ".join(f"{UPDATE_LABELS[p]} {v:.3f}" for p, v in parts.items())
              + f", forward+loss+rest {rest:.3f}")


def describe_machine(args) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers
    import trl

    device = f"device cuda ({torch.cuda.get_device_name()})" if args.device == "cuda" else "device cpu"
    precision = "bf16 autocast" if args.bf16 else "fp32"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"{device}, transformers {transformers.__version__}, trl {trl.__version__}, {precision}")


def main() -> None:
    global BATCH, MICRO, CHUNK, RESPONSE_LENGTH, WORKLOAD, NUM_GENERATIONS, REWARD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None,
                        help="comma-separated: " + ", ".join(SIZES) + " (default tiny,100m; with --vllm, 100m)")
    parser.add_argument("--repeats", type=int, default=5, help="paired repeats (default 5)")
    parser.add_argument("--updates", type=int, default=None,
                        help=f"timed updates per run, after one warm-up (default {DEFAULT_UPDATES})")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="num_ppo_epochs for every contender")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, see above)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="PPOConfig(bf16=True) for every contender (CUDA only)")
    parser.add_argument("--vllm", action="store_true",
                        help="ours with and without use_vllm=True (needs vLLM; not the tiny size on a CPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="--vllm: engines without compilation")
    parser.add_argument("--flops", action="store_true",
                        help="count each contender's matmul FLOPs per phase of one update instead of timing")
    parser.add_argument("--workload", choices=["fixed", "early_stop"], default="fixed",
                        help="early_stop: each response ends at a length drawn from 10%%-100%% of T")
    parser.add_argument("--reward", choices=["model", "python"], default="model",
                        help="python: every contender but upstream scores with cheap_reward, no reward model")
    parser.add_argument("--response-length", type=int, default=RESPONSE_LENGTH, help="T (default 32)")
    parser.add_argument("--batch", type=int, default=BATCH, help="rollout batch B per update (default 4)")
    parser.add_argument("--micro", type=int, default=None,
                        help="per_device_train_batch_size (default B; gradient accumulation B // micro)")
    parser.add_argument("--rollout-chunk", type=int, default=None,
                        help="local_rollout_forward_batch_size: rows per generate call and scoring forward "
                             "(default --micro; TRL GRPO generates the whole batch in one call)")
    parser.add_argument("--num-generations", type=int, default=NUM_GENERATIONS,
                        help="samples per prompt of the grpo arms (default 4)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated subset of " + ", ".join(CONTENDERS) + " (default: all but the vLLM ones)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device.")
    if args.bf16 and args.device != "cuda":
        parser.error("--bf16 needs --device cuda (on the CPU the package computes in fp32).")
    sizes = [s.strip() for s in (args.sizes or ("100m" if args.vllm else "tiny,100m")).split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {list(SIZES)}")
    if args.repeats < 1 or (args.updates is not None and args.updates < 1):
        parser.error("--repeats and --updates must be >= 1")
    BATCH, RESPONSE_LENGTH, WORKLOAD, REWARD = args.batch, args.response_length, args.workload, args.reward
    MICRO = args.micro or BATCH
    CHUNK = args.rollout_chunk or MICRO
    NUM_GENERATIONS = args.num_generations
    if BATCH % MICRO:
        parser.error(f"--micro {MICRO} must divide --batch {BATCH}")
    torch.set_num_threads(args.threads)
    logging.getLogger("trl_ppo_ext").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # deprecation notices from transformers/peft would bury the table
    import transformers

    transformers.logging.set_verbosity_error()

    started = time.perf_counter()
    print(describe_machine(args), flush=True)
    contenders, missing = available_contenders()
    if args.vllm:
        if args.device == "cpu":  # vLLM's CPU settings (docs/vllm.md), where unset
            for name, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                                ("OMP_NUM_THREADS", str(args.threads))):
                os.environ.setdefault(name, value)
        contenders, missing = VLLM_CONTENDERS, None
        if "tiny" in sizes and args.device == "cpu":
            parser.error("--vllm on a CPU: the tiny size's head_dim 8 has no vLLM CPU attention kernel; "
                         "use --sizes 100m")
    elif missing:
        print(missing, flush=True)
    if args.contenders:
        chosen = [c.strip() for c in args.contenders.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in CONTENDERS]
        if unknown or not chosen:
            parser.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
        contenders = tuple(c for c in CONTENDERS if c in chosen)
    if REWARD == "python" and "upstream" in contenders:
        parser.error("--reward python: TRL 1.12's PPO trainer needs a reward model; leave out upstream "
                     "(--contenders)")
    if args.flops:
        for size in sizes:
            measure_flops(size, args, contenders)
        return
    ratios = {}
    for size in sizes:
        results, param_counts = measure_size(size, args, contenders)
        ratios[size] = print_size_table(size, results, args, param_counts)
    print(f"\ntotal runtime: {time.perf_counter() - started:.0f} s")
    last = ratios[sizes[-1]] if "100m" not in ratios else ratios["100m"]
    if args.vllm:
        return  # the vLLM/transformers ratios were printed under each size's table
    ref = "separate" if missing else "upstream"
    ordered = [c for c in CONTENDERS if c in last and c != ref]
    for c in sorted(ordered, key=lambda c: ("nockpt" not in c, CONTENDERS.index(c))):  # the default config last
        print(f"throughput ratio {c}/{ref}: {last[c]:.2f}")


if __name__ == "__main__":
    main()
