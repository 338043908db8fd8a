"""The rollout sampler with ``max_staleness > 0``, driven as the trainer drives it (``next_sample``
before each update, ``end_update`` after) with a fake server engine that stages versions: no vLLM,
a second or two. Checked: which version samples which batch, the trainer's data cursor, a batch too
old never handed out, the request seeds, a resume from a checkpoint that equals the run that went
on, and that ``max_staleness=0`` leaves the synchronous sampler as it was."""

import threading
import time
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


def _token_batch(epoch, b, n_per_epoch):
    token = 10 + n_per_epoch * epoch + b
    return {"input_ids": torch.tensor([[token], [token]]), "attention_mask": torch.ones(2, 1)}


def _data(cursor, n_per_epoch=3, batch_of=_token_batch):
    """The trainer's ``_repeat_dataloader``: batch ``b`` of epoch ``e`` is ``batch_of(e, b, n_per_epoch)``
    (by default the prompts ``[[10 + 3 e + b]]``, two rows), starting at the cursor and moving it."""
    def restart():
        while True:
            skip = cursor.batches
            for b in range(n_per_epoch):
                if b < skip:
                    continue
                cursor.batches = b + 1
                yield batch_of(cursor.epoch, b, n_per_epoch)
            cursor.epoch, cursor.batches = cursor.epoch + 1, 0
    return restart


def _sampler(max_staleness, engine):
    return RolloutSampler(_args(max_staleness), SimpleNamespace(pad_token_id=0), Accelerator(cpu=True), (49,),
                          engine_factory=lambda: engine)


def _run(sampler, cursor, steps, start=0, checkpoint_at=None, extra_publishes=0, model=None):
    """The trainer's loop: per update ``next_sample``, then ``end_update`` (the global step grows by
    one per update); returns per update (policy_version, prompt token, response ids, cursor)."""
    model, feed = model or _model(), PromptFeed(_data(cursor), cursor, lambda batch: batch)
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


# ---------------------------------------------------------------- episodes sampled ahead
class _Policy(torch.nn.Module):
    """Enough of a causal LM for the sampler: its embedding rows bound the ids of an episode."""

    def __init__(self, vocab):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 1)

    def get_input_embeddings(self):
        return self.embed


def _episode_model(vocab):
    model = torch.nn.Module()
    model.policy = _Policy(vocab)
    model.is_gradient_checkpointing = False
    return model


class FakeToolEngine(FakeFileEngine):
    """A server engine for the tool loop: a prompt without a tool result gets a call of ``mark`` with
    its row's code (the last number of the prompt text), one with a result gets ``Done.``; records,
    per request, the version served, the thread and the rows."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.calls = tok, []

    def generate(self, prompts, settings, generator=None):
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        self.calls.append((self.serving, threading.current_thread().name, len(prompts)))
        texts = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            if "<tool_response>" in text:
                texts.append("Done.<|im_end|>")
            else:
                code = int(text.split("code ")[-1].split("<")[0])
                texts.append('<tool_call>\n{"name": "mark", "arguments": {"x": %d}}\n</tool_call><|im_end|>' % code)
        ids = [self.tok(t).input_ids[: settings.max_tokens] for t in texts]
        self.seeds.append(seeds)
        return EngineSamples(completion_ids=ids, logprobs=[[-self.serving / 10] * len(i) for i in ids])


class Vault:
    """An environment: ``reset`` keeps the row's code, the tool ``mark`` records what the model sent."""

    def reset(self, code, **row):
        self.code, self.marked = code, None

    def mark(self, x: int) -> str:
        """Mark a number.

        Args:
            x: the number.
        """
        self.marked = x
        return "ok"


def _code_batch(epoch, b, n_per_epoch, rows=2):
    """Batch ``b`` holds ``rows`` prompts "code <100 b + r>" (a ``code`` column too) and token prompts."""
    codes = [100 * (n_per_epoch * epoch + b) + r for r in range(rows)]
    return {"input_ids": torch.tensor([[5]] * rows), "attention_mask": torch.ones(rows, 1),
            "prompt": [[{"role": "user", "content": f"code {c}"}] for c in codes], "code": codes}


# a rollout_func receives the decoded prompts: any text does
_TOK = SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, skip_special_tokens: [str(i) for i in ids])


def _tool_sampler(max_staleness, tok, engine, **kw):
    from trl_ppo_ext.agents import AgentRollout

    rollout = AgentRollout(tok, environment_factory=Vault, response_length=200,
                           chat_template_kwargs={"enable_thinking": False})
    args = _args(max_staleness, **kw)
    args.response_length = 200
    return RolloutSampler(args, tok, Accelerator(cpu=True), (tok.eos_token_id,), agent_rollout=rollout,
                          engine_factory=lambda: engine)


