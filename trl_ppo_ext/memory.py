"""Expected peak accelerator memory of a PPO run, phase by phase: does it fit one card?

    python -m trl_ppo_ext.memory --preset llama-7b --card 24      # the trainer's defaults
    python -m trl_ppo_ext.memory --config path/to/config.json --base bf16 --no-gradient-checkpointing
    python -m trl_ppo_ext.memory --fits-table            # the README table
    python -m trl_ppo_ext.memory --preset llama-7b --advantage-estimator grpo   # no critic

Pure arithmetic over two frozen dataclasses: :class:`ModelShape` (a Llama-shaped decoder:
Llama, Mistral, Qwen2) and :class:`PPORun` (batch sizes named as in ``PPOConfig``,
precision, LoRA, offload, checkpointing). :func:`estimate` returns the bytes alive at the
worst moment of each phase of one PPO update, by component:

* ``generation``: resident weights + optimizer state + the KV cache of one
  ``local_rollout_forward_batch_size`` chunk at ``P + T`` tokens and the last decoding
  step's transients, or the prefill's working set if larger;
* ``scoring``: resident weights + optimizer state + the largest of the three no-grad
  forwards (policy+value, reference, reward model) over one ``scoring_batch_size`` chunk, with an offloaded
  frozen model's weights while it is on the device;
* ``update``: resident weights + optimizer state (+ autocast's bf16 copies of trainable
  fp32 weights) + the larger of two moments: backward's start (the activations and logits
  of one ``per_device_train_batch_size`` micro-batch, plus the gradients of earlier
  micro-batches when several make one step) and the optimizer step (all gradients).

``peak`` is the largest phase; :meth:`Estimate.fits` adds a fixed allowance for the CUDA
context, cuBLAS workspaces and allocator slack and compares with a card.

Notation: ``N`` layers, ``H`` hidden size, ``a`` heads, ``g`` key/value heads, ``d`` head
size, ``I`` MLP size, ``V`` vocabulary, ``r`` LoRA rank; ``P`` prompt and ``T`` response
tokens, ``L = P + T``; ``b`` sequences in one forward, ``t = b * L`` tokens; ``c`` bytes per
element of the compute dtype (4 fp32, 2 bf16).

What is assumed (the package as of its first memory work; say so when quoting a figure):

* weights: fp32 4 B, bf16 2 B; nf4 (bitsandbytes, double quantization, blocks of 64):
  ``n/2`` packed bytes + ``n/64`` uint8 absmax + fp32 absmax of those per 256 blocks + 1092 B
  of codebooks per linear layer; embeddings, ``lm_head``, norms, biases and the reward
  model's score head stay unquantized, in the compute dtype. LoRA weights and the value
  head are fp32 (peft casts adapters to fp32). Trainable full models (``shared=False``:
  TRL's four models, policy and value model fully trained) hold fp32 weights whatever the
  checkpoint's dtype; their reference and reward model use ``base_dtype``.
* optimizer: AdamW (``adamw_torch_fused``, transformers' default since torch 2.8): fp32
  ``exp_avg`` and ``exp_avg_sq`` per trainable parameter (8 B), no step temporaries;
  gradients fp32 (4 B), alive from backward to the step (``zero_grad`` frees them). The
  optimizer state is counted in every phase (it persists after the first update), except
  with ``estimate(..., first_update=True)`` (a one-update benchmark).
* compute: ``compute_dtype="bf16"`` means bf16 autocast (mixed precision) on the GPU;
  ``"fp32"`` no autocast. Attention is SDPA with a padding mask (PPO batches are padded).
* activations, per layer and token, no checkpointing: the bytes of the tensors autograd
  keeps, counted op by op in the manner of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198, section 4.1: ``sbh(34 +
  5as/h)`` for GPT), redone for the HF Llama layer (RMSNorm, rotary, SDPA, SwiGLU, no
  dropout) and checked tensor by tensor on the CPU with :func:`live_tensor_bytes` (see
  ``tests/test_memory.py``: within 2% in every regime). See :func:`layer_activation_bytes` for the list. SDPA keeps no
  ``L x L`` score matrix, but it keeps the additive mask it builds from the boolean padding
  mask: ``b * L^2 * c`` per layer. With gradient checkpointing a layer keeps only its
  input (``t * H`` in the residual dtype) and one layer is recomputed at a time.
* logits: the LM head runs on the last ``T + 1`` positions (``logits_to_keep``);
  ``response_logits`` makes a second ``(b, T, V)`` tensor (the temperature division);
  ``logprobs_from_logits`` upcasts bf16 logits to fp32 row by row and autograd keeps those
  rows (``b * T * V * 4``). No extra fp32 copy of the logits (accelerate's
  ``convert_outputs_to_fp32``).
* generation, last decoding step (measured): the larger of half a layer's cache (the
  concatenation copies keys, then values) + 3 fp32 ``(b, V)`` tensors (the previous step's
  logits, ``generate``'s fp32 copy, scaled scores) and 5 such tensors while sampling.
* not counted: the rollout's own ``(B, T)`` tensors, tokenizer and Python state, kernels'
  scratch other than ``logsumexp``'s, allocator rounding and fragmentation (see
  ``Estimate.fits``), the CUDA context.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

from .estimator_table import ESTIMATORS, needs_critic

if TYPE_CHECKING:  # the CLI's --help and the arithmetic import no torch (batching does)
    from .batching import BatchPlan

# advantage_estimator's values: the estimator table's names (a module that imports nothing, so --help answers
# at once)
ESTIMATOR_CHOICES = ESTIMATORS

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
BASE_DTYPES = ("fp32", "bf16", "nf4")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_TARGETS + MLP_TARGETS
NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4-bit)
NF4_NESTED_BLOCK = 256  # absmax values per fp32 constant in double quantization
NF4_CONSTANT_BYTES = 16 * 4 + 256 * 4 + 4  # nf4 code, nested absmax code, offset (per layer)
PHASES = ("generation", "scoring", "update")


# ---------------------------------------------------------------------- model shape

@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder (Llama, Mistral, Qwen2 ...). Parameter counts follow from it.

    Args:
        hidden_size: ``H``.
        num_layers: ``N`` decoder layers.
        num_heads: ``a`` query heads.
        intermediate_size: ``I``, the SwiGLU MLP's inner size.
        vocab_size: ``V``.
        num_kv_heads: ``g`` key/value heads (grouped-query attention); None -> ``a``.
        head_dim: ``d``; None -> ``H / a``.
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        qkv_bias: q/k/v projections have biases (Qwen2).
        num_parameters: the checkpoint's parameter count, if known and different from the
            count derived from the dimensions; the difference is counted as unquantized
            weights. None -> derived.
        name: a label for tables.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    num_parameters: int | None = None
    name: str = "custom"

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{name}={value!r}: pass a positive integer.")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "pass head_dim explicitly."
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.kv_heads}.")
        if self.num_parameters is not None and self.num_parameters < self.linear_parameters():
            raise ValueError(
                f"num_parameters={self.num_parameters:,} is below the {self.linear_parameters():,} "
                "parameters of the decoder layers' linear maps alone; check the dimensions."
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each linear map of one decoder layer."""
        H, I = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.dim_per_head, self.kv_heads * self.dim_per_head
        return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def linear_parameters(self) -> int:
        """Weights of every decoder layer's linear maps (what 4-bit quantizes)."""
        return self.num_layers * sum(i * o for i, o in self.linear_shapes().values())

    def other_parameters(self, head: str = "lm") -> int:
        """Everything else: embeddings, norms, q/k/v biases and the head.

        Args:
            head: ``"lm"`` (causal LM: ``lm_head`` unless tied) or ``"score"`` (a reward or
                value model: a ``Linear(H, 1)`` without bias instead of ``lm_head``).
        """
        H, N = self.hidden_size, self.num_layers
        bias = (self.num_heads + 2 * self.kv_heads) * self.dim_per_head if self.qkv_bias else 0
        count = self.vocab_size * H + N * (2 * H + bias) + H  # embeddings, 2 norms/layer, final norm
        if self.num_parameters is not None:  # the caller's count wins; keep the head difference
            count = self.num_parameters - self.linear_parameters() - self._lm_head()
        return count + (self._lm_head() if head == "lm" else H)

    def _lm_head(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def parameters(self, head: str = "lm") -> int:
        """Total parameters of the causal LM (``head="lm"``) or of a scorer (``"score"``)."""
        return self.linear_parameters() + self.other_parameters(head)

    def lora_parameters(self, rank: int, targets: Iterable[str]) -> int:
        """LoRA A and B weights over every layer: ``r * (in + out)`` per adapted map."""
        shapes = self.linear_shapes()
        return self.num_layers * sum(rank * sum(shapes[t]) for t in targets)


def nf4_bytes(numel: int) -> int:
    """Bytes of one bitsandbytes nf4 weight with double quantization, quant state included.

    ``n/2`` packed 4-bit values, ``n/64`` uint8 absmax, one fp32 per 256 absmax, and the
    constants (16-entry nf4 code, 256-entry absmax code, offset). E.g. a 128 x 128 weight:
    8192 + 256 + 4 + 1092 = 9544 bytes (0.58 B/parameter; 0.516 B for large weights).
    """
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + NF4_CONSTANT_BYTES


def weight_bytes(model: ModelShape, dtype: str, compute_dtype: str, head: str = "lm") -> int:
    """Bytes of a whole model stored as ``dtype`` (fp32, bf16 or nf4).

    nf4 quantizes the decoder layers' linear weights only; the rest is kept in
    ``compute_dtype`` (transformers loads it so, and ``load_actor_critic`` asks for it).
    """
    if dtype == "nf4":
        per_layer = sum(nf4_bytes(i * o) for i, o in model.linear_shapes().values())
        return model.num_layers * per_layer + model.other_parameters(head) * DTYPE_BYTES[compute_dtype]
    return model.parameters(head) * DTYPE_BYTES[dtype]


# ---------------------------------------------------------------------- the run

@dataclass(frozen=True)
class PPORun:
    """One device's share of a PPO run; batch fields are ``PPOConfig``'s.

    Args:
        per_device_train_batch_size: sequences per forward/backward of the update (``b_u``).
        gradient_accumulation_steps: micro-batches per rollout, with ``num_mini_batches``:
            the rollout batch is ``B = per_device_train_batch_size * gradient_accumulation_steps``.
        num_mini_batches: optimizer steps per PPO epoch; gradients of earlier micro-batches
            of a mini-batch stay alive during the next micro-batch's forward.
        local_rollout_forward_batch_size: sequences per generation call (``b_r``);
            None -> ``B``.
        scoring_batch_size: sequences per scoring forward (``b_s``); None -> the micro-batch
            ``per_device_train_batch_size``, at most ``b_r`` (``PPOConfig.scoring_chunk_size``).
        prompt_length: ``P``, prompt tokens after padding.
        response_length: ``T``, generated tokens (``PPOConfig.response_length``).
        base_dtype: how frozen weights are stored: ``"fp32"``, ``"bf16"`` or ``"nf4"``.
        compute_dtype: ``"bf16"`` (bf16 autocast) or ``"fp32"``.
        shared: True: ``SharedActorCritic`` (one frozen base + LoRA policy + value head;
            reference = adapter off) and a reward model. False: TRL's four models (policy and
            value model trained in full, fp32; reference and reward model frozen).
        lora_r: LoRA rank (``shared=True``).
        lora_target_modules: adapted maps, names from ``ALL_LINEAR`` (or ``"all-linear"``).
        offload_reward_model, offload_ref_model: keep that frozen model off the device
            except while it scores (``offload_ref_model`` needs ``shared=False``).
        gradient_checkpointing: recompute each layer in backward instead of keeping its
            activations. On by default, as in the trainer (TRL's ``gradient_checkpointing=True``).
        reward_model: the reward model's shape; None -> the policy's.
        critic: False models an advantage estimator that reads no value (a ``PPOConfig.
            advantage_estimator`` whose row of ``estimator_table`` needs no critic: GRPO, RLOO,
            REINFORCE++; ``"gae"`` and ``"gae_rloo"`` read one): no value head
            (shared) or value model (four models -> three), none of their weights, gradients,
            optimizer state or activations.

    Raises:
        ValueError: a combination the package does not run (named in the message).
    """

    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 4
    num_mini_batches: int = 1
    local_rollout_forward_batch_size: int | None = None
    scoring_batch_size: int | None = None
    prompt_length: int = 512
    response_length: int = 256
    base_dtype: str = "nf4"
    compute_dtype: str = "bf16"
    shared: bool = True
    lora_r: int = 16
    lora_target_modules: tuple[str, ...] = ATTENTION_TARGETS
    offload_reward_model: bool = False
    offload_ref_model: bool = False
    gradient_checkpointing: bool = True
    reward_model: ModelShape | None = field(default=None, repr=False)
    critic: bool = True

    def __post_init__(self):
        if self.lora_target_modules == "all-linear":
            object.__setattr__(self, "lora_target_modules", ALL_LINEAR)
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"base_dtype={self.base_dtype!r}: choose one of {BASE_DTYPES}.")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}: choose 'bf16' or 'fp32'.")
        if self.base_dtype == "bf16" and self.compute_dtype == "fp32":
            raise ValueError("base_dtype='bf16' with compute_dtype='fp32' is not a set-up the package "
                             "runs; pass compute_dtype='bf16' (or base_dtype='fp32').")
        if self.shared and self.base_dtype == "fp32" and self.compute_dtype == "bf16":
            raise ValueError("shared=True with an fp32 base and bf16 compute would cast every frozen "
                             "weight per op; load the base in bf16 (base_dtype='bf16') instead.")
        unknown = [t for t in self.lora_target_modules if t not in ALL_LINEAR]
        if unknown or (self.shared and not self.lora_target_modules):
            raise ValueError(f"lora_target_modules={self.lora_target_modules!r}: name maps from "
                             f"{ALL_LINEAR} (or 'all-linear').")
        if self.offload_ref_model and self.shared:
            raise ValueError("offload_ref_model=True needs shared=False: the shared model's reference is "
                             "its own base with the adapter off, so there is nothing to offload.")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                     "prompt_length", "response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: pass a positive integer.")
        if self.local_rollout_forward_batch_size is not None and self.local_rollout_forward_batch_size < 1:
            raise ValueError(f"local_rollout_forward_batch_size={self.local_rollout_forward_batch_size}: pass a "
                             "positive integer, or None for the whole rollout batch.")
        if self.scoring_batch_size is not None and self.scoring_batch_size < 1:
            raise ValueError(f"scoring_batch_size={self.scoring_batch_size}: pass a positive integer, or None "
                             "for the micro-batch.")
        if self.shared and self.lora_r < 1:
            raise ValueError(f"lora_r={self.lora_r}: a shared-backbone set-up trains a LoRA adapter; pass a rank "
                             ">= 1 (16 is the default).")
        self.plan  # BatchPlan checks that num_mini_batches divides the rollout batch

    @property
    def plan(self) -> BatchPlan:
        """The trainer's batch arithmetic for this device's share (one process, one PPO epoch,
        one update): the sizes below are read from it, never re-derived here."""
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        sizes = SimpleNamespace(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_mini_batches=self.num_mini_batches, num_ppo_epochs=1, total_episodes=batch,
        )
        from .batching import BatchPlan

        return BatchPlan.from_config(sizes, world_size=1, dataset_len=batch)

    @property
    def rollout_batch(self) -> int:
        """``B``: sequences generated per update on this device."""
        return self.plan.local_batch_size

    @property
    def forward_batch(self) -> int:
        """``b_r``: sequences per generation call."""
        return min(self.local_rollout_forward_batch_size or self.rollout_batch, self.rollout_batch)

    @property
    def scoring_batch(self) -> int:
        """``b_s``: sequences per scoring forward (``PPOConfig.scoring_chunk_size``)."""
        size = self.scoring_batch_size or min(self.per_device_train_batch_size, self.forward_batch)
        return min(size, self.rollout_batch)

    @property
    def accumulates(self) -> bool:
        """More than one micro-batch per optimizer step: gradients meet activations."""
        return self.plan.micro_batches_per_mini_batch > 1

    @property
    def sequence_length(self) -> int:
        return self.prompt_length + self.response_length


