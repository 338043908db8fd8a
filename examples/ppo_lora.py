"""PPO with a LoRA shared-backbone actor-critic: a whole RLHF run, on a CPU or one GPU.

    accelerate launch examples/ppo_lora.py          # the built-in demo: CPU, no hub, ~2 min
    python examples/ppo_lora.py                     # the same, without accelerate

With no ``--model_name_or_path`` the script runs a self-contained demo (nothing downloaded):

1. the synthetic task of ``examples/synthetic_task.py``: a tiny word-level tokenizer with a
   chat template, and a "true" preference that fits in one sentence (``Task.describe()``);
2. synthetic preference pairs ranked by that rule;
3. a tiny reward model trained on them with TRL's ``RewardTrainer`` (pairwise loss
   ``-log sigmoid(r_chosen - r_rejected)``); its held-out pair accuracy is reported;
4. PPO (``trl_ppo_ext.PPOTrainer``) on a tiny random Llama wrapped as a
   ``SharedActorCritic``: the policy is a LoRA adapter, the critic a value head on the same
   backbone, the reference the same model with the adapter disabled;
5. before and after PPO: responses sampled at the training temperature to held-out prompts
   (topics never seen in training), scored by the reward model and by the true rule, and
   the KL to the reference; printed, with sample completions, and written to
   ``<output_dir>/summary.json`` (per-update metrics in ``log_history.json``).

With ``--model_name_or_path`` it is a real run (one CUDA GPU; the hub is used if the paths
are hub ids)::

    accelerate launch examples/ppo_lora.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --reward_model_path <your RM> \\
        --dataset_name trl-lib/ultrafeedback-prompt --dataset_test_split test \\
        --load_in_4bit --offload_reward_model --bf16 --stop_token eos \\
        --learning_rate 1e-5 --response_length 128 --total_episodes 10000 --output_dir outputs/ppo

A local prompt file works the same way: ``--dataset_name json --data_files prompts.jsonl``,
or ``--dataset_name <directory>`` (data files, or a ``Dataset.save_to_disk`` folder). The
prompts come from ``--prompt_column`` (default ``prompt``, then ``messages``): plain strings
or conversations, rendered with the tokenizer's chat template (``render_prompts``); prompts
that leave no room for ``response_length`` tokens are dropped and counted. The reward model
scores the policy's token ids, so it must share the policy's tokenizer. Bad input (a missing
model or reward-model path, no prompt column, conversations without a chat template) stops
the script before any model is trained, with a message naming the argument.

Why the demo's LoRA settings (``DEMO_DEFAULTS``): the random tiny Llama's output layer has
weights of scale 0.02 and the final RMSNorm fixes the hidden-state norm, so with a frozen
``lm_head`` every logit stays within about +-0.6: LoRA on the attention and MLP projections
alone cannot make the policy prefer any word (in tuning runs its entropy stayed at
log 46 = 3.8 nats and the true reward did not move, at learning rates up to 1e-2). Adapting
``lm_head`` too lets it learn. Rank 8 with alpha 16 (scale 2) and learning rate 5e-3 take the
true reward from 0.27 to 1.5 (its maximum) in 1024 episodes, with the entropy still near
1 nat; in tuning runs 1e-2 also reached 1.5 but collapsed the entropy to ~0.03 nats, and
3e-3 ended near 1.43. Real checkpoints have peaked output distributions; there the default
targets are ``all-linear`` (every linear layer except ``lm_head``) and the usual LoRA
learning rates (1e-5 .. 1e-4) apply.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the wall time reported in summary.json starts here

import os  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import _startup  # noqa: E402  (env defaults; the package from a source checkout)
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import HfArgumentParser, ProgressCallback, set_seed  # noqa: E402

from trl_ppo_ext import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo_ext.data import render_prompts  # noqa: E402
from trl_ppo_ext.run.manifest import to_jsonable  # noqa: E402

# transformers 5 deprecates the `gradient_checkpointing` name that TRL's configs set by default;
# nothing for the user to change (this script never turns checkpointing on).
warnings.filterwarnings("ignore", message=r".*`gradient_checkpointing` is deprecated", category=FutureWarning)
# With lm_head among the LoRA targets peft also saves the (small) output layer next to the
# adapter, which is what we want; its notice about doing so is not a problem to fix.
warnings.filterwarnings("ignore", message=r"Setting `save_embedding_layers` to `True`", category=UserWarning)

# Modules LoRA adapts in the demo; see the module docstring for why lm_head is among them.
DEMO_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# Held-out prompts of the demo ask about these topics; training prompts never do.
HELD_OUT_TOPICS = ("sea", "snow")
# TRL's PPOConfig.reward_model_path default: a base LM, not a reward model.
TRL_PLACEHOLDER_REWARD_MODEL = "EleutherAI/pythia-160m"


@dataclass
class ScriptArguments:
    """Where prompts and models come from, and how the before/after evaluation is run."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "SFT policy (local directory or hub id). Unset: the built-in CPU demo. The reward model "
                  "is PPOConfig's --reward_model_path."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "datasets.load_dataset name or path: a hub id, 'json'/'csv'/'parquet' with --data_files, "
                  "or a local directory (data files or a save_to_disk folder). Real mode only."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    data_files: list[str] | None = field(
        default=None, metadata={"help": "Data files for --dataset_name json/csv/parquet (loaded as split 'train')."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split of the training prompts."})
    dataset_test_split: str | None = field(
        default="test",
        metadata={"help": "Split of the evaluation prompts; if the dataset lacks it, the last --num_eval_prompts "
                  "training prompts are held out instead."},
    )
    prompt_column: str | None = field(
        default=None, metadata={"help": "Column holding the prompts (strings or conversations); default: "
                                "'prompt', then 'messages'."},
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Drop prompts longer than this many tokens (after the chat template)."}
    )
    num_eval_prompts: int = field(
        default=64, metadata={"help": "Held-out prompts sampled before and after PPO (same prompts, same seed)."}
    )
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of the before/after evaluation."})
    num_samples_shown: int = field(default=3, metadata={"help": "Completions printed before and after PPO."})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (CPU runs only); default: 1 on a machine with at most "
                                "2 cores, else 4 at most."},
    )
    # Demo only.
    num_train_prompts: int = field(default=512, metadata={"help": "Demo: training prompts."})
    rm_pairs: int = field(default=4000, metadata={"help": "Demo: preference pairs the reward model trains on."})
    rm_eval_pairs: int = field(default=500, metadata={"help": "Demo: held-out pairs for the RM's pair accuracy."})
    rm_epochs: float = field(default=3.0, metadata={"help": "Demo: reward-model training epochs."})
    rm_learning_rate: float = field(default=3e-3, metadata={"help": "Demo: reward-model learning rate."})
    hidden_size: int = field(default=32, metadata={"help": "Demo: hidden size of the tiny policy and RM."})


