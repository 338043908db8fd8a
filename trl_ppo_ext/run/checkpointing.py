"""Everything that saves and loads a PPO run: atomic checkpoint folders, exact resume, the
RNG streams, preempted checkpoints and ``save_model``.

**The checkpoint.** ``<output_dir>/checkpoint-<step>`` holds:

- the inference export of ``save_model`` (policy or adapter, value head when shared);
- ``trainable_state.pt``: every trainable parameter of the policy/value module (exact;
  gathered from the shards under ZeRO-3);
- ``optimizer.pt`` (gathered from the shards under FSDP2: the same file as without), or under
  DeepSpeed ``deepspeed/``: DeepSpeed's own checkpoint, whose optimizer state (and fp32 master
  weights) each process writes for its shard; ``scheduler.pt``;
- ``ppo_state.json``: KL controller, guard counters, the run's counters
  (``run_state.RunCounters``: data cursor, skipped steps...), the number of processes and
  the optimizer's format;
- ``rng_state_<process>.pth``: Python, NumPy, torch CPU/CUDA generators of each process;
- ``inflight_update_<process>.pt`` only in ``checkpoint-<step>-preempted``: the update a
  SIGTERM interrupted (see ``preemption.InflightUpdate``);
- ``trainer_state.json`` (written last: its presence marks a complete checkpoint) with the
  global step, episode count and log history.

A checkpoint resumes bit for bit on the same number of processes. On another number it
resumes with a warning (weights, optimizer, scheduler, KL controller and counters carry
over; data order and random streams are re-derived), except under DeepSpeed, whose optimizer
shards belong to their process count. Files are read with ``torch.load(weights_only=True)``
(:func:`load_checkpoint_file`).

**Atomic folders.** A checkpoint is written into a hidden temporary folder next to it
(``.tmp-checkpoint-<step>-<random>``) and renamed into place only when everything in it was
written (:func:`atomic_checkpoint_dir`), so a crash, an exception or a ``SIGKILL`` mid-save
leaves the previous checkpoints intact and at most a hidden temporary folder behind
(:func:`clean_temp_dirs` removes those). A checkpoint also counts as complete only when it
holds its ``required_files`` (:data:`REQUIRED_FILES`), which keeps checkpoints written
non-atomically by other code from being resumed half-written.

**RNG.** :func:`capture_rng_state`/:func:`restore_rng_state` cover Python ``random``,
NumPy's global generator, torch's CPU generator and every CUDA device's generator, in a
format that loads with ``weights_only=True``. :func:`isolated_rng` runs a block in its own
streams: every random draw outside the training stream (completions table, held-out
evaluation, callbacks after a save) goes through it, so a checkpoint's RNG state stays the
one the training stream continues from.

**The trainer's part.** :class:`CheckpointMixin` is mixed into ``PPOTrainer``: saving and
resuming (``_save_checkpoint``, ``_load_checkpoint``, ``_restore_rng``), the checkpoint of a
preempted run (``_checkpoint_preempted``) and the ``save_model`` family. It reads the
trainer's attributes (``accelerator``, ``optimizer``, ``lr_scheduler``, ``kl_controller``,
``guards``, ``state``, ``counters``, ``args``).

Example:

>>> import os, tempfile
>>> from trl_ppo_ext.run.checkpointing import atomic_checkpoint_dir, latest_checkpoint, save_json
>>> out = tempfile.mkdtemp()
>>> with atomic_checkpoint_dir(os.path.join(out, "checkpoint-3")) as folder:
...     save_json(os.path.join(folder, "trainer_state.json"), {"global_step": 3})
>>> os.path.basename(latest_checkpoint(out))
'checkpoint-3'
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from .._utils import TEMP_PREFIX, fsync_dir, load_json, save_json  # noqa: F401  save_json: public here too
from ..models import fsdp
from ..models.prepare import config_values
from ..models.sharding import full_state, gathered, load_full_value, zero_stage
from .preemption import PREEMPTED, InflightUpdate, inflight_filename
from .state import LoopState

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
# Written last by transformers' ``Trainer._save_checkpoint`` (and by our trainer): a
# checkpoint without it was cut off mid-save.
COMPLETE_MARKER = "trainer_state.json"
REQUIRED_FILES: tuple[str, ...] = (COMPLETE_MARKER,)
TRASH_PREFIX = ".trash-"
# ``checkpoint-<step>-preempted``: written on SIGTERM between two optimizer steps of update
# <step> + 1; it holds that update's progress and counts as newer than ``checkpoint-<step>``.
PREEMPTED_SUFFIX = "-preempted"
_CHECKPOINT_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)({re.escape(PREEMPTED_SUFFIX)})?$")
_RESUME_HINT = (
    "Pass an earlier checkpoint, or resume_from_checkpoint=True to pick the latest complete one."
)



def _fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root`` and every folder, so a rename cannot expose empty files
    after a power loss."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(folder)


# ---------------------------------------------------------------------- atomic folders
@contextmanager
def atomic_checkpoint_dir(
    final_dir: str | os.PathLike, *, suffix: str | None = None, commit: bool = True, fsync: bool = True
) -> Iterator[str]:
    """Yield a temporary folder next to ``final_dir``; rename it to ``final_dir`` on success.

    On a clean exit the temporary folder replaces ``final_dir``: an existing ``final_dir`` is
    renamed to ``.trash-<name>-<random>``, the new one renamed into place, then the trash
    deleted. On an exception the temporary folder is deleted and ``final_dir`` is untouched.

    Args:
        final_dir: the checkpoint folder to create, e.g. ``out/checkpoint-500``.
        suffix: None -> a random ``.tmp-<name>-<random>`` folder. In multi-process saves pass a
            suffix every process shares (e.g. the step), so all processes write into one folder.
        commit: whether this process renames (True) or only writes (False). In multi-process
            saves, only the main process commits, after a barrier at the end of the block
            (``accelerator.wait_for_everyone()``) so every process has finished writing.
        fsync: flush every file to disk before the rename (durability across power loss).

    Yields:
        The temporary folder's path (str).
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    if suffix is None:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=final.parent))
    else:
        tmp = final.parent / f"{TEMP_PREFIX}{final.name}-{suffix}"
        tmp.mkdir(exist_ok=True)
    try:
        yield str(tmp)
    except BaseException:
        if commit:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not commit:
        return
    if fsync:
        _fsync_tree(tmp)
    _replace_dir(tmp, final)