# ---------------------------------------------------------------------- activations

def activation_regime(run: PPORun) -> str:
    """Which tensor list :func:`layer_activation_bytes` uses: ``"fp32-lora"``,
    ``"fp32-full"``, ``"bf16-lora"``, ``"nf4-lora"`` or ``"autocast-full"``."""
    if run.compute_dtype == "fp32":
        return "fp32-lora" if run.shared else "fp32-full"
    if not run.shared:
        return "autocast-full"
    return "nf4-lora" if run.base_dtype == "nf4" else "bf16-lora"


def layer_activation_bytes(model: ModelShape, run: PPORun, batch: int) -> int:
    """Bytes one decoder layer keeps for backward over ``batch`` sequences of ``L`` tokens.

    Per token (``c`` compute bytes; the four attention tensors are full-width even with
    grouped-query attention, because with a padding mask transformers repeats k and v to
    every head before SDPA, and autograd keeps the repeated copies):

    * every regime: both RMSNorms keep their fp32 input (``2 * 4H``); SDPA keeps q and k
      after rotary, v and its output (``4 * cH``) and an fp32 log-sum-exp per head
      (``4a``); the norms keep ``rsqrt`` (``2 * 4``); SwiGLU keeps gate, up and
      ``silu(gate)`` (``3 * cI``); SDPA keeps its additive padding mask (``b * L^2 * c`` per
      layer, i.e. ``L * c`` per token).
    * ``fp32-lora`` / ``nf4-lora`` (LoRA on a frozen base; nf4 under CUDA autocast):
      frozen maps keep nothing; LoRA's A keeps its input once per distinct input: the
      normed hidden state for q/k/v (``cH``), the same for gate/up (``cH``), the SwiGLU
      product for down (``cI``); o's input is SDPA's kept output. Plus A's outputs (``c r``
      per adapted map).
    * ``bf16-lora`` (bf16 base, fp32 LoRA, autocast): peft casts each adapted map's input
      to fp32 and autocast casts it back, so each map keeps its own bf16 copy (``2H`` per
      q/k/v/o/gate/up, ``2I`` for down).
    * ``fp32-full`` (every weight trains, fp32): as above plus the norms' normalised input
      and output (``4 * 4H``) and the SwiGLU product (``4I``); with grouped-query attention
      also k and v before repetition (``2 * 4gd``).
    * ``autocast-full`` (fp32 weights, bf16 autocast): measured ``38H + 8I`` (fp32
      residual stream and norms; bf16 casts of every map's input; q, k in fp32 and bf16).

    Args:
        model: the layer's model.
        run: precision, LoRA targets and sequence length.
        batch: ``b``, sequences in the forward.
    """
    H, I, a, L = model.hidden_size, model.intermediate_size, model.num_heads, run.sequence_length
    width = a * model.dim_per_head  # q and SDPA's output (= H unless head_dim says otherwise)
    regime = activation_regime(run)
    c = DTYPE_BYTES[run.compute_dtype]
    common = 2 * 4 * H + 4 * c * width + 4 * a + 2 * 4 + 3 * c * I + L * c
    targets = set(run.lora_target_modules)
    if regime in ("fp32-lora", "nf4-lora"):
        lora = c * H * bool(targets & {"q_proj", "k_proj", "v_proj"})
        lora += c * H * bool(targets & {"gate_proj", "up_proj"}) + c * I * ("down_proj" in targets)
        per_token = common + lora + c * run.lora_r * len(targets)
    elif regime == "bf16-lora":
        copies = 2 * H * len(targets - {"down_proj"}) + 2 * I * ("down_proj" in targets)
        per_token = common + copies + c * run.lora_r * len(targets)
    elif regime == "fp32-full":
        gqa = 2 * 4 * model.kv_heads * model.dim_per_head if model.kv_heads < a else 0
        per_token = common + 4 * 4 * H + 4 * I + gqa
    else:  # autocast-full
        per_token = 38 * H + 8 * I + 4 * a + 2 * 4 + L * c
    return batch * L * per_token


