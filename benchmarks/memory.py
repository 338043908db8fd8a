"""Peak memory of one PPO update cycle: TRL's four models vs a shared LoRA backbone vs 4-bit.

    python benchmarks/memory.py [--hidden 768] [--layers 12] [--heads 12] [--intermediate 2048]
        [--vocab 8000] [--batch 4] [--prompt-length 16] [--response-length 32]
        [--device cpu|cuda] [--bf16] [--gradient-checkpointing] [--threads N]
        [--setups a b c] [--json-out FILE]

Three set-ups, same random Llama-shaped checkpoints, batch, prompt and response length:

  a  TRL's own trainer (``trl.experimental.ppo.PPOTrainer``): policy, reference, value
     model and reward model, four separate full-precision models;
  b  ``trl_ppo_ext.PPOTrainer`` with a ``SharedActorCritic``: LoRA policy + value head on
     one base, reference = the disabled adapter, a reward model of the base's dtype;
  c  as b with an nf4 base (``load_actor_critic(load_in_4bit=True)``) and an nf4 reward
     model with ``offload_reward_model=True`` (a no-op without CUDA). On CUDA the offloaded
     reward model is quantized on the CPU and never held on the GPU outside scoring;
  d  (not run by default) ``trl_ppo_ext.PPOTrainer`` with a's four separate models: what
     the memory model's ``shared=False`` describes (TRL's trainer keeps more, e.g. the
     ``(B, T, V)`` generation scores).

Precision: fp32 weights and compute by default. ``--bf16`` (CUDA only) passes
``PPOConfig(bf16=True)`` and loads b's and c's bases and reward models in bf16 (c: bf16
compute dtype); a keeps fp32 weights (bf16 autocast, as accelerate does for
``bf16=True``). Whether autocast was on during the update's forward, and the dtype of the
logits there, is read from a hook on the policy's ``lm_head`` and printed: "bf16 in
effect" is then a fact, not a flag. ``--gradient-checkpointing`` enables non-reentrant
activation checkpointing on the trained model(s) themselves
(``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``,
plus ``enable_input_require_grads()`` on a frozen base) and sets
``PPOConfig(gradient_checkpointing=True)``, so the table shows it even where a trainer
would not apply the flag itself.

The parent saves the two random checkpoints (policy, reward/value) once into a temporary
directory, then runs each set-up in its own subprocess (``--setup X --child``), because
peak RSS is per process and never goes down. A child reports, in MiB:

  import  memory after importing the libraries, before any model exists;
  models  memory after the models and the trainer are built (before the first update);
  cycle   peak during ``trainer.train()`` (one update: rollout, scoring, PPO step), the
          high-water mark being reset after the build; also per phase (generation,
          scoring, update: ours by wrapping ``generate_rollout``/``score_rollout``/
          ``ppo_update``, TRL's by swapping its module-level ``batch_generation``,
          ``forward`` and ``get_reward``; its update is the rest of ``train()``);
  peak    the process peak (max of the load peak and the cycle peak).

Measures: on the CPU, RSS (VmHWM, reset with /proc/self/clear_refs), the highest
anonymous RSS sampled every 5 ms (without clean file-backed pages of memory-mapped
checkpoints), and live tensor bytes (``trl_ppo_ext.memory.live_tensor_bytes``: every
storage an ATen op returns, counted while it lives; the CPU analogue of
``torch.cuda.memory_allocated``). On CUDA, ``torch.cuda.max_memory_allocated`` (tensors),
``max_memory_reserved`` (what the caching allocator holds) and the context: device memory
in use (``torch.cuda.mem_get_info``) minus reserved, read after the run (CUDA context,
loaded kernels, cuBLAS handles); context + reserved peak is what the card must hold.

Each set-up is also predicted by the memory model (``trl_ppo_ext.memory.estimate``) for
the same shapes and run; the second table gives predicted vs measured per phase (live
tensor bytes on the CPU, allocated bytes on CUDA) and the error. The ratio table's last
line is ``memory ratio c/a: <x.xx>``. Nothing is asserted. Set-up a needs a TRL that has a PPO
trainer (1.0 - 1.12); with a newer TRL it is left out, and the run says so. On the CPU the RSS peaks move by
up to ~200 MiB between runs (glibc keeps freed heap that varies with thread timing).
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
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a source checkout
RESULT_PREFIX = "MEMORY_RESULT "
SETUPS = {
    "a": "TRL: 4 full models",
    "b": "shared LoRA",
    "c": "shared LoRA, nf4 + nf4 RM",
    "d": "ours: 4 full models",
}
PHASES = ("generation", "scoring", "update")
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
    parser.add_argument("--bf16", action="store_true", help="bf16 weights/autocast (CUDA only; see above)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="checkpoint the trained model(s)' layers (see above)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=["a", "b", "c"])
    parser.add_argument("--no-tensor-tracking", action="store_true",
                        help="CPU: skip the live-tensor count (it slows every op)")
    parser.add_argument("--json-out", help="also write every result and prediction to this file")
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
    if args.bf16 and args.device != "cuda":
        parser.error("--bf16 needs --device cuda: on the CPU the package computes 4-bit models in fp32 "
                     "and ignores bf16 (trl_ppo_ext.models.quantization.resolve_compute_dtype).")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device.")
    return args


# ---------------------------------------------------------------- measuring memory

def _proc_status_mib(field: str) -> float:
    """One ``kB`` field of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) in MiB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024


