"""Short PPO runs meant for `accelerate launch` with 2 CPU processes (see tests/test_distributed.py
and tests/end_to_end/test_fsdp2.py).

    ppo_two_process.py OUT MODE [MODE ...]

Runs one short train() per MODE (tiny_setup.TWO_PROCESS_MODES and DDP_REFERENCE_MODES), in the
order given, in this one launch (the launch's start-up, imports and gloo set-up, is paid once).
Each writes `OUT/<MODE>/rank<k>.json` with what the test checks: the world size, every logged
metric, the optimizer steps and micro-batches per update, a parameter checksum, and the mode's
own facts. A mode that raises writes `OUT/<MODE>/rank<k>.error` (its traceback) and ends the
launch there (exit status 1): the other process may be waiting in a collective, so no later mode
runs.
"""

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from accelerate import PartialState
from peft import LoraConfig
from ppo_fsdp2 import run_layout  # beside this file
from tiny_setup import (  # beside this file
    TOOL_CALL,
    multiply,
    prompt_dataset,
    record_optimizer_steps,
    run_and_exit,
    tiny_config,
    tiny_models,
    tool_dataset,
    two_turn_rollout,
)

from trl_ppo_ext import PPOTrainer
from trl_ppo_ext.models.actor_critic import VALUE_ADAPTER_NAME, SharedActorCritic
from trl_ppo_ext.tiny import build_tiny_causal_lm, build_tiny_chat_tokenizer, build_tiny_tokenizer


class ToolTurns(PPOTrainer):
    """tools mode: the first turn calls `multiply` (scripted), the answer is the policy's own."""

    def generate_continuations(self, prefixes, max_new_tokens, temperature=None):
        tok = self.processing_class
        if all("<tool_response>" in tok.decode(p) for p in prefixes):
            return super().generate_continuations(prefixes, max_new_tokens, temperature)
        call = TOOL_CALL.format(name="multiply", args='{"a": 6, "b": 7}')
        ids = [tok(call, add_special_tokens=False).input_ids for _ in prefixes]
        return ids, [[float("nan")] * len(row) for row in ids]


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        try:
            run_mode(out / mode, mode)
        except BaseException:
            (out / mode / f"rank{os.environ.get('RANK', '0')}.error").write_text(traceback.format_exc())
            raise
        gc.collect()
    PartialState().destroy_process_group()