def forward_activation_bytes(model: ModelShape, run: PPORun, batch: int, *, head: str = "lm") -> int:
    """Bytes a trained model keeps for backward over ``batch`` sequences (logits excluded).

    ``N`` layers (:func:`layer_activation_bytes`), or with checkpointing each layer's input
    in the residual stream's dtype (bf16 for a LoRA base computing in bf16, fp32 otherwise);
    + the final norm's fp32 input (``4H`` per token; full training also keeps its output) + the value head's
    fp32 input (``b (T+1) H * 4``; ``head="score"``: every position). The layer that
    checkpointing recomputes during backward is :func:`layer_activation_bytes` itself; it
    comes after the logits' backward, so it competes with the logits, not with them added.
    """
    H, L, T = model.hidden_size, run.sequence_length, run.response_length
    tokens = batch * L
    if run.gradient_checkpointing:
        residual = 2 if run.shared and run.compute_dtype == "bf16" else 4  # fp32 stream in full autocast
        layers = model.num_layers * tokens * H * residual
    else:
        layers = model.num_layers * layer_activation_bytes(model, run, batch)
    final = tokens * 4 * H
    if not run.shared:
        final += tokens * (4 + DTYPE_BYTES[run.compute_dtype]) * H
    value_input = batch * (L if head == "score" else T + 1) * H * 4 if run.critic else 0
    return layers + final + value_input


