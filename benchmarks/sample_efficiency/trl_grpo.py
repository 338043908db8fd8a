"""The ``trl_grpo`` arm: TRL's own ``GRPOTrainer`` (of the installed TRL, 1.16 or newer), a peer for
this package's critic-free estimators (e.g. ``--arm grpo:advantage_estimator=grpo,num_generations=4``;
rloo, reinforce_pp_baseline alike), on the ``synthetic``, ``verifiable`` and ``long`` tasks, and
against this package's critic on ``tools_env``, where both trainers run their tool loop with
``environment_factory=Calculator`` (``multiturn`` is refused: its ``rollout_func`` samples with this
package's ``trainer.generate_continuations``).

What it shares with the ``ours`` arms: the task's initial policy per seed (built or loaded exactly
as they do), the LoRA rank, alpha and targets as ``peft_config`` (but ``lm_head``, trained whole
through ``modules_to_save``: TRL 1.16's GRPO refuses an adapter there, its fused LM head reads
``lm_head.weight`` directly; see ``grpo_lora``), the prompts (as text that its tokenizer turns back
into exactly the same ids: ``prompt_texts``; on tools_env the same conversations, which both render
with the tool's schema), learning rate, temperature (0.7 synthetic and long, 1.0 verifiable and
tools_env), ``max_completion_length`` = the task's response_length (on tools_env TRL's budget of the
whole multi-turn completion, tool replies included, as ours), ``max_tool_calling_iterations`` and
``chat_template_kwargs`` as ours, stopping at ``<eos>`` (the tokenizer's EOS, which GRPO always adds
to the model's generation_config), the episode budget counted in completions, and the update shape
(``grpo_settings``): one generation batch = the task's rollout batch (32 synthetic, long and
tools_env, 64 verifiable) of ``num_generations=4`` completions per prompt, as this package's group
estimators are run (so 8 or 16 prompts per batch where ``defaults`` has 32 or 64);
``steps_per_generation`` = our ``num_mini_batches`` (2) optimizer steps of
``per_device_train_batch_size`` = batch / 2 rows, no gradient accumulation, and ``num_iterations`` =
our ``num_ppo_epochs`` (4): 8 optimizer steps per rollout, as ours; ``max_steps`` = ``ceil(episodes /
batch) * 8``, so both generate the same completions. The rest is TRL GRPO's defaults: ``beta`` 0 (no
KL term, no reference model; ``kl`` is None in its rows), ``loss_type`` "dapo", ``scale_rewards``
"group", ``epsilon`` 0.2, a linear learning-rate decay over its optimizer steps (ours decays per
update). Its rewards are each task module's ``grpo()``: synthetic, the task's trained reward model
read on prompt + completion ids at the last completion token (``reward_model_function``, as this
package reads it); verifiable, the example's reward functions with their weights
(``reward_weights``); long, ``long_task_reward`` on the completion ids; tools_env,
``correct_answer`` on the message lists, as ours. Its rows come from what the reward functions saw
per generation batch (``GRPORecorder``: the true reward or the exact answer of those completions,
measured as for the other arms; on tools_env also the call rate, read from the environments the
reward function is given) and from TRL's per-step logs averaged over the rollout's optimizer steps
(``entropy``; ``score`` is GRPO's ``reward``, the weighted reward it trained on; ``reward_std`` and
``frac_reward_zero_std`` are kept too).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from .tasks import task_module, task_settings

# Completions per prompt of the trl_grpo arm: as this package's group arms (advantage_estimator grpo, rloo,
# reinforce_pp_baseline with num_generations=4), so a rollout batch of 32 holds 8 prompts.
GRPO_GENERATIONS = 4


def grpo_settings(ppo, episodes: int, num_generations: int = GRPO_GENERATIONS) -> dict:
    """The ``GRPOConfig`` fields of the ``trl_grpo`` arm that mirror a task's ``PPOConfig`` ``ppo``.

    Ours samples a rollout batch of ``B = per_device_train_batch_size * gradient_accumulation_steps``
    completions (one process), then takes ``num_mini_batches`` optimizer steps over it per epoch
    for ``num_ppo_epochs`` epochs. TRL GRPO gets the same shape: a generation batch of ``B``
    (``steps_per_generation = num_mini_batches`` steps of ``per_device_train_batch_size = B /
    num_mini_batches`` rows, no accumulation), reused ``num_iterations = num_ppo_epochs`` times;
    ``max_steps`` covers ``ceil(episodes / B)`` rollouts, ours' ``num_total_batches``, so both runs
    generate the same completions. Learning rate, temperature and completion budget
    (``max_completion_length = response_length``: for episodes with tools TRL's budget of the whole
    multi-turn completion, tool replies included, as our ``response_length``) are ours, and so are
    the tool loop's ``max_tool_calling_iterations`` and ``chat_template_kwargs`` (None where ``ppo``
    has none: GRPO's defaults).

    >>> from types import SimpleNamespace as NS
    >>> ppo = NS(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_mini_batches=2,
    ...          num_ppo_epochs=4, learning_rate=5e-3, temperature=0.7, response_length=10)
    >>> s = grpo_settings(ppo, 1024)
    >>> s["per_device_train_batch_size"], s["steps_per_generation"], s["num_iterations"], s["max_steps"]
    (16, 2, 4, 256)
    """
    batch, steps = ppo.per_device_train_batch_size * ppo.gradient_accumulation_steps, ppo.num_mini_batches
    if batch % steps or batch % num_generations:
        raise ValueError(f"trl_grpo: the rollout batch {batch} must split into num_mini_batches={steps} optimizer "
                         f"steps and into groups of num_generations={num_generations}.")
    rollouts = math.ceil(episodes / batch)
    return dict(per_device_train_batch_size=batch // steps, gradient_accumulation_steps=1,
                steps_per_generation=steps, num_iterations=ppo.num_ppo_epochs, num_generations=num_generations,
                max_steps=rollouts * steps * ppo.num_ppo_epochs, learning_rate=ppo.learning_rate,
                temperature=ppo.temperature, max_completion_length=ppo.response_length,
                max_tool_calling_iterations=getattr(ppo, "max_tool_calling_iterations", None),
                chat_template_kwargs=getattr(ppo, "chat_template_kwargs", None))


def grpo_lora(lora):
    """The LoRA config of the ``trl_grpo`` arm from the task's ``lora``: the same rank, alpha, dropout
    and targets, but ``lm_head`` trained whole (``modules_to_save``) instead of by an adapter.

    TRL 1.16's GRPOTrainer refuses an adapter on ``lm_head``: its fused LM head computes the
    log-probs from ``lm_head.weight`` directly, so the adapter would never be trained. Every task
    here adapts ``lm_head`` (a random tiny Llama does not learn without it, see
    ``examples/ppo_lora.py``); a full copy of the head (``vocab x hidden`` weights, 46 x 32 on the
    synthetic task, against the adapter's ``r (vocab + hidden)``) is the nearest thing TRL GRPO
    trains: ``get_output_embeddings().weight`` is then the trained copy's.
    """
    targets = list(lora.target_modules)
    if "lm_head" not in targets:
        return lora
    return dataclasses.replace(lora, target_modules=[t for t in targets if t != "lm_head"],
                               modules_to_save=[*(lora.modules_to_save or []), "lm_head"])


def prompt_texts(tokenizer, prompt_ids: list[list[int]]) -> list[str]:
    """Text prompts that ``tokenizer(text=...)`` (how TRL GRPO tokenizes a text prompt) turns back
    into exactly ``prompt_ids``: the ids decoded with their special tokens. Raises if one does not
    round-trip (a tokenizer that adds a BOS, merges words differently, ...).

    >>> from trl_ppo_ext.tiny import build_tiny_tokenizer
    >>> prompt_texts(build_tiny_tokenizer(), [[4, 6, 7, 3, 5]])
    ['<user> w0 w1 <eos> <assistant>']
    """
    texts = [tokenizer.decode(ids) for ids in prompt_ids]
    back = tokenizer(text=texts)["input_ids"]
    for ids, text, again in zip(prompt_ids, texts, back):
        if list(again) != list(ids):
            raise ValueError(f"prompt_texts: {text!r} tokenizes to {list(again)}, not the prompt's {list(ids)}.")
    return texts


def grpo_prompts(prompts, tokenizer, keep: tuple[str, ...] = ()):
    """A ``Dataset`` for TRL GRPO from the one ours trains on: a text ``prompt`` column giving back
    its ``input_ids`` (:func:`prompt_texts`), and the columns ``keep`` (``answer``: the reward's)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompt_texts(tokenizer, prompts["input_ids"]),
                              **{name: prompts[name] for name in keep}})