class MemoryProbe:
    """Current and peak memory of this process, as a dict of measures in MiB.

    CPU: ``rss`` (VmRSS / VmHWM) and, if ``tensors`` is a ``live_tensor_bytes()`` tracker,
    ``tensors``; a daemon thread also samples ``RssAnon`` every ``interval`` seconds, since
    Linux keeps a high-water mark only for the whole RSS. CUDA: ``allocated`` and
    ``reserved`` from the caching allocator.
    """

    def __init__(self, device: str, tensors=None, interval: float = 0.005):
        self.device = device
        self.tensors = tensors
        self.anon_peak = 0.0
        if device == "cpu":
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample_anon, args=(interval,), daemon=True)
            self._thread.start()

    def _sample_anon(self, interval: float) -> None:
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _proc_status_mib("RssAnon"))
            self._stop.wait(interval)

    def current(self) -> dict[str, float]:
        import torch

        if self.device == "cuda":
            return {"allocated": torch.cuda.memory_allocated() / MIB, "reserved": torch.cuda.memory_reserved() / MIB}
        out = {"rss": _proc_status_mib("VmRSS")}
        if self.tensors is not None:
            out["tensors"] = self.tensors.current / MIB
        return out

    def peak(self) -> dict[str, float]:
        import torch

        if self.device == "cuda":
            return {"allocated": torch.cuda.max_memory_allocated() / MIB,
                    "reserved": torch.cuda.max_memory_reserved() / MIB}
        out = {"rss": _proc_status_mib("VmHWM")}
        if self.tensors is not None:
            out["tensors"] = self.tensors.peak / MIB
        return out

    def reset_peak(self) -> None:
        """Start new high-water marks at the current values (Linux >= 4.0: clear_refs 5).
        The sampled anonymous peak is not reset: it stays the process's."""
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if self.tensors is not None:
            self.tensors.reset_peak()

    def extras(self) -> dict[str, float]:
        """CPU: anonymous and file-backed RSS now; CUDA: context (device use - reserved)."""
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return {"context": (total - free - torch.cuda.memory_reserved()) / MIB, "device_total": total / MIB}
        return {"rss_anon": _proc_status_mib("RssAnon"), "rss_file": _proc_status_mib("RssFile")}

    def close(self) -> None:
        if self.device == "cpu":
            self._stop.set()
            self._thread.join()