@dataclass
class ModelArguments:
    """How the policy is loaded and adapted; dtype, 4-bit and remote code apply to the reward model too."""

    model_revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit)."})
    torch_dtype: str | None = field(
        default=None, metadata={"help": "Weights dtype: 'bfloat16', 'float16', 'float32', 'auto'; default: "
                                "transformers' (with --load_in_4bit: the compute dtype)."},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub."})
    load_in_4bit: bool = field(
        default=False, metadata={"help": "Load the policy base and the reward model in 4-bit nf4 (bitsandbytes)."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (demo: 8)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha; the update is scaled by alpha/r (demo: 16)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (PPO turns dropout off anyway)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules to adapt; default: all-linear (every linear layer but lm_head). The demo adds "
                  "lm_head: " + " ".join(DEMO_LORA_TARGETS)},
    )
    value_lora: bool = field(
        default=False,
        metadata={"help": "Give the critic its own LoRA adapter on the same base (same rank and targets, lm_head "
                  "excepted): a second backbone pass, ~1.5x an update's work; it learned much faster where "
                  "credit travels over long responses (docs/benchmarks.md, the critic round)."},
    )


# The demo's settings; any of them can still be overridden on the command line.
DEMO_DEFAULTS = dict(
    output_dir="outputs/ppo_lora_demo",
    total_episodes=1024,  # 32 updates of 32 episodes
    per_device_train_batch_size=8,
    gradient_accumulation_steps=4,
    num_mini_batches=2,  # 2 optimizer steps per PPO epoch, num_ppo_epochs=4 (TRL's default)
    learning_rate=5e-3,  # LoRA: tuned, see the module docstring
    kl_coef=0.05,
    response_length=10,
    stop_token="eos",  # responses end at <eos>; the true rule rewards stopping in time
    local_rollout_forward_batch_size=64,
    per_device_eval_batch_size=64,
    num_sample_generations=0,  # the before/after evaluation below replaces TRL's sample tables
    eval_strategy="steps",  # every 8 updates: held-out prompts, logged as eval/* (incl. the true reward)
    eval_steps=8,
    save_strategy="no",
    logging_steps=2,  # the trainer's one-line summary every 2 updates under the progress bar
    report_to="none",
    seed=0,
    bf16=False,
    lora_r=8,
    lora_alpha=16,
    lora_target_modules=DEMO_LORA_TARGETS,
)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelArguments]:
    """Parse the command line; without ``--model_name_or_path``, ``DEMO_DEFAULTS`` become the defaults."""
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelArguments))
    script, config, model_args = parser.parse_args_into_dataclasses(args=argv)
    if script.model_name_or_path is None:
        parser.set_defaults(**DEMO_DEFAULTS)
        script, config, model_args = parser.parse_args_into_dataclasses(args=argv)
    return script, config, model_args


