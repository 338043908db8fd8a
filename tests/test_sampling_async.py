"""The rollout sampler with ``max_staleness > 0``, driven as the trainer drives it (``next_sample``
before each update, ``end_update`` after) with a fake server engine that stages versions: no vLLM,
a second or two. Checked: which version samples which batch, the trainer's data cursor, a batch too
old never handed out, the request seeds, a resume from a checkpoint that equals the run that went
on, and that ``max_staleness=0`` leaves the synchronous sampler as it was."""

import threading
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from trl_ppo_ext.generation.base import EngineSamples, GenerationEngine
from trl_ppo_ext.sampling import PolicySnapshot, PromptFeed, RolloutSampler, ahead_seed

VOCAB = 50


class FakeFileEngine(GenerationEngine):
    """A server engine with staged versions: each completion is ``[version, prompt's last id, seed
    % VOCAB]`` with log-prob ``-version / 10`` per token; records what it was asked."""

    def __init__(self):
        self.staged, self.used, self.released, self.seeds = [], [], [], []
        self.serving = None
        self.lock = threading.Lock()

    def stage_policy(self, policy, version):
        with self.lock:
            assert version not in self.staged, f"version {version} staged twice"
            self.staged.append(version)

    def use_version(self, version):
        with self.lock:
            assert version in self.staged, f"version {version} was never staged"
            self.serving = version
            self.used.append(version)

    def release_below(self, version):
        self.released.append(version)

    def generate(self, prompts, settings, generator=None):
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        self.seeds.append(seeds)
        ids = [[self.serving, p[-1], s % VOCAB] for p, s in zip(prompts, seeds)]
        return EngineSamples(completion_ids=ids, logprobs=[[-self.serving / 10] * 3 for _ in ids])

    def _push_policy(self, policy, version):
        raise AssertionError("the asynchronous sampler stages versions; it never pushes")


def _args(max_staleness, **kw):
    return SimpleNamespace(response_length=4, temperature=1.0, use_vllm=True, ds3_gather_for_generation=False,
                           max_staleness=max_staleness, seed=0, off_policy_correction="none", off_policy_cap=3.0,
                           **kw)


def _model():
    model = torch.nn.Module()
    model.policy = torch.nn.Linear(1, 1)
    model.is_gradient_checkpointing = False
    return model


def _data(cursor, n_per_epoch=3):
    """The trainer's ``_repeat_dataloader``: batch ``b`` of epoch ``e`` holds the prompts ``[[10 + 3 e + b]]``
    (two rows), starting at the cursor and moving it."""
    def restart():
        while True:
            skip = cursor.batches
            for b in range(n_per_epoch):
                if b < skip:
                    continue
                cursor.batches = b + 1
                token = 10 + 3 * cursor.epoch + b
                yield {"input_ids": torch.tensor([[token], [token]]), "attention_mask": torch.ones(2, 1)}
            cursor.epoch, cursor.batches = cursor.epoch + 1, 0
    return restart


def _sampler(max_staleness, engine):
    return RolloutSampler(_args(max_staleness), SimpleNamespace(pad_token_id=0), Accelerator(cpu=True), (49,),
                          engine_factory=lambda: engine)


def _run(sampler, cursor, steps, start=0, checkpoint_at=None, extra_publishes=0):
    """The trainer's loop: per update ``next_sample``, then ``end_update`` (the global step grows by
    one per update); returns per update (policy_version, prompt token, response ids, cursor)."""
    model, feed = _model(), PromptFeed(_data(cursor), cursor, lambda batch: batch)
    seen = []
    for step in range(start, start + steps):
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        seen.append((batch.policy_version, int(batch.queries[0, -1]), batch.responses.tolist(),
                     (cursor.epoch, cursor.batches)))
        for extra in range(extra_publishes):  # versions published without a batch trained (too many per batch)
            sampler.end_update(PolicySnapshot(model, 100 * (step + 1) + extra, 0))
        version = step + 1 if not extra_publishes else 100 * (step + 2)
        sampler.end_update(PolicySnapshot(model, version, version), checkpoint=step + 1 == checkpoint_at)
    return seen


def test_each_batch_is_sampled_by_the_version_the_schedule_names_and_the_cursor_stays_the_trainers():
    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler = _sampler(2, engine)
    seen = _run(sampler, cursor, steps=5)
    sampler.close_engine()
    # batch i trained at step i is sampled at max(0, i - 2): versions 0, 0, 0, 1, 2
    assert [s[0] for s in seen] == [0, 0, 0, 1, 2]
    # every batch answers its own prompts, data order as a synchronous run reads it (3 per epoch)
    assert [s[1] for s in seen] == [10, 11, 12, 13, 14]
    # the trainer's cursor is at the batch after the one it trains, never at the producer's read-ahead
    assert [s[3] for s in seen] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    # the engine sampled each batch from the version recorded on it (the first token is the version)
    assert [s[2][0][0] for s in seen] == [s[0] for s in seen]
    assert engine.staged == [0, 1, 2, 3, 4, 5]
    assert sampler._producer is None and sampler.engine is None  # closed