def update_logits_bytes(model: ModelShape, run: PPORun, batch: int) -> int:
    """Logit bytes at the worst moment of a micro-batch's update: the largest of

    * the LM head's ``(b, T+1, V)`` output next to ``response_logits``' ``(b, T, V)`` copy
      (the temperature division makes a new tensor);
    * that copy + the fp32 rows ``logprobs_from_logits`` makes from bf16 logits and autograd
      keeps (``b T V * 4``; none in fp32) + four fp32 ``(T, V)`` rows of the no-grad
      ``masked_entropy`` (its upcast, log-probabilities, probabilities, product);
    * backward: in fp32 the kept ``(b, T, V)`` logits, their gradient and two ``(T, V)``
      rows (``logsumexp`` and ``gather`` gradients of one row); in bf16 the kept fp32 rows
      and three ``(T, V)`` rows (smaller than the forward).

    The row counts were measured with :func:`live_tensor_bytes` (``tests/test_memory.py``).
    """
    V, T, c = model.vocab_size, run.response_length, DTYPE_BYTES[run.compute_dtype]
    scaled, row = batch * T * V * c, T * V * 4
    upcast = batch * T * V * 4 if c != 4 else 0
    forward = max(batch * (T + 1) * V * c + scaled, scaled + upcast + 4 * row)
    backward = 2 * scaled + 2 * row if c == 4 else upcast + 3 * row
    return max(forward, backward)


def dequantized_weight_bytes(model: ModelShape, run: PPORun) -> int:
    """The largest linear weight of a layer in the compute dtype: bitsandbytes dequantizes an
    nf4 weight before each multi-token matmul (forward and backward) and frees it after."""
    return max(i * o for i, o in model.linear_shapes().values()) * DTYPE_BYTES[run.compute_dtype]