def check_arguments(script: ScriptArguments, config: PPOConfig, model_args: ModelArguments) -> None:
    """Arguments that make no sense together, refused before anything is built."""
    if script.num_eval_prompts < 1:
        raise ValueError(f"--num_eval_prompts={script.num_eval_prompts}: evaluate on at least 1 prompt.")
    if script.model_name_or_path is not None:
        if script.dataset_name is None:
            raise ValueError(
                f"--model_name_or_path={script.model_name_or_path!r} asks for a real run, which needs prompts: "
                "pass --dataset_name (a hub id, a local directory, or json with --data_files prompts.jsonl)."
            )
        if config.reward_model_path == TRL_PLACEHOLDER_REWARD_MODEL:
            raise ValueError(
                f"--reward_model_path is TRL's placeholder default {TRL_PLACEHOLDER_REWARD_MODEL!r}, a base language "
                "model, not a reward model. Pass --reward_model_path <directory or hub id of a reward model with "
                "num_labels=1 that shares the policy's tokenizer>."
            )
        return
    demo_only = {"--dataset_name": script.dataset_name, "--data_files": script.data_files,
                 "--load_in_4bit": model_args.load_in_4bit or None}
    if config.reward_model_path != TRL_PLACEHOLDER_REWARD_MODEL:
        demo_only["--reward_model_path"] = config.reward_model_path
    given = {k: v for k, v in demo_only.items() if v is not None}
    if given:
        flags = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"{flags} given without --model_name_or_path: the built-in demo builds its own models and prompts. "
            "Pass --model_name_or_path <policy> to train a real model, or drop these arguments."
        )


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's CPU threads (unless a GPU does the work and none were asked for); return the count.

    Tiny models gain nothing from many threads, and on a 2-core machine shared with other
    work threads wait for each other: there the demo took about 60 s with one thread and
    360 s with two.
    """
    if requested is None and torch.cuda.is_available():
        return torch.get_num_threads()
    if requested is None:
        cores = os.cpu_count() or 1
        requested = 1 if cores <= 2 else min(4, cores)
    if requested < 1:
        raise ValueError(f"--num_threads={requested}: pass at least 1.")
    torch.set_num_threads(requested)
    return requested


# ---------------------------------------------------------------------------------- set-ups
@dataclass
class Setup:
    """Everything PPO and the evaluation need, from the demo or from real checkpoints."""

    tokenizer: object  # the policy's tokenizer (left padding, with a pad token)
    model: torch.nn.Module  # SharedActorCritic: LoRA policy + value head on one base
    reward_model: torch.nn.Module  # frozen sequence classifier, num_labels=1
    train_prompts: Dataset  # `input_ids` column, chat template applied
    eval_prompts: Dataset  # held-out prompts, same format
    task: object | None  # the synthetic task (knows the true reward); None in real mode
    rm_pair_accuracy: float | None  # demo: held-out pair accuracy of the freshly trained RM
    settings: dict  # what was built, for summary.json
    times: dict  # seconds spent in set-up phases


def _render_demo_prompts(task, n: int, *, held_out: bool, seed: int, response_length: int, max_length: int) -> Dataset:
    """``n`` prompts about the held-out topics (``held_out``) or about the others, tokenised."""
    chosen, draw_seed = [], seed
    while len(chosen) < n:
        draws = task.make_prompts(4 * n, seed=draw_seed)
        chosen += [p for p in draws if (p[0]["content"].split()[-1] in HELD_OUT_TOPICS) == held_out]
        draw_seed += 7919
    prompts, _ = render_prompts(Dataset.from_dict({"prompt": chosen[:n]}), task.tokenizer,
                                response_length=response_length, max_length=max_length)
    return prompts


def build_demo(script: ScriptArguments, config: PPOConfig, model_args: ModelArguments) -> Setup:
    """The synthetic task, its preference pairs, a reward model trained on them, a tiny LoRA actor-critic."""
    from peft import LoraConfig
    from synthetic_task import build_task, make_preference_pairs, train_reward_model

    from trl_ppo_ext.models.actor_critic import SharedActorCritic
    from trl_ppo_ext.tiny import build_tiny_causal_lm

    task = build_task(config.seed)
    print(f"Task: {task.describe()}")
    start = time.perf_counter()
    pairs = make_preference_pairs(task, script.rm_pairs, seed=config.seed + 1, max_answer_tokens=config.response_length)
    held_out_pairs = make_preference_pairs(task, script.rm_eval_pairs, seed=config.seed + 2,
                                           max_answer_tokens=config.response_length)
    print(f"Reward model: {len(pairs)} preference pairs from the rule, {script.rm_epochs:g} epochs ...")
    reward_model, accuracy = train_reward_model(
        task, pairs, held_out_pairs, os.path.join(config.output_dir, "reward_model"), epochs=script.rm_epochs,
        seed=config.seed, learning_rate=script.rm_learning_rate, hidden_size=script.hidden_size, progress=True,
    )
    rm_time = time.perf_counter() - start
    print(f"Reward model: held-out pair accuracy {accuracy:.3f} on {len(held_out_pairs)} pairs ({rm_time:.1f} s)")

    policy = build_tiny_causal_lm(task.tokenizer, seed=config.seed, hidden_size=script.hidden_size)
    lora = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
                      target_modules=_lora_targets(model_args.lora_target_modules), task_type="CAUSAL_LM")
    max_length = policy.config.max_position_embeddings
    kwargs = dict(seed=config.seed + 3, response_length=config.response_length, max_length=max_length)
    value_lora = None
    if model_args.value_lora:  # the value pass never reaches lm_head
        targets = lora.target_modules
        targets = [t for t in targets if t != "lm_head"] if isinstance(targets, (list, set)) else targets
        value_lora = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                                target_modules=targets)
    return Setup(
        tokenizer=task.tokenizer,
        model=SharedActorCritic(policy, lora_config=lora, value_lora_config=value_lora),
        reward_model=reward_model,
        train_prompts=_render_demo_prompts(task, script.num_train_prompts, held_out=False, **kwargs),
        eval_prompts=_render_demo_prompts(task, script.num_eval_prompts, held_out=True, **kwargs),
        task=task,
        rm_pair_accuracy=accuracy,
        settings={
            "task_rule": task.describe(),
            "policy": {"model": "random tiny Llama (trl_ppo_ext.tiny)", "hidden_size": script.hidden_size,
                       "num_layers": policy.config.num_hidden_layers, "vocab_size": policy.config.vocab_size},
            "reward_model": {"model": "tiny LlamaForSequenceClassification trained with TRL RewardTrainer",
                             "train_pairs": len(pairs), "held_out_pairs": len(held_out_pairs),
                             "epochs": script.rm_epochs, "learning_rate": script.rm_learning_rate},
            "prompts": {"train": script.num_train_prompts, "held_out_topics": list(HELD_OUT_TOPICS)},
        },
        times={"rm_train_time_s": rm_time},
    )


def _lora_targets(targets: list[str] | None) -> list[str] | str:
    """``--lora_target_modules`` as peft wants it: a list of names, or the string ``all-linear``."""
    if targets is None or targets == ["all-linear"]:
        return "all-linear"
    return list(targets)


def _checked_source(flag: str, value: str) -> str:
    """A model path or hub id, or a FileNotFoundError that names the command-line flag."""
    from trl_ppo_ext.models.loading import resolve_model_source

    try:
        return resolve_model_source(value)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{flag}: {err}") from err


def _load_or_explain(flag: str, value: str, loader, *args, **kwargs):
    """``loader(*args, **kwargs)``, with an OSError (missing files, offline hub) that names ``flag``."""
    try:
        return loader(*args, **kwargs)
    except OSError as err:
        raise OSError(
            f"{flag}={value!r} could not be loaded: {err} Pass a local directory written by save_pretrained(), "
            "or a hub id reachable from here (or cached, with HF_HUB_OFFLINE=1)."
        ) from err


def load_prompt_splits(script: ScriptArguments) -> tuple[Dataset, Dataset | None]:
    """``(train rows, eval rows or None)`` from ``--dataset_name`` (hub, builder + files, or a directory)."""
    import datasets

    name = script.dataset_name
    saved = os.path.isdir(name) and any(os.path.isfile(os.path.join(name, marker))
                                        for marker in ("dataset_dict.json", "state.json"))  # save_to_disk
    try:
        if saved:
            loaded = datasets.load_from_disk(name)
        else:
            loaded = datasets.load_dataset(name, script.dataset_config, data_files=script.data_files)
    except (FileNotFoundError, ConnectionError, OSError) as err:
        raise FileNotFoundError(
            f"--dataset_name={name!r} (--dataset_config={script.dataset_config!r}, --data_files={script.data_files!r}) "
            f"could not be loaded: {err} Pass a hub dataset id, a local directory, or --dataset_name json "
            "--data_files prompts.jsonl."
        ) from err
    if isinstance(loaded, Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if script.dataset_train_split not in loaded:
        raise ValueError(
            f"--dataset_train_split={script.dataset_train_split!r} is not a split of --dataset_name={name!r} "
            f"(splits: {list(loaded)}). Pass one of those."
        )
    test = script.dataset_test_split
    return loaded[script.dataset_train_split], (loaded[test] if test and test in loaded else None)


def _render_split(rows: Dataset, tokenizer, script: ScriptArguments, config: PPOConfig, max_length,
                  what: str) -> Dataset:
    """``render_prompts`` on one split; its errors re-raised with the command-line flags involved."""
    try:
        prompts, info = render_prompts(rows, tokenizer, prompt_column=script.prompt_column,
                                       max_prompt_length=script.max_prompt_length,
                                       response_length=config.response_length, max_length=max_length)
    except ValueError as err:
        raise ValueError(
            f"{what} prompts of --dataset_name={script.dataset_name!r} with the tokenizer of "
            f"--model_name_or_path={script.model_name_or_path!r}: {err} (Flags: --prompt_column, "
            "--max_prompt_length, --response_length.)"
        ) from err
    print(f"{what} prompts: kept {info.num_kept} of {info.num_prompts} ({info.num_empty} empty, "
          f"{info.num_too_long} longer than {info.max_prompt_tokens} tokens) from column {info.prompt_column!r}")
    return prompts


def _load_tokenizer(script: ScriptArguments, model_args: ModelArguments):
    """The policy's tokenizer, left padded; a missing pad token becomes the EOS (handled correctly here)."""
    from transformers import AutoTokenizer

    tokenizer = _load_or_explain(
        "--model_name_or_path", script.model_name_or_path, AutoTokenizer.from_pretrained, script.model_name_or_path,
        revision=model_args.model_revision, trust_remote_code=model_args.trust_remote_code, padding_side="left",
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer of --model_name_or_path={script.model_name_or_path!r} has neither a pad nor an EOS "
                "token. Add one to its tokenizer_config.json (PPO pads batches and stops at the EOS)."
            )
        tokenizer.pad_token = tokenizer.eos_token  # trl_ppo_ext never infers response ends from the pad id
    return tokenizer