class PhasePeaks:
    """Peak of each measure per phase: the high-water mark is folded into the phase that
    just ended and reset at every boundary; time outside any phase goes to ``remainder``."""

    def __init__(self, probe: MemoryProbe, remainder: str):
        self.probe = probe
        self.remainder = remainder
        self.peaks: dict[str, dict[str, float]] = {}
        self._depth = 0

    def _fold(self, name: str) -> None:
        old = self.peaks.get(name, {})
        self.peaks[name] = {k: max(v, old.get(k, 0.0)) for k, v in self.probe.peak().items()}
        self.probe.reset_peak()

    @contextmanager
    def phase(self, name: str):
        if self._depth:  # nested (a forward inside scoring): counted in the outer phase
            yield
            return
        self._fold(self.remainder)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._fold(name)

    def close(self) -> dict[str, dict[str, float]]:
        self._fold(self.remainder)
        return self.peaks


def instrument_ours(trainer, phases: PhasePeaks) -> None:
    """Wrap our trainer's phase methods on the instance (``train()`` calls ``self.X``)."""
    for method, phase in (("generate_rollout", "generation"), ("score_rollout", "scoring"),
                          ("ppo_update", "update")):
        original = getattr(trainer, method)

        def wrapped(*args, _original=original, _phase=phase, **kwargs):
            with phases.phase(_phase):
                return _original(*args, **kwargs)

        setattr(trainer, method, wrapped)


@contextmanager
def instrument_upstream(trainer, phases: PhasePeaks):
    """Swap the module-level helpers TRL's ``train()`` calls: generation, and the no-grad
    reference/value/reward forwards of scoring; the update is what remains."""
    import torch

    module = sys.modules[type(trainer).__module__]
    original = {name: getattr(module, name) for name in ("batch_generation", "forward", "get_reward")}

    def in_phase(name, fn, only_without_grad):
        def wrapped(*args, **kwargs):
            if only_without_grad and torch.is_grad_enabled():
                return fn(*args, **kwargs)
            with phases.phase(name):
                return fn(*args, **kwargs)
        return wrapped

    module.batch_generation = in_phase("generation", original["batch_generation"], False)
    module.forward = in_phase("scoring", original["forward"], True)
    module.get_reward = in_phase("scoring", original["get_reward"], True)
    try:
        yield
    finally:
        for name, fn in original.items():
            setattr(module, name, fn)


class PrecisionProbe:
    """Whether autocast was on, and the logits' dtype, in the update's (grad-enabled)
    forward of the policy's ``lm_head``."""

    def __init__(self, model, device_type: str):
        import torch

        self.seen: set[tuple[bool, str]] = set()
        head = next((m for name, m in model.named_modules() if name.endswith("lm_head")), None)
        if head is None:
            self._handle = None
            return

        def hook(module, inputs, output):
            if torch.is_grad_enabled():
                self.seen.add((torch.is_autocast_enabled(device_type), str(output.dtype).removeprefix("torch.")))

        self._handle = head.register_forward_hook(hook)

    def summary(self) -> dict:
        if self._handle is not None:
            self._handle.remove()
        return {"update_autocast": sorted({a for a, _ in self.seen}),
                "update_logits_dtype": sorted({d for _, d in self.seen})}


# ---------------------------------------------------------------- the memory model

def predicted(args, setup: str):
    """``trl_ppo_ext.memory.estimate`` for one set-up of this benchmark."""
    from trl_ppo_ext.memory import ModelShape, PPORun, estimate

    shape = ModelShape(args.hidden, args.layers, args.heads, args.intermediate, args.vocab, name="benchmark")
    cuda = args.device == "cuda"
    compute = "bf16" if args.bf16 else "fp32"
    base = {"a": "fp32", "b": "bf16" if args.bf16 else "fp32", "c": "nf4", "d": "fp32"}[setup]
    run = PPORun(
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, num_mini_batches=1,
        local_rollout_forward_batch_size=args.batch, prompt_length=args.prompt_length,
        response_length=args.response_length, base_dtype=base, compute_dtype=compute, shared=setup in "bc",
        offload_reward_model=setup == "c" and cuda, gradient_checkpointing=args.gradient_checkpointing,
    )
    return estimate(shape, run, first_update=True)  # the benchmark runs one update


