"""Checkpoints: atomic folders (exception, SIGKILL, crash between renames), finding, validating
and rotating complete checkpoints, JSON helpers, RNG capture/restore."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trl_ppo_ext.run import checkpointing as ckpt
from trl_ppo_ext.run.checkpointing import (
    atomic_checkpoint_dir,
    capture_rng_state,
    clean_temp_dirs,
    latest_checkpoint,
    load_json,
    load_rng_state,
    restore_rng_state,
    rotate_checkpoints,
    save_json,
    save_rng_state,
    validate_checkpoint,
)


def fill(folder, payload="weights", step=0, complete=True):
    """Write ``weights.bin`` and, when ``complete``, the marker file into ``folder``."""
    with open(os.path.join(folder, "weights.bin"), "w") as handle:
        handle.write(payload)
    if complete:
        save_json(os.path.join(folder, "trainer_state.json"), {"global_step": step})


def make_checkpoint(output_dir, step, *, complete=True, payload="weights"):
    """A checkpoint folder written the non-atomic way; ``complete`` adds the marker file."""
    path = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    fill(path, payload, step, complete)
    return path


def read(path):
    with open(path) as handle:
        return handle.read()


def hidden_entries(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


# ---------------------------------------------------------------------- json
def test_save_json_round_trip_leaves_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    save_json(path, {"a": [1, 2.5, None], "b": "x"})
    save_json(path, {"a": 2})  # replaces
    assert load_json(path) == {"a": 2}
    assert os.listdir(tmp_path) == ["state.json"]


def test_save_json_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    save_json(path, {"ok": True})
    with pytest.raises(TypeError):
        save_json(path, {"bad": object()})
    assert load_json(path) == {"ok": True}
    assert os.listdir(tmp_path) == ["state.json"]


def test_load_json_names_a_damaged_or_missing_file(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text('{"global_step": 3,')
    with pytest.raises(ValueError, match=r"trainer_state.json' is not valid JSON .*line 1.*cut off"):
        load_json(path)
    with pytest.raises(FileNotFoundError, match="No JSON file at .*nothing.json"):
        load_json(tmp_path / "nothing.json")


# ---------------------------------------------------------------------- atomic folders
def test_atomic_dir_appears_only_after_the_block(tmp_path):
    final = tmp_path / "checkpoint-1"
    with atomic_checkpoint_dir(final) as tmp:
        assert os.path.basename(tmp).startswith(".tmp-checkpoint-1-")
        assert os.path.dirname(tmp) == str(tmp_path)
        (tmp_path / os.path.basename(tmp) / "trainer_state.json").write_text("{}")
        assert not final.exists()
    assert read(final / "trainer_state.json") == "{}"
    assert os.listdir(tmp_path) == ["checkpoint-1"]


def test_an_exception_in_the_block_keeps_the_previous_checkpoint(tmp_path):
    previous = make_checkpoint(tmp_path, 1, payload="old")
    for target in ("checkpoint-2", "checkpoint-1"):  # a new step, and replacing the same step
        with pytest.raises(RuntimeError, match="disk full"):
            with atomic_checkpoint_dir(tmp_path / target) as tmp:
                fill(tmp, "half", complete=False)
                raise RuntimeError("disk full")
        assert read(os.path.join(previous, "weights.bin")) == "old"
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert latest_checkpoint(tmp_path) == previous


def test_replacing_an_existing_checkpoint_leaves_no_trash(tmp_path):
    make_checkpoint(tmp_path, 3, payload="old")
    with atomic_checkpoint_dir(tmp_path / "checkpoint-3") as tmp:
        fill(tmp, "new", step=3)
    assert read(tmp_path / "checkpoint-3" / "weights.bin") == "new"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]


def test_a_crash_between_the_two_renames_leaves_both_copies_hidden(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2, payload="old")
    real_rename, calls = os.rename, []

    def rename_then_crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # old moved to trash; the new one never arrives
            raise OSError("simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename_then_crash)
    with pytest.raises(OSError, match="simulated crash"):
        with atomic_checkpoint_dir(tmp_path / "checkpoint-2") as tmp:
            fill(tmp, "new", step=2)
    monkeypatch.undo()
    hidden = hidden_entries(tmp_path)
    assert [name.split("-checkpoint-2-")[0] for name in hidden] == [".tmp", ".trash"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert sorted(clean_temp_dirs(tmp_path)) == [str(tmp_path / name) for name in hidden]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_shared_suffix_without_commit_only_writes(tmp_path):
    # a non-main process: writes its files into the shared temp folder and leaves the rename to the main one
    with atomic_checkpoint_dir(tmp_path / "checkpoint-4", suffix="step4", commit=False) as tmp:
        assert tmp == str(tmp_path / ".tmp-checkpoint-4-step4")
        (tmp_path / ".tmp-checkpoint-4-step4" / "rng_state_1.pth").write_text("rank 1")
    assert not (tmp_path / "checkpoint-4").exists()
    with atomic_checkpoint_dir(tmp_path / "checkpoint-4", suffix="step4") as tmp:
        (tmp_path / ".tmp-checkpoint-4-step4" / "rng_state_0.pth").write_text("rank 0")
    assert sorted(os.listdir(tmp_path / "checkpoint-4")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert os.listdir(tmp_path) == ["checkpoint-4"]


CHILD = textwrap.dedent(
    """
    import importlib, os, signal, sys

    ckpt = importlib.import_module(sys.argv[1])  # the package's checkpointing module
    out, second = sys.argv[2], sys.argv[3]

    def write(folder, step, die):
        with open(os.path.join(folder, "weights.bin"), "w") as handle:
            handle.write(f"weights of step {step}" * 1000)
            handle.flush()
        if die:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-write: the marker file never comes
        ckpt.save_json(os.path.join(folder, "trainer_state.json"), {"global_step": step})

    with ckpt.atomic_checkpoint_dir(os.path.join(out, "checkpoint-1")) as folder:
        write(folder, 1, die=False)
    with ckpt.atomic_checkpoint_dir(os.path.join(out, second)) as folder:
        write(folder, 2, die=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("second", ["checkpoint-2", "checkpoint-1"])
def test_sigkill_mid_write_leaves_the_previous_checkpoint_intact(tmp_path, second):
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, ckpt.__name__, str(out), second], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(ckpt.__file__).parents[1])},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    first = out / "checkpoint-1"
    assert read(first / "weights.bin") == "weights of step 1" * 1000
    assert load_json(first / "trainer_state.json") == {"global_step": 1}
    leftovers = hidden_entries(out)
    assert len(leftovers) == 1 and leftovers[0].startswith(f".tmp-{second}-")  # killed mid-write
    assert sorted(os.listdir(out)) == sorted(["checkpoint-1", *leftovers])
    assert latest_checkpoint(out) == str(first)
    validate_checkpoint(first)


