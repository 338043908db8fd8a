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


def test_a_fresh_run_starts_at_the_first_batch_of_epoch_zero_with_nothing_counted():
    assert RunCounters().state_dict() == {
        "data_cursor": {"epoch": 0, "batches": 0},
        "counters": {"stale_discarded": 0, "nonfinite_steps": 0, "rollout_age": 0, "critic_warmup_updates": 0,
                     "critic_warmup_over": False},
    }
