"""The trainer's inputs as GRPO users give them: a model id, no tokenizer, a dataset of prompts.

TRL's ``GRPOTrainer(model="org/name", reward_funcs=..., train_dataset=...)`` loads the policy
from its id (``GRPOConfig.model_init_kwargs`` for ``from_pretrained``), the tokenizer from the
same place, and renders the dataset's ``prompt`` column itself. These functions do the same for
:class:`trl_ppo_ext.PPOTrainer`, so a GRPO script moves with the import and the class changed:

* :func:`load_policy`: a model id or folder -> ``AutoModelForCausalLM`` (a model passes through);
* :func:`load_processing_class`: ``None`` -> the policy's own tokenizer, with a pad token;
* :func:`load_reward_models`: model ids among ``reward_funcs`` (and a ``reward_model`` id) ->
  ``AutoModelForSequenceClassification(num_labels=1)``, as GRPO loads them;
* :func:`default_value_model`: no ``value_model`` and no ``peft_config`` (a GRPO script has
  neither) -> a critic made of the policy's backbone and a new scalar head, trained in full;
* :func:`prompt_dataset`: a dataset without ``input_ids`` but with a ``prompt`` (or
  ``messages``) column -> rendered with the chat template (``data.render_prompts``); the
  ``(dataset, info)`` pair ``render_prompts`` returns is accepted as it is;
* :func:`check_data_source` and :func:`environment_stand_in`: where an ``environment_factory``
  owns the data (TRL 1.16), ``train_dataset=None`` with ``max_steps`` trains on GRPO's stand-in
  (one empty user message per prompt), and an empty or missing prompt is the one ``reset(**row)``
  gives, not a row to drop.

``trust_remote_code`` is set only when the config asks: in ``model_init_kwargs``, where
``PPOConfig(trust_remote_code=True)`` (GRPO's field) puts it.

Example:

>>> from datasets import Dataset
>>> from trl_ppo_ext.inputs import prompt_dataset
>>> from trl_ppo_ext.tiny import build_tiny_tokenizer
>>> tok = build_tiny_tokenizer()
>>> ds = prompt_dataset(Dataset.from_dict({"prompt": ["w0 w1"], "answer": ["w1"]}), tok, response_length=4)
>>> ds.column_names, ds[0]["input_ids"]
(['prompt', 'answer', 'input_ids'], [4, 6, 7, 3, 5])
"""

from __future__ import annotations

import copy
import json
import logging
import os

from .data import PROMPT_COLUMNS, RenderInfo, _template_ids, render_prompts
from .estimator_table import needs_critic

logger = logging.getLogger(__name__)


def model_init_kwargs(args) -> dict:
    """``args.model_init_kwargs`` as a dict (it may arrive as JSON text from the command line, as in
    TRL); a ``torch_dtype``/``dtype`` given as text ("bfloat16") is left for transformers to read."""
    kwargs = getattr(args, "model_init_kwargs", None) or {}
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"PPOConfig.model_init_kwargs={kwargs!r} is not JSON: {err}. Pass a dict, or JSON "
                             'text such as \'{"dtype": "bfloat16"}\'.') from err
    if not isinstance(kwargs, dict):
        raise TypeError(f"PPOConfig.model_init_kwargs must be a dict or JSON text, got {type(kwargs).__name__}.")
    return dict(kwargs)


def default_args(model):
    """GRPO's ``args=None``: the default config, writing to ``<model name>-PPO`` (GRPO writes to
    ``<model name>-GRPO``)."""
    from .config import PPOConfig

    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model).rstrip("/").split("/")[-1]
    else:
        name = (getattr(getattr(model, "config", None), "_name_or_path", "") or "").rstrip("/").split("/")[-1]
    return PPOConfig(output_dir=f"{name or 'model'}-PPO")


