"""A user's TRL PPO script, structured like TRL's examples/scripts/ppo/ppo.py.

The drop-in claim under test: this file differs from a TRL script only in the marked
import line. It parses (ScriptArguments, PPOConfig, ModelConfig), loads every model and
the tokenizer from paths (left padding, a fresh [PAD] token), loads a prompt dataset,
tokenizes it, trains, saves and samples completions.
"""

import shutil

from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config

from trl_ppo_ext import PPOConfig, PPOTrainer  # was: from trl.experimental.ppo import PPOConfig, PPOTrainer

if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)

    peft_config = get_peft_config(model_args)
    ref_policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path) if peft_config is None else None

    dataset = load_dataset(script_args.dataset_name, split=script_args.dataset_train_split)
    eval_samples = 4
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))

    def prepare_dataset(ds):
        def tokenize(element):
            return {"input_ids": tokenizer(element["prompt"], padding=False)["input_ids"]}

        return ds.map(tokenize, batched=True, remove_columns=ds.column_names)

    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset)
        eval_dataset = prepare_dataset(eval_dataset)

    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.generate_completions()