def inference_forward_bytes(model: ModelShape, run: PPORun, batch: int, length: int, *,
                            logit_positions: int = 0, quantized: bool = False) -> int:
    """Transient bytes of one no-grad forward over ``batch`` sequences of ``length`` tokens.

    The larger of a layer's working set (measured: ``t c (8H + 3I)``; SwiGLU's ``silu(gate)``,
    up and their product are the ``3I``; + SDPA's float mask ``b length^2 c``) and,
    with ``logit_positions = k > 0`` (scoring: ``T + 1``), the logits: the LM head's
    ``(b, k, V)`` output, its temperature-divided ``(b, k - 1, V)`` copy and fp32
    ``(k - 1, V)`` rows of ``logprobs_from_logits`` (``logsumexp``'s two scratch rows, and
    the upcast of a bf16 row), next to the final hidden state (``t c H``). ``quantized``:
    nf4 weights, whose dequantized copy (:func:`dequantized_weight_bytes`) joins the
    working set.
    """
    H, I, V = model.hidden_size, model.intermediate_size, model.vocab_size
    c = DTYPE_BYTES[run.compute_dtype]
    tokens = batch * length
    working = tokens * c * (8 * H + 3 * I) + batch * length * length * c
    if quantized:
        working += dequantized_weight_bytes(model, run)
    if not logit_positions:
        return working
    k = logit_positions
    rows = 2 + (c != 4)
    return max(working, tokens * c * H + batch * (2 * k - 1) * V * c + rows * (k - 1) * V * 4)