def max_positions(model) -> int | None:
    """The policy's ``max_position_embeddings`` (``n_positions`` for GPT-2), None when it has none."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_policy(model, args):
    """``model`` itself, or, for a model id or folder (``str`` / ``os.PathLike``),
    ``AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs(args))``."""
    if not isinstance(model, (str, os.PathLike)):
        if model is None:
            raise ValueError("`model` is required: a causal LM, a SharedActorCritic, or a model id / folder "
                             "(loaded with AutoModelForCausalLM.from_pretrained and PPOConfig.model_init_kwargs).")
        return model
    from transformers import AutoModelForCausalLM

    from .models.loading import resolve_model_source

    source = resolve_model_source(model)
    logger.info("Loading the policy from %s", source)
    return AutoModelForCausalLM.from_pretrained(source, **model_init_kwargs(args))


def load_processing_class(processing_class, model, trust_remote_code: bool = False):
    """``processing_class``, or for ``None`` the policy's tokenizer (``AutoTokenizer`` from the
    folder or id the policy was loaded from, with ``trust_remote_code``: the config's
    ``model_init_kwargs.get("trust_remote_code")``), given the
    EOS as pad token when it has none (as GRPO does: the response mask here never reads the pad id,
    so pad == EOS is safe)."""
    if processing_class is not None:
        return processing_class
    source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not source:
        raise ValueError(
            f"processing_class=None, and the policy ({type(model).__name__}) does not say where it was loaded from "
            "(config._name_or_path is empty), so its tokenizer cannot be found. Pass processing_class=tokenizer."
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **({"trust_remote_code": True} if trust_remote_code else {}))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# TRL 1.16 GRPO's prompt where the environment gives it: reset()'s text is appended to this user message
ENVIRONMENT_PROMPT = [{"role": "user", "content": ""}]


def check_data_source(args, train_dataset, environment_factory) -> None:
    """Refuse ``train_dataset=None`` before any model is loaded, unless an environment owns the
    data as TRL 1.16 allows it: one ``environment_factory`` (not a dict: its rows route by an
    ``environment`` column) and ``max_steps > 0`` for the run's length. Errors name the fix."""
    if train_dataset is not None:
        return
    if environment_factory is None:
        raise ValueError(
            "train_dataset=None: a dataset of prompts is required (a `prompt` column, or tokenized `input_ids`) "
            "unless an `environment_factory` owns the data and returns each prompt from reset(); pass one of them.")
    if isinstance(environment_factory, dict):
        raise ValueError(
            "train_dataset=None with a dict environment_factory (several environments): each row must say its "
            "environment in an `environment` column. Pass such a dataset, or a single environment factory.")
    if int(getattr(args, "max_steps", -1) or -1) <= 0:
        raise ValueError(
            f"train_dataset=None (the environment owns the data) with max_steps={getattr(args, 'max_steps', None)}: "
            "without a dataset nothing else says how long to train. Set PPOConfig(max_steps=<updates>).")


def environment_stand_in(args, num_processes: int = 1):
    """TRL 1.16 GRPO's dataset where the environment owns the data: a ``prompt`` column of
    :data:`ENVIRONMENT_PROMPT`, one rollout batch's prompts (``per_device_train_batch_size *
    gradient_accumulation_steps / num_generations`` per process), cycled over the updates."""
    from datasets import Dataset

    per_process = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    return Dataset.from_dict({"prompt": [ENVIRONMENT_PROMPT] * (max(per_process, 1) * num_processes)})


def prompt_dataset(dataset, tokenizer, *, response_length: int | None = None, max_length: int | None = None,
                   name: str = "train_dataset", environment: bool = False):
    """The prompts as the trainer reads them (an ``input_ids`` column).

    Args:
        dataset: a dataset with ``input_ids`` (returned as it is); or one with a ``prompt`` /
            ``messages`` column (text or conversations), rendered with ``render_prompts``
            (chat template, ``add_generation_prompt=True``; prompts that leave no room for
            ``response_length`` within ``max_length`` are dropped with a count); or the
            ``(dataset, RenderInfo)`` pair ``render_prompts`` returns; or None.
        name: the argument's name, for errors.
        environment: an ``environment_factory`` gives the prompts at ``reset(**row)`` (TRL
            1.16): an empty prompt, or a dataset without a prompt column whose rows only feed
            ``reset``, stands for :data:`ENVIRONMENT_PROMPT` (its template ids) instead of being
            refused; no ``prompt`` column is added, so ``reset`` gets the row's own columns.
    Returns:
        the dataset, or None for None.
    """
    if isinstance(dataset, tuple) and len(dataset) == 2 and isinstance(dataset[1], RenderInfo):
        dataset = dataset[0]
    if dataset is None:
        return None
    columns = getattr(dataset, "column_names", None)
    if columns is None or "input_ids" in columns:
        return dataset
    empty_ids = _template_ids(tokenizer, ENVIRONMENT_PROMPT) if environment else None
    if environment and not any(c in columns for c in PROMPT_COLUMNS):  # the rows only feed reset(**row)
        return dataset.map(lambda _: {"input_ids": empty_ids}, desc="Environment prompts")
    if not any(c in columns for c in PROMPT_COLUMNS):
        raise ValueError(
            f"`{name}` has neither an `input_ids` column nor a prompt column ({' or '.join(PROMPT_COLUMNS)}); its "
            f"columns: {list(columns)}. Name the prompt column `prompt` (text or a list of messages), or tokenize "
            "the prompts yourself into `input_ids`."
        )
    rendered, _ = render_prompts(dataset, tokenizer, response_length=response_length, max_length=max_length,
                                 empty_ids=empty_ids)
    return rendered


def _load_scorer(source, args, where: str = "reward_model"):
    """A model id or folder loaded as a one-label sequence classifier; a failure names ``where``."""
    from transformers import AutoModelForSequenceClassification

    from .models.loading import resolve_model_source

    try:
        return AutoModelForSequenceClassification.from_pretrained(resolve_model_source(source), num_labels=1,
                                                                  **model_init_kwargs(args))
    except OSError as err:  # FileNotFoundError included: neither a folder nor a hub id, or not reachable
        raise ValueError(
            f"{where}={os.fspath(source)!r}: a string is a reward model's id or folder (GRPO's rule), and it could "
            f"not be loaded ({type(err).__name__}: {str(err)[:200]}). Pass a callable reward function, a model, or "
            "the id / folder of a sequence classifier."
        ) from err