def test_a_batch_older_than_max_staleness_is_never_handed_out():
    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler = _sampler(1, engine)
    # two versions per trained batch: a batch sampled ahead falls two versions behind and is sampled again
    model, feed = _model(), PromptFeed(_data(cursor), cursor, lambda batch: batch)
    published, ages = 0, []
    for step in range(4):
        batch = sampler.next_sample(feed, PolicySnapshot(model, published, published))
        ages.append(published - batch.policy_version)
        for _ in range(2):
            published += 1
            sampler.end_update(PolicySnapshot(model, published, published))
    metrics = sampler.async_metrics()
    sampler.close_engine()
    assert max(ages) <= 1, ages
    assert metrics["async/dropped_stale"] > 0 and metrics["async/staleness"] <= 1


def test_request_seeds_come_from_the_batch_index_not_the_runs_rng():
    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler = _sampler(1, engine)
    torch.manual_seed(123)  # whatever the run's RNG holds, the seeds of batch i are the same
    _run(sampler, cursor, steps=3)
    sampler.close_engine()
    expected = [torch.randint(0, 2**31 - 1, (2,), generator=torch.Generator().manual_seed(ahead_seed(0, i))).tolist()
                for i in range(3)]
    assert engine.seeds[:3] == expected


def test_a_run_resumed_from_a_checkpoint_samples_what_the_run_that_went_on_sampled():
    # run A: 5 updates, a checkpoint written after update 2 (its batches in flight discarded and sampled again)
    engine_a, cursor_a = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler_a = _sampler(2, engine_a)
    seen_a = _run(sampler_a, cursor_a, steps=2, checkpoint_at=2)
    saved_cursor, saved_state = (cursor_a.epoch, cursor_a.batches), sampler_a.async_state()
    seen_a += _run(sampler_a, cursor_a, steps=3, start=2)
    sampler_a.close_engine()
    assert saved_state == {"next_index": 2, "version": 2}  # the global step: nothing beyond it to save
    assert saved_cursor == (0, 2)  # the trainer's position, not the read-ahead's
    # run B: a new sampler from the checkpoint (cursor and step), the weights of version 2
    engine_b, cursor_b = FakeFileEngine(), SimpleNamespace(epoch=saved_cursor[0], batches=saved_cursor[1])
    sampler_b = _sampler(2, engine_b)
    seen_b = _run(sampler_b, cursor_b, steps=3, start=2)
    sampler_b.close_engine()
    assert seen_b == seen_a[2:]
    # after the checkpoint the next two batches are sampled from its weights (a synchronisation point)
    assert [s[0] for s in seen_b] == [2, 2, 2]


def test_max_staleness_zero_leaves_the_synchronous_sampler_alone():
    engine = FakeFileEngine()
    sampler = _sampler(0, engine)
    sampler.end_update(PolicySnapshot(_model(), 1, 1), checkpoint=True)  # no producer: nothing happens
    assert sampler.async_metrics() == {} and sampler.async_state() == {}
    assert engine.staged == [] and sampler._producer is None and sampler.engine is None


def test_engines_without_staged_versions_are_refused():
    cursor = SimpleNamespace(epoch=0, batches=0)
    feed = PromptFeed(_data(cursor), cursor, lambda batch: batch)

    class NoStaging(GenerationEngine):  # an engine that pushes at once (the NCCL one, a colocated one)
        generate = _push_policy = None

    sampler = _sampler(1, NoStaging())
    with pytest.raises(NotImplementedError, match="needs an engine that stages versions"):
        sampler.next_sample(feed, PolicySnapshot(_model(), 0, 0))


def test_several_processes_need_an_engine_that_follows_the_versions_process_0_pushes():
    cursor = SimpleNamespace(epoch=0, batches=0)
    feed = PromptFeed(_data(cursor), cursor, lambda batch: batch)
    sampler = _sampler(1, FakeFileEngine())  # stages, but every process would push its own versions
    sampler.accelerator = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True, device="cpu")
    with pytest.raises(NotImplementedError, match="with 2 processes needs a weight push that keeps several"):
        sampler.next_sample(feed, PolicySnapshot(_model(), 0, 0))