def _wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the producer did not get there in time"
        time.sleep(0.01)


def test_tool_episodes_are_sampled_ahead_at_one_version_and_keep_their_own_environments():
    from trl_ppo_ext.tiny import build_tiny_chat_tokenizer

    tok = build_tiny_chat_tokenizer()
    engine, cursor = FakeToolEngine(tok), SimpleNamespace(epoch=0, batches=0)
    max_staleness = 2
    sampler = _tool_sampler(max_staleness, tok, engine)
    model, feed = _episode_model(len(tok)), PromptFeed(_data(cursor, 4, _code_batch), cursor, lambda batch: batch)
    seen = []
    for step in range(5):
        sampler.tool_stats = type(sampler.tool_stats)()  # as the trainer's collect_rollout does
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        # while this batch is "scored", the producer samples the ones after it (up to max_staleness ahead)
        last = min(step + max_staleness, 4)
        _wait_for(lambda: len(engine.calls) >= 2 * (last + 1) or step + max_staleness > 4)
        environments = batch.extras["environments"]
        seen.append((batch.policy_version, batch.extras["code"], [e.code for e in environments],
                     [e.marked for e in environments], sampler.tool_stats.calls))
        sampler.end_update(PolicySnapshot(model, step + 1, step + 1))
    sampler.close_engine()
    assert [s[0] for s in seen] == [0, 0, 0, 1, 2]  # batch i at max(0, i - 2), as single-turn batches
    for version, codes, env_codes, marked, calls in seen:
        # each batch's environments still hold its own rows when it is scored, 2 batches sampled after it
        assert env_codes == codes == marked
        assert calls == 2  # this batch's tool calls only: one per episode
    # every turn (2 per batch: the call, then the answer) on the producer thread at its batch's version
    per_batch = [engine.calls[2 * i: 2 * i + 2] for i in range(5)]
    assert all(c == [(v, "rollout-producer", 2)] * 2 for c, (v, *_) in zip(per_batch, seen))
    # the two turns of batch i draw from one seed stream, a function of the batch index
    stream = torch.Generator().manual_seed(ahead_seed(0, 3))
    assert engine.seeds[6:8] == [torch.randint(0, 2**31 - 1, (2,), generator=stream).tolist() for _ in range(2)]
    # the response: the model's call, the tool result (environment tokens), the answer; log-probs the version's
    assert batch.action_mask.sum().item() < batch.response_mask.sum().item()
    assert torch.allclose(batch.engine_logprobs[batch.action_mask], torch.tensor(-0.2))


def test_environment_slots_never_share_an_instance_between_live_batches():
    from trl_ppo_ext.agents import Environments

    envs = Environments(Vault)
    first, again = envs.draw([None, None], slot=1), envs.draw([None, None], slot=1)
    other, trainer = envs.draw([None, None], slot=2), envs.draw([None], slot=0)
    assert first == again  # a slot reuses its instances, batch after batch
    assert not {id(e) for e in first} & {id(e) for e in other}
    assert trainer[0] is envs.pool[None][0]  # slot 0 starts from the probe, as the synchronous loop
    assert not {id(e) for e in first + other} & {id(trainer[0])}


def test_a_rollout_func_runs_on_the_producer_thread_and_its_turns_sample_the_staged_version():
    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    threads = []

    def rollout_func(prompts):  # TRL's contract with the trainer bound: its turns call generate_continuations
        threads.append(threading.current_thread().name)
        prefixes = [[7] for _ in prompts]
        first, _ = sampler.continue_prefixes(prefixes, 2)
        second, logprobs = sampler.continue_prefixes([p + f for p, f in zip(prefixes, first)], 3)
        return {"prompt_ids": prefixes, "completion_ids": [f + s for f, s in zip(first, second)],
                "logprobs": [[-1.0] * len(f) + lp for f, lp in zip(first, logprobs)]}

    args = _args(1)
    args.response_length = 5  # two turns: 2 tokens, then 3
    sampler = RolloutSampler(args, _TOK, Accelerator(cpu=True), (49,), rollout_func=rollout_func,
                             engine_factory=lambda: engine)
    model, feed = _episode_model(VOCAB), PromptFeed(_data(cursor), cursor, lambda batch: batch)
    versions = []
    for step in range(3):
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        versions.append(batch.policy_version)
        # each turn's first token is the version that sampled it (the fake engine's completions)
        assert batch.responses[:, 0].tolist() == batch.responses[:, 2].tolist() == [batch.policy_version] * 2
        sampler.end_update(PolicySnapshot(model, step + 1, step + 1))
    sampler.close_engine()
    assert versions == [0, 0, 1] and set(threads) == {"rollout-producer"}
    # two turns per batch, each at the batch's version (batch 3, sampled ahead before the close, may follow)
    assert engine.used[:6] == [0, 0, 0, 0, 1, 1]


