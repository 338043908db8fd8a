"""The rollout producer: version bookkeeping, the staleness bound (a too-old batch is never handed
out), overlap with the consumer, errors surfacing in the consumer, clean shutdown, and resume.
``sample`` here is a pure function of (version, index), as the producer requires."""

import threading
import time

import pytest
import torch

from trl_ppo_ext.async_rollouts import ASYNC_KEYS, RolloutProducer, RolloutProducerError


def sample(version, index):
    """A deterministic batch of (version, index): what a seeded engine holding ``version`` gives."""
    return torch.randn(3, generator=torch.Generator().manual_seed(1000 * version + index))


def run(producer, batches, publishes_per_batch=1, first_version=0):
    """Consume ``batches`` batches, publishing after each as a trainer would; what it got."""
    got, version = [], first_version
    for _ in range(batches):
        got.append(producer.get(timeout=10))
        version += publishes_per_batch
        for v in range(version - publishes_per_batch + 1, version + 1):
            producer.publish(v)
    return got


def test_synchronous_samples_on_demand_without_a_thread():
    calls = []
    before = threading.active_count()
    with RolloutProducer(lambda v, i: calls.append((v, i)) or (v, i), max_staleness=0) as producer:
        assert threading.active_count() == before
        got = run(producer, 3)
    assert calls == [(0, 0), (1, 1), (2, 2)]  # each batch sampled by the newest policy, when asked
    assert [(b.index, b.version, b.staleness) for b in got] == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]
    assert set(producer.metrics()) == set(ASYNC_KEYS)


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_each_batch_records_the_version_that_sampled_it_on_a_fixed_schedule(max_staleness):
    calls = []

    def recorded(version, index):
        calls.append((version, index))
        time.sleep(0.002 * (index % 3))  # uneven sampling times: the schedule must not depend on them
        return sample(version, index)

    with RolloutProducer(recorded, max_staleness=max_staleness) as producer:
        got = run(producer, 8)
    # batch k trained at version k, sampled at max(0, k - s): exactly min(s, k) versions old
    assert [b.index for b in got] == list(range(8))
    assert [b.version for b in got] == [max(0, k - max_staleness) for k in range(8)]
    assert [b.staleness for b in got] == [min(max_staleness, k) for k in range(8)]
    assert all(torch.equal(b.batch, sample(b.version, b.index)) for b in got)
    assert sorted(i for _, i in calls)[:8] == list(range(8))  # every batch sampled once (later ones may be in flight)


def test_the_next_batch_is_sampled_while_the_consumer_trains():
    sampling_next = threading.Event()

    def signalling(version, index):
        if index == 2:
            sampling_next.set()
        return sample(version, index)

    with RolloutProducer(signalling, max_staleness=1) as producer:
        producer.get(timeout=10)
        producer.publish(1)
        assert producer.get(timeout=10).index == 1
        # "training" batch 1: batch 2 (at version 1, already published) is sampled meanwhile
        assert sampling_next.wait(timeout=10)


def test_a_batch_too_old_is_dropped_sampled_again_and_counted():
    calls = []

    def recorded(version, index):
        calls.append((version, index))
        return sample(version, index)

    with RolloutProducer(recorded, max_staleness=1) as producer:
        got = run(producer, 6, publishes_per_batch=2)  # two updates per batch: the schedule runs behind
        dropped = producer.metrics()["async/dropped_stale"]
    assert [b.index for b in got] == list(range(6))  # in order, none skipped, none twice
    assert all(b.staleness <= 1 for b in got)
    assert all(b.staleness == 2 * b.index - b.version for b in got)  # consumer version at batch k is 2k
    assert dropped >= 1
    assert len(calls) > 6  # the dropped ones were sampled again


def test_fewer_publishes_than_batches_does_not_wait_for_ever():
    with RolloutProducer(sample, max_staleness=2) as producer:
        got = [producer.get(timeout=10) for _ in range(6)]  # never publishes: version 0 throughout
    assert [b.version for b in got] == [0] * 6 and [b.staleness for b in got] == [0] * 6


