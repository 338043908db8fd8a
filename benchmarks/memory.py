"""Peak memory of one PPO update cycle: TRL's four models vs a shared LoRA backbone vs 4-bit.

    python benchmarks/memory.py [--hidden 768] [--layers 12] [--heads 12] [--intermediate 2048]
        [--vocab 8000] [--batch 4] [--prompt-length 16] [--response-length 32]
        [--device cpu|cuda] [--threads N] [--setups a b c]

Three set-ups, same random Llama-shaped checkpoints, batch, prompt and response length,
fp32 compute everywhere:

  a  TRL's own trainer (``trl.experimental.ppo.PPOTrainer``): policy, reference, value
     model and reward model, four separate full-precision models;
  b  ``trl_ppo_ext.PPOTrainer`` with a ``SharedActorCritic``: LoRA policy + value head on
     one fp32 base, reference = the disabled adapter, fp32 reward model;
  c  as b with an nf4 base (``load_actor_critic(load_in_4bit=True)``) and an nf4 reward
     model with ``offload_reward_model=True`` (a no-op without CUDA).

The parent saves the two random checkpoints (policy, reward/value) once into a temporary
directory, then runs each set-up in its own subprocess (``--setup X --child``), because
peak RSS is per process and never goes down. A child reports, in MiB:

  import  memory after importing the libraries, before any model exists;
  models  memory after the models and the trainer are built (before the first update);
  cycle   peak during ``trainer.train()`` (one update: rollout, scoring, PPO step), the
          high-water mark being reset after the build;
  peak    the process peak (max of the load peak and the cycle peak): VmHWM / ru_maxrss
          on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA;
  anon    (CPU) highest anonymous RSS, sampled every 5 ms: the peak without clean
          file-backed pages (``from_pretrained`` memory-maps the safetensors file, and the
          pages it touched count in RSS until the map is released).

The table gives each set-up's peak and its ratio to a; the last line is
``memory ratio c/a: <x.xx>``. Nothing is asserted.

Set-up a needs a TRL that has a PPO trainer (1.0 - 1.12; 1.13 removed it). With a newer TRL
it is left out and the run says so: b and c are measured, without ratios to a. On the CPU the peaks move by up to
~200 MiB between runs (glibc keeps freed heap that varies with thread timing), most in c.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a source checkout
RESULT_PREFIX = "MEMORY_RESULT "
SETUPS = {
    "a": "TRL: 4 fp32 models",
    "b": "shared LoRA, fp32",
    "c": "shared LoRA, nf4 + nf4 RM",
}
QUIET_ENV = {  # offline, and no notices that would bury the table
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore",
}
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (multiple of 64)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP size (multiple of 64)")
    parser.add_argument("--vocab", type=int, default=8000, help="tokenizer and embedding rows")
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--setup", choices=list(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("hidden", "intermediate"):
        if getattr(args, name) % 64:
            parser.error(f"--{name}={getattr(args, name)}: bitsandbytes quantizes in blocks of 64 "
                         "input features; pass a multiple of 64 (e.g. 768, 2048).")
    if args.hidden % args.heads:
        parser.error(f"--hidden={args.hidden} is not divisible by --heads={args.heads}.")
    return args


# ---------------------------------------------------------------- measuring memory

def _proc_status_mib(field: str) -> float:
    """One ``kB`` field of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) in MiB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024


class MemoryProbe:
    """Current and peak memory of this process: RSS on the CPU, allocated memory on CUDA.

    On the CPU a daemon thread also samples ``RssAnon`` every ``interval`` seconds, since
    Linux keeps a high-water mark only for the whole RSS (anonymous + file-backed).
    """

    def __init__(self, device: str, interval: float = 0.005):
        self.device = device
        self.anon_peak = 0.0
        if device == "cpu":
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample_anon, args=(interval,), daemon=True)
            self._thread.start()

    def _sample_anon(self, interval: float) -> None:
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _proc_status_mib("RssAnon"))
            self._stop.wait(interval)

    def current(self) -> float:
        import torch

        if self.device == "cuda":
            return torch.cuda.memory_allocated() / MIB
        return _proc_status_mib("VmRSS")

    def peak(self) -> float:
        import torch

        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() / MIB
        return _proc_status_mib("VmHWM")

    def reset_peak(self) -> None:
        """Start a new high-water mark at the current value (Linux >= 4.0: clear_refs 5).
        The sampled anonymous peak is not reset: it stays the process's."""
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def breakdown(self) -> dict[str, float]:
        """Anonymous and file-backed RSS now, in MiB (empty on CUDA)."""
        if self.device == "cuda":
            return {}
        return {"rss_anon": _proc_status_mib("RssAnon"), "rss_file": _proc_status_mib("RssFile")}

    def close(self) -> None:
        if self.device == "cpu":
            self._stop.set()
            self._thread.join()


# ---------------------------------------------------------------- the parent

