"""``PPOConfig``: TRL's PPO config plus the fields our trainer adds.

Its base is TRL's ``PPOConfig`` where the installed TRL has one (1.0 - 1.12), else
``trl_ppo_ext._base.PPOConfigBase`` (the same fields on TRL's base config). Defaults equal
TRL's, so a script that only swaps the import behaves the same apart from the fixes listed in
the README. Readable by ``HfArgumentParser`` like every TRL config.

Example:

>>> import tempfile
>>> from trl_ppo_ext import PPOConfig
>>> args = PPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], bf16=False)
>>> args.kl_coef, args.kl_estimator, args.whiten_advantages, args.missing_eos_penalty
(0.05, 'k1', True, None)
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Literal

from ._compat import PPOConfigBase, upstream_ppo_config
from ._utils import optional_number_from_text
from .agents.arguments import ToolArguments
from .batching import check_local_batch
from .choices import KL_ESTIMATORS, LOSS_TYPES, OFF_POLICY_CORRECTIONS, SERVER_WEIGHT_SYNC_CHOICES
from .estimator_table import CRITIC_ONLY_FIELDS, ESTIMATORS, estimator, resolve_scale_rewards
from .generation.arguments import VLLMArguments
from .generation.base import VLLM_MIN_TEMPERATURE
from .grpo_names import GRPOFields, refuse_foreign_names
from .run.guards import GuardSettings
from .run.preemption import ON_SIGTERM_CHOICES

# Critic-recipe fields that None turns off; on the command line they arrive as text.
RECIPE_OPTIONAL_FLOATS = (
    "value_lam", "lam_length_alpha", "cliprange_high", "dual_clip", "critic_warmup_explained_variance",
    "critic_gate_explained_variance", "lam_length_min",
)


def _bf16_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@refuse_foreign_names
@dataclass
class PPOConfig(PPOConfigBase, GuardSettings, VLLMArguments, GRPOFields, ToolArguments):
    r"""Configuration for [`trl_ppo_ext.PPOTrainer`]; every field of TRL's ``PPOConfig``, the
    guard-rail thresholds of [`trl_ppo_ext.run.guards.GuardSettings`] (``nonfinite_halt_after``,
    ``min_explained_variance``, ``kl_max``, ``max_clip_fraction``, ``reward_hacking_metric``, ...),
    TRL GRPO's vLLM fields of [`trl_ppo_ext.generation.arguments.VLLMArguments`] (``use_vllm``,
    ``vllm_mode``, ``vllm_importance_sampling_correction``, ...; see docs/vllm.md), GRPO's names
    for five PPO fields (``max_completion_length``, ``num_iterations``, ``epsilon``,
    ``epsilon_high``, ``delta``) and GRPO's own fields that carry over (the sampling filters
    ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``;
    ``log_completions``, ``shuffle_dataset``, ...; [`trl_ppo_ext.grpo_names`]), plus:

    Parameters:
        entropy_coef (`float`, defaults to `0.0`):
            Weight of the entropy bonus: the loss is
            ``policy_loss + vf_coef * value_loss - entropy_coef * entropy``.
        kl_estimator (`"k1"`, `"k2"` or `"k3"`, defaults to `"k1"`):
            Per-token KL estimator used in the shaped reward, with ``logr = log pi_ref - log pi``:
            k1 = ``-logr`` (unbiased), k2 = ``logr**2 / 2``, k3 = ``exp(logr) - 1 - logr``
            (unbiased, lower variance). See http://joschu.net/blog/kl-approx.html.
        whiten_advantages (`bool`, defaults to `True`):
            Whiten advantages over the valid tokens of the whole rollout batch, with statistics
            shared by all processes.
        bf16 (`bool` or `None`, defaults to `None`):
            As in TRL, except that unset means "bf16 where the hardware supports it" (TRL sets
            True and then fails to start on a CPU-only machine).
        cliprange_value (`float` or `None`, defaults to `0.2`):
            Clip range of the value loss around the rollout's values; ``None`` disables
            value clipping (on the command line, where argparse cannot parse ``None``, pass
            ``--cliprange_value inf``: clipping to +-inf is no clipping).
        offload_reward_model (`bool`, defaults to `False`):
            Keep the reward model on the CPU between scoring passes (single-GPU memory saver).
        offload_ref_model (`bool`, defaults to `False`):
            The same for a separate reference model.
        adaptive_kl (`bool`, defaults to `False`):
            Adapt the KL coefficient toward ``kl_target`` (Ziegler et al. 2019), starting from
            ``kl_coef``: ``beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / kl_horizon``.
        kl_target (`float`, defaults to `6.0`), kl_horizon (`float`, defaults to `10000`):
            The adaptive controller's target per-sequence KL (nats) and horizon (episodes).
        reward_weights (`list[float]` or `None`, defaults to `None`):
            One weight per reward -- ``reward_model`` first, then each of the trainer's
            ``reward_funcs`` -- in the combined score; None: 1 each.
        print_metrics_dict (`bool`, defaults to `False`):
            Also print each logged metrics dict on the console, as transformers does; by default
            the console gets one readable line per logged update (``reporting.console_line``), and
            the tqdm bar only on a terminal.
        step_separator (`str`, defaults to `"\\n"`):
            A process reward model's step separator (TRL ``PRMTrainerConfig.step_separator``): a
            token-classification ``reward_model`` (or model in ``reward_funcs``) scores each step at
            the last token of its separator, and the score lands on that token of the completion.
        max_rollout_age (`int` or `None`, defaults to `None`):
            Discard and regenerate a rollout sampled more than this many updates ago (policy
            lag). ``None``: no limit. The synchronous trainer's rollouts have age 0; the limit
            matters for asynchronous rollout producers (override ``produce_rollout``).
        on_sigterm (`"save_and_exit"`, `"save_and_return"` or `"off"`, defaults to `"save_and_exit"`):
            What SIGTERM (a cluster's or spot machine's notice before it kills the job) does during
            ``train()``: finish the current optimizer step, write a complete checkpoint (whatever
            ``save_strategy``), record ``stop_reason="preempted"``, then exit with status 0
            (``"save_and_exit"``) or return from ``train()`` (``"save_and_return"``). ``"off"``
            leaves SIGTERM's handling alone.
        value_lam (`float` or `None`, defaults to `None`):
            Critic recipe: the GAE lambda of the value targets only (decoupled GAE,
            VC-PPO / VAPO; 1.0 = Monte-Carlo returns); None: ``lam``, today's targets.
        lam_length_alpha (`float` or `None`, defaults to `None`):
            VAPO's length-adaptive policy lambda: each sequence's advantages use
            ``max(0, 1 - 1 / (lam_length_alpha * L))`` (L its valid tokens) instead of ``lam``
            (VAPO uses 0.05). None: ``lam``.
        cliprange_high (`float` or `None`, defaults to `None`):
            Upper clip of the ratio, ``1 + cliprange_high`` (DAPO's clip-higher; TRL GRPO's
            ``epsilon_high``); None: ``cliprange`` (symmetric).
        dual_clip (`float` or `None`, defaults to `None`):
            Dual-clip PPO's bound c > 1: a token with a negative advantage loses at most
            ``c * |A|``. None: off.
        loss_type (`"dapo"`, `"grpo"` or `"dr_grpo"`, defaults to `"dapo"`):
            How the clipped surrogate is normalised (TRL GRPO's ``loss_type``): ``"dapo"`` the
            token mean over the mini-batch on every process (this package's loss before the
            field); ``"grpo"`` the mean over sequences of each one's token mean; ``"dr_grpo"``
            the token sum over ``sequences * response_length``. The value loss and the entropy
            stay token means.
        critic_warmup_steps (`int`, defaults to `0`):
            The first this many updates train the value function only (VAPO's value
            pre-training): the policy, its adapter and its optimizer state do not move. They
            count episodes and advance the learning-rate schedule like any update. 0: off.
        critic_warmup_explained_variance (`float` or `None`, defaults to `None`):
            End the warm-up early, after the first update whose ``val/explained_variance``
            reaches this (<= 1). None: the warm-up takes ``critic_warmup_steps`` updates.
        num_critic_epochs (`int` or `None`, defaults to `None`):
            Critic updates per batch (verl's ``critic.ppo_epochs``; SAO trains the critic twice per
            batch): the update's epochs over its rollout, of which the first ``num_ppo_epochs`` are
            the joint PPO epochs and the others train the critic alone, in shuffled mini-batches,
            against the same returns and old values (value clipping as usual). The policy, its
            AdamW state and its weight decay do not move in those steps; with the shared value head
            only the head trains there (the shared trunk is the policy's). Must be
            ``>= num_ppo_epochs``; refused for an estimator that trains no critic and under
            DeepSpeed or FSDP (``trl_ppo_ext.critic_epochs``, docs/critic.md). None: the critic
            trains in the PPO epochs only.
        critic_context_column (`str` or `None`, defaults to `None`):
            A privileged critic: the name of a dataset column (e.g. ``"answer"``) whose value, a
            string, the critic reads before each prompt and the policy never sees: the value and a
            newline, tokenized with the processing class without special tokens, put before the
            prompt in the critic's input only (``trl_ppo_ext.critic_context``, docs/critic.md). Needs
            a critic with a pass of its own: a separate value model or ``use_value_adapter=True``
            (not the shared value head, not ``value_branch_layer``), and the column in
            ``train_dataset`` (and ``eval_dataset``). None: the critic reads the policy's input.
        use_value_adapter (`bool`, defaults to `False`):
            Give the critic its own LoRA adapter on the policy's base (``SharedActorCritic``'s
            ``value_lora_config``; docs/critic.md), a copy of ``peft_config`` without ``lm_head``.
            Needs ``peft_config`` (or a ``PeftModel`` policy) and ``advantage_estimator="gae"``.
        num_generations (`int`, defaults to `1`):
            Completions sampled per prompt in each rollout batch (TRL GRPO's name). The copies
            of a prompt sit on adjacent rows of one process, so group statistics need no
            gather; the batch sizes (and ``total_episodes``) count completions, and the
            per-process rollout batch ``per_device_train_batch_size *
            gradient_accumulation_steps`` must be a multiple of it.
        advantage_estimator (`str`, defaults to `"gae"`):
            ``"gae"``: the critic's GAE (any ``num_generations``); ``"grpo"``: each sequence's
            summed shaped reward minus its group's mean, divided by the std ``scale_rewards``
            names; ``"rloo"``: minus the mean of the group's other samples (TRL RLOO);
            ``"reinforce_pp"``: REINFORCE++, per-token discounted returns whitened over the
            batch; ``"reinforce_pp_baseline"``: the group's mean score subtracted first. All but
            ``"gae"`` train no critic (no value head, no value loss); ``"grpo"``, ``"rloo"`` and
            ``"reinforce_pp_baseline"`` need ``num_generations >= 2``. ``"gae_rloo"`` (needs
            ``num_generations >= 2`` and trains a critic): the group's leave-one-out advantage of
            the sequence return plus the critic's credit inside the episode, ``GAE(0, V - V_first)``;
            a flat critic gives RLOO's advantages exactly (``trl_ppo_ext.critic_baselines``,
            docs/critic.md). See ``trl_ppo_ext.estimators``.
        scale_rewards (`str`, defaults to `"group"`):
            TRL GRPO's values, read by ``advantage_estimator="grpo"`` only: ``"group"`` (or
            True) divides by the group's std, ``"batch"`` by the whole batch's, ``"none"`` (or
            False) not at all (Dr. GRPO); 1e-4 is added to the std, as in TRL.
        max_staleness (`int`, defaults to `0`):
            TRL ``AsyncGRPOConfig``'s name and meaning: a rollout sampled more than this many
            policy versions (updates) before the one it is trained with is never trained on.
            ``0``: the synchronous loop, sample then update, exactly as without this field. Above
            0 the rollout sampler samples the next batches in a background thread while the
            trainer updates (``sampling.RolloutSampler.next_sample``, docs/async.md); this needs
            ``use_vllm=True, vllm_mode="server"``: only an engine in its own process samples from
            a copy of the weights that the update running beside it does not touch. Episodes (a
            ``rollout_func``, ``tools``, ``environment_factory``) are sampled on that thread too,
            every turn at the batch's version (a ``rollout_func`` runs there); with several
            processes the server's weights go as a LoRA adapter (``vllm_server_weight_sync``).
        off_policy_correction (`str`, defaults to `"none"`):
            How the gap between the policy that sampled a batch (the engine's log-probs) and the
            proximal policy (the trainer's log-probs of the current weights, recomputed when the
            batch is trained) is corrected, per token (``trl_ppo_ext.off_policy``):
            ``"decoupled"`` (AReaL: weights above ``off_policy_cap`` leave their token out),
            ``"tis"`` (truncated at ``off_policy_cap``) or ``"none"``. It replaces
            ``vllm_importance_sampling_correction`` (the same ratio), which must then be False.
        off_policy_cap (`float`, defaults to `3.0`):
            The bound ``C >= 1`` on ``pi_prox / pi_behav`` of ``off_policy_correction`` (AReaL's
            ``behav_imp_weight_cap``; 3.0 is TRL's ``vllm_importance_sampling_clip_max`` for the
            same ratio).
        vllm_server_weight_sync (`str`, defaults to `"auto"`):
            How the policy's weights reach a vLLM server (``vllm_mode="server"``): ``"nccl"``
            (TRL's weight-transfer engine; needs CUDA on the trainer), ``"adapter"`` (the LoRA
            adapter as files the server loads as a new adapter per version) or ``"files"`` (every
            weight in a safetensors file the server reloads in place). ``"auto"``: NCCL where
            CUDA is and ``max_staleness=0``, else the adapter for a LoRA policy vLLM accepts,
            else files (``generation.server_weights.choose_server_weight_sync``).
        vllm_server_weight_dir (`str` or `None`, defaults to `None`):
            The folder the ``"adapter"`` / ``"files"`` weight sync writes to, seen by the server
            under the same path (a shared mount for a server on another machine). None: a new
            temporary folder (a server on this machine).
        value_branch_layer (`int` or `None`, defaults to `None`):
            With ``use_value_adapter=True``: the critic branches from the policy's own pass at the
            input of this decoder layer (negative: counted from the top, ``-1`` = the last layer).
            Its adapter covers the layers from there up only, and the layers below are the
            policy's, detached (the value loss never reaches the policy's adapter), so the critic
            costs those layers instead of a second backbone pass (``models.branch_critic``; Llama,
            Mistral, Qwen2, Qwen3; docs/critic.md). None: the value adapter runs the whole backbone.
        critic_gate_explained_variance (`float` or `None`, defaults to `None`):
            The explained-variance gate (EVPO; EVPO uses 0.0): each update measures the explained
            variance of the rollout's old values against its own value targets, over the action
            tokens of every process, before the update; while it is ``<=`` this the advantages
            use a baseline that does not read the critic, broadcast over each episode's action
            tokens (the group's leave-one-out mean of the sequence returns with
            ``num_generations >= 2``, else the batch mean). The critic trains as always. Logged
            as ``train/gate_explained_variance`` and ``train/gate_used_critic`` (1 the critic, 0
            the baseline). None: off. Needs a critic (``advantage_estimator`` ``"gae"`` or
            ``"gae_rloo"``).
        lam_length_min (`float` or `None`, defaults to `None`):
            The floor of the length-adaptive lambda (``lam_length_alpha``):
            ``max(lam_length_min, 1 - 1 / (alpha * L))``, so that a short response or turn (every
            one of ``<= 1 / alpha`` tokens gets lambda 0 without it) keeps part of its later TD
            errors. None: 0 (VAPO's clamp). Needs ``lam_length_alpha``.
        lam_length_per_turn (`bool`, defaults to `False`):
            The length-adaptive lambda's L is the length of each token's turn (a run of tokens
            the policy sampled), one lambda per token, rather than the episode's action tokens
            (SAO's per-turn use, with ``lam_length_alpha=1.5``). The same as False for
            completions without environment tokens. Needs ``lam_length_alpha``.
        critic_lr_multiplier (`float`, defaults to `1.0`):
            The critic's learning rate is ``learning_rate`` times this, through the schedule's
            warm-up and decay: the critic's parameters (the value model's, or the value head's and
            the value adapter's) get optimizer groups of their own. Critic-PPO recipes train the
            critic faster than the policy (VAPO and NeMo-RL 2x, SAO 5x). ``1.0``: one learning
            rate, the optimizer as without this field. Applies to the optimizer the trainer builds
            (not to one passed as ``optimizers=``); refused under DeepSpeed and FSDP (not checked
            there).
        scoring_batch_size (`int` or `None`, defaults to `None`):
            Rows per no-grad scoring forward (old log-probs and values, reference, reward models),
            per process, cut from length-sorted rows and trimmed to their extent. None: the
            training micro-batch, ``per_device_train_batch_size`` (GRPO scores its log-probs at that
            size), at most ``local_rollout_forward_batch_size``. ``local_rollout_forward_batch_size``
            keeps setting the rows per ``generate`` call: sampling the batch in one call and scoring
            it in chunks of the micro-batch is cheaper than either size for both (a chunk pads only
            to its own longest row) and holds the logits of a micro-batch at a time.
    """

    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Entropy bonus weight: loss = policy_loss + vf_coef * value_loss - entropy_coef * entropy."},
    )
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator in the shaped reward, logr = log pi_ref - log pi: 'k1' = -logr "
            "(unbiased), 'k2' = logr^2/2, 'k3' = exp(logr) - 1 - logr (unbiased, lower variance). "
            "See http://joschu.net/blog/kl-approx.html."
        },
    )
    whiten_advantages: bool = field(
        default=True,
        metadata={"help": "Whiten advantages over the valid tokens of the rollout batch (global statistics)."},
    )
    cliprange_value: float | None = field(
        default=0.2,
        metadata={"help": "Clip range of the value loss around the rollout values; None (or inf on the command line) "
            "disables value clipping."},
    )

    offload_reward_model: bool = field(
        default=False,
        metadata={
            "help": "Keep the reward model in CPU memory and move it to the GPU only for the scoring pass of each "
            "rollout, so the PPO update holds none of its weights. No effect without CUDA."
        },
    )
    offload_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Same as offload_reward_model for a separate reference model (not needed when the reference "
            "is the policy with its adapter disabled)."
        },
    )

    adaptive_kl: bool = field(
        default=False,
        metadata={"help": "Adapt the KL coefficient toward kl_target (Ziegler et al. 2019), starting from kl_coef."},
    )
    kl_target: float = field(
        default=6.0, metadata={"help": "Adaptive KL: target per-sequence KL to the reference (nats)."}
    )
    kl_horizon: float = field(default=10000, metadata={"help": "Adaptive KL: horizon in episodes."})
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "Weights of the rewards (reward_model first, then each of reward_funcs, in order) in the "
            "combined score: score = sum of weight * reward over the rewards that apply. None: 1 each."
        },
    )
    step_separator: str = field(
        default="\n",
        metadata={
            "help": "A process reward model's step separator (PRMTrainerConfig.step_separator): a token-classification "
            "reward model scores each step at its separator's last token, where the score lands in the completion."
        },
    )
    # `| str`: HfArgumentParser then hands over the text, so `--max_rollout_age None` parses
    max_rollout_age: int | str | None = field(
        default=None,
        metadata={
            "help": "Discard and regenerate rollouts sampled more than this many updates ago (policy lag). "
            "None: no limit."
        },
    )

    print_metrics_dict: bool = field(
        default=False,
        metadata={"help": "Print every logged metrics dict on the console (transformers' default) below the one "
            "readable line per logged update; False: that line only (the trackers and log_history get every key "
            "either way)."},
    )

    on_sigterm: Literal["save_and_exit", "save_and_return", "off"] = field(
        default="save_and_exit",
        metadata={
            "help": "On SIGTERM during train(): finish the optimizer step, checkpoint, record stop_reason="
            "'preempted', then exit 0 ('save_and_exit') or return ('save_and_return'); 'off' leaves SIGTERM alone."
        },
    )

    # Critic recipe. Typed `float | str | None`: argparse cannot produce None, so
    # HfArgumentParser hands "None" over as text, made None by `_read_recipe_values`.
    value_lam: float | str | None = field(
        default=None,
        metadata={"help": "GAE lambda of the value targets only (decoupled GAE; 1.0 = Monte-Carlo returns), in "
            "[0, 1]. None: lam."},
    )
    lam_length_alpha: float | str | None = field(
        default=None,
        metadata={"help": "Length-adaptive policy lambda (VAPO): 1 - 1/(alpha * L) per sequence of L valid tokens, "
            "alpha > 0 (VAPO: 0.05). None: lam."},
    )
    cliprange_high: float | str | None = field(
        default=None,
        metadata={"help": "Upper ratio clip 1 + cliprange_high (DAPO clip-higher, TRL GRPO's epsilon_high), >= 0. "
            "None: cliprange."},
    )
    dual_clip: float | str | None = field(
        default=None,
        metadata={"help": "Dual-clip PPO bound c > 1: the loss of a token with advantage A < 0 is at most c * |A|. "
            "None: off."},
    )
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = field(
        default="dapo",
        metadata={"help": "Normalisation of the policy loss (TRL GRPO's names): 'dapo' token mean over the "
            "mini-batch (default, as before), 'grpo' mean of each sequence's token mean, 'dr_grpo' token sum over "
            "sequences * response_length. Value loss and entropy stay token means."},
    )
    trim_forwards: bool = field(
        default=True,
        metadata={"help": "Run every scoring forward and every training micro-batch on its rows' own extent "
            "(prompts cut to the longest real prompt, responses to the longest response of the chunk), "
            "results scattered back into the (B, T) rollout. Only padding is dropped; False: full-width "
            "forwards (prompt + response_length), as before, for comparison."},
    )
    group_by_length_in_batches: bool = field(
        default=True,
        metadata={"help": "Cut scoring chunks and each mini-batch's micro-batches (same count and sizes) from "
            "rows sorted by length, so rows of similar length share a trimmed forward. Changes results only "
            "by float summation order; mini-batch shuffling is unchanged. False: rows in rollout/shuffled order. "
            "(transformers' `group_by_length` is the Trainer's dataset sampler, which PPO does not use.)"},
    )
    scoring_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per no-grad scoring forward (old log-probs and values, reference, reward models), per "
            "process, cut from length-sorted rows (group_by_length_in_batches) and trimmed (trim_forwards). "
            "None: per_device_train_batch_size (GRPO's size for its log-prob forwards), at most "
            "local_rollout_forward_batch_size, which keeps setting the rows per generate call."},
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "Token budget of one training forward (verl's ppo_max_token_len_per_gpu): each "
            "mini-batch's rows, sorted by length, are packed into micro-batches of at most this many token "
            "positions (rows x (longest prompt + longest response) of the micro-batch), however many that "
            "takes; one optimizer step per mini-batch as before. None: per_device_train_batch_size rows."},
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={"help": "Train only the value function for the first this many updates (the policy and its "
            "optimizer state do not move); they count episodes and advance the LR schedule. 0: off."},
    )
    critic_warmup_explained_variance: float | str | None = field(
        default=None,
        metadata={"help": "End the critic warm-up after the first update whose val/explained_variance reaches "
            "this (<= 1). None: the warm-up takes critic_warmup_steps updates."},
    )
    use_value_adapter: bool = field(
        default=False,
        metadata={"help": "Give the critic its own LoRA adapter on the policy's base (the layout docs/critic.md "
            "recommends for long responses with a reward at the end), a copy of peft_config without lm_head; "
            "costs a second backbone pass per forward. Needs peft_config and advantage_estimator='gae'."},
    )

    num_generations: int = field(
        default=1,
        metadata={"help": "Completions sampled per prompt in each rollout batch (TRL GRPO's name), on adjacent rows "
            "of one process. Batch sizes and total_episodes count completions; per_device_train_batch_size * "
            "gradient_accumulation_steps must be a multiple of it. 1: each prompt sampled once."},
    )
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae_rloo"] = field(
        default="gae",
        metadata={"help": "'gae' (the critic, default), 'grpo' (score minus group mean, over the std scale_rewards "
            "names), 'rloo' (leave-one-out group baseline), 'reinforce_pp' (REINFORCE++: discounted returns "
            "whitened over the batch), 'reinforce_pp_baseline' (group mean subtracted first) or 'gae_rloo' (RLOO "
            "across prompts plus the critic's credit inside the episode; RLOO exactly when the critic is flat). "
            "Only 'gae' and 'gae_rloo' train a critic; all but 'gae' and 'reinforce_pp' need num_generations >= 2."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "advantage_estimator='grpo' only, TRL GRPO's values: 'group' (or True, default) divides "
            "by the group's std, 'batch' by the batch's std, 'none' (or False) does not scale (Dr. GRPO)."},
    )
    value_branch_layer: int | None = field(
        default=None,
        metadata={"help": "With use_value_adapter: the critic branches from the policy's pass at the input of this "
            "decoder layer (negative: from the top), its adapter on the layers above only, the layers below "
            "shared and detached; costs those layers instead of a second backbone pass. None: the whole backbone."},
    )

    max_staleness: int = field(
        default=0,
        metadata={"help": "TRL AsyncGRPO's name and meaning: a rollout sampled more than this many policy versions "
            "before the update that trains it is never trained on. 0 (default): sample, then update, as always. "
            "Above 0 the next batches are sampled in the background while the trainer updates; needs "
            "use_vllm=True with vllm_mode='server' (an engine in its own process). See docs/async.md."},
    )
    off_policy_correction: Literal["none", "tis", "decoupled"] = field(
        default="none",
        metadata={"help": "Correct the gap between the sampling policy (the engine's log-probs) and the proximal "
            "policy (recomputed at train time) per token: 'decoupled' (AReaL: tokens whose weight exceeds "
            "off_policy_cap are left out), 'tis' (weights truncated at off_policy_cap) or 'none'. Replaces "
            "vllm_importance_sampling_correction, which must then be False."},
    )
    off_policy_cap: float = field(
        default=3.0,
        metadata={"help": "The cap C >= 1 on pi_prox / pi_behav of off_policy_correction (AReaL's "
            "behav_imp_weight_cap)."},
    )
    vllm_server_weight_sync: Literal["auto", "nccl", "adapter", "files"] = field(
        default="auto",
        metadata={"help": "How weights reach a vLLM server: 'nccl' (needs CUDA), 'adapter' (LoRA adapter files "
            "loaded per version), 'files' (all weights in a safetensors file reloaded in place) or 'auto' (NCCL "
            "with CUDA and max_staleness=0, else adapter for a LoRA policy vLLM accepts, else files)."},
    )
    vllm_server_weight_dir: str | None = field(
        default=None,
        metadata={"help": "Where the 'adapter'/'files' weight sync writes, seen by the server under the same path. "
            "None: a temporary folder (a server on this machine)."},
    )

    critic_gate_explained_variance: float | str | None = field(
        default=None,
        metadata={"help": "Explained-variance gate (EVPO uses 0.0): while the rollout's explained variance (old "
            "values against its value targets, before the update) is <= this, the advantages use a baseline that "
            "does not read the critic (group leave-one-out mean with num_generations >= 2, else the batch mean). "
            "Logged as train/gate_used_critic and train/gate_explained_variance. None: off."},
    )
    lam_length_min: float | str | None = field(
        default=None,
        metadata={"help": "Floor of the length-adaptive lambda: max(lam_length_min, 1 - 1/(lam_length_alpha * L)), "
            "in [0, 1]; without it every response or turn of <= 1/alpha tokens gets lambda 0. None: 0. Needs "
            "lam_length_alpha."},
    )
    lam_length_per_turn: bool = field(
        default=False,
        metadata={"help": "Length-adaptive lambda per turn: L is the length of each token's turn (a run of "
            "policy tokens), not the episode's (SAO, with lam_length_alpha=1.5). Needs lam_length_alpha."},
    )
    critic_lr_multiplier: float = field(
        default=1.0,
        metadata={"help": "The critic's learning rate is learning_rate times this (its parameters in optimizer "
            "groups of their own; VAPO and NeMo-RL use 2, SAO 5). 1.0: one learning rate."},
    )
    num_critic_epochs: int | str | None = field(
        default=None,
        metadata={"help": "Critic updates per batch (verl's critic.ppo_epochs): epochs over each rollout, the first "
            "num_ppo_epochs joint, the others value-only steps (the policy and its optimizer state do not move; "
            "with the shared value head only the head trains). >= num_ppo_epochs. None: num_ppo_epochs."},
    )
    critic_context_column: str | None = field(
        default=None,
        metadata={"help": "A privileged critic: a dataset column (e.g. 'answer') whose string value, and a newline, "
            "the critic reads before each prompt; the policy never sees it. Needs a separate value model or "
            "use_value_adapter (not the shared head, not value_branch_layer). None: the critic reads the policy's "
            "input."},
    )

    def guard_settings(self) -> GuardSettings:
        """The guard-rail thresholds of this config, as a ``GuardSettings``."""
        return GuardSettings(**{f.name: getattr(self, f.name) for f in fields(GuardSettings)})

    def __post_init__(self):
        self.resolve_grpo_aliases()  # first: every check below reads the PPO names
        # TRL turns an unset `bf16` into True, and transformers then refuses to start on a
        # machine without bf16 support ("Your setup doesn't support bf16/gpu"). Unset means
        # "bf16 where the hardware has it": True on a bf16-capable CUDA device, else False.
        if self.bf16 is None and not self.fp16 and not _bf16_available():
            self.bf16 = False
        self.check_grpo_fields()
        super().__post_init__()  # TRL's and transformers' checks (they do not chain to GuardSettings)
        GuardSettings.__post_init__(self)
        self._read_recipe_values()
        self._check_ppo_fields()
        self._check_recipe_fields()
        self._check_estimator_fields()
        self._check_async_fields()
        if self.use_vllm:
            self._check_vllm_run()  # values the user must change come before the install hint below
        VLLMArguments.__post_init__(self)  # field checks; use_vllm without vLLM: ImportError naming the extra
        ToolArguments.__post_init__(self)

    def _check_vllm_run(self) -> None:
        """What a vLLM run needs that its fields alone do not say; refused here, before anything
        of the run is built."""
        if self.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(
                f"PPOConfig.temperature={self.temperature} with use_vllm=True: below {VLLM_MIN_TEMPERATURE} vLLM's "
                "sampled-token log-probs no longer match the trainer's log_softmax(logits / temperature) "
                "(docs/vllm.md). "
                f"Sample at temperature >= {VLLM_MIN_TEMPERATURE}, or set use_vllm=False for near-greedy sampling."
            )
        import torch

        if self.vllm_mode == "server" and self.vllm_server_weight_sync == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "PPOConfig.vllm_mode='server' with use_vllm=True and vllm_server_weight_sync='nccl' needs CUDA on the "
                "trainer: the policy's weights reach the server over NCCL after every update, and this machine has "
                "no CUDA device. Use vllm_server_weight_sync='auto' (adapter or weight files the server reads), or "
                "vllm_mode='colocate' (an engine inside this process; works on a CPU)."
            )

    def _check_ppo_fields(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"PPOConfig.kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}. "
                "Use 'k1' (TRL's default) unless you have a reason to prefer k2/k3."
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError(
                f"PPOConfig.stop_token={self.stop_token!r} and stop_token_id={self.stop_token_id!r} are both set; "
                "they are mutually exclusive. Set stop_token='eos' to stop at the tokenizer's EOS, or "
                "stop_token_id=<id> for another token, not both."
            )
        if self.stop_token is not None and self.stop_token != "eos":
            raise ValueError(f"PPOConfig.stop_token must be 'eos' or None, got {self.stop_token!r}.")
        for name in ("num_mini_batches", "num_ppo_epochs", "local_rollout_forward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PPOConfig.{name} must be >= 1, got {getattr(self, name)}.")
        size = self.scoring_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"PPOConfig.scoring_batch_size must be a positive integer or None (the training "
                             f"micro-batch, per_device_train_batch_size), got {size!r}.")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(
                f"PPOConfig.max_tokens_per_micro_batch must be a positive integer or None, got {budget!r}. Use at "
                "least the longest prompt + response_length (a longer row gets a micro-batch of its own), or None "
                "for micro-batches of per_device_train_batch_size rows."
            )
        if self.response_length < 1:
            raise ValueError(
                f"PPOConfig.response_length must be >= 1 (number of tokens to generate), got {self.response_length}."
            )
        if self.cliprange_value is not None and self.cliprange_value <= 0:
            raise ValueError(
                f"PPOConfig.cliprange_value must be > 0 or None (no value clipping), got {self.cliprange_value}."
            )
        if self.on_sigterm not in ON_SIGTERM_CHOICES:
            raise ValueError(
                f"PPOConfig.on_sigterm must be one of {list(ON_SIGTERM_CHOICES)}, got {self.on_sigterm!r}."
            )
        if self.entropy_coef < 0:
            raise ValueError(f"PPOConfig.entropy_coef must be >= 0, got {self.entropy_coef}.")
        if self.max_rollout_age is not None and self.max_rollout_age < 0:
            raise ValueError(f"PPOConfig.max_rollout_age must be >= 0 or None (no limit), got {self.max_rollout_age}.")
        if self.adaptive_kl and (self.kl_target <= 0 or self.kl_horizon <= 0):
            raise ValueError(
                f"PPOConfig: adaptive_kl needs kl_target > 0 and kl_horizon > 0, got kl_target={self.kl_target}, "
                f"kl_horizon={self.kl_horizon}."
            )

    def _check_async_fields(self) -> None:
        """``max_staleness``, the off-policy correction and the server weight sync (docs/async.md)."""
        staleness = self.max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"PPOConfig.max_staleness must be an int >= 0 (0: synchronous rollouts), got "
                             f"{staleness!r}.")
        if self.vllm_server_weight_sync not in SERVER_WEIGHT_SYNC_CHOICES:
            raise ValueError(f"PPOConfig.vllm_server_weight_sync must be one of "
                             f"{list(SERVER_WEIGHT_SYNC_CHOICES)}, got {self.vllm_server_weight_sync!r}.")
        if staleness > 0 and not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError(
                f"PPOConfig.max_staleness={staleness} samples the next rollouts while the trainer updates, which needs "
                "an engine in its own process holding its own copy of the weights: set use_vllm=True and "
                f"vllm_mode='server' (got use_vllm={self.use_vllm}, vllm_mode={self.vllm_mode!r}), or max_staleness=0. "
                "A colocated engine or transformers' generate would sample from the weights being updated."
            )
        if staleness > 0 and self.vllm_server_weight_sync == "nccl":
            raise ValueError(
                f"PPOConfig.max_staleness={staleness} with vllm_server_weight_sync='nccl': the asynchronous sampler "
                "stages each version's weights on the trainer's thread and switches to them on its own, which the "
                "adapter and files syncs do. Use vllm_server_weight_sync='auto', 'adapter' or 'files'."
            )
        if staleness > 0 and self.max_rollout_age is not None and self.max_rollout_age < staleness:
            raise ValueError(
                f"PPOConfig.max_rollout_age={self.max_rollout_age} is below max_staleness={staleness}: the "
                "asynchronous sampler hands out rollouts up to max_staleness updates old, which the trainer would "
                "discard. Set max_rollout_age=None (max_staleness bounds the age) or >= max_staleness."
            )
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(f"PPOConfig.off_policy_correction must be one of {list(OFF_POLICY_CORRECTIONS)}, got "
                             f"{self.off_policy_correction!r}.")
        if self.off_policy_correction != "none":
            if not 1.0 <= self.off_policy_cap < math.inf:  # nan fails too
                raise ValueError(f"PPOConfig.off_policy_cap must be a finite number >= 1, got {self.off_policy_cap}.")
            if not self.use_vllm:
                raise ValueError(
                    f"PPOConfig.off_policy_correction={self.off_policy_correction!r} weights tokens by pi_prox / "
                    "pi_behav, with pi_behav the engine's log-probs: it needs use_vllm=True (transformers' generate "
                    "samples from the policy itself). Set off_policy_correction='none'."
                )
            if self.vllm_importance_sampling_correction:
                raise ValueError(
                    f"PPOConfig.off_policy_correction={self.off_policy_correction!r} and "
                    "vllm_importance_sampling_correction=True both weight the policy loss by pi_prox / pi_engine; "
                    "only one may apply. Set vllm_importance_sampling_correction=False to use "
                    "off_policy_correction, or off_policy_correction='none' to keep TRL's correction."
                )

    def _read_recipe_values(self) -> None:
        """The critic-recipe fields and ``max_rollout_age`` as the command line gives them (text)
        made Python values: ``"None"`` -> None, a number's text -> float (int for the age)."""
        for name in RECIPE_OPTIONAL_FLOATS:
            setattr(self, name, optional_number_from_text(getattr(self, name), float, owner="PPOConfig", name=name,
                                                          off="turns it off"))
        self.max_rollout_age = optional_number_from_text(self.max_rollout_age, int, owner="PPOConfig",
                                                         name="max_rollout_age", off="sets no limit")
        self.num_critic_epochs = optional_number_from_text(self.num_critic_epochs, int, owner="PPOConfig",
                                                           name="num_critic_epochs",
                                                           off="trains the critic in the PPO epochs only")

    def _check_recipe_fields(self) -> None:
        # `not lo <= x <= hi` is True for nan as well: nan is refused with the rest
        if self.value_lam is not None and not 0.0 <= self.value_lam <= 1.0:
            raise ValueError(f"PPOConfig.value_lam must be in [0, 1] or None (use lam), got {self.value_lam}.")
        if self.lam_length_alpha is not None and not 0.0 < self.lam_length_alpha < math.inf:
            raise ValueError(
                f"PPOConfig.lam_length_alpha must be a finite number > 0 (VAPO uses 0.05) or None (use lam), "
                f"got {self.lam_length_alpha}."
            )
        if self.cliprange_high is not None and not 0.0 <= self.cliprange_high < math.inf:
            raise ValueError(
                f"PPOConfig.cliprange_high must be a finite number >= 0 or None (use cliprange), "
                f"got {self.cliprange_high}."
            )
        if self.dual_clip is not None and not 1.0 < self.dual_clip < math.inf:
            raise ValueError(
                f"PPOConfig.dual_clip must be a finite number > 1 (3.0 is common) or None (off), got {self.dual_clip}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"PPOConfig.loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}; 'dapo' is the "
                "token mean this package always used."
            )
        steps = self.critic_warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"PPOConfig.critic_warmup_steps must be an int >= 0 (0: no warm-up), got {steps!r}.")
        threshold = self.critic_warmup_explained_variance
        if threshold is not None and not threshold <= 1.0:  # nan fails too
            raise ValueError(
                f"PPOConfig.critic_warmup_explained_variance must be a number <= 1 (explained variance is at most "
                f"1) or None, got {threshold}."
            )
        if threshold is not None and steps == 0:
            raise ValueError(
                f"PPOConfig.critic_warmup_explained_variance={threshold} needs critic_warmup_steps > 0 (the most "
                "updates the warm-up may take), got critic_warmup_steps=0."
            )
        self._check_critic_baseline_fields()

    def _check_critic_baseline_fields(self) -> None:
        """The gate's threshold and the length-adaptive lambda's floor and per-turn switch."""
        gate = self.critic_gate_explained_variance
        if gate is not None and not -math.inf < gate <= 1.0:  # nan fails too
            raise ValueError(
                f"PPOConfig.critic_gate_explained_variance must be a finite number <= 1 (EVPO uses 0.0: the critic "
                f"is used once it explains any of the returns) or None (off), got {gate}."
            )
        floor = self.lam_length_min
        if floor is not None and not 0.0 <= floor <= 1.0:
            raise ValueError(f"PPOConfig.lam_length_min must be in [0, 1] or None (0, VAPO's clamp), got {floor}.")
        if not isinstance(self.lam_length_per_turn, bool):
            raise ValueError(f"PPOConfig.lam_length_per_turn must be True or False, got {self.lam_length_per_turn!r}.")
        if not 0.0 < self.critic_lr_multiplier < math.inf:  # nan fails too
            raise ValueError(
                f"PPOConfig.critic_lr_multiplier must be a finite number > 0, got {self.critic_lr_multiplier}.")
        for name, value, default in (("lam_length_min", floor, None), ("lam_length_per_turn",
                                                                       self.lam_length_per_turn, False)):
            if value != default and self.lam_length_alpha is None:
                raise ValueError(
                    f"PPOConfig.{name}={value!r} shapes the length-adaptive lambda, which is off "
                    "(lam_length_alpha=None). Set lam_length_alpha (VAPO: 0.05 for long answers, SAO: 1.5 for "
                    f"agent turns), or leave {name} at {default!r}."
                )


    @property
    def scoring_chunk_size(self) -> int:
        """Rows per scoring forward: ``scoring_batch_size``, else ``per_device_train_batch_size`` at
        most ``local_rollout_forward_batch_size`` (generation's call size, TRL PPO's one size for both)."""
        if self.scoring_batch_size is not None:
            return self.scoring_batch_size
        return min(self.per_device_train_batch_size, self.local_rollout_forward_batch_size)

    @property
    def trains_critic(self) -> bool:
        """Whether the run has a critic: its ``advantage_estimator`` reads values (``estimator_table``)."""
        return estimator(self.advantage_estimator).needs_critic

    def _check_estimator_fields(self) -> None:
        """``num_generations``, ``advantage_estimator`` and ``scale_rewards`` (made one of
        ``"group"``, ``"batch"``, ``"none"``)."""
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"PPOConfig.advantage_estimator must be one of {list(ESTIMATORS)}, got {self.advantage_estimator!r}."
            )
        self.scale_rewards = resolve_scale_rewards(self.scale_rewards)
        n = self.num_generations
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"PPOConfig.num_generations must be an int >= 1 (1: one sample per prompt), got {n!r}.")
        check_local_batch(self.per_device_train_batch_size, self.gradient_accumulation_steps, num_generations=n)
        if estimator(self.advantage_estimator).needs_groups and n < 2:
            raise ValueError(
                f"PPOConfig.advantage_estimator={self.advantage_estimator!r} compares the samples of a prompt with "
                f"each other and needs num_generations >= 2, got num_generations={n}. Set num_generations (4 or 8 "
                "is common), or use advantage_estimator='reinforce_pp' or 'gae'."
            )
        if not self.trains_critic and self.critic_warmup_steps:
            raise ValueError(
                f"PPOConfig.critic_warmup_steps={self.critic_warmup_steps} with advantage_estimator="
                f"{self.advantage_estimator!r}, which trains no critic: there is nothing to warm up. Set "
                "critic_warmup_steps=0, or advantage_estimator='gae'."
            )
        if not self.trains_critic and self.use_value_adapter:
            raise ValueError(
                f"PPOConfig.use_value_adapter=True with advantage_estimator={self.advantage_estimator!r}, which trains "
                "no critic: there is no value to give an adapter. Set use_value_adapter=False, or "
                "advantage_estimator='gae'.")
        self._check_critic_epochs()
        self._check_critic_context()
        ignored = [] if self.trains_critic else _changed_from_default(self, CRITIC_ONLY_FIELDS)
        if ignored:  # a critic-free estimator reads none of these: say so rather than ignore them
            warnings.warn(
                f"PPOConfig: advantage_estimator={self.advantage_estimator!r} trains no critic and does not read "
                f"{', '.join(f'{name}={value!r}' for name, value in ignored)}: these are the critic's and GAE's "
                "settings (the group estimators normalise by scale_rewards, REINFORCE++ always whitens), so they "
                "have no effect. Leave them at their defaults, or use advantage_estimator='gae'.",
                UserWarning, stacklevel=3)


    def _check_critic_epochs(self) -> None:
        """``num_critic_epochs``: None, or an int ``>= num_ppo_epochs`` on a run with a critic."""
        k = self.num_critic_epochs
        if k is None:
            return
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"PPOConfig.num_critic_epochs must be an int >= num_ppo_epochs or None (the critic "
                             f"trains in the PPO epochs only), got {k!r}.")
        if k < self.num_ppo_epochs:
            raise ValueError(
                f"PPOConfig.num_critic_epochs={k} is below num_ppo_epochs={self.num_ppo_epochs}: the critic trains in "
                "every PPO epoch, and num_critic_epochs counts those too. Set num_critic_epochs >= num_ppo_epochs "
                f"(e.g. {self.num_ppo_epochs + 1}: one more epoch that trains the critic alone), or None."
            )
        if not self.trains_critic:
            raise ValueError(
                f"PPOConfig.num_critic_epochs={k} with advantage_estimator={self.advantage_estimator!r}, which trains "
                "no critic: there is no critic to update. Set num_critic_epochs=None, or advantage_estimator='gae'."
            )


    def _check_critic_context(self) -> None:
        """``critic_context_column``: None (``"None"`` from the command line), or a column name on a run whose
        critic has a pass of its own (the model's layout is checked by the trainer, ``critic_context.check_layout``)."""
        column = self.critic_context_column
        if isinstance(column, str) and column.strip().lower() == "none":
            column = self.critic_context_column = None
        if column is None:
            return
        if not isinstance(column, str) or not column:
            raise ValueError(
                f"PPOConfig.critic_context_column must be a dataset column's name or None, got {column!r}.")
        if not self.trains_critic:
            raise ValueError(
                f"PPOConfig.critic_context_column={column!r} with advantage_estimator={self.advantage_estimator!r}, "
                "which trains no critic: nothing would read the context. Set critic_context_column=None, or "
                "advantage_estimator='gae'."
            )
        if self.value_branch_layer is not None:
            raise ValueError(
                f"PPOConfig.critic_context_column={column!r} with value_branch_layer={self.value_branch_layer}: the "
                "branch critic shares the policy's layers below the branch, so it cannot read an input of its own. "
                "Set value_branch_layer=None (the value adapter's own pass), or critic_context_column=None."
            )


