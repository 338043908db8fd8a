"""Where the installed TRL keeps its PPO trainer, which base our classes stand on, and
whether we support that TRL.

TRL's PPOv2-style trainer moved from ``trl.PPOTrainer`` (0.12 - 0.28) to
``trl.experimental.ppo.PPOTrainer`` (0.26 - 1.12) and was removed in 1.13. We support
``TRL_MIN <= trl < TRL_MAX``:

- where the installed TRL has PPO (1.0 - 1.12) our ``PPOTrainer`` / ``PPOConfig`` subclass
  TRL's, so ``isinstance`` checks against TRL's classes hold;
- where it has none (1.13 on), they stand on ``trl_ppo_ext._base``: the same fields and
  ``save_model`` on TRL's base trainer and base config.

``TRL_PPO_EXT_OWN_BASE=1`` in the environment (read once, at import) forces our own base on
a TRL that has PPO; the parity tests use it to run both bases on one TRL. Everything else in
the package imports TRL through this module, so a future move is a one-file change.
"""

from __future__ import annotations

import importlib
import os
import warnings
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

TRL_MIN = "1.0.0"
TRL_MAX = "2.0.0"  # exclusive: the next major release may break the base classes we build on
TRL_WITHOUT_PPO = "1.13.0"  # the first TRL without a PPO trainer: from here on, our own base
TRL_NEWEST_VERIFIED = "1.16.0"  # the newest TRL the test suite has run against (README, CI)

OWN_BASE_ENV = "TRL_PPO_EXT_OWN_BASE"
_OWN_BASE_FORCED = os.environ.get(OWN_BASE_ENV, "").strip().lower() not in ("", "0", "false", "no")

# (module, trainer class, config class), first match wins.
_LOCATIONS = (
    ("trl.experimental.ppo", "PPOTrainer", "PPOConfig"),
    ("trl", "PPOTrainer", "PPOConfig"),
)


def installed_trl_version() -> str:
    try:
        return version("trl")
    except PackageNotFoundError as err:
        raise ImportError(
            f"trl-ppo-ext needs TRL, which is not installed. Install a supported version: "
            f"pip install 'trl>={TRL_MIN},<{TRL_MAX}'."
        ) from err


def check_trl_version(installed: str | None = None) -> str:
    """Raise ImportError unless ``installed`` (default: the installed TRL) is supported.

    >>> check_trl_version("1.12.0")
    '1.12.0'
    >>> check_trl_version("1.16.0")
    '1.16.0'
    """
    installed = installed or installed_trl_version()
    v = Version(installed)
    if not (Version(TRL_MIN) <= v < Version(TRL_MAX)):
        raise ImportError(
            f"trl-ppo-ext supports trl>={TRL_MIN},<{TRL_MAX} but trl=={installed} is installed. "
            f"Install a supported version: pip install 'trl>={TRL_MIN},<{TRL_MAX}'."
        )
    return installed


def _import_quietly(name: str):
    # trl.experimental warns on every import; our users did not import it themselves.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        return importlib.import_module(name)


def find_trl_ppo():
    """``(TRL's PPOTrainer, TRL's PPOConfig, module)``, or None where the installed TRL has
    no PPO trainer (1.13 on)."""
    check_trl_version()
    for module_name, trainer_name, config_name in _LOCATIONS:
        try:
            module = _import_quietly(module_name)
        except ImportError:
            continue
        trainer, config = getattr(module, trainer_name, None), getattr(module, config_name, None)
        if trainer is not None and config is not None:
            return trainer, config, module
    return None


def load_trl_ppo():
    """Return ``(TRLPPOTrainer, TRLPPOConfig, module)`` from wherever TRL keeps them; raise
    ImportError where the installed TRL has none (for code that compares against TRL's own
    trainer: benchmarks, parity tests)."""
    found = find_trl_ppo()
    if found is None:
        raise ImportError(
            f"none of {[m for m, _, _ in _LOCATIONS]} has a PPO trainer. trl_ppo_ext.PPOTrainer works without it. "
            + trl_ppo_hint()
        )
    return found


