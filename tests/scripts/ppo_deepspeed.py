"""PPO runs for `accelerate launch` with 2 CPU processes, plain DDP or DeepSpeed ZeRO-2/3
(see tests/end_to_end/test_deepspeed.py). One main run per call, plus optional follow-ups:

    ppo_deepspeed.py OUT TAG [--shared] [--updates N] [--save] [--kill-in-update K] [--resume]
                             [--wait-for-sigterm-in-update K] [--run-dir NAME] [--resume-check K]
                             [--also-shared] [--probe-generation] [--also-resume TAG2 RUN_DIR]...
                             [--also-conformance SETUP VARIATION]

--shared            the LoRA shared-backbone actor-critic (default: separate policy/value/ref/reward)
--save              checkpoint after every update (into OUT/<run-dir or TAG>/out)
--kill-in-update K  rank 1 SIGKILLs itself inside update K (after its first optimizer step)
--resume            resume from the latest checkpoint in OUT/<run-dir>/out
--wait-for-sigterm-in-update K
                    rank 0 writes OUT/<TAG>.waiting at its first loss of update K, then waits
                    there until a SIGTERM arrives (the test sends it to the launcher)
--resume-check K    afterwards, a second trainer resumes from checkpoint-K of this run and trains
                    to the end: are its parameters and logs equal to the main run's?
--also-shared       afterwards, train the shared LoRA actor-critic for as many updates
--probe-generation  afterwards, count ZeRO-3 gathers and per-module parameter fetches during one
                    rollout's generation, with ds3_gather_for_generation True and False
--also-resume TAG2 RUN_DIR
                    afterwards, a fresh trainer resumes from the latest checkpoint in
                    OUT/<RUN_DIR>/out and trains to the end, writing OUT/<TAG2>_rank<k>.json and
                    OUT/<TAG2>_params.pt: what a launch `TAG2 --resume --run-dir RUN_DIR` (with
                    this call's --save and --updates) writes, without a launch of its own; repeatable
--also-conformance SETUP VARIATION
                    last, one row of tests/scripts/conformance_setups.py (``run("ours", ...)``,
                    TRL's default PPOConfig), its outcome in the report under "conformance"

Every model is built before the first trainer: under ZeRO-3, DeepSpeed's partitioning stays
switched on for modules constructed later in the same process.

Writes OUT/<TAG>_rank<k>.json (world size, ZeRO stage, logged metrics, optimizer steps, time and
peak RSS of the main run, follow-up results) and OUT/<TAG>_params.pt (trainable parameters, full).
"""

import argparse
import json
import os
import resource
import signal
import time
from pathlib import Path

import torch
from peft import LoraConfig
from tiny_setup import (  # beside this file
    prompt_dataset,
    record_optimizer_steps,
    run_and_exit,
    tiny_config,
    tiny_models,
)

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.models.actor_critic import SharedActorCritic
from trl_ppo_ext.models.sharding import full_state, zero_stage
from trl_ppo_ext.reporting import TIMING_KEYS
from trl_ppo_ext.tiny import build_tiny_tokenizer


class KilledInUpdate(PPOTrainer):
    """Rank 1 dies (SIGKILL) in update ``kill_in_update`` after that update's first optimizer step."""

    kill_in_update = None
    losses_seen = 0

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step + 1 == self.kill_in_update and self.accelerator.process_index == 1:
            self.losses_seen += 1
            if self.losses_seen > self.plan.micro_batches_per_mini_batch:  # one optimizer step done
                os.kill(os.getpid(), signal.SIGKILL)
        return super().compute_loss_terms(mb, adv, num_tokens)