# ---------------------------------------------------------------- the parent

def build_checkpoints(args, directory: Path) -> dict[str, int]:
    """Save a random causal LM (policy) and a random scalar scorer (reward and value model),
    each with the tokenizer, under ``directory``; returns their parameter counts."""

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
    return counts


def run_child(args, setup: str, checkpoints: Path) -> dict:
    """Run one set-up in a fresh interpreter and return its result line as a dict."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--setup", setup,
               "--checkpoints", str(checkpoints), "--device", args.device, "--batch", str(args.batch),
               "--prompt-length", str(args.prompt_length),
               "--response-length", str(args.response_length)]
    for flag in ("bf16", "gradient_checkpointing", "no_tensor_tracking"):
        if getattr(args, flag):
            command.append("--" + flag.replace("_", "-"))
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


def main_measure(device: str) -> str:
    """The measure the ratios use: RSS on the CPU, allocated bytes on CUDA."""
    return "rss" if device == "cpu" else "allocated"


def print_table(results: dict[str, dict], device: str) -> None:
    key = main_measure(device)
    unit = "RSS" if device == "cpu" else "CUDA allocated"
    print(f"{unit}, MiB; 'peak' is the process peak, 'cycle' the peak of train() alone")
    extra = "anon peak" if device == "cpu" else "reserved peak"
    header = (f"{'setup':<30} | {'import':>7} | {'models':>7} | {'cycle':>7} | {'peak':>7} | "
              f"{'cycle-models':>12} | {extra:>13} | {'peak / a':>8}")
    print(header)
    print("-" * len(header))
    base = results["a"]["peak"][key] if "a" in results else None
    for setup, r in results.items():
        ratio = f"{r['peak'][key] / base:>8.2f}" if base else f"{'-':>8}"
        second = r.get("anon_peak") if device == "cpu" else r["peak"].get("reserved")
        second = f"{second:>13.0f}" if second else f"{'-':>13}"
        print(f"{setup + ' ' + SETUPS[setup]:<30} | {r['import'][key]:>7.0f} | {r['models'][key]:>7.0f} | "
              f"{r['cycle'][key]:>7.0f} | {r['peak'][key]:>7.0f} | {r['cycle'][key] - r['models'][key]:>12.0f} | "
              f"{second} | {ratio}")
    if device == "cuda":
        for setup, r in results.items():
            print(f"  {setup}: context {r['context']:.0f} MiB + reserved peak {r['peak']['reserved']:.0f} MiB "
                  f"= {r['context'] + r['peak']['reserved']:.0f} MiB of the card's {r['device_total']:.0f}; "
                  f"load peak (allocated) {r['load_peak']['allocated']:.0f} MiB")


def print_model_table(results: dict[str, dict], predictions: dict, device: str) -> None:
    """Predicted vs measured, per phase: live tensor bytes (CPU) or allocated bytes (CUDA)."""
    key = "tensors" if device == "cpu" else "allocated"
    if not all(key in r["phases"].get("update", {}) for r in results.values()):
        return
    print(f"\nmemory model vs measured ({'live tensor bytes' if device == 'cpu' else 'CUDA allocated'}), MiB; "
          "error = predicted / measured - 1")
    header = f"{'setup':<30} | " + " | ".join(f"{p:>26}" for p in (*PHASES, "peak"))
    print(header)
    print("-" * len(header))
    for setup, r in results.items():
        e = predictions[setup]
        cells = []
        for phase in PHASES:
            measured = r["phases"].get(phase, {}).get(key)
            guess = e.phase_total(phase) / MIB
            cells.append(f"{guess:>7.1f} vs {measured:>7.1f} {guess / measured - 1:>+6.1%}" if measured
                         else f"{'-':>26}")
        measured_peak = max(r["phases"][p][key] for p in PHASES if p in r["phases"])
        cells.append(f"{e.peak / MIB:>7.1f} vs {measured_peak:>7.1f} {e.peak / MIB / measured_peak - 1:>+6.1%}")
        print(f"{setup + ' ' + SETUPS[setup]:<30} | " + " | ".join(cells))
    if device == "cpu":
        print("RSS above the import baseline (cycle - import) vs predicted peak: " + ", ".join(
            f"{s} {r['cycle']['rss'] - r['import']['rss']:.0f} vs {predictions[s].peak / MIB:.0f}"
            for s, r in results.items()))


def parent(args) -> None:
    import torch

    start = time.perf_counter()
    precision = "bf16" if args.bf16 else "fp32"
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
          f"device={args.device}{' (' + torch.cuda.get_device_name() + ')' if args.device == 'cuda' else ''}, "
          f"{precision}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; "
          f"Llama hidden={args.hidden} layers={args.layers} heads={args.heads} "
          f"intermediate={args.intermediate} vocab={args.vocab}; batch={args.batch}, "
          f"prompt={args.prompt_length}, response={args.response_length}, 1 update, 1 PPO epoch")
    setups = list(args.setups)
    if "a" in setups:
        from trl_ppo_ext import _compat

        if not _compat.trl_has_ppo():
            setups.remove("a")
            print(f"set-up a (TRL's four models) left out, so no ratios to a below. {_compat.trl_ppo_hint()}",
                  flush=True)
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
                  f"{r['held_params'] / 1e6:.1f}M parameters held{rss}; update forward: autocast "
                  f"{r['precision']['update_autocast']}, logits {r['precision']['update_logits_dtype']}",
                  flush=True)
    predictions = {setup: predicted(args, setup) for setup in results}
    print_table(results, args.device)
    print_model_table(results, predictions, args.device)
    key = main_measure(args.device)
    if "a" in results:
        for setup in ("b", "c"):
            if setup in results:
                anon = ""
                if results["a"].get("anon_peak"):
                    anon = f" (anon peak {results[setup]['anon_peak'] / results['a']['anon_peak']:.2f})"
                print(f"{setup}/a: {results[setup]['peak'][key] / results['a']['peak'][key]:.2f}{anon}")
    print(f"total runtime: {time.perf_counter() - start:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "checkpoints"}, "results": results,
                       "predicted": {s: {"phases": e.phases, "peak": e.peak} for s, e in predictions.items()}},
                      f, indent=2)
    if "a" in results and "c" in results:
        print(f"memory ratio c/a: {results['c']['peak'][key] / results['a']['peak'][key]:.2f}")


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
        "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
        "use_cpu": args.device == "cpu",
    }


def enable_checkpointing(model, frozen_base=None) -> None:
    """Non-reentrant activation checkpointing on ``model``; a frozen base also gets
    ``enable_input_require_grads`` (needed by reentrant checkpointing, harmless here)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if frozen_base is not None:
        frozen_base.enable_input_require_grads()


