"""One short PPO run per set-up on whichever base ``trl_ppo_ext`` chose (see tests/test_base.py).

    ppo_base_parity.py OUT        (TRL_PPO_EXT_OWN_BASE=1 in the environment forces our own base)

Set-ups: ``full`` (separate full policy, reference, value and reward models) and ``peft``
(a LoRA policy, reference = adapter disabled, separate value model): both save through the
base class's ``save_model``. Each runs 2 updates with a checkpoint after each, then
``save_model(OUT/<setup>/final)``. Writes OUT/summary.json: the base in use, and per set-up the
log history, the files of each checkpoint and of ``final``.
"""

import json
import sys
from pathlib import Path

import torch
from tiny_setup import prompt_dataset, tiny_config, tiny_models  # beside this file

from trl_ppo_ext import PPOTrainer, _compat
from trl_ppo_ext.tiny import build_tiny_tokenizer


def run(out: Path, use_peft: bool) -> dict:
    from peft import LoraConfig

    tok = build_tiny_tokenizer(pad_equals_eos=True)
    policy, ref, value, reward = tiny_models(tok)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = tiny_config(out, total_episodes=16, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       num_mini_batches=2, num_ppo_epochs=2, save_strategy="steps", save_steps=1)
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None if use_peft else ref,
                         reward_model=reward, train_dataset=prompt_dataset(tok, n=12), value_model=value,
                         peft_config=peft_config if use_peft else None)
    trainer.train()
    trainer.save_model(str(out / "final"))
    run_dir = out / "out"
    return {
        "log_history": trainer.state.log_history,
        "files": {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(run_dir.iterdir()) if d.is_dir()},
        "final_files": sorted(p.name for p in (out / "final").iterdir()),
        "output_dir_files": sorted(p.name for p in run_dir.iterdir()),
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    summary = {"own_base": _compat.uses_own_base(), "base": _compat.base_description()}
    for name, use_peft in (("full", False), ("peft", True)):
        summary[name] = run(out / name, use_peft)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
