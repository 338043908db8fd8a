"""Rollout generation alone: vLLM (colocated engine) vs transformers' generate, one process, and
what a weight sync costs (full weights; with ``--lora``, a LoRA policy as a vLLM adapter and as
merged weights).

    python benchmarks/generation_speed.py [--size 100m|tiny] [--prompts 16] [--response-length 32]
        [--repeats 3] [--threads 1] [--lora] [--enforce-eager]

Same random Llama-shaped fp32 policy as benchmarks/throughput.py (100m: hidden 768, 12 layers,
12 heads, MLP 2048, 8000-token vocabulary, 97.2M parameters), same prompts (random words, 8-16
tokens) and sampling (temperature 1, stop at EOS) for both arms. The transformers arm is the
trainer's own path (``generation.transformers_generate.generate_responses`` with its ``sampling_config``, the whole
batch in one chunk); the vLLM arm is ``VLLMColocateEngine.generate``. Each arm runs once as a
warm-up (vLLM's first call compiles), then ``--repeats`` times, alternating (the machine is
shared and its load drifts); the table shows medians, and the last line is
``generation speed-up vllm/transformers: <x.xx>`` (median transformers seconds / median vLLM
seconds). Engine start and the first (compiling) call are reported apart. Timings are never
asserted anywhere. Needs vLLM (docs/vllm.md); run it as a script (vLLM spawns: the
``__main__`` guard matters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRL_EXPERIMENTAL_SILENCE", "1"), ("OMP_NUM_THREADS", "1"),
                      ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                      ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

SIZES = {
    "tiny": dict(words=40, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256),
    "100m": dict(words=7994, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048),
}


def build_policy(size: str):
    from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_tokenizer, default_words

    spec = dict(SIZES[size])
    tokenizer = build_tiny_tokenizer(default_words(spec.pop("words")))
    return tokenizer, build_tiny_causal_lm(tokenizer, seed=0, **spec)


def random_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    first = tokenizer.convert_tokens_to_ids("w0")
    lengths = torch.randint(8, 17, (n,), generator=g).tolist()
    return [torch.randint(first, len(tokenizer), (k,), generator=g).tolist() for k in lengths]


def transformers_arm(policy, tokenizer, prompts, response_length: int):
    """A callable sampling the batch the trainer's way; returns the number of valid tokens."""
    from trl_ppo_ext.generation.transformers_generate import generate_responses, sampling_config
    from trl_ppo_ext.rollout import finalize_responses, left_pad

    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    queries, query_mask = left_pad(ids, mask, tokenizer.pad_token_id)
    stop = (tokenizer.eos_token_id,)
    config = sampling_config(response_length, stop, tokenizer.pad_token_id, 1.0)

    def run() -> int:
        raw = generate_responses(policy, queries, query_mask, config, response_length, tokenizer.pad_token_id,
                                 chunk_size=len(prompts))
        return int(finalize_responses(raw, stop, tokenizer.pad_token_id)[1].sum())

    return run


def vllm_arm(engine, tokenizer, prompts, response_length: int):
    from trl_ppo_ext.generation.base import SamplingSettings

    settings = SamplingSettings(max_tokens=response_length, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    generator = torch.Generator().manual_seed(0)

    def run() -> int:
        return sum(len(ids) for ids in engine.generate(prompts, settings, generator).completion_ids)

    return run


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def sync_seconds(engine, policy, first_version: int, repeats: int) -> float:
    """Median seconds of ``load_policy`` with a new version each time (a push every call)."""
    return statistics.median(timed(lambda v=v: engine.load_policy(policy, v))[0]
                             for v in range(first_version, first_version + repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100m", choices=list(SIZES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lora", action="store_true", help="also time a LoRA policy: adapter and merged sync")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    tokenizer, policy = build_policy(args.size)
    prompts = random_prompts(tokenizer, args.prompts)
    n_params = sum(p.numel() for p in policy.parameters()) / 1e6
    print(f"policy {args.size}: {n_params:.1f}M parameters, fp32; {args.prompts} prompts x {args.response_length} "
          f"tokens; torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores")
    engine_kwargs = {"enforce_eager": True} if args.enforce_eager else {}

    start, engine = timed(lambda: VLLMColocateEngine(policy, engine_kwargs=engine_kwargs))
    engine.load_policy(policy, 0)
    arms = {"transformers": transformers_arm(policy, tokenizer, prompts, args.response_length),
            "vllm": vllm_arm(engine, tokenizer, prompts, args.response_length)}
    first = {name: timed(run)[0] for name, run in arms.items()}
    seconds = {name: [] for name in arms}
    tokens = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, run in arms.items():
            s, n = timed(run)
            seconds[name].append(s)
            tokens[name].append(n)
    print(f"vllm engine start {start:.1f} s; first call: vllm {first['vllm']:.1f} s, transformers "
          f"{first['transformers']:.1f} s")
    print(f"{'arm':<14}{'median s':>10}{'tokens/s':>10}   per repeat (s)")
    for name in arms:
        median = statistics.median(seconds[name])
        rate = statistics.median(tokens[name]) / median
        print(f"{name:<14}{median:>10.2f}{rate:>10.1f}   " + ", ".join(f"{s:.2f}" for s in seconds[name]))
    print(f"weight sync, full ({n_params:.1f}M parameters, one reload_weights call): "
          f"{sync_seconds(engine, policy, 1, args.repeats):.3f} s")
    engine.close()
    if args.lora:
        time_lora_syncs(policy, prompts, tokenizer, args, engine_kwargs)
    speedup = statistics.median(seconds["transformers"]) / statistics.median(seconds["vllm"])
    print(f"generation speed-up vllm/transformers: {speedup:.2f}")


def time_lora_syncs(policy, prompts, tokenizer, args, engine_kwargs) -> None:
    """A LoRA (r=16, q/k/v/o) policy: push cost and generation time as an adapter and merged."""
    from peft import LoraConfig, get_peft_model

    from trl_ppo_ext.generation.vllm_colocate import VLLMColocateEngine

    lora = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]))
    for mode in ("adapter", "merged"):
        engine = VLLMColocateEngine(lora, lora_sync=mode, engine_kwargs=engine_kwargs)
        push = sync_seconds(engine, lora, 0, args.repeats)
        run = vllm_arm(engine, tokenizer, prompts, args.response_length)
        run()  # warm-up
        generation = statistics.median(timed(run)[0] for _ in range(args.repeats))
        print(f"LoRA policy as {mode:<8}: sync {push:.3f} s, generation {generation:.2f} s")
        engine.close()


if __name__ == "__main__":
    main()
