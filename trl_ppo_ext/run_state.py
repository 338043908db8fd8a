"""Checkpoints that resume exactly, and the run manifest: the trainer's persistence.

A checkpoint ``<output_dir>/checkpoint-<step>`` holds, written atomically (temp folder, then
rename; see ``checkpoint.atomic_checkpoint_dir``):

- the inference export of ``save_model`` (policy or adapter, value head when shared);
- ``trainable_state.pt``: every trainable parameter of the policy/value module (exact;
  gathered from the shards under ZeRO-3);
- ``optimizer.pt``, or under DeepSpeed ``deepspeed/``: DeepSpeed's own checkpoint, whose
  optimizer state (and fp32 master weights) each process writes for its shard; ``scheduler.pt``;
- ``ppo_state.json``: KL controller, guard counters, data cursor (epoch, batches consumed),
  the number of processes and the optimizer's format;
- ``rng_state_<process>.pth``: Python, NumPy, torch CPU/CUDA generators of each process;
- ``inflight_update_<process>.pt`` only in ``checkpoint-<step>-preempted``: the update a
  SIGTERM interrupted (see ``preemption.InflightUpdate``);
- ``trainer_state.json`` (written last: its presence marks a complete checkpoint) with the
  global step, episode count and log history.

A checkpoint resumes bit for bit on the same number of processes. On another number it
resumes with a warning (weights, optimizer, scheduler, KL controller and counters carry
over; data order and random streams are re-derived), except under DeepSpeed, whose optimizer
shards belong to their process count.

``CheckpointMixin`` is mixed into ``PPOTrainer``; it reads the trainer's attributes
(``accelerator``, ``optimizer``, ``lr_scheduler``, ``kl_controller``, ``guards``, ``state``,
``counters``). The PPO run's own counters are one :class:`RunCounters`, saved as a unit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import random
import re

import torch

from . import checkpoint as ckpt
from . import manifest as mf
from .distributed import full_state, zero_stage
from .preemption import InflightUpdate, inflight_filename

logger = logging.getLogger(__name__)

TRAINABLE_STATE = "trainable_state.pt"
OPTIMIZER = "optimizer.pt"
DEEPSPEED_STATE = "deepspeed"  # DeepSpeed's checkpoint tag (a folder) inside a checkpoint
SCHEDULER = "scheduler.pt"
PPO_STATE = "ppo_state.json"
# The optimizer's state is optimizer.pt or deepspeed/ (ppo_state.json says which), checked on load.
CHECKPOINT_FILES = (ckpt.COMPLETE_MARKER, PPO_STATE, TRAINABLE_STATE)


@dataclasses.dataclass
class RunCounters:
    """What a PPO run counts beyond ``TrainerState`` (global step, episode): where it is in the
    data and how many things went wrong. Saved in ``ppo_state.json`` as a unit and restored
    before the first resumed update."""

    epoch: int = 0  # the data epoch the next batch comes from
    batches: int = 0  # batches of that epoch already consumed (the next one is skipped to on resume)
    stale_discarded: int = 0  # rollouts discarded for being older than max_rollout_age, in total
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient, in total
    rollout_age: int = 0  # updates between sampling the current rollout and training on it (policy lag)

    def state_dict(self) -> dict:
        """``{"data_cursor": {epoch, batches}, "counters": {...}}``, the keys ``ppo_state.json``
        has always used (checkpoints written before this class resume unchanged)."""
        return {
            "data_cursor": {"epoch": self.epoch, "batches": self.batches},
            "counters": {"stale_discarded": self.stale_discarded, "nonfinite_steps": self.nonfinite_steps,
                         "rollout_age": self.rollout_age},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`'s form; ``rollout_age`` defaults to 0 (older files)."""
        cursor, counters = state["data_cursor"], state["counters"]
        self.epoch, self.batches = int(cursor["epoch"]), int(cursor["batches"])
        self.stale_discarded = int(counters["stale_discarded"])
        self.nonfinite_steps = int(counters["nonfinite_steps"])
        self.rollout_age = int(counters.get("rollout_age", 0))


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects beyond tensors and plain data; it was not loaded."""


def load_checkpoint_file(path: str, name: str):
    """``torch.load`` of one file of a checkpoint with ``weights_only=True``: tensors, numbers,
    strings and containers of them (all that the trainer's optimizer, scheduler and weights
    states hold), never an arbitrary pickled object, whose loading could run any code.

    Raises:
        UnsafeCheckpointError: the file holds other objects (nothing in it was run).
    """
    file = os.path.join(path, name)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found is None:  # not a refused object but a damaged file: the caller says so, in one line
            detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
            raise pickle.UnpicklingError(f"{name}: {detail.group(1) if detail else str(err).splitlines()[0]}") from None
        raise UnsafeCheckpointError(
            f"Checkpoint file {file!r} holds pickled objects other than tensors and plain data (here "
            f"{found.group(1)}), which trl_ppo_ext never writes; it was not loaded (weights_only=True), as loading it "
            "could run arbitrary code. Resume only from checkpoints written by trl_ppo_ext that you trust."
        ) from None


def _setup_name(optimizer_format: str, stage: int | None) -> str:
    """How a run keeps its optimizer state, in words: "under DeepSpeed ZeRO-2", "without DeepSpeed"."""
    return f"under DeepSpeed ZeRO-{stage}" if optimizer_format == DEEPSPEED_STATE else "without DeepSpeed"


class CheckpointMixin:
    """Save and restore everything a PPO run needs to continue bit for bit."""

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model=None, trial=None, folder_name: str | None = None) -> str:
        """Write ``checkpoint-<global_step>`` (or ``folder_name``) atomically; returns its path."""
        step = self.state.global_step
        final = os.path.join(self.args.output_dir, folder_name or f"{ckpt.CHECKPOINT_PREFIX}{step}")
        is_main = self.accelerator.is_main_process
        self.store_flos()
        if is_main:  # as TRL does: the model card in output_dir follows the checkpoints
            self._write_model_card()
        # Every process writes into one temp folder (shared suffix); the main process renames it.
        suffix = str(step) if self.accelerator.num_processes > 1 else None
        with ckpt.atomic_checkpoint_dir(final, suffix=suffix, commit=is_main) as tmp:
            self.save_model(tmp, _internal_call=True)
            self._save_training_state(tmp)  # every process: ZeRO gathers and DeepSpeed's save are collective
            ckpt.save_rng_state(tmp, self.accelerator.process_index)
            if getattr(self, "_inflight", None) is not None:
                self._inflight.save(os.path.join(tmp, inflight_filename(self.accelerator.process_index)))
            self.accelerator.wait_for_everyone()
            if is_main:
                self.state.save_to_json(os.path.join(tmp, ckpt.COMPLETE_MARKER))
        self.accelerator.wait_for_everyone()
        if is_main and folder_name is None:
            ckpt.rotate_checkpoints(
                self.args.output_dir, self.args.save_total_limit, keep=self._protected_checkpoints,
                required_files=CHECKPOINT_FILES,
            )
        self._last_checkpoint = (step, final)
        return final

    def _write_model_card(self) -> None:
        """TRL's model card, written with the unwrapped model: it reads ``self.model.config``,
        which DDP's wrapper does not pass through (checkpoints on several processes failed)."""
        name = (self.args.hub_model_id or os.path.basename(os.path.normpath(self.args.output_dir))).split("/")[-1]
        wrapped, self.model = self.model, self.accelerator.unwrap_model(self.model)
        try:
            self.create_model_card(model_name=name)
        finally:
            self.model = wrapped

    def _record_stop_in_checkpoint(self, path: str) -> None:
        """Rewrite a complete checkpoint's ``trainer_state.json`` from the current state (e.g. its
        ``stop_reason``), atomically: a preemption right after a save need not save again."""
        if self.accelerator.is_main_process:
            ckpt.save_json(os.path.join(path, ckpt.COMPLETE_MARKER), dataclasses.asdict(self.state))
        self.accelerator.wait_for_everyone()

    def _save_training_state(self, directory: str) -> None:
        """Trainable weights, optimizer, scheduler and PPO state. Every process calls it: under
        ZeRO-3 the weights are gathered (one parameter at a time) and under DeepSpeed each
        process writes its optimizer shard; the main process writes the rest."""
        is_main = self.accelerator.is_main_process
        unwrapped = self.accelerator.unwrap_model(self.model)
        trainable = full_state(((k, v) for k, v in unwrapped.named_parameters() if v.requires_grad), keep=is_main)
        if self.is_deepspeed_enabled:
            self.model.save_checkpoint(directory, tag=DEEPSPEED_STATE, save_latest=False,
                                       exclude_frozen_parameters=True)
        if not is_main:
            return
        torch.save(trainable, os.path.join(directory, TRAINABLE_STATE))
        if not self.is_deepspeed_enabled:
            torch.save(self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(directory, SCHEDULER))
        ckpt.save_json(os.path.join(directory, PPO_STATE), {
            "kl_controller": self.kl_controller.state_dict(),
            "guards": self.guards.state_dict(),
            **self.counters.state_dict(),
            "world_size": self.accelerator.num_processes,
            "batch_size": self.args.batch_size,
            "optimizer_format": DEEPSPEED_STATE if self.is_deepspeed_enabled else "torch",
            "zero_stage": zero_stage(self.accelerator),
        })

    # ------------------------------------------------------------------ resume
    def _resolve_resume_path(self, resume_from_checkpoint) -> str | None:
        if resume_from_checkpoint in (None, False):
            return None
        if resume_from_checkpoint is True:
            path = ckpt.latest_checkpoint(self.args.output_dir, CHECKPOINT_FILES)
            if path is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but {self.args.output_dir!r} holds no complete checkpoint "
                    f"(a checkpoint-<step> folder with {list(CHECKPOINT_FILES)}). Start without resuming, or pass "
                    "the path of a checkpoint."
                )
            return path
        ckpt.validate_checkpoint(resume_from_checkpoint, CHECKPOINT_FILES)
        return str(resume_from_checkpoint)

    def _load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, scheduler, PPO state and trainer state (RNG comes last,
        in ``_restore_rng``, right before the first resumed update)."""
        try:
            ppo_state = ckpt.load_json(os.path.join(path, PPO_STATE))
            trainable = load_checkpoint_file(path, TRAINABLE_STATE)
            optimizer_state = None
            if ppo_state.get("optimizer_format", "torch") == "torch":
                optimizer_state = load_checkpoint_file(path, OPTIMIZER)
            scheduler_state = load_checkpoint_file(path, SCHEDULER)
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # torch/pickle/json raise many kinds for a damaged file
            raise ValueError(
                f"Checkpoint {path!r} could not be read ({type(err).__name__}: {err}). It is damaged or was not "
                "written by trl_ppo_ext; resume from another checkpoint or start a new run."
            ) from err
        exact = self._check_resume_topology(path, ppo_state)
        unwrapped = self.accelerator.unwrap_model(self.model)
        params = dict(unwrapped.named_parameters())
        missing = [k for k, p in params.items() if p.requires_grad and k not in trainable]
        if missing:
            raise ValueError(
                f"Checkpoint {path!r} does not match this model: {len(missing)} trainable parameter(s) are missing "
                f"(first: {missing[0]!r}). Resume with the same model set-up (LoRA config, shared or separate value)."
            )
        if self.is_deepspeed_enabled:
            self._load_deepspeed_state(path)  # weights (with fp32 masters) and optimizer shards
        else:
            with torch.no_grad():
                for name, value in trainable.items():
                    params[name].copy_(value.to(params[name].device))
            self.optimizer.load_state_dict(optimizer_state)
        self.lr_scheduler.load_state_dict(scheduler_state)
        self.kl_controller.load_state_dict(ppo_state["kl_controller"])
        self.guards.load_state_dict(ppo_state["guards"])
        self.counters.load_state_dict(ppo_state)
        if not exact:
            self.counters.batches = self._rederive_batches(ppo_state)
        self._load_inflight(path, exact)
        resumed = type(self.state).load_from_json(os.path.join(path, ckpt.COMPLETE_MARKER))
        for field_name in ("global_step", "episode", "log_history", "epoch", "total_flos"):
            setattr(self.state, field_name, getattr(resumed, field_name))
        if not exact:  # updates now hold another number of episodes: the run still ends at total_episodes
            remaining = max(0, self.args.total_episodes - self.state.episode)
            self.state.max_steps = self.state.global_step + math.ceil(remaining / self.args.batch_size)
        self._resume_path, self._resume_exact = path, exact

    def _check_resume_topology(self, path: str, ppo_state: dict) -> bool:
        """Whether the checkpoint resumes bit for bit here (same number of processes).

        Raises ``ValueError`` where it cannot resume at all: DeepSpeed's optimizer shards read by
        a run without DeepSpeed (or the reverse), by another ZeRO stage or another process count.
        """
        saved_world, world = ppo_state.get("world_size"), self.accelerator.num_processes
        saved_format = ppo_state.get("optimizer_format", "torch")
        here = DEEPSPEED_STATE if self.is_deepspeed_enabled else "torch"
        saved_setup = _setup_name(saved_format, ppo_state.get("zero_stage"))
        setup = _setup_name(here, zero_stage(self.accelerator))
        if saved_setup != setup:
            raise ValueError(
                f"Checkpoint {path!r} was written {saved_setup} and this run runs {setup}: the optimizer state is "
                "stored differently. Resume with the accelerate config the checkpoint was written with."
            )
        if saved_world == world:
            return True
        if here == DEEPSPEED_STATE:
            raise ValueError(
                f"Checkpoint {path!r} was written by {saved_world} DeepSpeed process(es) and this run has {world}: "
                "ZeRO's optimizer state is sharded by process count. Resume with --num_processes "
                f"{saved_world}."
            )
        logger.warning(
            "Checkpoint %r was written by %s process(es) and this run has %d: resuming with its trainable weights, "
            "optimizer state, scheduler, KL controller and counters, but NOT bit-exact: the data order within the "
            "epoch and every random stream are re-derived for %d process(es).", path, saved_world, world, world,
        )
        return False

    def _rederive_batches(self, ppo_state: dict) -> int:
        """Batches consumed in the saved epoch, for another process count: up to the first batch
        that starts at or after the prompts the checkpoint had consumed (a few may be skipped,
        none repeated)."""
        saved_batch = ppo_state.get("batch_size") or self.plan.local_batch_size * ppo_state["world_size"]
        consumed = ppo_state["data_cursor"]["batches"] * saved_batch
        return math.ceil(consumed / self.plan.batch_size)

    def _load_deepspeed_state(self, path: str) -> None:
        """DeepSpeed's own checkpoint: module weights, fp32 masters and this process's optimizer shard."""
        loaded, _ = self.model.load_checkpoint(path, tag=DEEPSPEED_STATE, load_module_strict=False,
                                               load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise ValueError(
                f"Checkpoint {path!r} has no readable DeepSpeed state in {DEEPSPEED_STATE}/ for process "
                f"{self.accelerator.process_index}; it is incomplete or damaged. Resume from another checkpoint."
            )

    def _load_inflight(self, path: str, exact: bool) -> None:
        """The update a preempted checkpoint stopped in, continued by the first resumed update."""
        self._resume_inflight = None
        file = os.path.join(path, inflight_filename(self.accelerator.process_index))
        if not os.path.exists(file):
            return
        if not exact:
            logger.warning("Checkpoint %r stopped inside an update; with another number of processes its "
                           "remaining optimizer steps are dropped and a new update starts.", path)
            return
        self._resume_inflight = InflightUpdate.load(file, self.accelerator.device)

    def _restore_rng(self) -> None:
        """Every random generator as the checkpoint left it; re-seeded (from the seed, the process
        and the step) when the checkpoint came from another number of processes."""
        if not getattr(self, "_resume_path", None):
            return
        if getattr(self, "_resume_exact", True):
            ckpt.load_rng_state(self._resume_path, self.accelerator.process_index)
            return
        import numpy as np

        seed = self.local_seed + 7919 * self.state.global_step
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ manifest
    def _manifest_path(self) -> str:
        return mf.manifest_path(self.args.output_dir)

    def _write_manifest(self) -> None:
        if not self.accelerator.is_main_process:
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        shared = getattr(unwrapped, "is_actor_critic", False)
        models = {"policy": mf.model_identity(unwrapped.policy, "policy")}
        if self.ref_model is None:
            models["reference"] = {"role": "reference", "same_as": "policy with its adapter disabled",
                                   "shared_with": ["policy"]}
        else:
            models["reference"] = mf.model_identity(self.ref_model, "reference")
        value = unwrapped if shared else unwrapped.value_model
        models["value"] = mf.model_identity(value, "value", shared_with=["policy"] if shared else ())
        if self.reward_model is not None:
            models["reward"] = mf.model_identity(self.reward_model, "reward")
        rewards = [
            {"name": r.name, "weight": r.weight, "kind": "model" if r.is_model else "function",
             **({} if r.is_model else {"qualname": getattr(r.source, "__qualname__", type(r.source).__name__),
                                        "module": getattr(r.source, "__module__", None)})}
            for r in self.rewards
        ]
        for r in self.rewards[1 if self.reward_model is not None else 0:]:
            if r.is_model:
                models[f"reward:{r.name}"] = mf.model_identity(r.source, "reward")
        generation = {
            "response_length": self.args.response_length, "temperature": self.args.temperature, "top_k": 0,
            "top_p": 1.0, "stop_token_id": self.stop_token_id, "stop_token_ids": list(self.stop_token_ids),
            "pad_token_id": self.processing_class.pad_token_id,
        }
        hyper = self.args.to_dict()
        hyper.update(kl_controller=self.kl_controller.state_dict(), resumed_from=getattr(self, "_resume_path", None),
                     rewards=rewards)
        os.makedirs(self.args.output_dir, exist_ok=True)
        mf.write_manifest(self._manifest_path(), mf.build_manifest(
            models=models, tokenizer=self.processing_class, train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset, generation=generation, hyperparameters=hyper, seed=self.args.seed,
            environment=mf.environment_identity(self.accelerator),
        ))

    def _finish_manifest(self, status: str, reason: str | None) -> None:
        if self.accelerator.is_main_process and os.path.exists(self._manifest_path()):
            mf.finish_manifest(self._manifest_path(), reason, status)
