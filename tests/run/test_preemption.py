"""SIGTERM: the watcher (a real signal to this process), the in-flight update's file, and
trainer runs stopped by a real SIGTERM between two optimizer steps, at an epoch's end and at
an update's end, each resumed and compared with an uninterrupted run. The subprocess test that
the program exits 0 is in tests/trainer/test_trainer_run_control.py."""

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.run.preemption import InflightUpdate, SigtermWatcher, inflight_filename
from trl_ppo_ext.tiny import build_tiny_tokenizer

ONE_PROCESS = SimpleNamespace(num_processes=1, device=torch.device("cpu"))


# ---------------------------------------------------------------------- watcher
def test_sigterm_sets_the_flag_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("outer"))
    try:
        with SigtermWatcher("save_and_exit") as watcher:
            assert not watcher.stop_agreed(ONE_PROCESS)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before the next line
            assert watcher.received and watcher.stop_agreed(ONE_PROCESS)
        assert seen == []  # the watcher took it, the process lives on
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["outer"]  # restored on exit
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_sigterm_goes_to_the_previous_handler_at_once():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("outer"))
    try:
        with SigtermWatcher("save_and_exit") as watcher:
            os.kill(os.getpid(), signal.SIGTERM)  # the notice: a flag, the run goes on to its checkpoint
            assert watcher.received and seen == []
            os.kill(os.getpid(), signal.SIGTERM)  # a second one (e.g. during the checkpoint's save): now
            assert seen == ["outer"]
            assert signal.getsignal(signal.SIGTERM) is not watcher._handle  # handed back at once
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_save_ends_the_process(second):
    """A process whose first SIGTERM is being turned into a checkpoint (here: a long sleep in its
    place) ends on a second SIGTERM (status -15, the default handler) or on SIGINT (Python's
    KeyboardInterrupt), instead of finishing the save."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        # Python's own SIGINT handler, also where this test runs in a background job (SIGINT ignored)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from trl_ppo_ext.run.preemption import SigtermWatcher\n"
        "with SigtermWatcher('save_and_exit') as watcher:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert watcher.received\n"
        f"    os.kill(os.getpid(), signal.{second})\n"
        "    time.sleep(30)\n"
        "print('saved')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "saved" not in proc.stdout
    if second == "SIGTERM":
        assert proc.returncode == -signal.SIGTERM
        assert "second SIGTERM: stopping now" in proc.stderr
    else:
        assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr


def test_off_installs_nothing_and_a_wrong_action_is_named():
    before = signal.getsignal(signal.SIGTERM)
    with SigtermWatcher("off") as watcher:
        assert signal.getsignal(signal.SIGTERM) is before
        watcher.received = True
        assert not watcher.stop_agreed(ONE_PROCESS)  # off: never stops the loop
    with pytest.raises(ValueError, match=r"on_sigterm must be one of \['save_and_exit', .*got 'kill'"):
        SigtermWatcher("kill")


def test_inflight_update_round_trips_through_a_weights_only_file(tmp_path):
    state = InflightUpdate(
        rollout={"responses": torch.tensor([[5, 6], [7, 0]]), "response_mask": torch.tensor([[1, 1], [1, 0]]).bool(),
                 "policy_version": 3},
        advantages={"advantages": torch.tensor([[0.5, -0.5], [1.0, 0.0]]), "raw_advantage_mean": torch.tensor(0.25)},
        epoch=1, mini_batch=0, order=None, stats={"pg_loss": [torch.tensor(0.1), torch.tensor(0.2)]}, rollout_age=2,
    )
    path = tmp_path / inflight_filename(1)
    state.save(str(path))
    assert path.name == "inflight_update_1.pt"
    back = InflightUpdate.load(str(path), torch.device("cpu"))
    assert (back.epoch, back.mini_batch, back.order, back.rollout_age) == (1, 0, None, 2)
    assert back.rollout["policy_version"] == 3 and torch.equal(back.rollout["responses"], state.rollout["responses"])
    assert back.rollout["response_mask"].dtype == torch.bool
    assert torch.equal(back.advantages["raw_advantage_mean"], torch.tensor(0.25))
    assert all(torch.equal(a, b) for a, b in zip(back.stats["pg_loss"], state.stats["pg_loss"], strict=True))


# ---------------------------------------------------------------------- trainer
class SigtermInStep(PPOTrainer):
    """Sends itself SIGTERM during optimizer step ``at_step`` (1-based) of update ``in_update``.
    One micro-batch per mini-batch here, so the k-th loss belongs to the k-th step. A test sets
    ``at_step`` on its trainer, never on the class: nothing it sets outlives the test."""

    in_update, at_step, losses = 1, 1, 0  # defaults; each trainer counts its own losses

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step + 1 == self.in_update:
            self.losses += 1
            if self.losses == self.at_step:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().compute_loss_terms(mb, adv, num_tokens)


# 4 prompts per update, 2 PPO epochs x 2 mini-batches of 2 rows (one micro-batch each): 4 steps
RUN = dict(total_episodes=8, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
           num_ppo_epochs=2, save_strategy="no", adaptive_kl=True, kl_target=0.01, kl_horizon=100,
           on_sigterm="save_and_return")


@pytest.fixture(scope="module")
def make_sigterm_run(trainer_builder, make_prompts):
    """``make_sigterm_run(out, cls=PPOTrainer, **overrides)``: the run every test here stops or resumes, written
    under ``out`` (module-scoped, so the straight run below can use it too)."""

    def make_sigterm_run(out, cls=PPOTrainer, **overrides):
        tok = build_tiny_tokenizer(pad_equals_eos=True)
        return trainer_builder(out)(tok, cls=cls, train_dataset=make_prompts(tok, n=10), **{**RUN, **overrides})

    return make_sigterm_run


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped.named_parameters() if v.requires_grad}


def _logs(trainer):
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history
            if "objective/scores" in h]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, make_sigterm_run):
    trainer = make_sigterm_run(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return _params(trainer), _logs(trainer)


@pytest.mark.parametrize(
    "at_step, folder, resume_at",
    [
        (1, "checkpoint-0-preempted", (0, 1)),  # mid-epoch: epoch 0's order is kept, mini-batch 1 next
        (2, "checkpoint-0-preempted", (1, 0)),  # an epoch's end: epoch 1 draws its order on resume
        (4, "checkpoint-1", None),  # the update's last step: it finishes, a plain checkpoint follows
    ],
)
def test_sigterm_checkpoints_where_it_stopped_and_resumes_exactly(tmp_path, make_sigterm_run, straight, at_step, folder,
                                                                  resume_at):
    stopped = make_sigterm_run(tmp_path, cls=SigtermInStep)
    stopped.at_step = at_step
    stopped.train()  # save_and_return: train() returns instead of exiting
    assert stopped.state.stop_reason == "preempted"
    assert stopped.state.global_step == (1 if resume_at is None else 0)  # SIGTERM came in update 1 of 2
    out = tmp_path / "out"
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["status"] == "preempted" and manifest["stop_reason"] == "preempted"
    ckpt = out / folder
    assert (ckpt / "trainer_state.json").exists(), sorted(os.listdir(out))  # written though save_strategy="no"
    inflight = ckpt / inflight_filename(0)
    assert inflight.exists() == (resume_at is not None)
    if resume_at is not None:
        saved = InflightUpdate.load(str(inflight), torch.device("cpu"))
        assert (saved.epoch, saved.mini_batch) == resume_at
        assert (saved.order is None) == (resume_at[1] == 0)
        assert len(saved.stats["pg_loss"]) == at_step  # statistics of the steps already taken

    resumed = make_sigterm_run(tmp_path)
    resumed.train(resume_from_checkpoint=True)  # picks the preempted checkpoint: the newest
    assert resumed.state.stop_reason is None and resumed.state.global_step == 2
    params, logs = straight
    now = _params(resumed)
    assert now.keys() == params.keys() and all(torch.equal(now[k], params[k]) for k in params)
    assert _logs(resumed) == logs


def test_sigterm_right_after_a_save_records_the_stop_without_saving_again(tmp_path, make_sigterm_run):
    saves = []

    class CountingSaves(SigtermInStep):
        def _save_checkpoint(self, model=None, trial=None, folder_name=None):
            saves.append(folder_name or f"checkpoint-{self.state.global_step}")
            return super()._save_checkpoint(model, trial, folder_name)

    trainer = make_sigterm_run(tmp_path, cls=CountingSaves, save_strategy="steps", save_steps=1)
    trainer.at_step = 4  # the update's last step: save_steps=1 saves checkpoint-1 right after it
    trainer.train()
    assert saves == ["checkpoint-0", "checkpoint-1"]  # the preemption rewrote no weights (grace time)
    state = json.loads((tmp_path / "out" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["global_step"], state["stop_reason"]) == (1, "preempted")


def test_on_sigterm_off_leaves_the_signal_alone(tmp_path, make_sigterm_run):
    class Look(PPOTrainer):
        seen = None

        def compute_loss_terms(self, mb, adv, num_tokens=None):
            self.seen = signal.getsignal(signal.SIGTERM)
            return super().compute_loss_terms(mb, adv, num_tokens)

    before = signal.getsignal(signal.SIGTERM)
    trainer = make_sigterm_run(tmp_path, cls=Look, on_sigterm="off", total_episodes=4)
    trainer.train()
    assert trainer.seen is before


def test_stop_if_preempted_carries_where_the_update_resumes_and_asks_no_one_after_its_last_step():
    from dataclasses import make_dataclass

    from trl_ppo_ext.run.preemption import UpdatePreempted, stop_if_preempted

    part = make_dataclass("Part", ["x", "n"])(x=torch.arange(4), n=4)
    asked = []

    def agreed():
        asked.append(1)
        return True

    shape = dict(num_ppo_epochs=2, num_mini_batches=3, rollout_age=5)
    stop_if_preempted(part, part, (1, 2), torch.arange(4), {}, stop_agreed=agreed, **shape)  # the last step
    assert asked == []
    stop_if_preempted(part, part, (0, 0), torch.arange(4), {}, stop_agreed=lambda: False, **shape)  # no SIGTERM
    order = torch.tensor([3, 1, 0, 2])
    with pytest.raises(UpdatePreempted, match="SIGTERM after PPO epoch 0, mini-batch 1") as mid:
        stop_if_preempted(part, part, (0, 1), order, {"loss": [torch.tensor(1.0)]}, stop_agreed=agreed, **shape)
    inflight = mid.value.inflight
    assert (inflight.epoch, inflight.mini_batch, inflight.rollout_age) == (0, 2, 5) and inflight.order is order
    assert inflight.rollout == {"x": part.x, "n": 4} and inflight.stats == {"loss": [torch.tensor(1.0)]}
    with pytest.raises(UpdatePreempted) as boundary:  # the epoch's last mini-batch: the next epoch shuffles afresh
        stop_if_preempted(part, part, (0, 2), order, {}, stop_agreed=agreed, **shape)
    assert (boundary.value.inflight.epoch, boundary.value.inflight.mini_batch) == (1, 0)
    assert boundary.value.inflight.order is None