# ---------------------------------------------------------------------- finding, validating
def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    make_checkpoint(tmp_path, 9)
    make_checkpoint(tmp_path, 10)  # numeric order: 10 > 9 (a string sort would pick 9)
    make_checkpoint(tmp_path, 11, complete=False)  # cut off mid-save
    os.makedirs(tmp_path / ".tmp-checkpoint-12-abc")
    fill(tmp_path / ".tmp-checkpoint-12-abc", step=12)  # complete-looking, but a temp folder
    os.makedirs(tmp_path / "checkpoint-13.bak")
    (tmp_path / "checkpoint-14").write_text("a file, not a folder")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert latest_checkpoint(tmp_path, required_files=("trainer_state.json", "optimizer.pt")) is None
    assert latest_checkpoint(tmp_path, required_files=("weights.bin",)) == str(tmp_path / "checkpoint-11")


def test_validate_checkpoint_errors_name_the_folder_the_problem_and_the_fix(tmp_path):
    good = make_checkpoint(tmp_path, 2)
    validate_checkpoint(good)
    with pytest.raises(FileNotFoundError) as err:
        validate_checkpoint(tmp_path / "checkpoint-7")
    message = str(err.value)
    assert "checkpoint-7' does not exist" in message
    assert f"latest complete checkpoint there is {good!r}" in message
    assert "resume_from_checkpoint=True" in message

    partial = make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(ValueError, match=r"checkpoint-3' is incomplete: missing \['trainer_state.json'\].*earlier"):
        validate_checkpoint(partial)

    with open(os.path.join(partial, "trainer_state.json"), "w") as handle:
        handle.write('{"global_step": ')
    with pytest.raises(ValueError, match=r"checkpoint-3' is damaged: .*not valid JSON.*resume_from_checkpoint=True"):
        validate_checkpoint(partial)

    (tmp_path / "checkpoint-5").write_text("")
    with pytest.raises(ValueError, match="checkpoint-5' is not a folder"):
        validate_checkpoint(tmp_path / "checkpoint-5")


