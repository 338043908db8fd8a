"""PPO runs for `accelerate launch --config_file examples/accelerate_configs/fsdp2.yaml` with 2 CPU
processes (see tests/end_to_end/test_fsdp2.py); the same runs under plain DDP are modes of
tests/scripts/ppo_two_process.py (``run_layout`` here), the reference the tests compare with.

    ppo_fsdp2.py OUT LAYOUT [LAYOUT ...] [--resume-check K] [--probe-generation]

LAYOUT (each trained in turn, in this one launch, 3 updates with a checkpoint after each but for
shared, the settings of tests/scripts/ppo_deepspeed.py, so the runs compare with the ZeRO ones):
  separate        separate policy, value, reference and reward models (full fine-tune)
  shared          the LoRA shared-backbone actor-critic (value head on the policy's hidden states)
  value_adapter   the same with a value LoRA adapter of its own (a second backbone pass)

--resume-check K    afterwards, a fresh trainer of the separate layout resumes from checkpoint-K of
                    its run and trains to the end: are its parameters and logs equal to the run's?
--probe-generation  afterwards, count FSDP2 all-gathers during one rollout's generation of the
                    separate layout, with ds3_gather_for_generation True and False

Writes OUT/<LAYOUT>/rank<k>.json (world size, distributed type, sharding, logged metrics, optimizer
steps, time and peak RSS, follow-up results), OUT/<LAYOUT>/params.pt (trainable parameters, full)
and the run's checkpoints in OUT/<LAYOUT>/out. Announces each run on stdout (`ppo_fsdp2: run X
starts`).
"""

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from peft import LoraConfig
from ppo_deepspeed import build_trainer, logs, trainable_params  # beside this file
from tiny_setup import record_optimizer_steps, run_and_exit, tiny_models

from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.fsdp import fsdp2_units
from trl_ppo_ext.models.sharding import is_fsdp2_param
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.tiny import build_tiny_tokenizer

UPDATES = 3
LAYOUTS = ("separate", "shared", "value_adapter")


def announce(run: str) -> None:
    """Say which run of this launch starts: a launch that fails is named by its last one."""
    print(f"ppo_fsdp2: run {run} starts", flush=True)


def make_trainer(tok, layout: str, run_dir: Path, save: bool):
    """A trainer of ``layout`` on fresh tiny models (built in the same order for every layout),
    checkpointing after every update when ``save``."""
    opts = argparse.Namespace(updates=UPDATES, save=save)
    policy, ref, value, reward = tiny_models(tok)
    if layout == "separate":
        return build_trainer(tok, (policy, ref, value, reward), opts, run_dir, shared=False)
    if layout == "shared":
        return build_trainer(tok, (policy, ref, value, reward), opts, run_dir, shared=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = SharedActorCritic(policy, lora_config=lora, value_lora_config=lora)
    return build_trainer(tok, (model, None, None, reward), opts, run_dir, shared=False)


def sharding_facts(trainer) -> dict:
    """How the trained module is sharded on this process."""
    params = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp_units": len(fsdp2_units(trainer.unwrapped)),
        "trainable": len(params),
        # a DTensor holding fewer rows here than the whole parameter has: really sharded
        "sharded": sum(is_fsdp2_param(p) and p.to_local().numel() < p.numel() for p in params),
    }


def probe_generation(trainer) -> dict:
    """FSDP2 all-gathers (one per unit gathered) while generating one rollout, per setting."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    counts = {"gathers": 0}
    real = group_module.foreach_all_gather

    def counting(*args, **kwargs):
        counts["gathers"] += 1
        return real(*args, **kwargs)

    batch = next(iter(trainer.dataloader))
    result = {}
    group_module.foreach_all_gather = counting
    try:
        for flag in (True, False):
            trainer.args.ds3_gather_for_generation = flag
            counts["gathers"] = 0
            rollout = trainer.generate_rollout(batch)
            result[str(flag)] = {"gathers": counts["gathers"], "tokens": int(rollout.responses.shape[1])}
    finally:
        group_module.foreach_all_gather = real
        trainer.args.ds3_gather_for_generation = True
    policy = trainer.unwrapped.policy
    result["policy_units"] = len([m for m in fsdp2_units(policy)])
    result["resharded_after"] = all(is_fsdp2_param(p) for p in policy.parameters())
    return result


def resume_check(tok, layout, out: Path, main, checkpoint: int) -> dict:
    again = make_trainer(tok, layout, out / f"{layout}_resume_check", save=True)
    again.train(resume_from_checkpoint=str(out / layout / "out" / f"checkpoint-{checkpoint}"))
    a, b = trainable_params(main), trainable_params(again)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    return {"params_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "logs_equal": strip(logs(main))[checkpoint:] == strip(logs(again))[checkpoint:]}


def run_layout(tok, layout: str, out: Path, save: bool = True):
    """Train ``layout`` into ``out`` (``out/out`` its checkpoints when ``save``); writes
    ``out/rank<k>.json``, ``out/start.pt`` and ``out/params.pt`` (the trainable parameters before
    and after). Returns the trainer and the report."""
    trainer = make_trainer(tok, layout, out, save)
    start_params = trainable_params(trainer)  # gathered by every process
    if trainer.accelerator.process_index == 0:
        torch.save(start_params, out / "start.pt")
    steps = record_optimizer_steps(trainer)
    start = time.perf_counter()
    trainer.train()
    report = {"world_size": trainer.accelerator.num_processes, "logs": logs(trainer), "optimizer_steps": steps,
              "train_seconds": time.perf_counter() - start,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **sharding_facts(trainer)}
    params = trainable_params(trainer)  # gathered by every process
    if trainer.accelerator.process_index == 0:
        torch.save(params, out / "params.pt")
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
    return trainer, report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("layouts", nargs="+", choices=list(LAYOUTS))
    parser.add_argument("--resume-check", type=int, default=None)
    parser.add_argument("--probe-generation", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    trainer = None
    for layout in opts.layouts:
        announce(layout)
        # the shared actor-critic's checkpoints are the value adapter's run's, less the adapter
        trainer, report = run_layout(tok, layout, opts.out / layout, save=layout != "shared")
        if opts.probe_generation and layout == "separate":
            announce(f"{layout}/probe-generation")
            report["generation"] = probe_generation(trainer)
        if opts.resume_check is not None and layout == "separate":  # the one with every kind of unit
            announce(f"{layout}/resume-check")
            report["resume_check"] = resume_check(tok, layout, opts.out, trainer, opts.resume_check)
        (opts.out / layout / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(report))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    run_and_exit(main)