def _replace_dir(new: Path, final: Path) -> None:
    """Move ``new`` to ``final``; an existing ``final`` is moved aside first and deleted last.

    A crash between the two renames leaves the old folder as ``.trash-*`` and the new one as
    ``.tmp-*``, both hidden: resuming then picks the previous complete checkpoint.
    """
    trash = None
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}{final.name}-", dir=final.parent))
        os.rename(final, trash / final.name)
    os.rename(new, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def clean_temp_dirs(output_dir: str | os.PathLike) -> list[str]:
    """Delete the ``.tmp-*``/``.trash-*`` folders a crashed save left in ``output_dir``.

    Call it on the main process before training starts, never while a save may be running.
    Returns the deleted paths.
    """
    if not os.path.isdir(output_dir):
        return []
    removed = []
    for entry in sorted(os.scandir(output_dir), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and entry.name.startswith((TEMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


# ---------------------------------------------------------------------- finding checkpoints
def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The ``<step>`` of a ``checkpoint-<step>`` (or ``checkpoint-<step>-preempted``) folder
    name, else None (temp folders and ``-halted`` ones included)."""
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def _checkpoint_order(name: str) -> tuple[int, bool]:
    """Sort key: the step, then a preempted checkpoint after the plain one of the same step."""
    return checkpoint_step(name), name.endswith(PREEMPTED_SUFFIX)


def is_complete(path: str | os.PathLike, required_files: Iterable[str] = REQUIRED_FILES) -> bool:
    """True when ``path`` is a folder holding every one of ``required_files``."""
    return os.path.isdir(path) and all(os.path.isfile(os.path.join(path, name)) for name in required_files)


def list_checkpoints(output_dir: str | os.PathLike, required_files: Iterable[str] = REQUIRED_FILES) -> list[str]:
    """Complete ``checkpoint-<step>`` folders in ``output_dir``, oldest (lowest step) first; a
    ``checkpoint-<step>-preempted`` comes right after ``checkpoint-<step>``."""
    if not os.path.isdir(output_dir):
        return []
    required = tuple(required_files)
    found = []
    for entry in os.scandir(output_dir):
        if checkpoint_step(entry.name) is not None and is_complete(entry.path, required):
            found.append((_checkpoint_order(entry.name), entry.path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike, required_files: Iterable[str] = REQUIRED_FILES) -> str | None:
    """The complete ``checkpoint-<step>`` folder (or ``checkpoint-<step>-preempted``) that comes
    last in ``list_checkpoints``' order, or None.

    Temporary folders of an interrupted save and folders missing a required file are ignored.
    """
    complete = list_checkpoints(output_dir, required_files)
    return complete[-1] if complete else None


def validate_checkpoint(path: str | os.PathLike, required_files: Iterable[str] = REQUIRED_FILES) -> None:
    """Raise unless ``path`` is a complete checkpoint whose required JSON files parse.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a folder, misses required files, or a required ``.json``
            file is damaged. Every message names the folder, the problem and what to do.
    """
    path = str(path)
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        latest = latest_checkpoint(parent, required_files)
        hint = f" The latest complete checkpoint there is {latest!r}." if latest else ""
        raise FileNotFoundError(f"Checkpoint folder {path!r} does not exist.{hint} {_RESUME_HINT}")
    if not os.path.isdir(path):
        raise ValueError(f"Checkpoint {path!r} is not a folder. {_RESUME_HINT}")
    required = tuple(required_files)
    missing = [name for name in required if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise ValueError(
            f"Checkpoint {path!r} is incomplete: missing {missing} (the save was interrupted, or the folder was "
            f"not written by a trainer). {_RESUME_HINT}"
        )
    for name in required:
        if name.endswith(".json"):
            try:
                load_json(os.path.join(path, name))
            except ValueError as err:
                raise ValueError(f"Checkpoint {path!r} is damaged: {err} {_RESUME_HINT}") from err


def rotate_checkpoints(
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    keep: Iterable[str] = frozenset(),
    required_files: Iterable[str] = REQUIRED_FILES,
) -> list[str]:
    """Delete the oldest complete checkpoints until at most ``save_total_limit`` remain.

    Checkpoints named in ``keep`` (paths or folder names: the last-known-good or halted
    checkpoint) are never deleted, so more than ``save_total_limit`` may remain. The newest
    checkpoint is never deleted (``save_total_limit >= 1``). Incomplete folders are not
    touched.

    Args:
        save_total_limit: None -> delete nothing; else an int >= 1.

    Returns:
        The deleted paths, oldest first.
    """
    if save_total_limit is None:
        return []
    if isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1:
        raise ValueError(
            f"save_total_limit must be None (keep all) or an int >= 1, got {save_total_limit!r}; "
            "it counts the checkpoints kept, and the newest is always kept."
        )
    keep_names = {os.path.basename(os.path.normpath(str(k))) for k in keep}
    complete = list_checkpoints(output_dir, required_files)
    excess = len(complete) - save_total_limit
    deleted = []
    for path in complete[:-1]:
        if excess <= 0:
            break
        if os.path.basename(path) in keep_names:
            continue
        shutil.rmtree(path)
        deleted.append(path)
        excess -= 1
    return deleted


# ---------------------------------------------------------------------- RNG
def capture_rng_state() -> dict:
    """The state of every global random generator: ``python``, ``numpy``, ``torch`` (CPU) and
    ``torch_cuda`` (one state per CUDA device; None without CUDA).

    Restoring it with :func:`restore_rng_state` makes the next draws equal those that followed
    the capture. Capture at the point the resumed run will continue from (after everything
    the finished update drew), and save it per process (each process has its own streams).
    """
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict) -> None:
    """Set every global generator from :func:`capture_rng_state`'s dict.

    CUDA states are restored on as many devices as both the state and this machine have; a
    mismatch (resuming on other hardware) warns, as the run then cannot be bit-exact.
    """
    import numpy as np
    import torch

    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(
            f"RNG state is missing {sorted(missing)}; it was not written by capture_rng_state(). Resume from a "
            "checkpoint saved by this package, or skip restoring RNG state (the run will not be bit-exact)."
        )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], np.asarray(numpy_state["keys"], dtype=np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    _restore_cuda_rng(state.get("torch_cuda"))


def _restore_cuda_rng(cuda_states: list | None) -> None:
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    saved = len(cuda_states) if cuda_states else 0
    if saved != available:
        warnings.warn(
            f"The checkpoint holds CUDA RNG state for {saved} device(s) and this machine has {available}; "
            f"restoring {min(saved, available)}. The resumed run will not be bit-exact.",
            stacklevel=3,
        )
    for device in range(min(saved, available)):
        torch.cuda.set_rng_state(cuda_states[device], device)


@contextmanager
def isolated_rng(seed: int | None = None) -> Iterator[None]:
    """Random draws inside the block leave every global generator (Python, NumPy, torch CPU and
    CUDA) as it was before it: the rule for anything outside the training stream (completions
    table, held-out evaluation, callbacks), whose draws would otherwise shift the stream that a
    checkpoint captured and break exact resume.

    ``seed``: torch (CPU and CUDA) is seeded with it inside the block, so the block's own draws
    are reproducible whatever the training stream did before; None: they continue from it.

    Example:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> with isolated_rng(seed=0):
        ...     _ = torch.rand(3)
        >>> torch.equal(before, torch.get_rng_state())
        True
    """
    import torch

    state = capture_rng_state()
    try:
        if seed is not None:
            torch.manual_seed(seed)
        yield
    finally:
        restore_rng_state(state)


def rng_state_filename(process_index: int = 0) -> str:
    """``rng_state_<process_index>.pth``: one RNG file per process inside a checkpoint."""
    return f"rng_state_{process_index}.pth"


def save_rng_state(directory: str | os.PathLike, process_index: int = 0) -> str:
    """``torch.save`` this process's :func:`capture_rng_state` into ``directory``; returns the path."""
    import torch

    path = os.path.join(directory, rng_state_filename(process_index))
    torch.save(capture_rng_state(), path)
    return path


def load_rng_state(directory: str | os.PathLike, process_index: int = 0) -> None:
    """Restore this process's RNG state saved by :func:`save_rng_state` (loaded with weights_only)."""
    import torch

    path = os.path.join(directory, rng_state_filename(process_index))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No RNG state for process {process_index} in {str(directory)!r} (expected {path!r}). The checkpoint was "
            "saved with a different number of processes or is incomplete; resume with the same world size, or "
            "from another checkpoint."
        )
    restore_rng_state(torch.load(path, weights_only=True))


# ---------------------------------------------------------------------------------------------- a PPO run
TRAINABLE_STATE = "trainable_state.pt"
OPTIMIZER = "optimizer.pt"
DEEPSPEED_STATE = "deepspeed"  # DeepSpeed's checkpoint tag (a folder) inside a checkpoint
SCHEDULER = "scheduler.pt"
PPO_STATE = "ppo_state.json"
# The optimizer's state is optimizer.pt or deepspeed/ (ppo_state.json says which), checked on load.
CHECKPOINT_FILES = (COMPLETE_MARKER, PPO_STATE, TRAINABLE_STATE)


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


class CheckpointedRun(Protocol):
    """What :class:`CheckpointMixin` reads of the trainer it is mixed into, and nothing else (a test
    holds the two lists equal): the run's parts it saves and restores, and the trainer's facts it
    reads to do so. Of the loop's state (``loop_state``) it reads ``inflight``,
    ``protected_checkpoints``, ``last_checkpoint`` and ``resume_*``; it writes there only its own
    resume bookkeeping (``resume_path``, ``resume_exact``, ``resume_inflight``, ``last_checkpoint``)
    and clears ``inflight`` once saved; of the trainer it writes ``model`` (a reloaded FSDP2 wrapper)."""

    args: object  # the PPOConfig: output_dir, save limits, seeds, hub settings
    state: object  # transformers' TrainerState (OnlineTrainerState)
    accelerator: object
    model: object  # the prepared policy/value module
    unwrapped: object
    optimizer: object
    lr_scheduler: object
    processing_class: object
    plan: object  # batching.BatchPlan, checked against a resumed run's
    counters: object  # run.state.RunCounters
    guards: object  # run.guards.GuardRails
    kl_controller: object
    local_seed: int
    is_deepspeed_enabled: bool
    is_peft_model: bool
    loop_state: LoopState  # the loop's state between updates (run.state.LoopState)
    _saved_dropout: list  # (config, name, value) of the trained models' configs, written back on save

    def create_model_card(self, *args, **kwargs): ...

    def push_to_hub(self, *args, **kwargs): ...

    def store_flos(self): ...


class CheckpointMixin:
    """Save and restore everything a PPO run needs to continue bit for bit; the checkpoint of a
    preempted run; ``save_model`` (the inference export, also written into every checkpoint).
    What it reads of the trainer is listed by :class:`CheckpointedRun`."""

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model=None, trial=None, folder_name: str | None = None) -> str:
        """Write ``checkpoint-<global_step>`` (or ``folder_name``) atomically; returns its path."""
        step = self.state.global_step
        final = os.path.join(self.args.output_dir, folder_name or f"{CHECKPOINT_PREFIX}{step}")
        is_main = self.accelerator.is_main_process
        self.store_flos()
        if is_main:  # as TRL does: the model card in output_dir follows the checkpoints
            self._write_model_card()
        # Every process writes into one temp folder (shared suffix); the main process renames it.
        suffix = str(step) if self.accelerator.num_processes > 1 else None
        with atomic_checkpoint_dir(final, suffix=suffix, commit=is_main) as tmp:
            self.save_model(tmp, _internal_call=True)
            self._save_training_state(tmp)  # every process: ZeRO gathers and DeepSpeed's save are collective
            save_rng_state(tmp, self.accelerator.process_index)
            if self.loop_state.inflight is not None:
                self.loop_state.inflight.save(os.path.join(tmp, inflight_filename(self.accelerator.process_index)))
            self.accelerator.wait_for_everyone()
            if is_main:
                self.state.save_to_json(os.path.join(tmp, COMPLETE_MARKER))
        self.accelerator.wait_for_everyone()
        if is_main and folder_name is None:
            rotate_checkpoints(
                self.args.output_dir, self.args.save_total_limit, keep=self.loop_state.protected_checkpoints,
                required_files=CHECKPOINT_FILES,
            )
        self.loop_state.last_checkpoint = (step, final)
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
            save_json(os.path.join(path, COMPLETE_MARKER), dataclasses.asdict(self.state))
        self.accelerator.wait_for_everyone()

    def _save_training_state(self, directory: str) -> None:
        """Trainable weights, optimizer, scheduler and PPO state. Every process calls it: under
        ZeRO-3 the weights are gathered (one parameter at a time) and under DeepSpeed each
        process writes its optimizer shard; the main process writes the rest."""
        is_main = self.accelerator.is_main_process
        unwrapped = self.accelerator.unwrap_model(self.model)
        trainable = full_state(((k, v) for k, v in unwrapped.named_parameters() if v.requires_grad), keep=is_main)
        fsdp2 = fsdp.is_fsdp2_model(self.model)
        optimizer_state = fsdp.full_optimizer_state(self.optimizer, keep=is_main) if fsdp2 else None  # a gather
        if self.is_deepspeed_enabled:
            self.model.save_checkpoint(directory, tag=DEEPSPEED_STATE, save_latest=False,
                                       exclude_frozen_parameters=True)
        if not is_main:
            return
        torch.save(trainable, os.path.join(directory, TRAINABLE_STATE))
        if not self.is_deepspeed_enabled:
            torch.save(optimizer_state if fsdp2 else self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(directory, SCHEDULER))
        save_json(os.path.join(directory, PPO_STATE), {
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
            path = latest_checkpoint(self.args.output_dir, CHECKPOINT_FILES)
            if path is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but {self.args.output_dir!r} holds no complete checkpoint "
                    f"(a checkpoint-<step> folder with {list(CHECKPOINT_FILES)}). Start without resuming, or pass "
                    "the path of a checkpoint."
                )
            return path
        validate_checkpoint(resume_from_checkpoint, CHECKPOINT_FILES)
        return str(resume_from_checkpoint)

    def _load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, scheduler, PPO state and trainer state (RNG comes last,
        in ``_restore_rng``, right before the first resumed update)."""
        try:
            ppo_state = load_json(os.path.join(path, PPO_STATE))
            trainable = load_checkpoint_file(path, TRAINABLE_STATE)
            optimizer_state = None
            if ppo_state["optimizer_format"] == "torch":
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
        for unit in fsdp.fsdp2_units(unwrapped):  # FSDP2: the sharded parameters, the optimizer's own
            unit.reshard()
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
            for name, value in trainable.items():
                load_full_value(params[name], value)  # FSDP2: this process's rows
            if fsdp.is_fsdp2_model(self.model):  # this process's rows of every moment
                fsdp.load_full_optimizer_state(self.optimizer, optimizer_state)
            else:
                self.optimizer.load_state_dict(optimizer_state)
        self.lr_scheduler.load_state_dict(scheduler_state)
        self.kl_controller.load_state_dict(ppo_state["kl_controller"])
        self.guards.load_state_dict(ppo_state["guards"])
        self.counters.load_state_dict(ppo_state)
        if not exact:
            self.counters.batches = self._rederive_batches(ppo_state)
        self._load_inflight(path, exact)
        resumed = type(self.state).load_from_json(os.path.join(path, COMPLETE_MARKER))
        for field_name in ("global_step", "episode", "log_history", "epoch", "total_flos", "num_input_tokens_seen"):
            setattr(self.state, field_name, getattr(resumed, field_name))
        if not exact:  # updates now hold another number of episodes: the run still ends at total_episodes
            remaining = max(0, self.args.total_episodes - self.state.episode)
            self.state.max_steps = self.state.global_step + math.ceil(remaining / self.args.batch_size)
        self.loop_state.resume_path, self.loop_state.resume_exact = path, exact

    def _check_resume_topology(self, path: str, ppo_state: dict) -> bool:
        """Whether the checkpoint resumes bit for bit here (same number of processes).

        Raises ``ValueError`` where it cannot resume at all: DeepSpeed's optimizer shards read by
        a run without DeepSpeed (or the reverse), by another ZeRO stage or another process count.
        """
        saved_world, world = ppo_state["world_size"], self.accelerator.num_processes
        saved_format = ppo_state["optimizer_format"]
        here = DEEPSPEED_STATE if self.is_deepspeed_enabled else "torch"
        saved_setup = _setup_name(saved_format, ppo_state["zero_stage"])
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
        consumed = ppo_state["data_cursor"]["batches"] * ppo_state["batch_size"]
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
        self.loop_state.resume_inflight = None
        file = os.path.join(path, inflight_filename(self.accelerator.process_index))
        if not os.path.exists(file):
            return
        if not exact:
            logger.warning("Checkpoint %r stopped inside an update; with another number of processes its "
                           "remaining optimizer steps are dropped and a new update starts.", path)
            return
        self.loop_state.resume_inflight = InflightUpdate.load(file, self.accelerator.device)

    def _restore_rng(self) -> None:
        """Every random generator as the checkpoint left it; re-seeded (from the seed, the process
        and the step) when the checkpoint came from another number of processes."""
        loop = self.loop_state
        if not loop.resume_path:
            return
        if loop.resume_exact:
            load_rng_state(loop.resume_path, self.accelerator.process_index)
            return
        import numpy as np

        seed = self.local_seed + 7919 * self.state.global_step
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ preemption
    def _checkpoint_preempted(self, inflight: bool) -> None:
        """Record the preemption and write a complete checkpoint (whatever ``save_strategy``):
        ``checkpoint-<step>`` at an update boundary, else ``checkpoint-<step>-preempted`` holding
        the update in progress (resumed first by ``resume_from_checkpoint=True``)."""
        self.state.stop_reason = PREEMPTED
        name = f"{CHECKPOINT_PREFIX}{self.state.global_step}" + (PREEMPTED_SUFFIX if inflight else "")
        path = os.path.join(self.args.output_dir, name)
        just_saved = self.loop_state.last_checkpoint == (self.state.global_step, path) and os.path.isdir(path)
        if not inflight and just_saved:
            self._record_stop_in_checkpoint(path)  # save_steps wrote this update's checkpoint: no second save
        else:
            self._save_checkpoint(self.model, folder_name=name)
        self.loop_state.inflight = None
        logger.warning("SIGTERM: stopped after update %d%s; checkpoint %s written.", self.state.global_step,
                       " and part of the next one" if inflight else "", name)

    # ------------------------------------------------------------------ save_model
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy (or adapter) for inference; a shared actor-critic also saves its value
        head. The saved config keeps the dropout values it came with (training runs with 0)."""
        with config_values(self._saved_dropout):
            self._save_policy(output_dir or self.args.output_dir, _internal_call)

    def _save_policy(self, output_dir: str, _internal_call: bool) -> None:
        unwrapped = self.unwrapped
        if self.is_deepspeed_enabled:
            return self._save_model_deepspeed(output_dir, _internal_call)
        if fsdp.is_fsdp2_model(self.model):
            return self._save_model_fsdp2(output_dir, _internal_call)
        if getattr(unwrapped, "is_actor_critic", False):
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                unwrapped.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return
        wrapped = self.model
        self.model = unwrapped  # TRL's save_model saves `self.model.policy`
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model = wrapped

    def _save_model_deepspeed(self, output_dir: str, _internal_call: bool) -> None:
        """``save_model`` under DeepSpeed: every process takes part (ZeRO-3 gathers the saved
        weights: the adapter and value head of a LoRA model, the whole policy of a full
        fine-tune), the main process writes. TRL/transformers' own DeepSpeed save path expects
        the engine where TRL puts the bare policy, and fails."""
        unwrapped = self.unwrapped
        target = unwrapped if getattr(unwrapped, "is_actor_critic", False) else unwrapped.policy
        is_adapter = getattr(unwrapped, "is_actor_critic", False) or self.is_peft_model
        saved = [p for p in target.parameters() if p.requires_grad or not is_adapter]
        self.accelerator.wait_for_everyone()
        with gathered(saved):
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                target.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_model_fsdp2(self, output_dir: str, _internal_call: bool) -> None:
        """``save_model`` under FSDP2: the saved weights (the adapter and value head of a LoRA model,
        the whole policy of a full fine-tune) gathered one tensor at a time by every process, written
        by the main process from that full state dict (the modules' own state dicts stay sharded)."""
        unwrapped = self.unwrapped
        shared = getattr(unwrapped, "is_actor_critic", False)
        prefix = "" if shared else "policy."
        target = unwrapped if shared else unwrapped.policy
        trainable = {prefix + name for name, p in target.named_parameters() if p.requires_grad}
        keys = [k for k in unwrapped.state_dict() if k.startswith(prefix)]
        if shared or self.is_peft_model:  # an adapter export reads only the trained tensors
            keys = [k for k in keys if k in trainable]
        self.accelerator.wait_for_everyone()
        state = fsdp.full_state_dict(unwrapped, keep=self.args.should_save, names=set(keys))
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            target.save_pretrained(output_dir, state_dict={k[len(prefix):]: v for k, v in state.items()})
            self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