def trl_ppo_hint() -> str:
    """What a comparison with TRL's own PPO trainer needs where the installed TRL has none, and how
    to get it: a second environment with TRL 1.12 (the last with PPO), as CI builds one."""
    return (
        f"TRL's own PPO trainer is in trl {TRL_MIN} - 1.12 (TRL {TRL_WITHOUT_PPO} removed it); this environment has "
        f"trl=={installed_trl_version()}. To compare with it, make a second environment from the checkout: "
        "python -m venv .venv-trl112 && .venv-trl112/bin/pip install torch==2.13.0 && "
        ".venv-trl112/bin/pip install -e . trl==1.12.0, then run the same command with .venv-trl112/bin/python."
    )


def trl_has_ppo() -> bool:
    """Whether the installed TRL ships a PPO trainer (1.0 - 1.12)."""
    return _cached("trl_ppo", find_trl_ppo) is not None


def uses_own_base() -> bool:
    """Whether our ``PPOTrainer`` / ``PPOConfig`` stand on ``trl_ppo_ext._base`` (TRL has no
    PPO, or ``TRL_PPO_EXT_OWN_BASE=1`` was set) rather than on TRL's PPO classes."""
    return _OWN_BASE_FORCED or not trl_has_ppo()


def base_description() -> str:
    """One line saying which base our classes stand on (for bug reports and the tests)."""
    if not uses_own_base():
        return f"TRL's PPOTrainer/PPOConfig ({_cached('trl_ppo', find_trl_ppo)[2].__name__})"
    from . import _base

    roots = f"{_base.config_root().__name__}/{_base.trainer_root().__name__}"
    why = f"forced by {OWN_BASE_ENV}" if _OWN_BASE_FORCED and trl_has_ppo() else "TRL has no PPO trainer"
    return f"trl_ppo_ext._base on {roots} ({why})"


def upstream_ppo_config():
    """TRL's own ``PPOConfig`` class, or None where TRL has none (for accepting its objects)."""
    found = _cached("trl_ppo", find_trl_ppo)
    return None if found is None else found[1]


_LOADED: dict = {}


def _cached(key: str, make):
    if key not in _LOADED:
        _LOADED[key] = make()
    return _LOADED[key]


def _resolve(name: str):
    if name in ("PPOTrainerBase", "PPOConfigBase"):
        if uses_own_base():
            from . import _base

            return getattr(_base, name)
        trainer, config, _ = _cached("trl_ppo", find_trl_ppo)
        return trainer if name == "PPOTrainerBase" else config
    trainer, config, _ = load_trl_ppo()
    return trainer if name == "TRLPPOTrainer" else config


def __getattr__(name):
    # Looked up on first use: importing TRL takes seconds, and `trl_ppo_ext.functional` or
    # `trl_ppo_ext.tiny` alone do not need it.
    #   PPOTrainerBase / PPOConfigBase: what our classes subclass (TRL's, or our own base);
    #   TRLPPOTrainer / TRLPPOConfig: TRL's own classes (ImportError where TRL has none).
    if name in ("PPOTrainerBase", "PPOConfigBase", "TRLPPOTrainer", "TRLPPOConfig"):
        return _cached(name, lambda: _resolve(name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextmanager
def unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params: bool = True, **kwargs):
    """TRL's context manager that gathers ZeRO-3 weights for generation; under FSDP2 the policy's
    units are gathered the same way (``models.fsdp.policy_for_generation``: once for the block
    with ``gather_deepspeed3_params``, else in every forward)."""
    from trl.models.utils import unwrap_model_for_generation as _unwrap

    from .distributed import check_fsdp_run
    from .models.fsdp import is_fsdp2_model, policy_for_generation

    check_fsdp_run(accelerator)
    with _unwrap(model, accelerator, gather_deepspeed3_params=gather_deepspeed3_params, **kwargs) as unwrapped:
        if not is_fsdp2_model(unwrapped):
            yield unwrapped
            return
        with policy_for_generation(unwrapped, getattr(unwrapped, "policy", unwrapped), gather_deepspeed3_params):
            yield unwrapped


def prepare_deepspeed(model, accelerator):
    """TRL's helper that wraps a frozen model in a DeepSpeed inference engine.

    Always ``trl.models.utils.prepare_deepspeed(model, accelerator)``, which has that
    signature in every TRL 1.x. (The one TRL 1.0's PPO module imports is
    ``trl.trainer.utils.prepare_deepspeed(model, per_device_train_batch_size, fp16, bf16)``:
    looked up through the PPO module, ZeRO-1/2 got the accelerator as a batch size.)
    """
    from trl.models.utils import prepare_deepspeed as _prepare

    return _prepare(model, accelerator)