def test_a_resumed_run_with_a_rollout_func_samples_what_the_run_that_went_on_sampled():
    def make(engine):
        def rollout_func(prompts):
            ids, logprobs = sampler.continue_prefixes([[7]] * len(prompts), 3)
            return {"prompt_ids": [[7]] * len(prompts), "completion_ids": ids, "logprobs": logprobs}
        sampler = RolloutSampler(_args(1), _TOK, Accelerator(cpu=True), (49,), rollout_func=rollout_func,
                                 engine_factory=lambda: engine)
        return sampler

    engine_a, cursor_a = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler_a = make(engine_a)
    model = _episode_model(VOCAB)
    _run_model = lambda sampler, cursor, steps, start=0, checkpoint_at=None: _run(  # noqa: E731
        sampler, cursor, steps, start, checkpoint_at, model=model)
    seen_a = _run_model(sampler_a, cursor_a, 2, checkpoint_at=2)
    saved = (cursor_a.epoch, cursor_a.batches)
    seen_a += _run_model(sampler_a, cursor_a, 3, start=2)
    sampler_a.close_engine()
    engine_b, cursor_b = FakeFileEngine(), SimpleNamespace(epoch=saved[0], batches=saved[1])
    sampler_b = make(engine_b)
    seen_b = _run_model(sampler_b, cursor_b, 3, start=2)
    sampler_b.close_engine()
    assert seen_b == seen_a[2:]  # versions, responses (request seeds from the index) and cursors
    assert [s[0] for s in seen_a] == [0, 0, 2, 2, 3]  # the checkpoint after update 2 is a synchronisation point
    # the request seeds of batches 2-4, exactly (either run may sample batch 5 ahead before its close)
    assert all(seeds in engine_a.seeds for seeds in engine_b.seeds[:3])


def test_several_samples_per_prompt_stay_together_in_their_batch_for_the_group_estimators():
    from trl_ppo_ext.data import repeat_prompts
    from trl_ppo_ext.estimators import rloo_advantages

    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler = _sampler(1, engine)
    model = _model()
    feed = PromptFeed(_data(cursor), cursor, lambda batch: repeat_prompts(batch, 2))  # the trainer's repeated_prompts
    for step in range(3):
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        prompts, seeds = batch.queries[:, -1].tolist(), batch.responses[:, 2].tolist()
        # 2 prompt rows x 2 samples, the copies adjacent; one version for the batch; seeds differ per row
        assert prompts == [10 + step] * 4 and batch.responses[:, 0].tolist() == [batch.policy_version] * 4
        assert len(set(seeds)) == 4
        scores = torch.tensor(seeds, dtype=torch.float32)
        # RLOO: each sample's score minus the other sample of its group (G = 2), computed by hand
        expected = torch.tensor([seeds[0] - seeds[1], seeds[1] - seeds[0], seeds[2] - seeds[3], seeds[3] - seeds[2]],
                                dtype=torch.float32)
        assert torch.equal(rloo_advantages(scores, 2), expected)
        sampler.end_update(PolicySnapshot(model, step + 1, step + 1))
    sampler.close_engine()


def test_a_dataset_column_rides_with_its_batch_sampled_ahead_for_the_critics_context():
    """A privileged critic's context (``critic_context_column``) is built from the batch's own column when the
    trainer scores it: the column reaches each batch sampled ahead with its rows, and the critic's prompts
    are each row's context before its prompt."""
    from trl_ppo_ext.critic_context import with_critic_context
    from trl_ppo_ext.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()

    def answered(epoch, b, n_per_epoch):
        return {**_token_batch(epoch, b, n_per_epoch), "answer": ["w1", f"w{b} w{b + 2}"]}

    engine, cursor = FakeFileEngine(), SimpleNamespace(epoch=0, batches=0)
    sampler, model = _sampler(1, engine), _model()
    feed = PromptFeed(_data(cursor, batch_of=answered), cursor, lambda batch: batch)
    for step in range(3):
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        assert batch.extras["answer"] == ["w1", f"w{step} w{step + 2}"]
        ids = with_critic_context(batch, tok, "answer").critic_queries.tolist()
        w = tok.convert_tokens_to_ids
        assert ids == [[tok.pad_token_id, w("w1"), 10 + step], [w(f"w{step}"), w(f"w{step + 2}"), 10 + step]]
        sampler.end_update(PolicySnapshot(model, step + 1, step + 1))
    sampler.close_engine()