def _prompt_datasets(script, config, tokenizer, max_length) -> tuple[Dataset, Dataset]:
    """Rendered training and evaluation prompts; without a test split the last training prompts are held out."""
    train_rows, eval_rows = load_prompt_splits(script)
    train = _render_split(train_rows, tokenizer, script, config, max_length, "Training")
    if eval_rows is not None:
        evaluation = _render_split(eval_rows, tokenizer, script, config, max_length, "Evaluation")
        return train, evaluation.select(range(min(script.num_eval_prompts, len(evaluation))))
    n = script.num_eval_prompts
    if len(train) <= n:
        raise ValueError(
            f"--dataset_test_split={script.dataset_test_split!r} is not in the dataset, and holding out "
            f"--num_eval_prompts={n} of the {len(train)} training prompts leaves none to train on. Lower "
            "--num_eval_prompts or pass a test split."
        )
    print(f"No split {script.dataset_test_split!r}: holding out the last {n} training prompts for evaluation.")
    return train.select(range(len(train) - n)), train.select(range(len(train) - n, len(train)))


def build_real(script: ScriptArguments, config: PPOConfig, model_args: ModelArguments) -> Setup:
    """Checkpoints and a prompt dataset; every check runs before the first large model is loaded."""
    from transformers import AutoConfig

    from trl_ppo_ext.models.loading import load_actor_critic, load_reward_model

    policy_source = _checked_source("--model_name_or_path", script.model_name_or_path)
    rm_source = _checked_source("--reward_model_path", config.reward_model_path)
    hub = dict(revision=model_args.model_revision, trust_remote_code=model_args.trust_remote_code)
    policy_config = _load_or_explain("--model_name_or_path", policy_source, AutoConfig.from_pretrained,
                                     policy_source, **hub)
    rm_config = _load_or_explain("--reward_model_path", rm_source, AutoConfig.from_pretrained, rm_source,
                                 trust_remote_code=model_args.trust_remote_code)
    tokenizer = _load_tokenizer(script, model_args)
    text_config = policy_config.get_text_config() if hasattr(policy_config, "get_text_config") else policy_config
    max_length = getattr(text_config, "max_position_embeddings", None)
    train, evaluation = _prompt_datasets(script, config, tokenizer, max_length)
    rm_vocab = getattr(rm_config.get_text_config() if hasattr(rm_config, "get_text_config") else rm_config,
                       "vocab_size", None)
    if rm_vocab is not None and len(tokenizer) > rm_vocab:
        raise ValueError(
            f"--reward_model_path={rm_source!r} has vocab_size={rm_vocab}, but the tokenizer of "
            f"--model_name_or_path={policy_source!r} has {len(tokenizer)} tokens. The reward model reads the "
            "policy's token ids; pass a reward model trained with the policy's tokenizer."
        )

    model = load_actor_critic(policy_source, lora_r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                              lora_dropout=model_args.lora_dropout,
                              lora_target_modules=_lora_targets(model_args.lora_target_modules),
                              load_in_4bit=model_args.load_in_4bit, torch_dtype=model_args.torch_dtype,
                              value_lora=model_args.value_lora, **hub)
    reward_model = load_reward_model(rm_source, load_in_4bit=model_args.load_in_4bit,
                                     torch_dtype=model_args.torch_dtype,
                                     trust_remote_code=model_args.trust_remote_code)
    return Setup(
        tokenizer=tokenizer, model=model, reward_model=reward_model, train_prompts=train, eval_prompts=evaluation,
        task=None, rm_pair_accuracy=None,
        settings={
            "policy": {"model_name_or_path": policy_source, "revision": model_args.model_revision,
                       "torch_dtype": model_args.torch_dtype, "load_in_4bit": model_args.load_in_4bit},
            "reward_model": {"path": rm_source, "load_in_4bit": model_args.load_in_4bit,
                             "offload": config.offload_reward_model},
            "prompts": {"dataset_name": script.dataset_name, "dataset_config": script.dataset_config,
                        "data_files": script.data_files, "train_split": script.dataset_train_split,
                        "test_split": script.dataset_test_split, "train": len(train), "max_length": max_length},
        },
        times={},
    )