def build_checkpoints(args, directory: Path) -> dict[str, int]:
    """Save a random causal LM (policy) and a random scalar scorer (reward and value model),
    each with the tokenizer, under ``directory``; returns their parameter counts."""
    import torch

    from trl_ppo_ext.tiny import (
        SPECIAL_TOKENS,
        build_tiny_causal_lm,
        build_tiny_scorer,
        build_tiny_tokenizer,
    )

    words = [f"w{i}" for i in range(args.vocab - len(SPECIAL_TOKENS))]
    tokenizer = build_tiny_tokenizer(words=words)
    sizes = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
             "intermediate_size": args.intermediate,
             "max_position_embeddings": max(256, args.prompt_length + args.response_length)}
    counts = {}
    for name, build, seed in (("policy", build_tiny_causal_lm, 0), ("reward", build_tiny_scorer, 1)):
        model = build(tokenizer, seed=seed, **sizes)
        counts[name] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
        del model
    torch.manual_seed(0)
    return counts


def run_child(args, setup: str, checkpoints: Path) -> dict:
    """Run one set-up in a fresh interpreter and return its result line as a dict."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--setup", setup,
               "--checkpoints", str(checkpoints), "--device", args.device,
               "--batch", str(args.batch), "--prompt-length", str(args.prompt_length),
               "--response-length", str(args.response_length)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    env = {**os.environ, **QUIET_ENV}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU numbers must not depend on a visible GPU
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise RuntimeError(f"set-up {setup} failed (exit code {done.returncode}); its output is above.")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def print_table(results: dict[str, dict], device: str) -> None:
    unit = "RSS" if device == "cpu" else "CUDA allocated"
    print(f"{unit}, MiB; 'peak' is the process peak, 'cycle' the peak of train() alone")
    header = (f"{'setup':<30} | {'import':>7} | {'models':>7} | {'cycle':>7} | {'peak':>7} | "
              f"{'cycle-models':>12} | {'anon peak':>9} | {'peak / a':>8}")
    print(header)
    print("-" * len(header))
    base = results["a"]["peak"] if "a" in results else None
    for setup, r in results.items():
        ratio = f"{r['peak'] / base:>8.2f}" if base else f"{'-':>8}"
        anon = f"{r['anon_peak']:>9.0f}" if r.get("anon_peak") else f"{'-':>9}"
        print(f"{setup + ' ' + SETUPS[setup]:<30} | {r['import']:>7.0f} | {r['models']:>7.0f} | "
              f"{r['cycle']:>7.0f} | {r['peak']:>7.0f} | {r['cycle'] - r['models']:>12.0f} | "
              f"{anon} | {ratio}")


def parent(args) -> None:
    import torch

    start = time.perf_counter()
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
          f"device={args.device}, fp32; Llama hidden={args.hidden} layers={args.layers} "
          f"heads={args.heads} intermediate={args.intermediate} vocab={args.vocab}; "
          f"batch={args.batch}, prompt={args.prompt_length}, response={args.response_length}, "
          "1 update, 1 PPO epoch")
    setups = list(args.setups)
    if "a" in setups:
        from trl_ppo_ext import _compat

        if not _compat.trl_has_ppo():
            setups.remove("a")
            print(f"set-up a left out: trl=={_compat.installed_trl_version()} has no PPO trainer (TRL "
                  f"{_compat.TRL_WITHOUT_PPO} removed it); install trl<{_compat.TRL_WITHOUT_PPO} to measure "
                  "TRL's four models. No ratios to a below.", flush=True)
    with tempfile.TemporaryDirectory(prefix="ppo_memory_") as tmp:
        counts = build_checkpoints(args, Path(tmp))
        print(f"parameters: policy {counts['policy'] / 1e6:.1f}M, "
              f"reward/value model {counts['reward'] / 1e6:.1f}M")
        results = {}
        for setup in setups:
            results[setup] = run_child(args, setup, Path(tmp))
            r = results[setup]
            rss = ""
            if "rss_anon" in r:
                rss = f", at the end anon {r['rss_anon']:.0f} / file {r['rss_file']:.0f} MiB"
            print(f"  {setup}: {r['seconds']:.0f} s, {r['trainable'] / 1e6:.2f}M trainable, "
                  f"{r['held_params'] / 1e6:.1f}M parameters held{rss}", flush=True)
    print_table(results, args.device)
    if "a" in results:
        for setup in ("b", "c"):
            if setup in results:
                anon = ""
                if results["a"].get("anon_peak"):
                    anon = f" (anon peak {results[setup]['anon_peak'] / results['a']['anon_peak']:.2f})"
                print(f"{setup}/a: {results[setup]['peak'] / results['a']['peak']:.2f}{anon}")
    print(f"total runtime: {time.perf_counter() - start:.0f} s")
    if "a" in results and "c" in results:
        print(f"memory ratio c/a: {results['c']['peak'] / results['a']['peak']:.2f}")


# ---------------------------------------------------------------- the children

def prompt_dataset(tokenizer, n: int, length: int):
    """``n`` prompts of ``length`` random ordinary words (same in every child)."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    first_word = tokenizer.convert_tokens_to_ids("w0")
    ids = torch.randint(first_word, len(tokenizer), (n, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def config_kwargs(args, output_dir: str) -> dict:
    """The PPO settings every set-up shares: one update over one batch, one PPO epoch."""
    return {
        "output_dir": output_dir, "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1, "total_episodes": args.batch,
        "response_length": args.response_length, "num_ppo_epochs": 1, "num_mini_batches": 1,
        "local_rollout_forward_batch_size": args.batch, "report_to": [], "disable_tqdm": True,
        "num_sample_generations": 0, "save_strategy": "no", "stop_token": "eos", "seed": 0,
        "bf16": False, "gradient_checkpointing": False,  # neither trainer checkpoints anyway
    }


def build_trl_default(args, ckpt: Path, dataset, tokenizer, output_dir: str):
    """(a) TRL's trainer with four separate fp32 models; the value model starts as the RM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    def causal_lm():
        return AutoModelForCausalLM.from_pretrained(ckpt / "policy", dtype=torch.float32)

    def scorer():
        return AutoModelForSequenceClassification.from_pretrained(ckpt / "reward", dtype=torch.float32)

    return PPOTrainer(
        args=PPOConfig(**config_kwargs(args, output_dir)), processing_class=tokenizer,
        model=causal_lm(), ref_model=causal_lm(), reward_model=scorer(), value_model=scorer(),
        train_dataset=dataset,
    )


def build_shared(args, ckpt: Path, dataset, tokenizer, output_dir: str, *, four_bit: bool):
    """(b) / (c) our trainer on a SharedActorCritic; (c) with an nf4 base and nf4 offloaded RM."""
    import torch

    from trl_ppo_ext import PPOConfig, PPOTrainer
    from trl_ppo_ext.modeling import load_actor_critic, load_reward_model

    model = load_actor_critic(ckpt / "policy", load_in_4bit=four_bit, torch_dtype=torch.float32)
    reward = load_reward_model(ckpt / "reward", load_in_4bit=four_bit, torch_dtype=torch.float32)
    config = PPOConfig(**config_kwargs(args, output_dir), offload_reward_model=four_bit)
    return PPOTrainer(args=config, processing_class=tokenizer, model=model, ref_model=None,
                      reward_model=reward, train_dataset=dataset, value_model=None)


def _held_tensors(trainer) -> list:
    """Every distinct parameter and buffer of the models the trainer holds."""
    models = [trainer.model, getattr(trainer, "ref_model", None), trainer.reward_model]
    seen = {}
    for model in filter(None, models):
        for tensor in [*model.parameters(), *model.buffers()]:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def touch_weights(trainer) -> int:
    """Read every held weight once; returns the number of parameters (nf4 as stored).

    ``from_pretrained`` leaves fp32 weights memory-mapped from the safetensors file, and a
    page counts in RSS only once read: without this, 'models' would show almost nothing
    for a and b, and the embedding rows no prompt uses would never count.
    """
    import torch

    tensors = _held_tensors(trainer)
    for tensor in tensors:
        tensor.detach().sum()  # reads every page, allocates one scalar
    return sum(t.numel() for t in tensors if isinstance(t, torch.nn.Parameter))


def import_libraries(setup: str) -> None:
    """Import what the set-ups use before the import baseline is read: the same set in
    every child, plus bitsandbytes where the set-up quantizes."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import trl_ppo_ext  # noqa: F401
    from trl_ppo_ext import _compat

    _compat.trl_has_ppo()  # imports trl.experimental.ppo where it exists, as before

    if setup == "c":
        from trl_ppo_ext.quantization import import_bitsandbytes

        import_bitsandbytes()


def child(args) -> None:
    import torch

    import_libraries(args.setup)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    probe = MemoryProbe(args.device)
    result = {"import": probe.current()}
    ckpt = Path(args.checkpoints)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppo_memory_out_") as output_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt / "policy")
        dataset = prompt_dataset(tokenizer, args.batch, args.prompt_length)
        if args.setup == "a":
            trainer = build_trl_default(args, ckpt, dataset, tokenizer, output_dir)
        else:
            trainer = build_shared(args, ckpt, dataset, tokenizer, output_dir, four_bit=args.setup == "c")
        result["held_params"] = touch_weights(trainer)
        gc.collect()
        result.update(models=probe.current(), load_peak=probe.peak())
        probe.reset_peak()
        trainer.train()
        result.update(cycle=probe.peak(), anon_peak=probe.anon_peak or None, **probe.breakdown())
        if trainer.state.global_step != 1:
            raise RuntimeError(f"expected one PPO update, the trainer made {trainer.state.global_step}")
        result["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    probe.close()
    result.update(peak=max(result["load_peak"], result["cycle"]), seconds=time.perf_counter() - start)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    os.environ.update(QUIET_ENV)
    args = parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