def test_the_producer_waits_for_weights_and_says_so():
    with RolloutProducer(sample, max_staleness=1) as producer:
        producer.get(timeout=10)
        producer.get(timeout=10)  # batch 1 at version 0; batch 2 needs version 1
        time.sleep(0.2)
        producer.publish(1)
        producer.publish(2)
        producer.get(timeout=10)
        metrics = producer.metrics()
    assert metrics["async/wait_for_weights_s"] >= 0.15
    assert metrics["async/staleness"] == 1.0


def test_an_error_in_the_producer_surfaces_in_the_consumer_after_the_batches_before_it():
    def failing(version, index):
        if index == 3:
            raise ValueError("engine gone")
        return sample(version, index)

    producer = RolloutProducer(failing, max_staleness=2)
    assert [b.index for b in run(producer, 3)] == [0, 1, 2]
    with pytest.raises(RolloutProducerError, match="batch 3") as info:
        producer.get(timeout=10)
    assert isinstance(info.value.__cause__, ValueError)
    producer.close()
    assert not producer._thread.is_alive()


def test_a_synchronous_error_names_the_batch():
    def failing(version, index):
        raise OSError("no server")

    with RolloutProducer(failing, max_staleness=0) as producer, pytest.raises(RolloutProducerError, match="batch 0"):
        producer.get()


def test_close_stops_the_thread_wherever_it_waits():
    # waiting for weights / a free slot
    producer = RolloutProducer(sample, max_staleness=2)
    producer.get(timeout=10)
    time.sleep(0.05)
    producer.close()
    assert not producer._thread.is_alive()
    producer.close()  # twice is fine
    with pytest.raises(RuntimeError, match="after close"):
        producer.get(timeout=1)

    # inside a slow sample call: close waits for it to return
    started = threading.Event()

    def slow(version, index):
        started.set()
        time.sleep(0.3)
        return sample(version, index)

    producer = RolloutProducer(slow, max_staleness=1)
    assert started.wait(timeout=10)
    producer.close()
    assert not producer._thread.is_alive()


def test_close_says_when_sample_does_not_return():
    release = threading.Event()
    producer = RolloutProducer(lambda v, i: release.wait(10), max_staleness=1, close_timeout=0.05)
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="did not stop"):
        producer.close()
    release.set()
    producer._thread.join(10)
    assert not producer._thread.is_alive()


def test_get_times_out():
    with RolloutProducer(lambda v, i: time.sleep(0.5), max_staleness=1, close_timeout=5) as producer:
        with pytest.raises(TimeoutError, match="batch 0"):
            producer.get(timeout=0.05)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_resumed_producer_gives_the_batches_of_the_one_that_checkpointed(max_staleness):
    with RolloutProducer(sample, max_staleness=max_staleness) as producer:
        before = run(producer, 3)
        state = producer.checkpoint()  # queued and in-flight batches discarded
        after = run(producer, 5, first_version=3)
    assert state == {"next_index": 3, "version": 3}
    with RolloutProducer(sample, max_staleness=max_staleness, **state) as resumed:
        again = run(resumed, 5, first_version=3)
    key = [(b.index, b.version, b.staleness) for b in after]
    assert [(b.index, b.version, b.staleness) for b in again] == key
    assert all(torch.equal(a.batch, b.batch) for a, b in zip(after, again))
    # the checkpoint is a synchronisation point: the batches after it restart from its version
    assert [b.version for b in after] == [3 + max(0, k - max_staleness) for k in range(5)]
    assert [b.index for b in before + after] == list(range(8))


def test_needed_version_tells_what_may_be_released():
    with RolloutProducer(sample, max_staleness=2) as producer:
        assert producer.needed_version() == 0
        run(producer, 5)
        time.sleep(0.05)
        # batches 5 and 6 (versions 3 and 4) are sampled or next; nothing older is asked for again
        assert producer.needed_version() >= 3


def test_bad_arguments_are_named():
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="max_staleness must be an int"):
            RolloutProducer(sample, max_staleness=bad)
    with RolloutProducer(sample, max_staleness=0, version=4) as producer, pytest.raises(ValueError, match="only grow"):
        producer.publish(3)