def run_mode(out: Path, mode: str) -> None:
    """One short train() of ``mode`` (separate models unless the mode says otherwise), written
    to ``out/rank<k>.json``; models, tokenizer and trainer are the mode's own. A ``ddp_<layout>``
    mode is tests/scripts/ppo_fsdp2.py's run of that layout, under DDP and without checkpoints."""
    tok = build_tiny_tokenizer(pad_equals_eos=True)
    if mode.startswith("ddp_"):
        run_layout(tok, mode.removeprefix("ddp_"), out, save=False)
        return
    policy, ref, value, reward = tiny_models(tok)
    peft = mode == "peft"
    with_eval = mode == "eval"
    # eval: 5 prompts over 2 processes -> accelerate repeats rows to even out the last batch
    eval_dataset = prompt_dataset(tok, n=5, min_len=1, max_len=6, seed=3) if with_eval else None
    extra = dict(eval_strategy="steps", eval_steps=1, num_sample_generations=2, per_device_eval_batch_size=2)
    # recipe: issue 21's fields on (the sequence count reduced over processes, the warm-up decided alike)
    recipe = dict(loss_type="grpo", critic_warmup_steps=1, cliprange_high=0.28, dual_clip=3.0, value_lam=1.0)
    rank_now = int(os.environ.get("RANK", "0"))
    # budget: issue 32's token budget, chosen per process so that the counts differ for certain: rank 0
    # fits its whole mini-batch into one micro-batch, rank 1 (budget 1) runs one micro-batch per row
    budget = dict(max_tokens_per_micro_batch=10_000 if rank_now == 0 else 1)
    # critic: a third epoch of value-only steps per update (their gradients averaged by hand, not by DDP), and a
    # privileged critic reading each row's `answer` column before the prompt, through DDP's forward
    critic = dict(num_critic_epochs=3, critic_context_column="answer")
    prompts = tool_dataset(12) if mode == "tools" else prompt_dataset(tok, n=12)
    if mode == "critic":
        prompts = prompts.add_column("answer", [f"w{i % 5} w{i % 3}" for i in range(12)])
    # shared: the one-GPU layout (LoRA policy, value head and a value adapter of its own on one frozen base,
    # the reference = adapters off) under DDP, with TRL's default gradient checkpointing
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    shared = mode == "shared"
    if shared:
        policy = SharedActorCritic(policy, lora_config=lora, value_lora_config=lora)
        value_adapter_start = _value_adapter_sum(policy)

    def reporter(completions, log_metric, log_extra, **kwargs):
        """Rewards 0 (the scores stay the RM's); reports what each process is, GRPO's way."""
        log_metric("reporter/rank_plus_one", rank_now + 1)
        if rank_now == 1:
            log_metric("reporter/only_rank1", 5.0)  # a name the other process never logs
        log_extra("rank", [rank_now] * len(completions))
        return [0.0] * len(completions)
    if mode == "tools":  # each process runs its own tool loop; the tool metrics are summed over both
        tok = build_tiny_chat_tokenizer()
        policy, ref = (build_tiny_causal_lm(tok, seed=0, max_position_embeddings=1024) for _ in range(2))
        value = reward = None
    cls = ToolTurns if mode == "tools" else PPOTrainer
    tools = dict(response_length=128, chat_template_kwargs={"enable_thinking": False}, max_tool_calling_iterations=1)
    tool_inputs = dict(tools=[multiply], reward_funcs=[lambda completions, **kw: [float(len(completions[0]))] *
                                                       len(completions)]) if mode == "tools" else {}
    trainer = cls(
        **tool_inputs,
        args=tiny_config(out, total_episodes=16, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         num_mini_batches=2, num_ppo_epochs=2, **(extra if with_eval else {}),
                         **(recipe if mode == "recipe" else {}), **(budget if mode == "budget" else {}),
                         **(tools if mode == "tools" else {}), **(critic if mode == "critic" else {})),
        processing_class=tok, model=policy, ref_model=None if peft or shared else ref, reward_model=reward,
        train_dataset=prompts,
        value_model=None if shared else value, eval_dataset=eval_dataset,
        peft_config=lora if peft else None,
        eval_metrics={"prompt_words": lambda prompts, completions: [len(p.split()) for p in prompts]},
        **({} if mode == "tools" else {"reward_funcs": [reporter] if with_eval else None}),
        # episodes: a rollout_func with environment replies on each process (GAE over the action tokens)
        rollout_func=two_turn_rollout(tok) if mode == "episodes" else None,
    )
    steps = record_optimizer_steps(trainer)
    micro_counts = []
    plan_micro_batches = trainer.micro_batches
    trainer.micro_batches = lambda *a: micro_counts.append(len(rows := plan_micro_batches(*a))) or rows
    trainer.train()
    completions = trainer.generate_completions() if with_eval else None
    rank = trainer.accelerator.process_index
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    # Parameters stay in sync across processes (DDP averages gradients).
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters() if p.requires_grad))
    shared_facts = {}
    if shared:
        model = trainer.accelerator.unwrap_model(trainer.model)
        shared_facts = {"checkpointing": model.is_gradient_checkpointing,
                        "value_adapter_start": value_adapter_start, "value_adapter_end": _value_adapter_sum(model)}
    (out / f"rank{rank}.json").write_text(json.dumps({
        **shared_facts,
        "world_size": trainer.accelerator.num_processes, "logs": logs, "checksum": checksum,
        "batch_size": trainer.args.batch_size, "optimizer_steps": steps, "micro_batch_counts": micro_counts,
        "completions": None if completions is None else len(completions),
        "rank_column": None if completions is None else completions["rank"].tolist(),
        "eval_prompt_words": None if eval_dataset is None else sum(map(len, eval_dataset["input_ids"])) / 5,
    }))


def _value_adapter_sum(model) -> float:
    """Sum of the value adapter's LoRA weights (both processes must agree; it must move)."""
    return float(sum(p.detach().double().sum() for n, p in model.named_parameters()
                     if f".{VALUE_ADAPTER_NAME}." in n and "lora_" in n))


if __name__ == "__main__":
    run_and_exit(main)
