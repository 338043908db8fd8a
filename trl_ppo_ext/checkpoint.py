"""Atomic checkpoints and exact-resume helpers.

A checkpoint is a folder ``<output_dir>/checkpoint-<step>``. It is written into a hidden
temporary folder next to it (``.tmp-checkpoint-<step>-<random>``) and renamed into place
only when everything in it was written (:func:`atomic_checkpoint_dir`), so a crash, an
exception or a ``SIGKILL`` mid-save leaves the previous checkpoints intact and at most a
hidden temporary folder behind (:func:`clean_temp_dirs` removes those). A checkpoint also
counts as complete only when it holds its ``required_files`` (:data:`REQUIRED_FILES`), which
keeps checkpoints written non-atomically by other code from being resumed half-written.

RNG state (:func:`capture_rng_state`/:func:`restore_rng_state`) covers Python ``random``,
NumPy's global generator, torch's CPU generator and every CUDA device's generator. Its
format holds only tensors, ints, floats, strings, lists, tuples and None, so it loads with
``torch.load(..., weights_only=True)``. :func:`isolated_rng` runs a block in its own streams:
every random draw outside the training stream (completions table, held-out evaluation,
callbacks after a save) goes through it, so a checkpoint's RNG state stays the one the
training stream continues from.

The folder helpers use only the standard library; torch and NumPy are imported inside the
RNG functions, so tools (and the crash tests' subprocesses) can load this module cheaply.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ._utils import TEMP_PREFIX, fsync_dir, load_json, save_json  # noqa: F401  (save_json: public here too)

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