class WaitsForSigterm(PPOTrainer):
    """Rank 0 stops inside update ``in_update`` (before its first optimizer step) until SIGTERM
    comes, so the signal lands at a known step; the other rank waits in the step's collectives."""

    in_update = None
    marker = None

    def compute_loss_terms(self, mb, adv, num_tokens=None):
        if self.state.global_step + 1 == self.in_update and self.accelerator.process_index == 0:
            if not self.marker.exists():
                self.marker.write_text("waiting")
                deadline = time.monotonic() + 300
                while not self.loop_state.sigterm.received and time.monotonic() < deadline:
                    time.sleep(0.05)
        return super().compute_loss_terms(mb, adv, num_tokens)


def build_trainer(tok, models, opts, out_dir, shared, cls=PPOTrainer):
    policy, ref, value, reward = models
    args = tiny_config(
        out_dir, total_episodes=8 * opts.updates, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_mini_batches=2, num_ppo_epochs=2, save_strategy="steps" if opts.save else "no", save_steps=1,
        adaptive_kl=True, kl_target=0.01, kl_horizon=100,
    )
    if shared:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        policy, ref, value = SharedActorCritic(policy, lora_config=lora), None, None
    return cls(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
               train_dataset=prompt_dataset(tok, n=12), value_model=value)


def trainable_params(trainer) -> dict:
    """Every trainable parameter, full (gathered under ZeRO-3), on rank 0; {} elsewhere."""
    named = [(k, v) for k, v in trainer.unwrapped.named_parameters() if v.requires_grad]
    return full_state(named, keep=trainer.accelerator.process_index == 0)


def logs(trainer) -> list:
    return [h for h in trainer.state.log_history if "objective/scores" in h]


def probe_generation(trainer):
    """ZeRO-3 gathers (`GatheredParameters` entries) and per-module parameter fetches during one
    rollout's generation, with and without `ds3_gather_for_generation`."""
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    counts = {}
    real_gather = deepspeed.zero.GatheredParameters.__enter__
    real_fetch = PartitionedParameterCoordinator.fetch_sub_module

    def gather(self, *a, **k):
        counts["gathers"] += 1
        return real_gather(self, *a, **k)

    def fetch(self, *a, **k):
        counts["fetches"] += 1
        return real_fetch(self, *a, **k)

    batch = next(iter(trainer.dataloader))
    result = {}
    deepspeed.zero.GatheredParameters.__enter__ = gather
    PartitionedParameterCoordinator.fetch_sub_module = fetch
    try:
        for flag in (True, False):
            trainer.args.ds3_gather_for_generation = flag
            counts.update(gathers=0, fetches=0)
            rollout = trainer.generate_rollout(batch)
            result[str(flag)] = dict(counts, tokens=int(rollout.responses.shape[1]))
    finally:
        deepspeed.zero.GatheredParameters.__enter__ = real_gather
        PartitionedParameterCoordinator.fetch_sub_module = real_fetch
    return result


def resume_check(tok, models, opts, main, checkpoint: int) -> dict:
    """A fresh trainer resumes from checkpoint-<checkpoint> of the main run and trains to the end."""
    run_dir = opts.out / f"{opts.tag}_resume_check"
    again = build_trainer(tok, models, opts, run_dir, opts.shared)
    again.train(resume_from_checkpoint=str(opts.out / (opts.run_dir or opts.tag) / "out" / f"checkpoint-{checkpoint}"))
    a, b = trainable_params(main), trainable_params(again)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    return {"params_equal": all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys(),
            "logs_equal": strip(logs(main))[checkpoint:] == strip(logs(again))[checkpoint:]}


def announce(run: str) -> None:
    """Say which run of this launch starts: a launch that fails is named by its last one."""
    print(f"ppo_deepspeed: run {run} starts", flush=True)


def train_and_report(trainer, resume: bool) -> dict:
    """Train ``trainer`` (from its latest checkpoint if ``resume``): what the report says of a run."""
    steps = record_optimizer_steps(trainer)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resume else None)
    return {
        "world_size": trainer.accelerator.num_processes,
        "zero_stage": zero_stage(trainer.accelerator),
        "logs": logs(trainer),
        "optimizer_steps": steps,
        "train_seconds": time.perf_counter() - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "partitioned": sum(hasattr(v, "ds_id") and v.ds_tensor.numel() < v.ds_numel
                           for v in trainer.unwrapped.parameters() if v.requires_grad),
        "trainable": sum(v.requires_grad for v in trainer.unwrapped.parameters()),
    }