def kv_cache_bytes(model: ModelShape, run: PPORun, batch: int, tokens: int) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``tokens``:
    ``2 N b tokens g d c``."""
    per_layer = 2 * batch * tokens * model.kv_heads * model.dim_per_head * DTYPE_BYTES[run.compute_dtype]
    return model.num_layers * per_layer


# ---------------------------------------------------------------------- the estimate

@dataclass(frozen=True)
class Estimate:
    """Bytes by component for each phase; see the module docstring for what each holds."""

    model: ModelShape
    run: PPORun
    phases: dict[str, dict[str, int]]
    trainable_parameters: int

    def phase_total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    @property
    def peak(self) -> int:
        """Bytes at the worst moment of the run (the largest phase)."""
        return self.phase_total(self.peak_phase)

    def required(self, overhead_gib: float = 1.0, slack: float = 0.05) -> float:
        """GiB the card needs: ``peak * (1 + slack) + overhead_gib`` (CUDA context and cuBLAS
        workspaces ~0.5-1 GiB; ``slack`` for the caching allocator's rounding and
        fragmentation, measured on a GPU as reserved / allocated - 1)."""
        return self.peak / GIB * (1 + slack) + overhead_gib

    def fits(self, card_gib: float, overhead_gib: float = 1.0, slack: float = 0.05) -> bool:
        """True when :meth:`required` is at most ``card_gib``."""
        return self.required(overhead_gib, slack) <= card_gib


def _trained_parts(model: ModelShape, run: PPORun) -> tuple[int, dict[str, int], int]:
    """``(trainable parameters, resident frozen weights by name, reference bytes)``."""
    if run.shared:
        trainable = model.lora_parameters(run.lora_r, run.lora_target_modules)
        trainable += model.hidden_size + 1 if run.critic else 0  # the value head Linear(H, 1)
        weights = {"weights: base (policy = reference)": weight_bytes(model, run.base_dtype, run.compute_dtype),
                   f"weights: LoRA{' + value head' if run.critic else ''} (fp32)": 4 * trainable}
        return trainable, weights, 0
    trainable = model.parameters("lm") + (model.parameters("score") if run.critic else 0)
    reference = weight_bytes(model, run.base_dtype, run.compute_dtype)
    weights = {f"weights: policy{' + value model' if run.critic else ''} (fp32)": 4 * trainable}
    if not run.offload_ref_model:
        weights["weights: reference"] = reference
    return trainable, weights, reference


def _generation(model: ModelShape, run: PPORun) -> dict[str, int]:
    """The transients of sampling one chunk: the worse of the last decoding step and the prefill."""
    b_r, P, T = run.forward_batch, run.prompt_length, run.response_length
    kv_end, kv_prompt = kv_cache_bytes(model, run, b_r, P + T), kv_cache_bytes(model, run, b_r, P)
    # The last decoding step (measured): during its forward, a layer's keys (or values) exist twice
    # while DynamicCache concatenates, next to the previous step's logits, fp32 copy and scaled
    # scores (3 (b, V)); after it, 5 such (b, V) tensors of sampling.
    sampling = b_r * model.vocab_size * 4
    decoding = {"KV cache": kv_end,
                "decoding step (cache growth, sampling)": max(kv_end // (2 * model.num_layers) + 3 * sampling,
                                                              5 * sampling)}
    # The prefill: the cache of P tokens + a forward's working set, whose k and v are the cache's.
    quantized = run.base_dtype == "nf4" and run.shared
    prefill = {"KV cache + prefill": kv_prompt - kv_prompt // model.num_layers
               + inference_forward_bytes(model, run, b_r, P, quantized=quantized)}
    return max(decoding, prefill, key=lambda parts: sum(parts.values()))


def _scoring(model: ModelShape, reward: ModelShape, run: PPORun, reference: int, reward_weights: int) -> dict[str, int]:
    """The largest no-grad forward of scoring, with the offloaded weights it brings in."""
    b_r, L, T = run.scoring_batch, run.sequence_length, run.response_length
    nf4 = run.base_dtype == "nf4"  # the frozen models (and the shared base) are 4-bit
    policy = "policy + value" if run.critic else "policy"
    forwards = {
        policy: {f"forward: {policy}": inference_forward_bytes(
            model, run, b_r, L, logit_positions=T + 1, quantized=nf4 and run.shared)},
        "reference": {"forward: reference": inference_forward_bytes(
            model, run, b_r, L, logit_positions=T + 1, quantized=nf4)},
        "reward model": {"forward: reward model": inference_forward_bytes(reward, run, b_r, L, quantized=nf4)},
    }
    if run.offload_ref_model:
        forwards["reference"]["weights: reference (moved in)"] = reference
    if run.offload_reward_model:
        forwards["reward model"]["weights: reward model (moved in)"] = reward_weights
    return max(forwards.values(), key=lambda parts: sum(parts.values()))


def _update(model: ModelShape, run: PPORun, trainable: int, moments: dict[str, int]) -> dict[str, int]:
    """One micro-batch's forward/backward and the optimizer step, beyond the resident bytes:
    the worse of backward's start and the step (``moments``: AdamW's state when it is created
    at this step, else empty)."""
    b_u = run.per_device_train_batch_size
    activations = forward_activation_bytes(model, run, b_u)
    if not run.shared and run.critic:  # the value model's forward is alive at the same time
        activations += forward_activation_bytes(model, run, b_u, head="score")
    extra = {}
    if run.compute_dtype == "bf16":  # autocast keeps a bf16 copy of each trainable fp32 weight for backward
        extra["autocast weight copies (bf16)"] = 2 * trainable
    logits = update_logits_bytes(model, run, b_u)
    # Backward reaches the layers after the logits: a recomputed layer (checkpointing) and the
    # dequantized nf4 weight of backward's matmuls compete with the logits, not add to them.
    layer_work = layer_activation_bytes(model, run, b_u) if run.gradient_checkpointing else 0
    layer_work += dequantized_weight_bytes(model, run) if run.base_dtype == "nf4" and run.shared else 0
    backward_start = {"activations": activations, **(
        {"logits": logits} if logits >= layer_work else {"recomputed layer, dequantized weight": layer_work})}
    if run.accumulates:  # earlier micro-batches' gradients wait for the step
        backward_start["gradients (fp32)"] = 4 * trainable
    optimizer_step = {"gradients (fp32)": 4 * trainable, **moments}  # backward has freed the activations
    return {**extra, **max(backward_start, optimizer_step, key=lambda parts: sum(parts.values()))}


def estimate(model: ModelShape, run: PPORun, *, first_update: bool = False) -> Estimate:
    """Expected bytes per phase of one PPO update of ``model`` under ``run``.

    Args:
        model: the policy's shape (and the reward model's, unless ``run.reward_model``).
        run: batch, lengths, precision, LoRA, offload, checkpointing.
        first_update: the run's first update, before the optimizer has any state: AdamW's
            moments appear only at its step (a one-update benchmark). False: every later
            update, with the moments resident in every phase.

    Example (Llama-2-7B shape, QLoRA, the default run: checkpointing on, as in the trainer)::

        >>> e = estimate(PRESETS["llama-7b"], PPORun())
        >>> e.peak_phase, e.fits(24), e.fits(16)
        ('generation', True, True)
        >>> off = estimate(PRESETS["llama-7b"], PPORun(gradient_checkpointing=False))
        >>> off.peak_phase, off.fits(24), off.fits(16)        # activations kept: the update peaks
        ('update', True, False)
    """
    reward = run.reward_model or model
    trainable, resident, reference = _trained_parts(model, run)
    reward_weights = weight_bytes(reward, run.base_dtype, run.compute_dtype, head="score")
    if not run.offload_reward_model:
        resident["weights: reward model"] = reward_weights
    moments = {"optimizer (AdamW m, v; fp32)": 8 * trainable}
    if not first_update:
        resident.update(moments)
    phases = {
        "generation": {**resident, **_generation(model, run)},
        "scoring": {**resident, **_scoring(model, reward, run, reference, reward_weights)},
        "update": {**resident, **_update(model, run, trainable, moments if first_update else {})},
    }
    return Estimate(model, run, phases, trainable)


# ---------------------------------------------------------------------- presets and configs

PRESETS: dict[str, ModelShape] = {  # published shapes (each checkpoint's config.json)
    "llama-1b": ModelShape(2048, 16, 32, 8192, 128256, num_kv_heads=8, tie_word_embeddings=True,
                           name="Llama-3.2-1B"),
    "llama-3b": ModelShape(3072, 28, 24, 8192, 128256, num_kv_heads=8, tie_word_embeddings=True,
                           name="Llama-3.2-3B"),
    "llama-7b": ModelShape(4096, 32, 32, 11008, 32000, name="Llama-2-7B"),
    "llama-8b": ModelShape(4096, 32, 32, 14336, 128256, num_kv_heads=8, name="Llama-3.1-8B"),
    "llama-13b": ModelShape(5120, 40, 40, 13824, 32000, name="Llama-2-13B"),
    "mistral-7b": ModelShape(4096, 32, 32, 14336, 32000, num_kv_heads=8, name="Mistral-7B-v0.1"),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 8960, 151936, num_kv_heads=2, tie_word_embeddings=True,
                               qkv_bias=True, name="Qwen2.5-1.5B"),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 18944, 152064, num_kv_heads=4, qkv_bias=True,
                             name="Qwen2.5-7B"),
}


def shape_from_config(config, name: str | None = None) -> ModelShape:
    """A :class:`ModelShape` from a transformers config: a ``config.json`` path, a dict, or a
    ``PretrainedConfig`` (a multimodal config's ``text_config`` is used).

    ``tie_word_embeddings`` defaults to False when absent (Llama's and Qwen2's default);
    Qwen2 configs, and configs with ``attention_bias``, get q/k/v biases.

    Raises:
        ValueError: a required key (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``intermediate_size``, ``vocab_size``) is missing.
    """
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise ValueError(f"config lacks {missing}; the memory model needs a Llama-shaped decoder config "
                         f"with {list(required)}.")
    model_type = str(config.get("model_type", ""))
    return ModelShape(
        hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"], num_kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"), tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type.startswith("qwen2") or bool(config.get("attention_bias", False)),
        name=name or model_type or "config",
    )


# ---------------------------------------------------------------------- measuring on the CPU

def live_tensor_bytes(device: str = "cpu"):
    """A context manager that follows the bytes of live tensor storages on ``device``.

    It sees every tensor an ATen op returns (a ``TorchDispatchMode``), counts each storage
    once while it lives (a weak reference tells when it is freed) and keeps ``current``
    and ``peak``. Storages that existed before are counted when first seen; call
    ``count_existing()`` right after entering to count every tensor alive then instead.
    Internal scratch of a kernel is not seen. The CPU analogue of
    ``torch.cuda.memory_allocated`` / ``max_memory_allocated``, without allocator rounding;
    it slows every op down (Python runs per op), so use it on small models.

    Example::

        with live_tensor_bytes() as live:
            live.count_existing()
            start = live.current
            loss = model(**batch).logits.sum(); loss.backward()
        print(live.peak - start)
    """
    import gc

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveTensorBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.current = 0
            self.peak = 0
            self._bytes: dict[int, int] = {}
            self._refs: dict[int, weakref.ref] = {}

        def _see(self, tensor) -> None:
            if tensor.device.type != device:
                return
            storage = tensor.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))
            self.current += size - self._bytes.get(key, 0)  # a resized storage changes size
            self._bytes[key] = size
            self.peak = max(self.peak, self.current)

        def _forget(self, key: int) -> None:
            self.current -= self._bytes.pop(key, 0)
            self._refs.pop(key, None)

        def count_existing(self) -> None:
            """Count every tensor the garbage collector can reach now (parameters, ...)."""
            with warnings.catch_warnings():  # isinstance() on some torch objects warns of deprecation
                warnings.simplefilter("ignore")
                tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
            for tensor in tensors:
                if not tensor.is_meta:
                    self._see(tensor)

        def reset_peak(self) -> None:
            self.peak = self.current

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                    self._see(leaf)
            return out

    return LiveTensorBytes()


# ---------------------------------------------------------------------- command line

def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def describe(model: ModelShape) -> str:
    return (f"{model.name}: {model.parameters() / 1e9:.2f}B parameters (H={model.hidden_size}, "
            f"N={model.num_layers}, a={model.num_heads}, g={model.kv_heads}, I={model.intermediate_size}, "
            f"V={model.vocab_size}{', tied' if model.tie_word_embeddings else ''})")


def describe_run(run: PPORun, trainable: int) -> str:
    if run.shared:
        what = (f"shared LoRA {'actor-critic' if run.critic else 'policy, no critic'}, r={run.lora_r} on "
                f"{','.join(run.lora_target_modules)}, {run.base_dtype} base")
    elif run.critic:
        what = f"four models (policy + value trained in full, fp32; reference and RM {run.base_dtype})"
    else:
        what = f"three models, no critic (policy trained in full, fp32; reference and RM {run.base_dtype})"
    offload = [n for n, on in (("RM", run.offload_reward_model), ("reference", run.offload_ref_model)) if on]
    return (f"{what}; {trainable / 1e6:.1f}M trainable; {run.compute_dtype} compute; "
            f"B={run.rollout_batch} (micro-batch {run.per_device_train_batch_size}, "
            f"{run.num_mini_batches} mini-batch(es)), generate chunk {run.forward_batch}, "
            f"scoring chunk {run.scoring_batch}, "
            f"P={run.prompt_length}, T={run.response_length}; checkpointing "
            f"{'on' if run.gradient_checkpointing else 'off'}; offload: {', '.join(offload) or 'none'}")


def format_estimate(e: Estimate, cards: list[float], overhead_gib: float, slack: float) -> str:
    """The per-phase table and, for each card, whether the run fits."""
    lines = [describe(e.model), "run: " + describe_run(e.run, e.trainable_parameters),
             f"{'phase':<11} {'component':<44} {'GiB':>8}"]
    for phase in PHASES:
        for i, (name, n) in enumerate(e.phases[phase].items()):
            lines.append(f"{phase if i == 0 else '':<11} {name:<44} {_gib(n)}")
        lines.append(f"{'':<11} {'= ' + phase:<44} {_gib(e.phase_total(phase))}")
    need = e.required(overhead_gib, slack)
    lines.append(f"peak: {e.peak_phase}, {e.peak / GIB:.2f} GiB; a card needs {need:.2f} GiB "
                 f"(+{overhead_gib:g} GiB CUDA context/workspaces, +{slack:.0%} allocator slack)")
    for card in cards:
        verdict = "fits" if e.fits(card, overhead_gib, slack) else "does NOT fit"
        lines.append(f"{card:g} GiB card: {verdict} ({card - need:+.2f} GiB left)")
    return "\n".join(lines)


FITS_TABLE_MODELS = ("llama-1b", "llama-7b", "llama-8b", "llama-13b")


def fits_table_runs(base: PPORun) -> dict[str, PPORun]:
    """The set-ups of the README table, on ``base``'s batch and lengths."""
    return {
        "QLoRA shared, nf4 RM offloaded, ckpt": replace(base, shared=True, base_dtype="nf4", compute_dtype="bf16",
                                                        offload_reward_model=True, gradient_checkpointing=True),
        "QLoRA shared, nf4 RM, no ckpt": replace(base, shared=True, base_dtype="nf4", compute_dtype="bf16",
                                                 offload_reward_model=False, gradient_checkpointing=False),
        "bf16 LoRA shared, bf16 RM, ckpt": replace(base, shared=True, base_dtype="bf16", compute_dtype="bf16",
                                                   offload_reward_model=False, gradient_checkpointing=True),
        "four models, bf16 frozen, ckpt": replace(base, shared=False, base_dtype="bf16", compute_dtype="bf16",
                                                  offload_reward_model=False, gradient_checkpointing=True),
    }


def format_fits_table(base: PPORun, cards: list[float], overhead_gib: float, slack: float) -> str:
    """A markdown table: required GiB and fit per card, for each preset and set-up."""
    cells = " | ".join(f"{c:g} GB" for c in cards)
    header = f"| policy (= RM shape) | set-up | peak phase | needs GiB | {cells} |"
    lines = [header, "|" + "---|" * (4 + len(cards))]
    for key in FITS_TABLE_MODELS:
        model = PRESETS[key]
        for label, run in fits_table_runs(base).items():
            e = estimate(model, run)
            need = e.required(overhead_gib, slack)
            marks = " | ".join("yes" if need <= c else "no" for c in cards)
            lines.append(f"| {model.name} ({model.parameters() / 1e9:.1f}B) | {label} | {e.peak_phase} | "
                         f"{need:.1f} | {marks} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trl_ppo_ext.memory",
                                     description=__doc__.splitlines()[0])
    shape = parser.add_argument_group("model (one of --preset, --config, or the dimensions)")
    shape.add_argument("--preset", choices=sorted(PRESETS), help="a published model shape")
    shape.add_argument("--config", help="a transformers config.json (Llama-shaped decoder)")
    for flag, help_ in (("--hidden", "H"), ("--layers", "N"), ("--heads", "a"), ("--kv-heads", "g (default a)"),
                        ("--intermediate", "I"), ("--vocab", "V"), ("--head-dim", "d (default H/a)"),
                        ("--params", "parameter count, if not the one derived from the dimensions")):
        shape.add_argument(flag, type=int, help=help_)
    shape.add_argument("--tied", action="store_true", help="lm_head tied to the embeddings")
    shape.add_argument("--qkv-bias", action="store_true", help="q/k/v biases (Qwen2)")
    shape.add_argument("--reward-preset", choices=sorted(PRESETS), help="reward model shape (default: the policy's)")
    shape.add_argument("--reward-config", help="reward model config.json (default: the policy's shape)")
    run = parser.add_argument_group("run (PPOConfig names)")
    defaults = PPORun  # the class: its field defaults, without building (and checking) a run
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                 "prompt_length", "response_length", "lora_r"):
        run.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    run.add_argument("--local-rollout-forward-batch-size", type=int, default=None,
                     help="rows per generate call (default: the whole rollout batch)")
    run.add_argument("--scoring-batch-size", type=int, default=None,
                     help="rows per scoring forward (default: the micro-batch, at most the generate call's rows)")
    run.add_argument("--base", choices=BASE_DTYPES, default=defaults.base_dtype, help="frozen weights' storage")
    run.add_argument("--compute", choices=sorted(DTYPE_BYTES), default=defaults.compute_dtype,
                     help="bf16 = bf16 autocast")
    run.add_argument("--four-models", action="store_true",
                     help="TRL's four models (policy and value trained in full) instead of the shared LoRA model")
    run.add_argument("--lora-target-modules", default=",".join(defaults.lora_target_modules),
                     help="comma-separated names, or all-linear")
    run.add_argument("--advantage-estimator", choices=ESTIMATOR_CHOICES, default="gae",
                     help=f"{' and '.join(e for e in ESTIMATOR_CHOICES if needs_critic(e))} train a critic; "
                          f"{', '.join(e for e in ESTIMATOR_CHOICES if not needs_critic(e))} have none, and the "
                          "estimate counts no value head or value model for them")
    run.add_argument("--offload-reward-model", action="store_true")
    run.add_argument("--offload-ref-model", action="store_true")
    run.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                     default=defaults.gradient_checkpointing,
                     help="recompute layers in backward; on by default, as the trainer's gradient_checkpointing=True "
                          "(TRL's default); --no-gradient-checkpointing models gradient_checkpointing=False")
    out = parser.add_argument_group("output")
    out.add_argument("--card", type=float, nargs="+", default=[24, 48, 80], help="card sizes, GiB")
    out.add_argument("--overhead-gib", type=float, default=1.0, help="CUDA context + workspaces")
    out.add_argument("--slack", type=float, default=0.05, help="allocator slack, fraction of the peak")
    out.add_argument("--json", action="store_true", help="print the estimate as JSON")
    out.add_argument("--fits-table", action="store_true",
                     help="print the README table (presets x set-ups, on this run's batch and lengths)")
    args = parser.parse_args(argv)
    args.parser = parser
    return args


