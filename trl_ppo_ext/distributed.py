"""Running on several processes: the process group of a CPU-only DeepSpeed or FSDP2 launch, the
DeepSpeed settings that PPO owns, and where the frozen models go (ZeRO's sharded parameters:
:mod:`trl_ppo_ext.models.sharding`; FSDP2's units: :mod:`trl_ppo_ext.models.fsdp`).

Nothing here imports DeepSpeed unless DeepSpeed is in use: it is an optional extra
(``pip install trl-ppo-ext[deepspeed]``).

Example:

>>> from trl_ppo_ext.distributed import launched_world_size
>>> launched_world_size() >= 1
True
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Accelerators for which accelerate picks a process-group backend itself (accelerate's
# `PartialState._prepare_backend`); on anything else a DeepSpeed launch gets none.
_ACCELERATOR_CHECKS = (
    "is_mlu_available", "is_sdaa_available", "is_musa_available", "is_npu_available", "is_hpu_available",
    "is_xpu_available", "is_neuron_available", "is_torch_xla_available",
)


def deepspeed_requested() -> bool:
    """Whether ``accelerate launch`` was asked for DeepSpeed (``distributed_type: DEEPSPEED``)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def launched_world_size() -> int:
    """Processes the launcher started (``WORLD_SIZE``; 1 for a plain ``python script.py``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _has_device_accelerator() -> bool:
    """CUDA or any other device accelerate knows a collective backend for."""
    if torch.cuda.is_available():
        return True
    import accelerate.utils as au

    return any(getattr(au, name, lambda: False)() for name in _ACCELERATOR_CHECKS)


def fsdp_requested() -> bool:
    """Whether ``accelerate launch`` was asked for FSDP (``distributed_type: FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def requested_fsdp_version() -> int:
    """The ``fsdp_version`` of an FSDP launch (accelerate's default, 1, when the config has none)."""
    return int(os.environ.get("FSDP_VERSION", "1"))


def check_fsdp_version() -> None:
    """Refuse an FSDP1 launch (``fsdp_version: 1`` or none): the trainer reads and writes its
    parameters one by one (checkpoints, the reference adapter, generation), which FSDP1's flat
    parameters do not allow; FSDP2 keeps one sharded tensor per parameter."""
    if fsdp_requested() and requested_fsdp_version() != 2:
        raise ValueError(
            f"The accelerate config asks for FSDP version {requested_fsdp_version()} (fsdp_version in fsdp_config); "
            "trl-ppo-ext supports FSDP2 only. Set fsdp_version: 2 (see examples/accelerate_configs/fsdp2.yaml), or "
            "use DDP or DeepSpeed ZeRO."
        )


def needs_gloo_backend() -> bool:
    """A DeepSpeed or FSDP launch of several processes on a machine with no device accelerator.

    accelerate chooses no process-group backend there, so every rank believes it is process
    0 of 1 while DeepSpeed's own group holds them all: data is not sharded, every rank is
    "main", and the first gather fails (``ProcessGroupGloo::allgather: invalid output tensor
    list``). An FSDP launch gets the same (two unsynchronised runs, silently). GPU runs are
    left alone: they get NCCL from accelerate.
    """
    return (deepspeed_requested() or fsdp_requested()) and launched_world_size() > 1 and not _has_device_accelerator()


def process_state():
    """accelerate's ``PartialState`` for this run, rebuilt with ``backend="gloo"`` when
    :func:`needs_gloo_backend` (``TrainingArguments`` already built it without a backend while
    the config was created; DeepSpeed's process group itself is reused, not re-created).

    An FSDP launch on the CPU is made an FSDP run (see :func:`_make_fsdp_state`); an FSDP1
    launch is refused (:func:`check_fsdp_version`).
    """
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    check_fsdp_version()
    state = PartialState()
    if needs_gloo_backend() and state.backend is None:
        AcceleratorState._reset_state(reset_partial_state=True)
        state = PartialState(backend="gloo")
        logger.info("CPU-only %s launch: using the gloo backend (%d processes).",
                    "DeepSpeed" if deepspeed_requested() else "FSDP", state.num_processes)
    if fsdp_requested() and launched_world_size() > 1:
        _make_fsdp_state(state)
    return state


def _make_fsdp_state(state) -> None:
    """Have the next ``Accelerator`` make this an FSDP run on the CPU too.

    accelerate (1.16) turns a launch into an FSDP run only when its process group is on a
    device it lists (``MULTI_GPU``, ``MULTI_NPU``, ...): with gloo on the CPU the state stays
    ``NO`` (the backend it built itself: each process alone) or ``MULTI_CPU`` (``use_cpu``:
    plain DDP), and FSDP is silently dropped. ``fully_shard`` itself runs on the CPU with gloo,
    so the state is marked as a multi-process device run, which ``AcceleratorState`` (built by
    the trainer's ``Accelerator`` right after this) turns into ``FSDP``; the device stays the
    CPU. Raises where the launch still has a single process.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if state.num_processes < 2:
        raise RuntimeError(
            f"accelerate launch started {launched_world_size()} processes for FSDP, but this one sees a process "
            f"group of {state.num_processes} (distributed_type {state.distributed_type}): they would train "
            "unsynchronised. Check the launch (num_processes, the process-group backend)."
        )
    if state.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU):
        if AcceleratorState._shared_state:  # an Accelerator made before the trainer's: rebuilt by the trainer's
            AcceleratorState._reset_state(reset_partial_state=False)
        state.distributed_type = DistributedType.MULTI_GPU  # read once, by AcceleratorState, and replaced by FSDP


def check_fsdp_run(accelerator) -> None:
    """Raise unless an FSDP launch became an FSDP2 run of every launched process (the trap
    :func:`process_state` closes: each process alone, or plain DDP, without a word)."""
    from accelerate.utils import DistributedType

    if not fsdp_requested():
        return
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (accelerator.distributed_type != DistributedType.FSDP or plugin is None or plugin.fsdp_version != 2
            or accelerator.num_processes != launched_world_size()):
        raise RuntimeError(
            f"accelerate launch asked for FSDP2 on {launched_world_size()} processes, but the accelerator runs "
            f"{accelerator.distributed_type} on {accelerator.num_processes}: the processes would train "
            "unsynchronised. Build the trainer before any other Accelerator of the script, or report this with "
            "the accelerate version."
        )


# ---------------------------------------------------------------------- the run's accelerator
def plan_accelerator(args, plan, mixed_precision: str | None):
    """The ``Accelerator`` that executes a ``batching.BatchPlan``: one optimizer step per mini-batch of
    ``plan.micro_batches_per_mini_batch`` micro-batches, counted by accelerate independently of any
    dataloader (with ``sync_with_dataloader``, its default, accelerate forces a step on every
    micro-batch while the train loader sits on its last batch, i.e. at every epoch end); under
    DeepSpeed the engine steps and clips as the plan says (:func:`configure_deepspeed`)."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    accelerator = Accelerator(
        cpu=bool(getattr(args, "use_cpu", False)), mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.micro_batches_per_mini_batch, sync_with_dataloader=False, adjust_scheduler=False),
    )
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        configure_deepspeed(accelerator, args, plan)
    return accelerator