def load_reward_models(reward_model, reward_funcs, args):
    """``(reward_model, reward_funcs)`` with every model id or folder among them loaded as a
    sequence classifier with one label (GRPO's rule for a string in ``reward_funcs``); its own
    tokenizer is found from its path later (``rewards.text.resolve_reward_tokenizer``)."""
    if isinstance(reward_model, (str, os.PathLike)):
        reward_model = _load_scorer(reward_model, args)
    if reward_funcs is None:
        return reward_model, None
    single = not isinstance(reward_funcs, (list, tuple))
    funcs = [_load_scorer(f, args, where=f"reward_funcs[{i}]") if isinstance(f, (str, os.PathLike)) else f
             for i, f in enumerate([reward_funcs] if single else reward_funcs)]
    return reward_model, funcs[0] if single else funcs


def value_model_or_default(model, value_model, peft_config, with_value: bool = True):
    """``value_model``, or :func:`default_value_model` of ``model`` when the run would otherwise have
    no critic: no ``value_model``, no ``peft_config``, and ``model`` is neither a shared
    actor-critic nor a ``PeftModel`` (both carry a value head of their own). ``with_value=False``
    (an advantage estimator that reads no value) builds none: ``value_model`` as given."""
    from peft import PeftModel

    if not with_value or value_model is not None or peft_config is not None:
        return value_model
    if getattr(model, "is_actor_critic", False) or isinstance(model, PeftModel):
        return None
    return default_value_model(model)


def default_value_model(policy):
    """The critic when the user gives none and no ``peft_config``: a sequence classifier of the
    policy's own config (``num_labels=1``) whose backbone starts as a copy of the policy's and
    whose scalar head is new -- the separate value model TRL's PPO docs build from a checkpoint,
    made from the policy in memory. It trains in full beside the policy (twice the policy's
    trainable memory); ``peft_config=LoraConfig(task_type="CAUSAL_LM")`` gives the one-GPU
    shared actor-critic instead.

    Raises ``ValueError`` for a policy that is not a transformers model with a backbone
    (``base_model_prefix``), naming the two ways out."""
    from transformers import AutoModelForSequenceClassification, PreTrainedModel

    backbone = getattr(policy, "base_model", None) if isinstance(policy, PreTrainedModel) else None
    if backbone is None or backbone is policy:
        raise ValueError(
            f"value_model=None and no peft_config, and the policy ({type(policy).__name__}) has no transformers "
            "backbone to copy a critic from. Pass value_model=AutoModelForSequenceClassification.from_pretrained("
            "<checkpoint>, num_labels=1), or peft_config=peft.LoraConfig(task_type='CAUSAL_LM') for the shared "
            "actor-critic."
        )
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    value = AutoModelForSequenceClassification.from_config(config, dtype=next(policy.parameters()).dtype)
    value.base_model.load_state_dict(backbone.state_dict())
    value.config._name_or_path = policy.config._name_or_path  # its tokenizer is the policy's
    logger.warning(
        "value_model=None and no peft_config: the critic is a copy of the policy's backbone (%s) with a new scalar "
        "head, trained in full beside the policy. For the one-GPU layout pass peft_config=LoraConfig("
        "task_type='CAUSAL_LM') (a LoRA policy and a value head on one shared base).", type(policy).__name__)
    return value.to(next(policy.parameters()).device)


def trainer_inputs(args, model, processing_class, reward_model, reward_funcs, train_dataset, eval_dataset,
                   value_model, peft_config, environment_factory=None) -> tuple:
    """Every input of ``PPOTrainer`` as the trainer reads it, in its argument order: the policy
    (:func:`load_policy`), its tokenizer (:func:`load_processing_class`), the reward models
    (:func:`load_reward_models`), both datasets (:func:`prompt_dataset`; with an
    ``environment_factory``, ``train_dataset=None`` is :func:`environment_stand_in`, checked by
    :func:`check_data_source` before anything is loaded) and the critic
    (:func:`value_model_or_default`; none is made when ``args.advantage_estimator`` reads no value)."""
    check_data_source(args, train_dataset, environment_factory)
    if train_dataset is None:
        from .distributed import process_state

        train_dataset = environment_stand_in(args, process_state().num_processes)
    model = load_policy(model, args)
    processing_class = load_processing_class(processing_class, model,
                                             bool(model_init_kwargs(args).get("trust_remote_code", False)))
    reward_model, reward_funcs = load_reward_models(reward_model, reward_funcs, args)
    train_dataset, eval_dataset = (
        prompt_dataset(dataset, processing_class, response_length=args.response_length,
                       max_length=max_positions(model), name=name, environment=environment_factory is not None)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)))
    with_value = needs_critic(getattr(args, "advantage_estimator", "gae"))
    if not getattr(args, "use_value_adapter", False):  # else the critic is an adapter on the policy's base
        value_model = value_model_or_default(model, value_model, peft_config, with_value=with_value)
    return model, processing_class, reward_model, reward_funcs, train_dataset, eval_dataset, value_model