def model_from_args(args) -> ModelShape:
    dims = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
            "intermediate_size": args.intermediate, "vocab_size": args.vocab}
    chosen = [bool(args.preset), bool(args.config), any(v is not None for v in dims.values())]
    if sum(chosen) != 1:
        args.parser.error("give exactly one of --preset, --config, or the dimensions (--hidden --layers "
                          "--heads --intermediate --vocab)")
    if args.preset:
        return PRESETS[args.preset]
    if args.config:
        try:
            return shape_from_config(args.config)
        except (OSError, ValueError) as err:
            args.parser.error(f"--config {args.config}: {err}")
    missing = [f"--{k}" for k, v in zip(("hidden", "layers", "heads", "intermediate", "vocab"), dims.values())
               if v is None]
    if missing:
        args.parser.error(f"missing {' '.join(missing)}")
    try:
        return ModelShape(**dims, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                          tie_word_embeddings=args.tied, qkv_bias=args.qkv_bias, num_parameters=args.params)
    except ValueError as err:
        args.parser.error(str(err))


def run_from_args(args) -> PPORun:
    reward = None
    if args.reward_preset:
        reward = PRESETS[args.reward_preset]
    elif args.reward_config:
        reward = shape_from_config(args.reward_config)
    targets = args.lora_target_modules
    targets = ALL_LINEAR if targets == "all-linear" else tuple(t.strip() for t in targets.split(",") if t.strip())
    try:
        return PPORun(
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, num_mini_batches=args.num_mini_batches,
            local_rollout_forward_batch_size=args.local_rollout_forward_batch_size,
            scoring_batch_size=args.scoring_batch_size,
            prompt_length=args.prompt_length, response_length=args.response_length, base_dtype=args.base,
            compute_dtype=args.compute, shared=not args.four_models, lora_r=args.lora_r,
            lora_target_modules=targets, offload_reward_model=args.offload_reward_model,
            offload_ref_model=args.offload_ref_model, gradient_checkpointing=args.gradient_checkpointing,
            reward_model=reward, critic=needs_critic(args.advantage_estimator),
        )
    except ValueError as err:
        args.parser.error(str(err))


def main(argv=None) -> None:
    args = parse_args(argv)
    run = run_from_args(args)
    if args.fits_table:
        print(format_fits_table(run, args.card, args.overhead_gib, args.slack))
        return
    e = estimate(model_from_args(args), run)
    if args.json:
        print(json.dumps({"model": asdict(e.model), "run": asdict(e.run),
                          "trainable_parameters": e.trainable_parameters, "phases": e.phases,
                          "peak_phase": e.peak_phase, "peak_bytes": e.peak,
                          "required_gib": e.required(args.overhead_gib, args.slack),
                          "fits": {f"{c:g}": e.fits(c, args.overhead_gib, args.slack) for c in args.card}},
                         indent=2))
        return
    print(format_estimate(e, args.card, args.overhead_gib, args.slack))


if __name__ == "__main__":
    sys.exit(main())