# ---------------------------------------------------------------------- DeepSpeed config
def configure_deepspeed(accelerator, args, plan) -> None:
    """Fill the DeepSpeed settings PPO owns and refuse values that contradict the run.

    PPO takes one optimizer step per mini-batch of ``plan.micro_batches_per_mini_batch``
    micro-batches and clips at ``args.max_grad_norm``; under DeepSpeed the engine does both
    inside ``backward`` from its config. ``"auto"`` (and absent) values are set from the plan
    and the config; an explicit different value raises ``ValueError`` naming it.
    Must run before ``accelerator.prepare``.
    """
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    clip = float(args.max_grad_norm) if args.max_grad_norm else 0.0
    micro, steps = plan.local_micro_batch_size, plan.micro_batches_per_mini_batch
    wanted = {
        "gradient_accumulation_steps": steps,
        "gradient_clipping": clip,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * steps * plan.world_size,
    }
    for key, value in wanted.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
    fixes = {
        "gradient_accumulation_steps": "one optimizer step per PPO mini-batch needs it to be the number of "
        "micro-batches per mini-batch; set it to \"auto\" in the DeepSpeed config",
        "gradient_clipping": "set it to \"auto\" in the DeepSpeed config (PPOConfig.max_grad_norm is used), "
        "or make PPOConfig.max_grad_norm match",
    }
    for key, fix in fixes.items():
        if float(config[key]) != float(wanted[key]):
            raise ValueError(
                f"The DeepSpeed config has {key}={config[key]!r} but this PPO run needs {wanted[key]!r} "
                f"(per_device_train_batch_size={args.per_device_train_batch_size}, "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}, "
                f"num_mini_batches={args.num_mini_batches}, max_grad_norm={args.max_grad_norm}): {fix}."
            )


# ---------------------------------------------------------------------- frozen models
def prepare_frozen_model(model: nn.Module, accelerator, prepare_deepspeed) -> nn.Module:
    """The reference or reward model under DeepSpeed: a DeepSpeed inference engine (ZeRO-3:
    sharded like the policy, so a reward model larger than one device fits; ZeRO-1/2: an
    unsharded stage-0 engine with the same precision settings as the trained model, so old
    and reference log-probs are taken alike), as TRL does. A 4-bit model stays as it is:
    DeepSpeed cannot shard or cast bitsandbytes weights, and quantized it is small already.
    """
    from .models.quantization import is_4bit_model

    if is_4bit_model(model):
        logger.info("A 4-bit %s is kept unsharded on its device under DeepSpeed.", type(model).__name__)
        return model
    return prepare_deepspeed(model, accelerator)