def build_four_models(args, ckpt: Path, dataset, tokenizer, output_dir: str, *, ours: bool):
    """(a) TRL's trainer, (d) ours, with four separate fp32 models; the value model starts
    as the RM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if ours:
        from trl_ppo_ext import PPOConfig, PPOTrainer
    else:
        from trl.experimental.ppo import PPOConfig, PPOTrainer

    def causal_lm():
        return AutoModelForCausalLM.from_pretrained(ckpt / "policy", dtype=torch.float32)

    def scorer():
        return AutoModelForSequenceClassification.from_pretrained(ckpt / "reward", dtype=torch.float32)

    policy, value = causal_lm(), scorer()
    if args.gradient_checkpointing:
        enable_checkpointing(policy)
        enable_checkpointing(value)
    return PPOTrainer(
        args=PPOConfig(**config_kwargs(args, output_dir)), processing_class=tokenizer,
        model=policy, ref_model=causal_lm(), reward_model=scorer(), value_model=value,
        train_dataset=dataset,
    )


def load_offloaded_4bit_reward_model(path: Path, dtype):
    """An nf4 reward model quantized on the CPU, to be moved to the GPU only for scoring.

    ``load_reward_model(device_map="cpu")`` would also quantize on the CPU but then computes
    in fp32 there (the package's CPU rule); here the compute dtype is the run's.
    """
    from transformers import AutoModelForSequenceClassification

    from trl_ppo_ext.models.quantization import make_4bit_cpu_safe, nf4_quantization_config

    model = AutoModelForSequenceClassification.from_pretrained(
        path, quantization_config=nf4_quantization_config(dtype), dtype=dtype, device_map={"": "cpu"})
    make_4bit_cpu_safe(model)
    return model.requires_grad_(False).eval()


def build_shared(args, ckpt: Path, dataset, tokenizer, output_dir: str, *, four_bit: bool):
    """(b) / (c) our trainer on a SharedActorCritic; (c) with an nf4 base and nf4 offloaded RM."""
    import torch

    from trl_ppo_ext import PPOConfig, PPOTrainer
    from trl_ppo_ext.models.loading import load_actor_critic, load_reward_model

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    offload = four_bit and args.device == "cuda"
    if offload:  # quantized and parked on the CPU before anything is on the GPU
        reward = load_offloaded_4bit_reward_model(ckpt / "reward", dtype)
    else:
        reward = load_reward_model(ckpt / "reward", load_in_4bit=four_bit, torch_dtype=dtype)
    model = load_actor_critic(ckpt / "policy", load_in_4bit=four_bit, torch_dtype=dtype)
    if args.gradient_checkpointing:
        enable_checkpointing(model, frozen_base=model.policy.get_base_model())
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

    _compat.trl_has_ppo()  # imports trl.experimental.ppo where it exists

    if setup == "c":
        from trl_ppo_ext.models.quantization import import_bitsandbytes

        import_bitsandbytes()


def child(args) -> None:
    import torch

    from trl_ppo_ext.memory import live_tensor_bytes

    import_libraries(args.setup)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.init()
    tracker = live_tensor_bytes() if args.device == "cpu" and not args.no_tensor_tracking else None
    with tracker if tracker is not None else nullcontext():
        if tracker is not None:
            tracker.count_existing()
        probe = MemoryProbe(args.device, tensors=tracker)
        result = {"import": probe.current()}
        ckpt = Path(args.checkpoints)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ppo_memory_out_") as output_dir:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ckpt / "policy")
            dataset = prompt_dataset(tokenizer, args.batch, args.prompt_length)
            if args.setup in "ad":
                trainer = build_four_models(args, ckpt, dataset, tokenizer, output_dir, ours=args.setup == "d")
            else:
                trainer = build_shared(args, ckpt, dataset, tokenizer, output_dir, four_bit=args.setup == "c")
            result["held_params"] = touch_weights(trainer)
            gc.collect()
            result.update(models=probe.current(), load_peak=probe.peak())
            probe.reset_peak()
            phases = PhasePeaks(probe, remainder="update")
            precision = PrecisionProbe(trainer.model, args.device)
            if args.setup == "a":
                with instrument_upstream(trainer, phases):
                    trainer.train()
            else:
                instrument_ours(trainer, phases)
                trainer.train()
            result["phases"] = phases.close()
            result["cycle"] = {k: max(p[k] for p in result["phases"].values()) for k in result["models"]}
            result.update(anon_peak=probe.anon_peak or None, precision=precision.summary(), **probe.extras())
            if trainer.state.global_step != 1:
                raise RuntimeError(f"expected one PPO update, the trainer made {trainer.state.global_step}")
            result["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        probe.close()
    result["peak"] = {k: max(result["load_peak"][k], result["cycle"][k]) for k in result["cycle"]}
    result["seconds"] = time.perf_counter() - start
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