def reward_model_function(reward_model, tokenizer):
    """A reward model as a reward function in TRL GRPO's convention, read as this package's trainer
    reads one: prompt ids (the text prompt tokenized as GRPO does) then the completion ids,
    scored at the last completion token (its ``<eos>`` when it stopped) by ``score_at``, with the
    positions of the valid tokens. Rows are padded on the right, so the padding is never read."""
    import torch

    from trl_ppo_ext.models.policy_value import score_at

    def reward_model_score(prompts, completion_ids, **kwargs) -> list[float]:
        rows = [list(p) + [int(t) for t in c] for p, c in zip(tokenizer(text=list(prompts))["input_ids"],
                                                             completion_ids)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            return score_at(reward_model, ids, mask, positions, index=mask.sum(1) - 1).tolist()

    return reward_model_score


def grpo_row(update: int, measured: list[list[float]], logs: list[dict], steps_per_rollout: int,
             extras: list[dict[str, list[float]]] | None = None) -> dict:
    """The benchmark's row of rollout ``update`` (1-based) of a ``trl_grpo`` run.

    Args:
        measured: per generation batch so far, the measured reward of each completion (the true
            reward, or the exact answer), as the reward functions saw them.
        logs: TRL's logs, one per optimizer step, each with its global ``step``; rollout ``k``
            trained in steps ``(k - 1) * steps_per_rollout + 1 .. k * steps_per_rollout``.
        extras: per generation batch, further per-completion figures by name (tools_env:
            ``call_rate``), each kept in the row as its mean; None: none.
    Returns:
        ``update``, ``episode`` (completions generated up to this rollout), ``reward`` (mean of
        its measured values), ``scored``, and the mean over its steps of what TRL logged:
        ``score`` (GRPO's ``reward``: the weighted reward it trained on), ``kl`` (only with
        beta != 0), ``entropy``, ``reward_std``, ``frac_reward_zero_std``; None where not logged; then
        the mean of each of ``extras``' figures for this rollout.
    """
    values = measured[update - 1]
    first, last = (update - 1) * steps_per_rollout + 1, update * steps_per_rollout
    mine = [log for log in logs if first <= log["step"] <= last]

    def mean(key):
        found = [log[key] for log in mine if log.get(key) is not None]
        return statistics.fmean(found) if found else None

    return {"update": update, "episode": sum(len(m) for m in measured[:update]), "reward": statistics.fmean(values),
            "scored": len(values), "score": mean("reward"), "kl": mean("kl"), "entropy": mean("entropy"),
            "explained_variance": None, "reward_std": mean("reward_std"),
            "frac_reward_zero_std": mean("frac_reward_zero_std"),
            **{key: statistics.fmean(v) for key, v in (extras[update - 1] if extras else {}).items()}}


class GRPORecorder:
    """Rows of a ``trl_grpo`` run from what its reward functions measured per generation batch
    (``measure``: the reward measured, and optionally further per-completion figures by name) and
    from TRL's per-step logs (``log``): a rollout's row is complete once the log of its last
    optimizer step arrives."""

    def __init__(self, steps_per_rollout: int):
        self.steps_per_rollout = steps_per_rollout
        self.measured: list[list[float]] = []
        self.extras: list[dict[str, list[float]]] = []
        self.logs: list[dict] = []
        self.rows: list[dict] = []

    def measure(self, values, extras: dict | None = None) -> None:
        self.measured.append([float(v) for v in values])
        self.extras.append({key: [float(v) for v in got] for key, got in (extras or {}).items()})

    def log(self, step: int, logs: dict) -> list[dict]:
        """Keep the log of optimizer step ``step``; return the rows it completes."""
        if "train_runtime" not in logs:  # the Trainer's closing summary is not a step's log
            self.logs.append({**logs, "step": step})
        new = []
        while len(self.rows) < len(self.measured) and step >= (len(self.rows) + 1) * self.steps_per_rollout:
            new.append(grpo_row(len(self.rows) + 1, self.measured, self.logs, self.steps_per_rollout, self.extras))
            self.rows.append(new[-1])
        return new


def grpo_config(task_name: str, episodes: int, *, output_dir: str, seed: int, overrides: dict | None = None):
    """``(GRPOConfig, PPOConfig)`` of the ``trl_grpo`` arm on ``task_name``: the task's PPOConfig as the
    "ours" arms get it (its example's settings, :func:`task_settings`), and the GRPOConfig
    mirroring it (:func:`grpo_settings`, ``reward_weights`` the task's), one log per optimizer
    step, everything else TRL GRPO's defaults (``beta`` 0, its ``loss_type``, ``scale_rewards``,
    ``epsilon``, ...) unless ``overrides`` (GRPOConfig fields, the arm's) say otherwise."""
    from trl import GRPOConfig

    from trl_ppo_ext import PPOConfig

    run = dict(output_dir=output_dir, eval_strategy="no", save_strategy="no", report_to="none", seed=seed, bf16=False)
    ppo = PPOConfig(**{**task_settings(task_name, {f.name for f in dataclasses.fields(PPOConfig)}), **run,
                       "total_episodes": episodes})
    weights = list(ppo.reward_weights) if ppo.reward_weights is not None else None
    config = GRPOConfig(**{**grpo_settings(ppo, episodes), "reward_weights": weights, "logging_steps": 1,
                           "disable_tqdm": True, **run, **(overrides or {})})
    return config, ppo


def run_grpo(task_name: str, arm, seed: int, *, model_dir: Path, episodes: int, hidden_size: int,
             out: Path, memory: Path | None = None) -> int:
    """The ``trl_grpo`` arm of ``run_one``: TRL's ``GRPOTrainer`` on ``task_name``'s policy, LoRA,
    prompts and reward (the task module's ``grpo()``), sized by :func:`grpo_settings` from the task's
    PPO settings. Returns the updates."""
    from trl import GRPOTrainer

    from .run import train_writing_rows

    module = task_module(task_name)
    if not hasattr(module, "grpo"):
        runs = [name for name in ("synthetic", "verifiable", "long", "tools_env") if hasattr(task_module(name), "grpo")]
        raise ValueError(f"the trl_grpo arm runs the {', '.join(runs)} tasks, not {task_name!r}.")
    config, ppo = grpo_config(task_name, episodes, output_dir=str(out.parent / f".{out.stem}_trainer"), seed=seed,
                              overrides=arm.overrides)
    steps_per_rollout = config.steps_per_generation * config.num_iterations
    recorder = GRPORecorder(steps_per_rollout)
    inputs = module.grpo(seed, ppo, model_dir=model_dir, hidden_size=hidden_size, recorder=recorder)
    lora = grpo_lora(inputs.lora)

    return train_writing_rows(
        lambda callbacks: GRPOTrainer(model=inputs.policy, reward_funcs=inputs.funcs, args=config,
                                      train_dataset=inputs.dataset, processing_class=inputs.tokenizer,
                                      peft_config=lora, callbacks=callbacks, **inputs.environments),
        # wall seconds of training when the rollout's last optimizer step was logged
        lambda state, logs: recorder.log(state.global_step, logs),
        out, updates=lambda: config.max_steps // steps_per_rollout, output_dir=config.output_dir, memory=memory)


# The trl_grpo arm is measured against this TRL's GRPOTrainer (environment_factory, the tool parser and
# the chat-template helpers the tools_env task needs arrived by 1.16).
TRL_GRPO_MIN = "1.16"


def trl_grpo_ok() -> str | None:
    """None if this python's TRL can run the ``trl_grpo`` arm (TRL >= ``TRL_GRPO_MIN`` whose
    ``GRPOTrainer`` imports), else why not."""
    import importlib.metadata

    from packaging.version import Version

    try:
        installed = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "TRL is not installed"
    if Version(installed) < Version(TRL_GRPO_MIN):
        return f"the trl_grpo arm needs TRL >= {TRL_GRPO_MIN}, this python has {installed}"
    try:
        from trl import GRPOTrainer  # noqa: F401
    except Exception as err:  # TRL's lazy module wraps the import error in a RuntimeError
        return f"trl.GRPOTrainer does not import here: {err}"
    return None