def _changed_from_default(config, names) -> list[tuple[str, object]]:
    """``(name, value)`` of each field of ``names`` whose value is not its dataclass default."""
    defaults = {f.name: f.default for f in fields(config)}
    return [(name, getattr(config, name)) for name in names if getattr(config, name) != defaults.get(name)]


def as_ppo_config(args) -> PPOConfig:
    """``args`` as our :class:`PPOConfig`: returned as it is when it already is one; TRL's own
    ``PPOConfig`` (where the installed TRL has one) is copied field by field through our
    constructor, so our ``__post_init__`` checks run and our own fields take their defaults.

    Raises:
        TypeError: ``args`` is neither, naming the type received and how to build ours.

    Example:
        >>> import tempfile
        >>> args = PPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], bf16=False)
        >>> as_ppo_config(args) is args
        True
    """
    if isinstance(args, PPOConfig):
        return args
    upstream = upstream_ppo_config()
    if upstream is None or not isinstance(args, upstream):
        accepted = "trl_ppo_ext.PPOConfig" + ("" if upstream is None else " or TRL's PPOConfig")
        raise TypeError(
            f"`args` must be a {accepted}, got {type(args).__name__}. Build it with "
            "`trl_ppo_ext.PPOConfig(output_dir=..., ...)` (it takes every TRL PPOConfig field)."
        )
    ours = {f.name for f in fields(PPOConfig) if f.init}
    return PPOConfig(**{f.name: getattr(args, f.name) for f in fields(args) if f.init and f.name in ours})


def mixed_precision(args, environ=None) -> str:
    """The precision a config asks for, as transformers' ``Trainer`` reads it: ``"fp16"`` /
    ``"bf16"`` from the config, else the launcher's (``accelerate launch --mixed_precision``,
    the ``ACCELERATE_MIXED_PRECISION`` variable of ``environ``, default ``os.environ``), else
    ``"no"``.

    Example:
        >>> from types import SimpleNamespace
        >>> mixed_precision(SimpleNamespace(fp16=False, bf16=True), environ={})
        'bf16'
        >>> mixed_precision(SimpleNamespace(fp16=False, bf16=False), environ={"ACCELERATE_MIXED_PRECISION": "fp16"})
        'fp16'
    """
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return (os.environ if environ is None else environ).get("ACCELERATE_MIXED_PRECISION", "no")
