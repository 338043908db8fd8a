"""One run: the models a seed starts from (``prepare``), one (arm, seed) trained with a row per
update (``run_one``), and its training timed or inside the live-tensor tracker (``timed_train``)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from .arms import CRITICS, GAE_MODES, LM_HEADS, TRAINERS, Arm
from .common import LOGGED, _examples_on_path, _quiet
from .tasks import TASKS, task_module, task_settings

# The memory run (--memory): one short process per arm, seed 0, this many updates, training inside
# live_tensor_bytes (every ATen op goes through Python there, so it is never a timed run).
MEMORY_UPDATES = 2
MEMORY_SEED = 0
MIB = 2**20


def timed_train(trainer, memory: Path | None = None) -> float:
    """``trainer.train()``; returns its wall seconds. With ``memory`` (a path), training runs inside
    ``trl_ppo_ext.memory.live_tensor_bytes`` with every tensor alive at the start counted (the
    models, the optimizer's state once made, ...), and the peak of live tensor bytes is written
    there as JSON: ``{"peak_live_tensors_mib", "start_live_tensors_mib", "train_s"}``."""
    if memory is None:
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start
    from trl_ppo_ext.memory import live_tensor_bytes

    with live_tensor_bytes() as live:
        live.count_existing()
        at_start = live.current
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
    result = {"peak_live_tensors_mib": live.peak / MIB, "start_live_tensors_mib": at_start / MIB, "train_s": train_s}
    tmp = memory.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, memory)
    return train_s


def train_writing_rows(build, rows_of, out: Path, *, updates, output_dir: str, memory: Path | None = None) -> int:
    """Train the trainer ``build(callbacks)`` makes (:func:`timed_train`), writing ``OUT.partial``: a
    JSON line for each row ``rows_of(state, logs)`` gives at each log, with ``time_s`` (the wall
    seconds of training when it was logged) and ``cpu_s`` (the process's CPU seconds since training
    began: one torch thread, so what other jobs on the machine leave untouched, unlike wall time),
    then ``{"done": True, "train_s", "updates"}``, with
    ``updates()`` read after training (a trainer may fill the count in its config). The trainer's
    ``output_dir`` is removed after. Returns the updates."""
    from transformers import TrainerCallback

    partial = out.with_suffix(".partial")
    with partial.open("w") as handle:

        class Rows(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

            def on_log(self, args, state, control, logs=None, **kwargs):
                for row in rows_of(state, logs or {}):
                    handle.write(json.dumps({**row, "time_s": time.perf_counter() - self.start,
                                             "cpu_s": time.process_time() - self.cpu_start}) + "\n")
                    handle.flush()

        train_s = timed_train(build([Rows()]), memory)
    done = updates()
    with partial.open("a") as f:
        f.write(json.dumps({"done": True, "train_s": train_s, "updates": done}) + "\n")
    shutil.rmtree(output_dir, ignore_errors=True)
    return done


def prepare(task_name: str, seed: int, model_dir: Path, hidden_size: int) -> None:
    """Build the models every arm of ``task_name`` starts from for ``seed``, saved to ``model_dir``
    (the task module's ``prepare``: the reward model, an SFT warm-up or the initial policy). Written
    atomically."""
    _quiet()
    _examples_on_path()
    import torch

    torch.set_num_threads(1)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    info = task_module(task_name).prepare(seed, tmp, hidden_size)
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    (tmp / "info.json").write_text(json.dumps({"seed": seed, "hidden_size": hidden_size, **info}))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)


def _check_choice(arm: Arm, field: str, choices: tuple[str, ...], why: str) -> None:
    """Refuse ``arm.<field>`` outside ``choices``, or other than the first (TRL's arms' only one) on a TRL arm."""
    value = getattr(arm, field)
    if value not in choices or (value != choices[0] and arm.trainer != "ours"):
        raise ValueError(f"{field}={value!r}: this package's arms take {', '.join(map(repr, choices))}{why}")


def run_one(task_name: str, arm: Arm, seed: int, *, model_dir: Path, episodes: int, hidden_size: int,
            out: Path, memory: Path | None = None) -> int:
    """Train one (arm, seed); write a row per update to ``out`` (``.partial`` until done). Returns the updates.
    With ``memory``, training runs inside the live-tensor tracker and its peak goes there (:func:`timed_train`)."""
    _quiet()
    _examples_on_path()
    import torch
    from transformers import set_seed

    torch.set_num_threads(1)
    set_seed(seed)
    spec = TASKS[task_name]
    variants = spec.rewards
    if arm.reward not in variants:
        raise ValueError(f"reward variant {arm.reward!r}: the {task_name} task has {', '.join(map(repr, variants))}.")
    if arm.trainer not in TRAINERS:
        raise ValueError(f"trainer={arm.trainer!r}: pick one of {', '.join(map(repr, TRAINERS))}.")
    _check_choice(arm, "critic", CRITICS, "; the trl112 arm always has TRL's separate value model, the trl_grpo "
                  "arm none.")
    if arm.reward != "default" and arm.trainer != "ours":
        raise ValueError(f"reward variant {arm.reward!r} needs this package's trainer; TRL 1.12's takes one reward "
                         "model of the policy's vocabulary, and the trl_grpo arm trains on the task's own reward.")
    _check_choice(arm, "gae", GAE_MODES, ".")
    _check_choice(arm, "lm_head", LM_HEADS, "; the trl_grpo arm always trains lm_head whole, the trl112 arm as the "
                  "task's LoRA says.")
    if arm.trainer in spec.refused:
        raise ValueError(spec.refused[arm.trainer])
    if arm.trainer == "trl_grpo":
        from .trl_grpo import run_grpo

        return run_grpo(task_name, arm, seed, model_dir=model_dir, episodes=episodes, hidden_size=hidden_size,
                        out=out, memory=memory)
    if arm.trainer == "trl112":
        from trl_ppo_ext._compat import load_trl_ppo

        trainer_cls, config_cls, _ = load_trl_ppo()
    else:
        from trl_ppo_ext import PPOConfig as config_cls
        from trl_ppo_ext import PPOTrainer as trainer_cls

        if arm.gae == "step_through":
            from .step_through import step_through_trainer

            trainer_cls = step_through_trainer(trainer_cls)

    settings = task_settings(task_name, {f.name for f in dataclasses.fields(config_cls)})
    common = dict(output_dir=str(out.parent / f".{out.stem}_trainer"), total_episodes=episodes,
                  num_sample_generations=0, eval_strategy="no", save_strategy="no", logging_steps=1,
                  report_to="none", disable_tqdm=True, seed=seed, bf16=False)

    def make_config(**fields):
        return config_cls(**{**settings, **common, **fields, **arm.overrides})

    run = task_module(task_name).ours(arm, seed, make_config=make_config, model_dir=model_dir, hidden_size=hidden_size)

    def rows_of(state, logs):
        if "episode" not in logs:
            return []
        reward, scored = run.batch_reward(logs)
        # time_s follows: wall seconds of training when the update ended
        return [{"update": state.global_step, "episode": logs["episode"], "reward": reward, "scored": scored,
                 **{key: logs.get(metric) for key, metric in LOGGED.items()}, **run.extras}]

    return train_writing_rows(
        lambda callbacks: trainer_cls(args=run.config, processing_class=run.tokenizer, callbacks=callbacks,
                                      **run.models),
        rows_of, out, updates=lambda: run.config.num_total_batches, output_dir=run.config.output_dir, memory=memory)