# ---------------------------------------------------------------------- rotation
def test_rotate_deletes_the_oldest_but_never_a_kept_or_incomplete_one(tmp_path):
    paths = {step: make_checkpoint(tmp_path, step) for step in (1, 2, 3, 4, 5)}
    make_checkpoint(tmp_path, 6, complete=False)
    deleted = rotate_checkpoints(tmp_path, 2, keep={"checkpoint-1"})
    # 5 complete, limit 2 -> 3 to delete, oldest first, skipping kept checkpoint-1: 2, 3, 4
    assert deleted == [paths[2], paths[3], paths[4]]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-5", "checkpoint-6"]


def test_rotate_keeps_the_newest_and_kept_paths_even_past_the_limit(tmp_path):
    paths = {step: make_checkpoint(tmp_path, step) for step in (1, 2, 3)}
    assert rotate_checkpoints(tmp_path, None) == []
    assert rotate_checkpoints(tmp_path, 1, keep={paths[1]}) == [paths[2]]  # a path works as well as a name
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-3"]
    with pytest.raises(ValueError, match="save_total_limit must be None .* or an int >= 1, got 0"):
        rotate_checkpoints(tmp_path, 0)


def test_clean_temp_dirs_removes_only_hidden_leftovers(tmp_path):
    keep = make_checkpoint(tmp_path, 1)
    os.makedirs(tmp_path / ".tmp-checkpoint-2-x1")
    os.makedirs(tmp_path / ".trash-checkpoint-1-x2")
    (tmp_path / ".tmp-notes").write_text("a file is left alone")
    removed = clean_temp_dirs(tmp_path)
    assert removed == [str(tmp_path / ".tmp-checkpoint-2-x1"), str(tmp_path / ".trash-checkpoint-1-x2")]
    assert sorted(os.listdir(tmp_path)) == [".tmp-notes", os.path.basename(keep)]


# ---------------------------------------------------------------------- RNG
def draws():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),  # exercises the cached-Gaussian part of NumPy's state
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_restore_then_draw_equals_the_draws_after_capture():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn(1)  # leave a cached Gaussian in NumPy's state
    state = capture_rng_state()
    expected = draws()
    draws()  # move every generator on
    restore_rng_state(state)
    assert draws() == expected


def test_rng_state_survives_a_weights_only_torch_load(tmp_path):
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    path = save_rng_state(tmp_path, process_index=1)
    assert os.path.basename(path) == "rng_state_1.pth"
    expected = draws()
    load_rng_state(tmp_path, process_index=1)  # torch.load(..., weights_only=True) inside
    assert draws() == expected
    with pytest.raises(FileNotFoundError, match="No RNG state for process 0 .*same world size"):
        load_rng_state(tmp_path, process_index=0)


def test_rng_state_is_plain_data():
    state = capture_rng_state()
    assert set(state) == {"python", "numpy", "torch", "torch_cuda"}
    json.dumps(state["numpy"])  # numpy state as plain ints/floats/strings
    assert state["torch"].dtype == torch.uint8


def test_restore_refuses_a_foreign_dict_and_warns_on_a_cuda_mismatch():
    with pytest.raises(ValueError, match=r"RNG state is missing \['numpy', 'torch'\]"):
        restore_rng_state({"python": random.getstate()})
    if torch.cuda.is_available():
        pytest.skip("the mismatch below is built for a machine without CUDA")
    state = capture_rng_state()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with pytest.warns(UserWarning, match=r"CUDA RNG state for 1 device\(s\) and this machine has 0"):
        restore_rng_state(state)


def test_the_checkpoint_mixin_reads_of_the_trainer_only_what_checkpointed_run_lists(make_trainer):
    import ast
    import inspect
    import textwrap

    from trl_ppo_ext.run.checkpointing import CheckpointedRun, CheckpointMixin

    own = {name for name, member in vars(CheckpointMixin).items() if callable(member)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(CheckpointMixin)))
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Load)}
    methods = {n for n, v in vars(CheckpointedRun).items() if inspect.isfunction(v) and not n.startswith("__")}
    assert read - own == set(CheckpointedRun.__annotations__) | methods
    trainer = make_trainer()
    assert all(hasattr(trainer, name) for name in CheckpointedRun.__annotations__ if name != "_resume_path")
