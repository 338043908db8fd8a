"""Asynchronous rollouts (``max_staleness=1``) on 2 processes (gloo, CPU), launched by
tests/test_sampling_async_launch.py: each process's ``RolloutSampler`` samples its own shard of the
prompts from one fake "server" (a folder both processes see): process 0 pushes every version (a file
``v<k>`` written after a delay, as a slow push), the other process follows it, and every switch to
a version (``use_version``) checks that its file is there. Between batches the trainer's thread runs
an all-reduce (the trainer's collectives) while the producer threads sample. Episodes come from a
``rollout_func`` whose two turns sample on the producer thread. Writes ``<out>/rank<k>.json``:
per update the batch's version, its prompts, the all-reduced versions; and what the engine saw."""

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import Accelerator

from trl_ppo_ext.generation.base import EngineSamples, GenerationEngine
from trl_ppo_ext.sampling import PolicySnapshot, PromptFeed, RolloutSampler

VOCAB = 50
PUSH_SECONDS = 0.2  # process 0's push is slow: a follower that did not wait would find no file


class FolderServer(GenerationEngine):
    """A server every process reaches: versions are files in ``folder``; a completion is
    ``[version, prompt's last id, seed % VOCAB]``."""

    follows_versions = True

    def __init__(self, folder):
        self.folder, self.serving = Path(folder), None
        self.pushed, self.followed, self.used, self.threads = [], [], [], set()

    def _file(self, version):
        return self.folder / f"v{version}"

    def stage_policy(self, policy, version):
        raise AssertionError("with several processes process 0 pushes (push_version), the others follow")

    def push_version(self, policy, version):
        time.sleep(PUSH_SECONDS)
        self._file(version).write_text("weights")
        self.pushed.append(version)

    def follow_version(self, version):
        assert self._file(version).exists(), f"version {version} followed before process 0 pushed it"
        self.followed.append(version)

    def use_version(self, version):
        assert self._file(version).exists(), f"switched to version {version} before its push was done"
        self.serving = version
        self.used.append(version)

    def release_below(self, version):
        pass

    def generate(self, prompts, settings, generator=None):
        self.threads.add(threading.current_thread().name)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        ids = [[self.serving, p[-1], s % VOCAB][: settings.max_tokens] for p, s in zip(prompts, seeds)]
        return EngineSamples(completion_ids=ids, logprobs=[[-0.1] * len(i) for i in ids])

    def _push_policy(self, policy, version):
        raise AssertionError("the asynchronous sampler never pushes at once")


def main(out: Path, folder: Path, steps: int = 4):
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    engine = FolderServer(folder)
    args = SimpleNamespace(response_length=4, temperature=1.0, use_vllm=True, ds3_gather_for_generation=False,
                           max_staleness=1, seed=0, off_policy_correction="none", off_policy_cap=3.0)
    tok = SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, skip_special_tokens: [str(i) for i in ids])

    def rollout_func(prompts):  # two turns, each through the sampler (the trainer's generate_continuations)
        prefixes = [[int(p.strip("[]").split(",")[-1])] for p in prompts]
        first, _ = sampler.continue_prefixes(prefixes, 1)
        second, logprobs = sampler.continue_prefixes([p + f for p, f in zip(prefixes, first)], 3)
        return {"prompt_ids": prefixes, "completion_ids": [f + s for f, s in zip(first, second)],
                "logprobs": [[-0.1] + lp for lp in logprobs]}

    sampler = RolloutSampler(args, tok, accelerator, (49,), rollout_func=rollout_func, engine_factory=lambda: engine)
    cursor = SimpleNamespace(epoch=0, batches=0)

    def shard():  # this process's shard: batch b holds prompt 10 + 2 b + rank (two rows)
        while True:
            b = cursor.batches
            cursor.batches += 1
            token = 10 + 2 * b + rank
            yield {"input_ids": torch.tensor([[token], [token]]), "attention_mask": torch.ones(2, 1)}

    model = torch.nn.Module()
    model.policy = torch.nn.Embedding(VOCAB, 1)  # enough of a policy: its embedding rows bound the ids
    model.policy.get_input_embeddings = lambda: model.policy
    model.is_gradient_checkpointing = False
    feed = PromptFeed(shard, cursor, lambda batch: batch)
    updates = []
    for step in range(steps):
        batch = sampler.next_sample(feed, PolicySnapshot(model, step, step))
        versions = torch.tensor([batch.policy_version, rank])  # the trainer's collective, producer running
        gathered = accelerator.gather(versions.unsqueeze(0)).tolist()
        updates.append({"step": step, "version": batch.policy_version, "prompt": int(batch.queries[0, -1]),
                        "turn_versions": [batch.responses[0, 0].item(), batch.responses[0, 1].item()],
                        "gathered": gathered})
        sampler.end_update(PolicySnapshot(model, step + 1, step + 1))
    sampler.close_engine()
    report = {"updates": updates, "pushed": engine.pushed, "followed": engine.followed, "used": engine.used,
              "threads": sorted(engine.threads)}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_setup import run_and_exit

    out_dir, server_dir = Path(sys.argv[1]), Path(sys.argv[2])
    run_and_exit(lambda: main(out_dir, server_dir))
