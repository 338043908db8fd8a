"""``RunCounters``: the PPO run's own counters saved and restored as one unit."""

from dataclasses import fields

from trl_ppo_ext.run.state import RunCounters


def test_counters_round_trip_through_their_state_dict():
    counters = RunCounters(epoch=2, batches=5, stale_discarded=3, nonfinite_steps=1, rollout_age=4,
                           critic_warmup_updates=6, critic_warmup_over=True)
    restored = RunCounters()
    restored.load_state_dict(counters.state_dict())
    assert restored == counters
    # every field is saved: a new counter that state_dict forgot would not survive a resume
    assert {f.name for f in fields(RunCounters)} == {"epoch", "batches", "stale_discarded", "nonfinite_steps",
                                                     "rollout_age", "critic_warmup_updates", "critic_warmup_over"}
    assert restored.state_dict() == {
        "data_cursor": {"epoch": 2, "batches": 5},
        "counters": {"stale_discarded": 3, "nonfinite_steps": 1, "rollout_age": 4, "critic_warmup_updates": 6,
                     "critic_warmup_over": True},
    }


def test_a_ppo_state_written_before_the_class_existed_loads():
    # ppo_state.json as checkpoints written before RunCounters had it: cursor and two counters, no rollout age
    saved = {"kl_controller": {"value": 0.05}, "data_cursor": {"epoch": 1, "batches": 3},
             "counters": {"stale_discarded": 2, "nonfinite_steps": 7}, "world_size": 1}
    counters = RunCounters(rollout_age=9, critic_warmup_updates=4, critic_warmup_over=True)
    counters.load_state_dict(saved)
    assert counters == RunCounters(epoch=1, batches=3, stale_discarded=2, nonfinite_steps=7, rollout_age=0,
                                   critic_warmup_updates=0, critic_warmup_over=False)


def test_a_fresh_run_starts_at_the_first_batch_of_epoch_zero_with_nothing_counted():
    assert RunCounters().state_dict() == {
        "data_cursor": {"epoch": 0, "batches": 0},
        "counters": {"stale_discarded": 0, "nonfinite_steps": 0, "rollout_age": 0, "critic_warmup_updates": 0,
                     "critic_warmup_over": False},
    }