# ------------------------------------------------------------------------------ evaluation
@dataclass
class Evaluation:
    """Responses sampled once per held-out prompt, at the training temperature. Means over responses."""

    rm_score: float  # raw reward-model score at the last response token
    true_reward: float | None  # the synthetic task's rule; None in real mode
    kl_to_ref: float  # sum over response tokens of log pi(a_t) - log pi_ref(a_t), at the sampling temperature
    eos_rate: float  # share of responses that ended with the stop token
    response_length: float  # response tokens, the stop token included
    samples: list[dict]  # the first few prompts with their responses and scores


@torch.no_grad()
def evaluate_policy(trainer: PPOTrainer, prompts: Dataset, *, seed: int, task=None, num_samples: int = 3) -> Evaluation:
    """Sample, score and measure the KL with the trainer's own rollout phases (same masks, same RM read).

    The global RNG state is saved and restored, so evaluating does not change the training run.
    """
    tokenizer, batch_size = trainer.processing_class, trainer.args.per_device_eval_batch_size
    rows = [{"input_ids": ids} for ids in prompts["input_ids"]]
    columns = {"rm": [], "kl": [], "eos": [], "length": [], "true": []}  # one value per response
    samples = []
    cuda = trainer.accelerator.device.type == "cuda"
    with torch.random.fork_rng(devices=None if cuda else []):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            batch = trainer.data_collator(rows[start : start + batch_size])
            rollout = trainer.score_rollout(trainer.generate_rollout(batch))
            mask = rollout.response_mask  # (b, T)
            responses = [r[m].tolist() for r, m in zip(rollout.responses, mask)]
            scores = rollout.scores.tolist()
            true = [task.true_reward(None, r) if task is not None else None for r in responses]
            columns["rm"] += scores
            columns["kl"] += (rollout.logprobs - rollout.ref_logprobs).masked_fill(~mask, 0.0).sum(1).tolist()
            columns["eos"] += rollout.has_stop.float().tolist()
            columns["length"] += mask.sum(1).float().tolist()
            columns["true"] += true
            for i in range(min(num_samples - len(samples), len(responses))):
                prompt = rollout.queries[i][rollout.query_mask[i]].tolist()
                samples.append({"prompt": tokenizer.decode(prompt, skip_special_tokens=True).strip(),
                                "response": tokenizer.decode(responses[i]), "rm_score": scores[i],
                                "true_reward": true[i]})

    def mean(name):
        return sum(columns[name]) / len(columns[name])

    return Evaluation(
        rm_score=mean("rm"), true_reward=mean("true") if task is not None else None, kl_to_ref=mean("kl"),
        eos_rate=mean("eos"), response_length=mean("length"), samples=samples,
    )