def place_frozen(model: nn.Module, name: str, offloaded: bool, accelerator, *, prepare_deepspeed=None) -> nn.Module:
    """A frozen model in eval mode, a 4-bit one kept off bitsandbytes' CPU repack first
    (``models.quantization.make_4bit_cpu_safe``): a DeepSpeed inference engine under DeepSpeed
    (``prepare_deepspeed`` given, TRL's, see :func:`prepare_frozen_model`), else on the training
    device, or on the CPU when ``offloaded`` on CUDA (moved in for each scoring pass). ``name`` names
    it in the log line."""
    from .models.quantization import is_4bit_model, make_4bit_cpu_safe

    if is_4bit_model(model):
        make_4bit_cpu_safe(model)
    model.eval().requires_grad_(False)
    if prepare_deepspeed is not None:
        return prepare_frozen_model(model, accelerator, prepare_deepspeed)
    cuda = accelerator.device.type == "cuda"
    if offloaded and not cuda:
        logger.info("%s offload has no effect without a CUDA device; it stays on %s.", name, accelerator.device)
    return model.to("cpu" if offloaded and cuda else accelerator.device)


def place_frozen_models(policy: nn.Module, ref_model, args, accelerator, *, prepare_deepspeed=None):
    """The policy's 4-bit layers kept off the CPU repack (bitsandbytes' breaks LoRA gradients) and the
    reference placed by :func:`place_frozen` (``args.offload_ref_model``; ``prepare_deepspeed`` given
    under DeepSpeed, where the offload flags are refused with a warning). Returns the placed
    reference (or None); the reward models are placed by ``rewards.building.place_run_rewards`` with
    :func:`place_frozen` too."""
    from .models.quantization import is_4bit_model, make_4bit_cpu_safe

    offloads = [name for name in ("offload_ref_model", "offload_reward_model") if getattr(args, name, False)]
    if prepare_deepspeed is not None and offloads:  # the flags would do nothing here, silently
        warnings.warn(
            f"{' and '.join(f'{name}=True' for name in offloads)} has no effect under DeepSpeed: the frozen "
            "models become DeepSpeed engines, which DeepSpeed places (on the training device; under ZeRO-3 its "
            "own zero_optimization.offload_param applies). Unset the flag, or offload through the DeepSpeed "
            "config.", UserWarning, stacklevel=4)
    if is_4bit_model(policy):
        make_4bit_cpu_safe(policy)
    if ref_model is None:
        return None
    return place_frozen(ref_model, "ref_model", args.offload_ref_model, accelerator,
                        prepare_deepspeed=prepare_deepspeed)


# ---------------------------------------------------------------------- gradient accumulation
def needs_equal_micro_batch_counts(accelerator) -> bool:
    """Whether every process must run as many micro-batches per mini-batch as the others.

    DDP reduces gradients once, in the backward of the step's last micro-batch (the others
    run under ``no_sync``), so processes may run different counts (a token budget gives
    each its own). DeepSpeed ZeRO and FSDP communicate inside every backward: there each
    process must run the same count, or the collectives stop matching and the run hangs."""
    from accelerate.utils import DistributedType

    return accelerator.num_processes > 1 and accelerator.distributed_type in (
        DistributedType.DEEPSPEED, DistributedType.FSDP)


@contextmanager
def accumulation_step(accelerator, model: nn.Module, last: bool, reduce: bool = True):
    """The backward of one micro-batch, ``last`` when it ends the mini-batch (the optimizer step).

    ``accelerator.accumulate`` counts micro-batches against a fixed number of accumulation
    steps; with ``max_tokens_per_micro_batch`` the count changes with every mini-batch and
    process, so the step boundary is said here instead: gradient sync (DDP ``no_sync``
    before it), accelerate's ``sync_gradients`` (the optimizer wrapper steps only then) and
    DeepSpeed's accumulation boundary. Loss scaling is the caller's (``accelerator.backward``
    still divides by the configured accumulation steps). ``reduce`` False: DDP does not reduce the last
    micro-batch either (a critic epoch's step averages the critic's gradients itself,
    ``critic_epochs.average_critic_gradients``).
    """
    accelerator.gradient_state._set_sync_gradients(last)
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        wrapped.engine.set_gradient_accumulation_boundary(last)
    with nullcontext() if last and reduce else accelerator.no_sync(model):
        yield
