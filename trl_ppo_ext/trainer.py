"""``PPOTrainer``: TRL's PPO trainer with explicit token-level math and ``train()`` in phases.

Its base is TRL's ``PPOTrainer`` where the installed TRL has one (1.0 - 1.12), else
``trl_ppo_ext._base.PPOTrainerBase`` (see ``_compat``); ``__init__`` never runs either.

Same constructor as TRL's trainer. ``train()`` reads as

    for each update:  rollout -> score -> advantages -> update -> log

and each phase is a method a subclass may override (``generate_rollout``, ``score_rollout``,
``compute_advantages``, ``ppo_update``/``compute_loss_terms``, ``log_update``). A hook
delegates to the module of its concept: ``rollout``, ``rewards``, ``advantages.compute_targets``,
``losses.ppo_loss``, ``metrics``; saving and loading is ``checkpointing.CheckpointMixin``; the
math is in ``functional``. The layout and the data that flows between the phases:
``docs/architecture.md``.

Example:

>>> from trl_ppo_ext import PPOTrainer
>>> phases = ("generate_rollout", "score_rollout", "compute_advantages", "ppo_update", "log_update")
>>> all(callable(getattr(PPOTrainer, name)) for name in phases)  # each one overridable in a subclass
True
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from peft import PeftModel
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerControl
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import TrainOutput, enable_full_determinism, set_seed, speed_metrics

from . import critic_context, critic_epochs, critic_warmup, inputs
from . import functional as F
from ._compat import PPOTrainerBase, prepare_deepspeed
from .advantages import PPOTargets
from .agents.tool_loop import ToolLoopStats
from .batching import BatchPlan
from .config import PPOConfig, as_ppo_config, mixed_precision
from .data import (
    PromptCollator,
    check_prompt_dataset,
    check_prompt_lengths,
    eval_dataloader,
    prompt_dataloader,
    repeat_batches,
    repeat_prompts,
)
from .distributed import place_frozen, place_frozen_models, plan_accelerator, process_state
from .estimators import estimator_settings, estimator_targets
from .generation.base import check_engine_context, effective_temperature
from .generation.filters import SamplingFilters
from .generation.mismatch import sampling_weights
from .generation.transformers_generate import configured_stop_token_id, generation_stop_ids
from .grpo_names import grpo_defaults_warning, grpo_metrics
from .kl_control import kl_controller_from_config
from .losses import loss_settings, ppo_loss, value_only_loss
from .metrics import (
    checked_eval_metrics,
    completion_rows,
    completions_table,
    heldout_metrics,
    logged_update_metrics,
    print_completion_rows,
    rollout_reward_metrics,
    show_completions,
    tool_loop_metrics,
)
from .models import assembly
from .models.offload import on_device
from .models.prepare import disable_dropout, strip_fp32_output_wrapper, warn_low_precision_trainables
from .models.values import has_values_alone, value_forward
from .reporting import console_line, log_due, update_progress, with_backend_keys
from .rewards.batch import RewardReader, score_batch_rewards, text_scores
from .rewards.building import build_run_rewards, place_run_rewards, scoring_model
from .rewards.logs import RewardLogs
from .rewards.scoring import reward_function_kwargs, say_nonfinite_rewards
from .rollout import (
    Rollout,
    SampledBatch,
    critic_sequence_inputs,
    forward_chunks,
    forward_responses,
    reference_response_logprobs,
    response_values,
    reward_model_scores,
    scored_rollout,
    sequence_inputs,
    valid_token_ids,
)
from .run import checkpointing as ckpt
from .run.checkpointing import CheckpointMixin, clean_temp_dirs
from .run.guards import GuardDecision, run_guards
from .run.manifest import ManifestMixin
from .run.preemption import PREEMPTED, SigtermWatcher, UpdatePreempted, stop_if_preempted
from .run.state import LoopState, OnlineTrainerState, RunCounters
from .sampling import PolicySnapshot, PromptFeed, RolloutSampler, build_agent_rollout, vllm_policy_engine
from .scoring_plan import plan_scoring
from .update import FIRST_LOGPROBS, Stepper, mini_batch_step, plan_micro_batches, stack_stats

logger = logging.getLogger(__name__)

# The key under which a preempted update's rollout keeps its tool loops' counts (ToolLoopStats fields).
INFLIGHT_TOOL_STATS = "_tool_loop_stats"

# The hooks whose override may read a rollout's old log-probs otherwise than the update's first forward would give
# them (a rollout of an older policy, a loss of its own): with one overridden, they are computed before the update
SCORING_HOOKS = ("produce_rollout", "compute_loss_terms")


class PPOTrainer(CheckpointMixin, ManifestMixin, PPOTrainerBase):
    """Drop-in replacement for TRL's ``PPOTrainer`` with correct token-level PPO math.

    Args are TRL's: ``args`` (a ``PPOConfig``), ``processing_class`` (tokenizer with a pad
    token), ``model`` (the policy, or a ``SharedActorCritic``), ``ref_model`` (``None``: the
    disabled adapter for PEFT/shared models, else a frozen copy of the policy),
    ``reward_model`` (sequence classifier, ``num_labels=1``), ``train_dataset`` (with
    ``input_ids``), ``value_model`` (sequence classifier; ``None`` with a ``peft_config`` or a
    ``SharedActorCritic`` builds/uses a shared-backbone value head), ``data_collator``,
    ``eval_dataset``, ``optimizers``, ``callbacks``, ``peft_config``. Keyword-only:
    ``reward_funcs`` (TRL GRPO's reward functions/models), ``reward_processing_classes`` (GRPO's
    meaning: one tokenizer or None per reward model, ``reward_model`` first; a model of another
    vocabulary scores its own rendering of the text, see ``reward_text``), ``eval_metrics``,
    ``rollout_func`` (TRL GRPO's: ``rollout_func(prompts, trainer) -> dict`` owns generation,
    e.g. an episode with turns; see :meth:`generate_episodes` and :meth:`generate_continuations`),
    ``tools`` and ``environment_factory`` (TRL GRPO's: functions the model may call, and a factory
    of per-rollout environments whose public methods are tools, with ``reset(**row)`` and an
    optional ``get_reward``; ``trl_ppo_ext.agents``).
    """

    _tag_names = ["trl", "ppo", "trl-ppo-ext"]
    # Further ``vllm.LLM`` keywords for the engine of ``use_vllm`` (a subclass may set them, e.g.
    # ``{"enforce_eager": True}`` to skip compilation for a short run).
    vllm_engine_kwargs: dict | None = None

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class=None,
        model: nn.Module | str | None = None,
        ref_model: nn.Module | None = None,
        reward_model: nn.Module | str | None = None,
        train_dataset=None,
        value_model: nn.Module | None = None,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config=None,
        *,
        eval_metrics: dict | None = None,
        reward_funcs=None,
        reward_processing_classes=None,
        rollout_func=None,
        tools=None,
        environment_factory=None,
    ) -> None:
        # a GRPO user's inputs (trl_ppo_ext.inputs): model / reward ids, no tokenizer, raw prompts, no critic
        args = as_ppo_config(args if args is not None else inputs.default_args(model))
        seed_construction(args)  # before any model, head or adapter is built (a new critic head was not, once)
        (model, processing_class, reward_model, reward_funcs, train_dataset, eval_dataset,
         value_model) = inputs.trainer_inputs(args, model, processing_class, reward_model, reward_funcs,
                                              train_dataset, eval_dataset, value_model, peft_config,
                                              environment_factory)
        self.args = args
        self.processing_class = processing_class
        if rollout_func is not None and not callable(rollout_func):
            raise TypeError(f"rollout_func must be callable as rollout_func(prompts, trainer), got "
                            f"{type(rollout_func).__name__}")
        self.rollout_func = rollout_func
        if self.rollout_func is not None and (tools or environment_factory is not None):
            raise ValueError("Pass either rollout_func or tools / environment_factory: with tools the trainer "
                             "runs the episodes itself (as TRL GRPO does), and a rollout_func would replace them.")
        self.agent_rollout = build_agent_rollout(args, processing_class, tools, environment_factory, model,
                                                 train_dataset)
        check_prompt_dataset(train_dataset, processing_class)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            critic_context.check_context_column(dataset, args.critic_context_column, name)
        assembly.check_separate_reference(model, ref_model)
        self.rewards = build_run_rewards(
            reward_model, reward_funcs, policy_tokenizer=processing_class, reward_weights=args.reward_weights,
            environment_rewards=self.agent_rollout.reward_functions() if self.agent_rollout else (),
            reward_processing_classes=reward_processing_classes, step_separator=args.step_separator,
            eval_metric_names=list(eval_metrics or ()))
        # what reward functions report through GRPO's log_metric / log_extra, until taken (reward_logs)
        self.reward_logs = RewardLogs()
        self.stop_token_id = configured_stop_token_id(args, processing_class)
        self.data_collator = data_collator or PromptCollator(processing_class)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.train_dataset_len = len(train_dataset)

        # a critic-free estimator: no value head, adapter or model anywhere (a value model given is dropped, warned)
        wrapper = assembly.build_policy_and_value(model, value_model, peft_config, with_value=args.trains_critic,
                                                  value_adapter=args.use_value_adapter,
                                                  value_branch_layer=args.value_branch_layer)
        critic_context.check_layout(args.critic_context_column, wrapper)  # a privileged critic needs its own pass
        self.policy_model = wrapper.policy
        self.value_model = None if not wrapper.has_value else value_model if value_model is not None else wrapper
        self.is_peft_model = isinstance(wrapper.policy, PeftModel)
        self.model_adapter_name, self.ref_adapter_name = args.model_adapter_name, args.ref_adapter_name
        self.stop_token_ids = generation_stop_ids(args, processing_class, wrapper.policy)
        grpo_signs = tuple(name for name, given in (("rollout_func", rollout_func), ("tools", tools),
                                                    ("environment_factory", environment_factory)) if given)
        if reward_funcs and reward_model is None:
            grpo_signs += ("reward_funcs without a reward_model",)
        warning = grpo_defaults_warning(args, grpo_signs)  # a GRPO script inherits PPO's defaults: say which
        if warning and PartialState().is_main_process:
            logger.warning(warning)
        assembly.apply_gradient_checkpointing(wrapper, args)
        warn_low_precision_trainables(wrapper)
        max_positions = getattr(wrapper.config, "max_position_embeddings", None)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None:
                lengths = check_prompt_lengths(dataset, name, max_positions, args.response_length)
                if lengths is not None:  # the engine's context too, on the lengths read once
                    check_engine_context(args, lengths, name)
        self.reward_model = reward_model  # TRL's attribute: the first reward model, or None
        # which scoring forwards the update reads: none of the reference where nothing reads a KL
        self.scoring = plan_scoring(args, trains_critic=args.trains_critic, values_alone=has_values_alone(wrapper),
                                    custom_update=any(getattr(type(self), hook) is not getattr(PPOTrainer, hook)
                                                      for hook in SCORING_HOOKS))
        self.ref_model = None
        if self.scoring.reference:
            self.ref_model = assembly.build_reference(self.policy_model, ref_model, self.is_peft_model)
        elif ref_model is not None:
            logger.info("ref_model is not used: nothing reads the reference (kl_coef=0, no adaptive_kl, no KL guard).")
        # dropout off; the user's values of the trained (and reference) models' configs go back into saved ones
        self._saved_dropout = [e for m in (wrapper, self.ref_model) if m is not None for e in disable_dropout(m)]

        self._setup_batch_sizes(args)
        self.model = wrapper
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)
        self._setup_callbacks_and_state(callbacks)
        critic_warmup.check_supported(args, self.is_deepspeed_enabled, fsdp=self.is_fsdp_enabled)
        self._setup_dataloaders()
        self._place_frozen_models()
        self._setup_run_control(eval_metrics)
        self.sampler = self._build_sampler()

    def create_optimizer(self, *args, **kwargs):
        """transformers' optimizer; with ``critic_lr_multiplier`` the critic's parameters in groups of their own."""
        built_here = self.optimizer is None  # an optimizer passed as `optimizers=` is left as it is
        optimizer = super().create_optimizer(*args, **kwargs)
        if built_here and self.args.trains_critic and self.args.critic_lr_multiplier != 1.0:
            critic_warmup.split_critic_groups(optimizer, self.unwrapped, self.args.critic_lr_multiplier)
        return optimizer

    def _build_sampler(self) -> RolloutSampler:
        """The rollout sampler (``sampling.RolloutSampler``), after the process group and the dataloaders
        exist; with ``use_vllm`` its engine is built now (leaving the run's RNG as it was). A
        ``rollout_func`` is handed this trainer (TRL's contract); the tool loop samples its turns through
        a subclass's own ``generate_continuations`` where one overrides it."""
        engine_factory = functools.partial(vllm_policy_engine, self.args, self.unwrapped, is_peft=self.is_peft_model,
                                           adapter_name=self.model_adapter_name,
                                           engine_kwargs=self.vllm_engine_kwargs)
        overridden = type(self).generate_continuations is not PPOTrainer.generate_continuations
        rollout_func = None if self.rollout_func is None else functools.partial(_call_rollout_func,
                                                                                self.rollout_func, self)
        sampler = RolloutSampler(self.args, self.processing_class, self.accelerator, self.stop_token_ids,
                                 rollout_func=rollout_func, agent_rollout=self.agent_rollout,
                                 engine_factory=engine_factory,
                                 turns=self.generate_continuations if overridden else None)
        if self.args.use_vllm:
            sampler.engine = engine_factory()
        return sampler

    @property
    def engine(self):
        """The sampler's vLLM engine (None without ``use_vllm``, or after ``train()`` closed it)."""
        return self.sampler.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.sampler.engine = engine

    def close_engine(self) -> None:
        """Release the vLLM engine (``train()`` does at its end, also on error, while the process
        group still exists); a later rollout builds a new one."""
        if getattr(self, "sampler", None) is not None:
            self.sampler.close_engine()

    def _setup_run_control(self, eval_metrics) -> None:
        """KL controller, guard rails, the counters a checkpoint carries and the loop's state."""
        self.kl_controller = kl_controller_from_config(self.args)
        self.counters = RunCounters()  # with the totals of skipped steps and stale rollouts the guards count
        self.guards = run_guards(self.args, self.counters)
        self.eval_metrics = checked_eval_metrics(eval_metrics)  # their names and the rewards': build_run_rewards
        self.loop_state = LoopState()  # what the loop and the checkpoint code keep between updates

    # ------------------------------------------------------------------ set-up
    def _setup_batch_sizes(self, args) -> None:
        """The run's ``BatchPlan`` and the ``Accelerator`` that executes it; fills TRL's derived
        config fields (``batch_size``, ``local_mini_batch_size``, ``num_total_batches``, ...)."""
        plan = BatchPlan.from_config(args, process_state().num_processes, self.train_dataset_len)
        self.episodes_per_epoch = plan.episodes_per_epoch(self.train_dataset_len)
        self.accelerator = plan_accelerator(args, plan, mixed_precision(args))
        self.plan = plan
        plan.fill_config(args)
        plan.check_dataset(self.train_dataset_len)
        self.local_seed = args.seed + self.accelerator.process_index * 100003
        self.sample_generations_freq = max(1, plan.num_total_batches // max(args.num_sample_generations, 1))
        self.local_dataloader_batch_size = plan.prompts_per_batch

    def _setup_callbacks_and_state(self, callbacks) -> None:
        # report_to backends see transformers' key convention (eval/... shown as eval/, not train/eval/)
        report = [with_backend_keys(cb) for cb in get_reporting_integration_callbacks(self.args.report_to)]
        self.callbacks = DEFAULT_CALLBACKS + report + list(callbacks or [])
        self.callback_handler = CallbackHandler(
            self.callbacks, self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self.add_callback(update_progress(self.args))  # one line per logged update; the dict when asked
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
            ],
        )
        # Attributes transformers.Trainer's save/log helpers read.
        self.current_flos = 0
        self.hp_search_backend = None
        self._initial_num_input_tokens_seen = 0
        self.is_distributed_loading_by_transformers = False
        self.is_deepspeed_enabled = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None
        self.hub_model_id = None
        if self.args.push_to_hub:
            self.init_hf_repo()
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)

    def _setup_dataloaders(self) -> None:
        """The train and eval loaders (``data.prompt_dataloader``), prepared by accelerate with the model."""
        train = prompt_dataloader(self.train_dataset, self.local_dataloader_batch_size, self.data_collator,
                                  seed=self.args.seed, shuffle=self.args.shuffle_dataset)
        self.model, self.optimizer, self.dataloader = self.accelerator.prepare(self.model, self.optimizer, train)
        strip_fp32_output_wrapper(self.unwrapped)  # every forward runs in `self.accelerator.autocast()`
        torch.manual_seed(self.local_seed)  # generation differs per process
        self.eval_dataloader = None if self.eval_dataset is None else self.accelerator.prepare(
            eval_dataloader(self.eval_dataset, self.args.per_device_eval_batch_size, self.data_collator))
        self.model_wrapped = self.model

    def _place_frozen_models(self) -> None:
        """Reference and reward models placed (``distributed.place_frozen_models``, ``rewards.building.
        place_run_rewards``, both by ``distributed.place_frozen``); ``reward_model`` follows."""
        deepspeed = prepare_deepspeed if self.is_deepspeed_enabled else None
        self.ref_model = place_frozen_models(self.unwrapped, self.ref_model, self.args, self.accelerator,
                                             prepare_deepspeed=deepspeed)
        place = functools.partial(place_frozen, accelerator=self.accelerator, prepare_deepspeed=deepspeed)
        self.rewards = place_run_rewards(self.rewards, place, offload=self.args.offload_reward_model)
        if self.reward_model is not None:
            self.reward_model = scoring_model(self.rewards[0])

    # ------------------------------------------------------------------ contexts
    @property
    def temperature(self) -> float:
        """The temperature log-probs are taken at: ``args.temperature`` (0 means near-greedy)."""
        return effective_temperature(self.args.temperature)

    @property
    def sampling_filters(self) -> SamplingFilters:
        """The run's ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty`` (``generation_kwargs``
        included): every sampler uses them, and ``response_forward`` scores the filtered distribution."""
        return SamplingFilters.from_config(self.args)

    @property
    def unwrapped(self) -> nn.Module:
        """The policy/value module without DDP/DeepSpeed wrapping."""
        return self.accelerator.unwrap_model(self.model)

    def null_ref_context(self):
        """The policy as the reference: adapter disabled (or the named reference adapter), every
        ``requires_grad`` flag restored on exit (``models.assembly.reference_adapter``)."""
        return assembly.reference_adapter(self.unwrapped.policy, self.unwrapped.parameters(), self.ref_adapter_name,
                                 self.model_adapter_name)

    # ------------------------------------------------------------------ phases
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run PPO updates until ``num_total_batches``: rollout -> score -> advantages -> update
        -> log, then guards, KL control and checkpoints. Returns a ``TrainOutput`` (:meth:`train_output`).

        Args:
            resume_from_checkpoint: a checkpoint folder, or True for the latest complete one in
                ``output_dir``; restores models, optimizer, scheduler, RNG, data position, KL
                controller, guard counters and log history, so the run continues bit for bit.
        """
        self._begin_training(resume_from_checkpoint)
        status, reason = "completed", None
        loop = self.loop_state
        loop.sigterm = SigtermWatcher(self.args.on_sigterm)
        try:
            with loop.sigterm:
                status, reason = self._train_loop(loop)
        except KeyboardInterrupt:
            status, reason = "interrupted", "KeyboardInterrupt"
            raise
        except BaseException as err:
            status, reason = "failed", f"{type(err).__name__}: {err}"
            raise
        finally:
            self.close_engine()
            self._finish_manifest(status, reason)
        self.state.stop_reason = reason
        # Checkpoints were written at the end of each update that asked for one; none twice.
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        if status == PREEMPTED and self.args.on_sigterm == "save_and_exit":
            self.accelerator.print("Preempted (SIGTERM): checkpoint written, exiting with status 0.")
            raise SystemExit(0)
        return self.train_output()

    def train_output(self) -> TrainOutput:
        """What ``train()`` returns, as transformers' (and TRL GRPO's) ``Trainer.train`` does:
        ``TrainOutput(global_step, training_loss, metrics)``, ``training_loss`` the mean over this
        call's updates of each update's mean micro-batch loss, ``metrics`` transformers'
        ``train_runtime``, ``train_samples_per_second`` (episodes), ``train_steps_per_second``
        (updates) and ``train_loss``."""
        loop = self.loop_state
        updates = self.state.global_step - loop.start_step
        training_loss = loop.loss_total / max(updates, 1)
        metrics = speed_metrics("train", loop.start_time, num_samples=self.state.episode - loop.start_episode,
                                num_steps=updates)
        metrics["train_loss"] = training_loss
        return TrainOutput(self.state.global_step, training_loss, metrics)

    def _train_loop(self, loop: LoopState) -> tuple[str, str | None]:
        """Updates until ``state.max_steps`` (``num_total_batches``; fewer or more after resuming on
        another number of processes), a guard's halt or SIGTERM (``loop.sigterm``); ``(status, reason)``."""
        while self.state.global_step < self.state.max_steps:
            try:
                decision = self.run_update(self.state.global_step + 1)
            except UpdatePreempted as stop:  # between two optimizer steps: the update's remainder is saved
                loop.inflight = stop.inflight
                self._checkpoint_preempted(inflight=True)
                return PREEMPTED, PREEMPTED
            if decision.halt:
                self._halt(decision)
                return "halted", decision.message
            if self.state.global_step < self.state.max_steps and loop.sigterm.stop_agreed(self.accelerator):
                self._checkpoint_preempted(inflight=False)
                return PREEMPTED, PREEMPTED
        return "completed", None

    def run_update(self, update: int) -> GuardDecision:
        """One PPO update; returns the guards' decision (``halt`` ends the run)."""
        self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
        loop = self.loop_state
        if loop.resume_inflight is None:
            rollout = self.collect_rollout(update)
            if isinstance(rollout, GuardDecision):
                return rollout
            advantages = self.compute_advantages(rollout)
        else:  # the update a preempted run stopped in: its rollout, continued where it stopped
            rollout, advantages = self._resumed_rollout()
        applied, skipped = loop.applied_steps, self.counters.nonfinite_steps
        warming = critic_warmup.warming(self.args, self.counters)  # ppo_update reads the same
        update_stats, decision = self.ppo_update(rollout, advantages, update)
        if update_stats.get("loss") is not None and update_stats["loss"].numel():  # train()'s training_loss
            loop.loss_total += float(update_stats["loss"].mean())
        all_skipped = loop.applied_steps == applied and self.counters.nonfinite_steps > skipped
        metrics = self.update_metrics(rollout, advantages, update_stats)
        if self.args.critic_warmup_steps > 0:
            metrics["train/critic_warmup"] = float(warming)
            if warming:  # the metric is gathered: every process ends the warm-up at the same update
                critic_warmup.record_update(self.args, self.counters, metrics["val/explained_variance"])
        if self._evaluation_due(update):
            metrics.update(self.evaluate_heldout())
        if not decision.halt:
            decision = self.guards.check(metrics, update)
            for warning in decision.warnings if self.accelerator.is_main_process else ():  # same on every process
                logger.warning(warning)
        metrics.update({k: float(v) for k, v in decision.figures.items()})  # keys are "guard/<name>"
        if decision.halt:
            metrics["guard/halted"] = 1.0  # the update a guard stopped the run at is logged, whatever logging_steps
        metrics["objective/kl_coef"] = self.kl_controller.value
        if not (all_skipped or warming) and "objective/kl" in metrics:  # the policy moved, and a KL was measured
            self.kl_controller.update(metrics["objective/kl"], self.args.batch_size)
        self.log_update(metrics)
        if self.args.log_completions and log_due(self.state.global_step, self.state.max_steps,
                                                 self.state.logging_steps, self.args.logging_first_step):
            self.log_completions(rollout)
        if not decision.halt:
            self._end_update(update)
        return decision

    def log_completions(self, rollout: Rollout) -> None:
        """TRL GRPO's ``log_completions``: this rollout's rows (every process's) as the last user
        message, the completion and each reward, ``num_completions_to_print`` of them printed, the
        table to wandb (``metrics.completion_rows``, ``print_completion_rows``)."""
        rows = completion_rows(rollout, self.processing_class, [r.name for r in self.rewards],
                               gather_object=gather_object)
        if self.is_world_process_zero():
            print_completion_rows(rows, step=self.state.global_step, num_to_print=self.args.num_completions_to_print,
                                  report_to=self.args.report_to)

    def _begin_training(self, resume_from_checkpoint) -> None:
        args = self.args
        self.model.train()
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.episodes_per_epoch
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value) if value < 1 else value)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model
        path = self._resolve_resume_path(resume_from_checkpoint)
        if self.accelerator.is_main_process:
            clean_temp_dirs(args.output_dir)
        if path is not None:
            self._load_checkpoint(path)
        loop = self.loop_state
        loop.policy_version = self.state.global_step  # the weights now in the policy
        loop.batches = self._repeat_dataloader()
        self._write_manifest()
        # The pre-PPO starting point stays as last-known-good: never rotated away (resumed runs too).
        loop.protected_checkpoints.add(f"{ckpt.CHECKPOINT_PREFIX}0")
        if path is None and self._saves_checkpoints():
            self._save_checkpoint(self.model)
        loop.start_time = loop.last_update_time = time.time()
        loop.start_episode, loop.start_step, loop.loss_total = self.state.episode, self.state.global_step, 0.0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._restore_rng()  # last: anything above may draw random numbers

    def _saves_checkpoints(self) -> bool:
        return str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) != "no"

    def _repeat_dataloader(self):
        """Batches forever from the saved cursor (``data.repeat_batches``: exact resume)."""
        return repeat_batches(self.dataloader, self.counters)

    def produce_rollout(self) -> Rollout:
        """The next scored rollout: sampled now, or ahead in the background (``max_staleness > 0``)."""
        if self.args.max_staleness > 0:  # rollouts carry their policy_version (RolloutSampler.next_sample)
            feed = PromptFeed(self._repeat_dataloader, self.counters, self.repeated_prompts)
            return self.score_rollout(self.sampler.next_sample(feed, self.sampling_policy()))
        return self.score_rollout(self.generate_rollout(self.repeated_prompts(next(self.loop_state.batches))))

    def repeated_prompts(self, batch):
        """A prompt batch with each row ``num_generations`` times on adjacent rows (``data.repeat_prompts``;
        the group estimators read the copies of a prompt there, on this process)."""
        return batch if self.args.num_generations == 1 else repeat_prompts(batch, self.args.num_generations)

    def collect_rollout(self, update: int) -> Rollout | GuardDecision:
        """``produce_rollout``; a rollout older than ``max_rollout_age`` updates is discarded and
        its prompts regenerated with the current policy (the stale-rollout guard may halt)."""
        self.sampler.tool_stats = ToolLoopStats()
        rollout = self.produce_rollout()
        while True:
            age = self.state.global_step - rollout.policy_version
            if self.args.max_rollout_age is None or age <= self.args.max_rollout_age:
                self.guards.fresh_rollout(say_nonfinite_rewards(rollout, [r.name for r in self.rewards], update,
                                                                self.args.batch_size))
                self.counters.rollout_age = age
                return rollout
            logger.warning("Update %d: discarded a rollout sampled %d updates ago (max_rollout_age=%d); "
                           "regenerating it with the current policy.", update, age, self.args.max_rollout_age)
            decision = self.guards.stale_rollout(update)
            if decision.halt:
                return decision
            prompts = {"input_ids": rollout.queries, "attention_mask": rollout.query_mask, **rollout.extras}
            rollout = self.score_rollout(self.generate_rollout(prompts))

    def sampling_policy(self) -> PolicySnapshot:
        """The policy the next batch samples with: the model, the update it is for, its weights' version."""
        return PolicySnapshot(self.model, self.state.global_step, self.loop_state.policy_version)

    def generate_rollout(self, batch, temperature: float | None = None) -> SampledBatch:
        """Sample responses to a batch of prompts with the current policy at ``temperature`` (default:
        ``args.temperature``): ``sampling.RolloutSampler.sample``; ``score_rollout`` scores them."""
        return self.sampler.sample(batch, self.sampling_policy(), temperature)

    def generate_episodes(self, batch, temperature: float) -> SampledBatch:
        """A batch of episodes from the ``rollout_func`` (TRL 1.16 GRPO's contract: ``rollout_func(prompts,
        trainer)``) or the tool loop: ``sampling.RolloutSampler.sample_episodes``. The sampler's log-probs
        are kept as the engine's with ``use_vllm``; old log-probs, reference log-probs and values come from
        the trainer's own forwards over the whole sequence, so the first ratio is exactly 1 on the action tokens."""
        return self.sampler.sample_episodes(batch, self.sampling_policy(), temperature)

    def generate_continuations(self, prefixes: list[list[int]], max_new_tokens: int | list[int],
                               temperature: float | None = None, *, logprobs: bool | None = None,
                               ) -> tuple[list[list[int]], list[list[float]]]:
        """Continue token-id prefixes with the rollout's policy, for a ``rollout_func``'s turns, on the run's
        engine (vLLM with ``use_vllm``, else transformers' ``generate``) at ``temperature`` (default: the
        rollout's, ``args.temperature`` outside one), drawing from the run's RNG (``max_staleness > 0``: on the
        producer thread, at the batch's staged version, from the batch's seeds). ``logprobs``: False skips
        the policy forward that gives ``generate``'s log-probs (NaN then); None: the rollout's mode.
        Returns per row the new ids (through the first stop token) and their log-probs
        (``sampling.RolloutSampler.continue_prefixes``)."""
        return self.sampler.continue_prefixes(prefixes, max_new_tokens, temperature, logprobs=logprobs,
                                              policy=self.sampling_policy())

    def sample_with_engine(self, policy, queries, query_mask, temperature: float, max_tokens: int | None = None):
        """``(responses (B, T), engine_logprobs (B, T), sampled (B, T) bool)`` from the vLLM engine, the
        policy's weights pushed first when they changed (``sampling.RolloutSampler.sample_on_engine``)."""
        return self.sampler.sample_on_engine(policy, queries, query_mask, temperature,
                                             self.loop_state.policy_version,
                                             max_tokens)

    @torch.no_grad()
    def score_rollout(self, sample: SampledBatch) -> Rollout:
        """Old log-probs and values, reference log-probs and rewards of a sampled batch: once
        each, per chunk of ``scoring_chunk_size`` rows; only those the run reads
        (``self.scoring``, ``scoring_plan``): without a reference the old log-probs stand in for its
        (a KL of 0), and an on-policy critic-free update fills the old log-probs with its own first
        forward's (zeros until then).

        No ``(B, T, V)`` tensor is kept for the batch: log-probs are taken per forward chunk.
        Each frozen model is moved to the GPU once for all its chunks when offloaded.
        """
        sample = self.with_critic_context(sample)  # the critic's own prompts, before any chunk is cut
        chunks = self.scoring_chunks(sample)
        if self.scoring.old_logprobs:
            logprobs, values = (chunks.merge(x) for x in zip(*(
                self.policy_logprobs_and_values(self.unwrapped, p, i) for p, i in chunks)))
        else:  # on-policy: the update's own first forward gives pi_old (scoring_plan); a critic's pass alone V
            logprobs = values = torch.zeros(sample.responses.shape, device=sample.responses.device)
            if self.args.trains_critic:
                values = chunks.merge([self.critic_values(self.unwrapped, p, i) for p, i in chunks])
        ref_logprobs = logprobs  # nothing reads the reference: the KL to pi_old is exactly 0 and not logged
        if self.scoring.reference:
            with self._frozen_on_device(self.ref_model, self.args.offload_ref_model):
                ref_logprobs = chunks.merge([self.reference_logprobs(p, i) for p, i in chunks])
        if type(self).score_rewards is PPOTrainer.score_rewards:
            scores, reward_values, reward_applies, token_rewards = self.score_rewards_per_token(sample, chunks)
        else:  # a subclass's own score_rewards: sequence rewards, as before per-token rewards existed
            (scores, reward_values, reward_applies), token_rewards = self.score_rewards(sample, chunks), None
        return scored_rollout(
            sample, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
            scores=scores, reward_values=reward_values, reward_applies=reward_applies, token_rewards=token_rewards,
        )

    def scoring_chunks(self, sample: SampledBatch):
        """``rollout.forward_chunks`` of ``scoring_chunk_size`` rows (``PPOConfig.scoring_batch_size``), cut
        from length-sorted rows and trimmed to their extent as the config says; per-chunk results go
        back to batch order and width with ``chunks.merge``."""
        args = self.args
        return forward_chunks(sample, args.scoring_chunk_size, trim=args.trim_forwards,
                              group_by_length=args.group_by_length_in_batches)

    def with_critic_context(self, sample: SampledBatch) -> SampledBatch:
        """``sample`` with the critic's own prompts, each row's ``critic_context_column`` value before its
        prompt (``critic_context.with_critic_context``); ``sample`` itself when the field is None."""
        column = self.args.critic_context_column
        return sample if column is None else critic_context.with_critic_context(sample, self.processing_class, column)

    @torch.no_grad()
    def score_rewards(self, sample: SampledBatch, chunks: list | None = None):
        """Every reward of ``self.rewards`` on a sampled batch, and their weighted sum:
        ``(scores (B,) float32, values (B, F) float32, applies (B, F) bool)``, the first three of
        :meth:`score_rewards_per_token` (a per-token reward counts in ``values`` only)."""
        return self.score_rewards_per_token(sample, chunks)[:3]

    @torch.no_grad()
    def score_rewards_per_token(self, sample: SampledBatch, chunks: list | None = None):
        """Every reward of ``self.rewards`` on a sampled batch, once (``rewards.batch.score_batch_rewards``):
        ``(scores (B,), values (B, F), applies (B, F), token_rewards (B, T) or None)``; models chunk by chunk
        (``chunks``, made here when not given) through :meth:`reward_scores`, functions with
        :meth:`reward_function_kwargs`."""
        return score_batch_rewards(self.rewards, sample, chunks if chunks is not None else self.scoring_chunks(sample),
                                   self._reward_reader(), chunk_scores=self.reward_scores,
                                   function_kwargs=self.reward_function_kwargs, update=self.state.global_step + 1)

    def _reward_reader(self) -> RewardReader:
        """What ``rewards.batch`` reads of the run besides the batch."""
        return RewardReader(self.processing_class, self.accelerator.device, self.accelerator.autocast,
                            self.args.scoring_chunk_size, self.args.chat_template_kwargs,
                            self.args.offload_reward_model and not self.is_deepspeed_enabled, self.reward_model)

    def reward_text_scores(self, reward, sample: SampledBatch, kwargs: dict | None = None) -> torch.Tensor:
        """Raw scores ``(B,)`` of a reward model with its own tokenizer (``rewards.batch.text_scores``);
        ``kwargs``: the batch's :meth:`reward_function_kwargs` when already built."""
        return text_scores(reward, sample, self.reward_function_kwargs(sample) if kwargs is None else kwargs,
                           self._reward_reader())

    def reward_function_kwargs(self, rollout: SampledBatch) -> dict:
        """The keyword arguments of a reward function (TRL GRPO's convention): ``prompts``,
        ``completions``, ``completion_ids``, ``trainer_state`` and every other dataset column."""
        return reward_function_kwargs(self.processing_class, *valid_token_ids(rollout), rollout.extras, self.state,
                                      self.reward_logs.kwargs())

    def _frozen_on_device(self, model, offloaded: bool):
        """Bring an offloaded frozen model to the training device for one block."""
        if model is None or not offloaded or self.is_deepspeed_enabled:
            return nullcontext()
        return on_device(model, self.accelerator.device)

    def response_forward(self, model, part: SampledBatch, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``rollout.forward_responses`` in the trainer's precision and temperature: ``(logits
        (b, T, V), V(s_t) (b, T))``, the values from the critic's own sequence when ``part`` carries one
        (``critic_context_column``). Scoring and the update both call it."""
        return forward_responses(model, inputs, part.responses.shape[1], self.temperature, self.accelerator.autocast,
                                 value_inputs=critic_sequence_inputs(part),
                                 filters=SamplingFilters.from_config(self.args))

    def policy_logprobs_and_values(self, model, part: SampledBatch, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log pi(a_t|s_t), V(s_t))``, both ``(b, T)``."""
        logits, values = self.response_forward(model, part, inputs)
        return F.logprobs_from_logits(logits, part.valid_responses), values

    def critic_values(self, model, part: SampledBatch, inputs) -> torch.Tensor:
        """``V(s_t)`` ``(b, T)`` from the critic's own pass, without the policy's (a value model or a
        value adapter, ``models.values``): an on-policy update's scoring reads nothing else. ``inputs``
        are the policy's; the critic reads its own sequence instead when ``part`` carries one."""
        T = part.responses.shape[1]
        with self.accelerator.autocast():
            values = value_forward(model, *(critic_sequence_inputs(part) or inputs), keep=T + 1)
        return response_values(values, T)

    def reference_logprobs(self, part: SampledBatch, inputs) -> torch.Tensor:
        """``log pi_ref(a_t|s_t)`` ``(b, T)``: a separate reference model or the disabled adapter."""
        if self.ref_model is not None:
            ref, context = self.ref_model, nullcontext()
        else:
            ref, context = self.unwrapped.policy, self.null_ref_context()
        with context:
            return reference_response_logprobs(ref, part, inputs, self.temperature, self.accelerator.autocast,
                                               filters=SamplingFilters.from_config(self.args))

    def reward_scores(self, part: SampledBatch, inputs, model: nn.Module | None = None) -> torch.Tensor:
        """Raw score ``(b,)`` of a reward model (default ``self.reward_model``) read at the last
        valid response token (the EOS when present)."""
        model = model if model is not None else self.reward_model
        return reward_model_scores(model, part, inputs, self.accelerator.autocast)

    def compute_advantages(self, rollout: Rollout) -> PPOTargets:
        """The update's targets at the KL controller's current coefficient: the critic's GAE
        (``advantages.compute_targets``) or the configured ``advantage_estimator``
        (``estimators.estimator_targets``)."""
        return estimator_targets(rollout, kl_coef=self.kl_controller.value, **estimator_settings(self.args))

    def ppo_update(self, rollout: Rollout, adv: PPOTargets, update: int) -> tuple[dict, GuardDecision]:
        """``num_ppo_epochs`` passes over the rollout in shuffled mini-batches, then (``num_critic_epochs``)
        the value-only ones (``critic_epochs``); one optimizer step per mini-batch, skipped (no parameter
        changes) when its loss or gradient is not finite.

        Returns per-micro-batch statistics stacked as ``(n,)`` tensors (a value-only step's under
        ``critic_epochs.STATS_PREFIX``), and the nonfinite guard's decision (``halt`` stops the update at once).
        """
        loop = self.loop_state
        start, loop.resume_inflight = loop.resume_inflight, None  # set when resuming a preempted update
        stats = defaultdict(list, start.stats if start else {})
        decision = GuardDecision.keep_going({})
        slices = self.plan.mini_batch_slices()
        stepper, warming = self._stepper(), critic_warmup.warming(self.args, self.counters)
        tokens_only = replace(rollout, extras={})  # the loss reads no dataset column: no host index per micro-batch
        # what a preempted checkpoint keeps: live environment objects cannot be saved (nor loaded weights_only);
        # the tool loop's counts of this rollout can, so the resumed update logs its tools/* figures
        saved = replace(rollout, extras={k: v for k, v in rollout.extras.items() if k != "environments"})
        if self.agent_rollout is not None:
            saved.extras[INFLIGHT_TOOL_STATS] = asdict(self.sampler.tool_stats)
        epochs = critic_epochs.total_epochs(self.args)
        for epoch in range(start.epoch if start else 0, epochs):
            value_only = critic_epochs.is_value_only(epoch, self.args)
            resuming = start is not None and epoch == start.epoch and start.order is not None
            order = start.order if resuming else torch.randperm(rollout.batch_size, device=rollout.responses.device)
            for index in range(start.mini_batch if resuming else 0, len(slices)):
                stepped = mini_batch_step(
                    stepper, tokens_only, adv, order[slices[index]], stats, micro_batches=self.micro_batches,
                    loss_terms=self.compute_value_loss_terms if value_only else self.compute_loss_terms,
                    warming=warming, update=update, critic_only=value_only)
                decision = self._count_step(stepped, update, warming or value_only)
                if decision.halt:
                    return stack_stats(stats), decision
                stop_if_preempted(saved, adv, (epoch, index), order, stats, num_ppo_epochs=epochs,
                                  num_mini_batches=self.plan.num_mini_batches, rollout_age=self.counters.rollout_age,
                                  stop_agreed=lambda: loop.sigterm.stop_agreed(self.accelerator))
        return stack_stats(stats), decision

    def _resumed_rollout(self) -> tuple[Rollout, PPOTargets]:
        """The rollout and advantages of the update a preempted checkpoint stopped in."""
        inflight = self.loop_state.resume_inflight
        self.counters.rollout_age = inflight.rollout_age
        extras = dict(inflight.rollout.get("extras") or {})
        tool_stats = extras.pop(INFLIGHT_TOOL_STATS, None)
        if tool_stats is not None:  # the counts of the tool loops that sampled this rollout
            self.sampler.tool_stats = ToolLoopStats(**tool_stats)
        return Rollout(**{**inflight.rollout, "extras": extras}), PPOTargets(**inflight.advantages)

    def micro_batches(self, rollout: Rollout, mini: torch.Tensor) -> list[torch.Tensor]:
        """The rows ``(b_i,)`` of each micro-batch of the mini-batch ``mini`` (``update.plan_micro_batches``)."""
        return plan_micro_batches(rollout, mini, self.plan, self.accelerator,
                                  group_by_length=self.args.group_by_length_in_batches,
                                  max_tokens=self.args.max_tokens_per_micro_batch)

    def _stepper(self) -> Stepper:
        """What this update's optimizer steps act on (read now: a test or callback may swap the optimizer)."""
        return Stepper(self.accelerator, self.model, self.unwrapped, self.optimizer, self.plan, self.args.loss_type,
                       self.args.trim_forwards, self.args.max_grad_norm, self.is_deepspeed_enabled)

    def _count_step(self, stepped: bool | None, update: int, warming: bool) -> GuardDecision:
        """The guards' and the trainer's record of one mini-batch's step (``update.mini_batch_step``)."""
        if stepped is None:
            return GuardDecision.keep_going({})
        if not stepped:
            cause = self.guards.rollout_cause
            logger.warning("Update %d: skipped an optimizer step with a non-finite loss or gradient%s.", update,
                           f" ({cause})" if cause else "")
            return self.guards.nonfinite_step(update)
        self.loop_state.applied_steps += 1
        if not warming:  # the policy moved: the update ending now is its version
            self.loop_state.policy_version = self.state.global_step + 1
        self.guards.finite_step()
        return GuardDecision.keep_going({})

    def compute_loss_terms(
        self, mb: Rollout, adv: PPOTargets, num_tokens: torch.Tensor | None = None,
        num_sequences: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO loss on one micro-batch: clipped surrogate + vf_coef * clipped value loss
        - entropy_coef * entropy, every term over the rollout's ``loss_mask`` only (the policy's
        own tokens: ``response_mask``, or ``action_mask`` in an episode with turns).

        ``num_tokens``: the valid-token count the token sums are divided by (the whole
        mini-batch's over every process, see ``functional.masked_token_mean``); None: this
        micro-batch's own; ``num_sequences`` likewise the sequence count ``loss_type`` "grpo" and
        "dr_grpo" divide by (passed by keyword, and only for those two: an override need not
        take it unless it runs them). The forward is here; the composition is ``losses.ppo_loss``, whose
        statistics are this micro-batch's own figures.
        """
        inputs = sequence_inputs(mb.queries, mb.query_mask, mb.responses, mb.response_mask)
        resp_logits, new_values = self.response_forward(self.model, mb, inputs)  # through DDP: grads sync
        if mb.reward_applies is not None and mb.reward_applies.shape[1] and self.args.trains_critic:
            # a row no reward applies to has no value target (its returns are its old values): no value gradient
            new_values = torch.where(mb.reward_applies.any(dim=1)[:, None], new_values, new_values.detach())
        new_logprobs = F.logprobs_from_logits(resp_logits, mb.valid_responses)
        weights = None if mb.engine_logprobs is None else self.sampling_weights(mb)  # sampled by vLLM
        settings = loss_settings(self.args)
        if not self.args.trains_critic:  # no critic: its values are zeros without a graph, and no value loss counts
            settings["vf_coef"] = 0.0
        old_logprobs = mb.logprobs
        if not self.scoring.old_logprobs:  # on-policy: this first forward is pi_old, so the ratio is exactly 1
            old_logprobs = new_logprobs.detach().masked_fill(~mb.response_mask, 0.0)
        loss, stats = ppo_loss(
            new_logprobs, resp_logits, new_values, old_logprobs=old_logprobs, old_values=mb.values,
            advantages=adv.advantages, returns=adv.returns, response_mask=mb.loss_mask, num_tokens=num_tokens,
            pg_weights=weights, num_sequences=num_sequences, max_completion_length=self.args.response_length,
            **settings,
        )
        if not self.scoring.old_logprobs:
            stats[FIRST_LOGPROBS] = old_logprobs  # for the rollout's metrics (see update.mini_batch_step)
        return loss, stats

    def compute_value_loss_terms(
        self, mb: Rollout, adv: PPOTargets, num_tokens: torch.Tensor | None = None,
        num_sequences: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of a critic epoch's value-only step on one micro-batch (``num_critic_epochs``):
        ``vf_coef *`` the clipped value loss over ``loss_mask`` (``losses.value_only_loss``), the values
        from :meth:`critic_forward`; ``num_tokens`` as in :meth:`compute_loss_terms` (``num_sequences``
        is accepted and not read: the value loss is a token mean)."""
        new_values = self.critic_forward(mb)
        if mb.reward_applies is not None and mb.reward_applies.shape[1]:
            # a row no reward applies to has no value target (its returns are its old values): no value gradient
            new_values = torch.where(mb.reward_applies.any(dim=1)[:, None], new_values, new_values.detach())
        return value_only_loss(new_values, old_values=mb.values, returns=adv.returns, response_mask=mb.loss_mask,
                               cliprange_value=self.args.cliprange_value, vf_coef=self.args.vf_coef,
                               num_tokens=num_tokens)

    def critic_forward(self, mb: Rollout) -> torch.Tensor:
        """``V(s_t)`` ``(b, T)``, with its graph, for a value-only step: the critic's own pass where the
        layout has one (a value model, a value adapter, a branch critic: :meth:`critic_values`), else the
        shared value head's, which reads the policy's whole pass (its logits unused)."""
        inputs = sequence_inputs(mb.queries, mb.query_mask, mb.responses, mb.response_mask)
        if has_values_alone(self.unwrapped):
            return self.critic_values(self.unwrapped, mb, inputs)
        return self.response_forward(self.unwrapped, mb, inputs)[1]

    def sampling_weights(self, mb: Rollout) -> torch.Tensor | None:
        """The truncated importance weights ``pi_old / pi_engine`` of a micro-batch sampled by vLLM
        (``vllm_importance_sampling_correction``; ``(b, T)`` token modes, ``(b, 1)`` sequence
        modes), or None. Each row's weight depends on that row alone, so cutting the rollout
        into micro-batches gives the weights of the whole rollout."""
        return sampling_weights(mb.logprobs, mb.engine_logprobs, mb.loss_mask, self.args)

    @torch.no_grad()
    def update_metrics(self, rollout: Rollout, adv: PPOTargets, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """This update's statistics over every process, the per-reward columns and the run's counters
        (``metrics.logged_update_metrics``)."""
        return {**logged_update_metrics(
            rollout, adv, stats, self.args, gather=self.accelerator.gather, device=self.accelerator.device,
            reference=self.scoring.reference, reward_names=[r.name for r in self.rewards], counters=self.counters,
            reward_logs=self._take_reward_logs, tool_stats=self.sampler.tool_stats if self.agent_rollout else None),
            **self.sampler.async_metrics(rollout)}  # async/*, off_policy/*: none when synchronous

    def _tool_metrics(self) -> dict[str, float]:
        """The tool loops' figures of this update, summed over every process (``metrics.tool_loop_metrics``)."""
        return tool_loop_metrics(self.sampler.tool_stats, gather=self.accelerator.gather,
                                 device=self.accelerator.device)

    def _take_reward_logs(self, logs: RewardLogs | None = None) -> dict[str, float]:
        """What reward functions passed to ``log_metric`` since the last call (into ``logs``,
        default ``self.reward_logs``), each name the mean over every process; their ``log_extra``
        columns are dropped (no table of training completions)."""
        logs = self.reward_logs if logs is None else logs
        logs.clear_columns()
        device = self.accelerator.device
        return logs.take_metrics(gather_object,
                                 lambda rows: self.accelerator.reduce(rows.to(device), reduction="sum").cpu())

    def _reward_metrics(self, rollout: Rollout) -> dict[str, float]:
        """``rewards/<name>/mean`` and ``/std`` (``metrics.rollout_reward_metrics``)."""
        return rollout_reward_metrics(rollout, [r.name for r in self.rewards], gather=self.accelerator.gather)

    def log_update(self, metrics: dict[str, float]) -> None:
        """Advance the step/episode counters and log ``metrics`` (plus lr, eps, episode)."""
        self.state.episode += self.args.batch_size
        loop = self.loop_state
        elapsed = max(time.time() - loop.start_time, 1e-9)
        previous = loop.last_update_time
        metrics["eps"] = int((self.state.episode - loop.start_episode) / elapsed)
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        self.state.epoch = self.state.episode / self.episodes_per_epoch
        self.state.global_step += 1
        now = loop.last_update_time = time.time()
        self.state.num_input_tokens_seen += int(metrics.get("val/num_tokens", 0))  # GRPO's num_tokens
        metrics.update(grpo_metrics(metrics, num_tokens_seen=self.state.num_input_tokens_seen,
                                    step_time=now - previous))
        # an evaluation, and the update a guard halted at, are never dropped
        kept = "guard/halted" in metrics or any(key.startswith("eval/") for key in metrics)
        if kept or log_due(self.state.global_step, self.state.max_steps, self.state.logging_steps,
                               self.args.logging_first_step):
            self.log(metrics)
            if self.is_world_process_zero():
                tqdm.write(console_line(metrics, update=self.state.global_step, total=self.state.max_steps,
                                        seconds=now - previous))

    def _end_update(self, update: int) -> None:
        self.lr_scheduler.step()
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        saved = self.control.should_save
        self.sampler.end_update(self.sampling_policy(), checkpoint=saved)  # async: new weights; in-flight redone
        if saved:
            self._save_checkpoint(self.model, trial=None)
        # The checkpoint holds the RNG state as of now: what runs after it (callbacks, the
        # completions table) draws in its own stream, or a resumed run would sample differently.
        with ckpt.isolated_rng():
            if saved:
                self.control = self.callback_handler.on_save(self.args, self.state, self.control)
            if self.args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.generate_completions(sampling=True)

    def _halt(self, decision: GuardDecision) -> None:
        """A guard fired: no further optimizer step; checkpoint the current state next to (never
        over) the last good one, record why, and say so."""
        self.state.stop_reason = decision.message
        self.state.halted_by = decision.guard
        if self._saves_checkpoints():
            name = f"{ckpt.CHECKPOINT_PREFIX}{self.state.global_step}-halted"
            self.loop_state.protected_checkpoints.add(name)
            self._save_checkpoint(self.model, folder_name=name)
        if self.accelerator.is_main_process:  # every process took the same decision on gathered metrics
            logger.warning("PPO run halted by guard %r: %s", decision.guard, decision.message)

    def _evaluation_due(self, update: int) -> bool:
        strategy = str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy))
        steps = getattr(self.state, "eval_steps", None)
        return self.eval_dataloader is not None and strategy == "steps" and bool(steps) and update % steps == 0

    @torch.no_grad()
    def evaluate_heldout(self) -> dict[str, float]:
        """Sample completions for ``eval_dataset`` with a fixed seed (training RNG untouched) and
        compute ``eval/rm_score``, ``eval/response_length``, ``eval/kl`` (the configured
        ``kl_estimator``, summed over each response) and each user metric
        ``eval/<name>`` from ``eval_metrics`` callables ``(prompts, completions) -> list[float]``
        (prompts decoded without special tokens; completions with them, e.g. a final EOS).

        Each prompt counts once: rows that accelerate repeats to give every process an equal
        share of the last batch are dropped (``gather_for_metrics``).
        """
        device = self.accelerator.device
        with ckpt.isolated_rng(seed=self.args.seed), self._own_reward_logs() as logs:
            metrics = heldout_metrics(
                (self.score_rollout(self.generate_rollout(batch)) for batch in self.eval_dataloader), self.rewards,
                self.args.kl_estimator, reference=self.scoring.reference, eval_metrics=self.eval_metrics,
                tokenizer=self.processing_class, gather=lambda t: self.accelerator.gather_for_metrics(t.to(device)))
            logged = self._take_reward_logs(logs)
        return {**metrics, **{f"eval/{name}": value for name, value in logged.items()}}

    @contextmanager
    def _own_reward_logs(self):
        """Reward functions log into a fresh ``RewardLogs`` inside the block (evaluation, the
        completions table): what they report there stays out of the training metrics."""
        training, self.reward_logs = self.reward_logs, RewardLogs()
        try:
            yield self.reward_logs
        finally:
            self.reward_logs = training

    # ------------------------------------------------------------------ outputs
    @torch.no_grad()
    def generate_completions(self, sampling: bool = False):
        """Sample completions for ``eval_dataset`` at low temperature, score them, print a table.

        Returns a ``pandas.DataFrame`` with ``query``, ``model response`` and ``score`` columns
        (gathered from every process), or None without an eval dataset. Draws in its own RNG
        stream (seeded by the process's seed and the step): the training stream is untouched.
        """
        if self.eval_dataloader is None:
            return None
        with ckpt.isolated_rng(seed=self.local_seed + self.state.global_step), self._own_reward_logs() as logs:
            df = completions_table(  # near-greedy, as TRL
                self.eval_dataloader, lambda batch: self.generate_rollout(batch, temperature=0.01),
                lambda rollout: self.score_rewards(rollout)[0], self.processing_class, logs,
                gather=self.accelerator.gather_for_metrics, gather_object=gather_object, first_only=sampling)
        if self.accelerator.is_main_process:
            show_completions(df, self.args.report_to)
        return df


def _call_rollout_func(rollout_func, trainer: PPOTrainer, prompts: list):
    """TRL GRPO's call: ``rollout_func(prompts, trainer)``."""
    return rollout_func(prompts, trainer)


def seed_construction(args) -> None:
    """Seed every RNG with ``args.seed`` (with ``full_determinism``, deterministic kernels too), as
    transformers' ``Trainer`` does in its constructor: what the trainer builds after it -- a
    critic's new value head, a LoRA adapter's first weights, a model loaded from a name -- is the
    same for one seed whatever the script drew before."""
    (enable_full_determinism if args.full_determinism else set_seed)(args.seed)