def print_samples(title: str, evaluation: Evaluation) -> None:
    print(f"\n{title}")
    for s in evaluation.samples:
        true = f", true reward {s['true_reward']:.2f}" if s["true_reward"] is not None else ""
        print(f"  {s['prompt']!r} -> {s['response']!r}  (RM {s['rm_score']:+.2f}{true})")


class BarOnly(ProgressCallback):
    """The Trainer's progress bar without the full metrics dict (25 keys) after each logged update:
    the trainer prints its own one-line summary of it. All metrics still reach ``log_history`` and
    any ``report_to`` integration."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


# --------------------------------------------------------------------------------- summary
PPO_SETTINGS = ("learning_rate", "total_episodes", "batch_size", "num_total_batches", "per_device_train_batch_size",
                "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs", "response_length", "temperature",
                "kl_coef", "kl_estimator", "cliprange", "cliprange_value", "vf_coef", "entropy_coef", "gamma", "lam",
                "whiten_rewards", "whiten_advantages", "missing_eos_penalty", "stop_token", "stop_token_id",
                "lr_scheduler_type", "max_grad_norm", "bf16", "offload_reward_model", "use_vllm", "seed")


def build_summary(setup: Setup, trainer: PPOTrainer, before: Evaluation, after: Evaluation, *, script, model_args,
                  threads: int, times: dict) -> dict:
    """summary.json: the before/after numbers first, then every setting used."""
    from trl_ppo_ext.run.manifest import package_versions

    config = trainer.args
    summary = {
        "mode": "demo" if setup.task is not None else "real",
        "rm_pair_accuracy": setup.rm_pair_accuracy,
        "rm_score_before": before.rm_score, "rm_score_after": after.rm_score,
        "true_reward_before": before.true_reward, "true_reward_after": after.true_reward,
        "kl_to_ref": after.kl_to_ref, "kl_to_ref_before": before.kl_to_ref,
        "eos_rate_before": before.eos_rate, "eos_rate_after": after.eos_rate,
        "response_length_before": before.response_length, "response_length_after": after.response_length,
        **times,
    }
    if setup.task is None:
        summary["true_reward_note"] = "real mode: no known true preference; only the reward model's scores are shown"
        summary["rm_pair_accuracy_note"] = "real mode: the reward model was trained elsewhere"
    lora = trainer.unwrapped.policy.peft_config[trainer.unwrapped.policy_adapter]
    summary["settings"] = {
        **setup.settings,
        "lora": {"r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
                 "target_modules": sorted(lora.target_modules) if isinstance(lora.target_modules, (set, list))
                 else lora.target_modules,
                 "trainable_parameters": sum(p.numel() for p in trainer.unwrapped.parameters() if p.requires_grad),
                 "value_adapter": getattr(trainer.unwrapped, "value_adapter", None),
                 "reference": "the policy with its LoRA adapter disabled"},
        "ppo": {name: getattr(config, name, None) for name in PPO_SETTINGS},
        "evaluation": {"num_eval_prompts": len(setup.eval_prompts), "seed": script.eval_seed,
                       "temperature": config.temperature, "kl_to_ref": "mean over responses of the sum over response "
                       "tokens of log pi - log pi_ref, both at the sampling temperature"},
        "output_dir": config.output_dir, "torch_num_threads": threads, "device": str(trainer.accelerator.device),
        "versions": package_versions(),
    }
    return to_jsonable(summary)


def print_summary(summary: dict, path: str) -> None:
    def fmt(key):
        value = summary.get(key)
        return "n/a" if value is None else f"{value:.3f}"

    print("\n" + "=" * 72)
    print(f"reward-model pair accuracy (held out): {fmt('rm_pair_accuracy')}")
    for what in ("true_reward", "rm_score", "eos_rate", "response_length"):
        print(f"{what:<16} before {fmt(what + '_before'):>8}   after {fmt(what + '_after'):>8}")
    print(f"KL to reference after PPO (per response): {fmt('kl_to_ref')}")
    print(f"wall time: {summary['wall_time_s']:.1f} s")
    print(f"summary written to {path}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None, *, start_time: float | None = None) -> dict:
    """Run the demo or a real run; return the summary that was written to ``summary.json``."""
    start = time.perf_counter() if start_time is None else start_time
    script, config, model_args = parse_args(argv)
    check_arguments(script, config, model_args)
    threads = set_cpu_threads(script.num_threads)
    _startup.vllm_cpu_defaults(config.use_vllm)
    if script.model_name_or_path is None:
        script.hidden_size = _startup.vllm_demo_hidden_size(script.hidden_size, config.use_vllm)
    set_seed(config.seed)
    setup = (build_demo if script.model_name_or_path is None else build_real)(script, config, model_args)

    # Held-out evaluation during training: the demo knows the true rule, so it logs it as
    # eval/true_reward next to eval/rm_score (a reward_hacking_metric for the guard rails).
    eval_metrics = None
    if setup.task is not None:
        eval_metrics = {"true_reward": lambda prompts, completions: [setup.task.true_reward(None, c)
                                                                     for c in completions]}
    trainer = PPOTrainer(args=config, processing_class=setup.tokenizer, model=setup.model, ref_model=None,
                         reward_model=setup.reward_model, train_dataset=setup.train_prompts, value_model=None,
                         eval_dataset=setup.eval_prompts if eval_metrics else None, eval_metrics=eval_metrics)
    if not config.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnly())
    show = dict(seed=script.eval_seed, task=setup.task, num_samples=script.num_samples_shown)
    before = evaluate_policy(trainer, setup.eval_prompts, **show)
    print_samples(f"Before PPO: held-out prompts, temperature {config.temperature}", before)

    print(f"\nPPO: {config.total_episodes} episodes, {config.num_total_batches} updates, LoRA r={model_args.lora_r} "
          f"alpha={model_args.lora_alpha}, learning rate {config.learning_rate:g}")
    ppo_start = time.perf_counter()
    trainer.train()
    ppo_time = time.perf_counter() - ppo_start
    after = evaluate_policy(trainer, setup.eval_prompts, **show)
    print_samples(f"After PPO: same prompts, same seed, temperature {config.temperature}", after)

    trainer.save_model(config.output_dir)
    times = {**setup.times, "ppo_train_time_s": ppo_time, "wall_time_s": time.perf_counter() - start}
    summary = build_summary(setup, trainer, before, after, script=script, model_args=model_args, threads=threads,
                            times=times)
    path = _startup.write_run_files(trainer, config.output_dir, summary)
    if path is not None:
        print_summary(summary, path)
    return summary


if __name__ == "__main__":
    main(start_time=_T0)