def save_params(trainer, out: Path, tag: str) -> None:
    params = trainable_params(trainer)  # a collective under ZeRO-3: every rank takes part
    if trainer.accelerator.process_index == 0:
        torch.save(params, out / f"{tag}_params.pt")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--shared", action="store_true")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--kill-in-update", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--wait-for-sigterm-in-update", type=int, default=None)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--resume-check", type=int, default=None)
    parser.add_argument("--also-shared", action="store_true")
    parser.add_argument("--probe-generation", action="store_true")
    parser.add_argument("--also-resume", nargs=2, action="append", default=[], metavar=("TAG2", "RUN_DIR"))
    parser.add_argument("--also-conformance", nargs=2, default=None, metavar=("SETUP", "VARIATION"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    runs = 1 + (opts.resume_check is not None) + opts.also_shared + len(opts.also_resume)
    models = [tiny_models(tok) for _ in range(runs)]
    if opts.also_conformance:
        import conformance_setups  # beside this file

        conformance_root = opts.out / f"{opts.tag}_conformance"
        conformance_models = conformance_setups.build_row_models(opts.also_conformance[0], conformance_root)

    KilledInUpdate.kill_in_update = opts.kill_in_update
    WaitsForSigterm.in_update = opts.wait_for_sigterm_in_update
    WaitsForSigterm.marker = opts.out / f"{opts.tag}.waiting"
    cls = KilledInUpdate if opts.kill_in_update else WaitsForSigterm if opts.wait_for_sigterm_in_update else PPOTrainer
    announce(opts.tag)
    trainer = build_trainer(tok, models.pop(0), opts, opts.out / (opts.run_dir or opts.tag), opts.shared, cls)
    report = train_and_report(trainer, opts.resume)
    rank = trainer.accelerator.process_index
    save_params(trainer, opts.out, opts.tag)
    if opts.probe_generation:
        announce(f"{opts.tag}/probe-generation")
        report["generation"] = probe_generation(trainer)
    if opts.resume_check is not None:
        announce(f"{opts.tag}/resume-check")
        report["resume_check"] = resume_check(tok, models.pop(0), opts, trainer, opts.resume_check)
    if opts.also_shared:
        announce(f"{opts.tag}/shared")
        shared = build_trainer(tok, models.pop(0), opts, opts.out / f"{opts.tag}_shared", shared=True)
        shared_steps = record_optimizer_steps(shared)
        shared.train()
        report["shared"] = {"logs": logs(shared), "optimizer_steps": shared_steps,
                            "adapter_params": sum(v.requires_grad for v in shared.unwrapped.parameters())}
    for tag, run_dir in opts.also_resume:
        announce(tag)
        again = build_trainer(tok, models.pop(0), opts, opts.out / run_dir, opts.shared)
        again_report = train_and_report(again, resume=True)
        save_params(again, opts.out, tag)
        (opts.out / f"{tag}_rank{rank}.json").write_text(json.dumps(again_report))
    if opts.also_conformance:
        setup_name, variation = opts.also_conformance
        announce(f"conformance:{setup_name}:{variation}")
        outcome = conformance_setups.run("ours", setup_name, variation, conformance_root, models=conformance_models)
        report["conformance"] = {"passed": outcome.passed, "updates": outcome.updates,
                                 "policy_moved": outcome.policy_moved, "value_moved": outcome.value_moved,
                                 "reload_matches": outcome.reload_matches, "warnings": outcome.warnings,
                                 "error": outcome.error, "trace": outcome.trace}
    (opts.out / f"{opts.tag}_rank{rank}.json").write_text(json.dumps(report))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    run_and_exit(main)
