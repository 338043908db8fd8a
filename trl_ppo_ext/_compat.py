"""Where the installed TRL keeps its PPO trainer, and whether we support that TRL.

TRL's PPOv2-style trainer moved from ``trl.PPOTrainer`` (0.12 - 0.28) to
``trl.experimental.ppo.PPOTrainer`` (0.26 - 1.12) and was removed in 1.13. We support
``TRL_MIN <= trl < TRL_MAX``; the README explains the floor. Everything else in the package
imports TRL through this module, so a future move is a one-file change.
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

TRL_MIN = "1.0.0"
TRL_MAX = "1.13.0"  # exclusive: trl 1.13 removed the PPO trainer

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
    """
    installed = installed or installed_trl_version()
    v = Version(installed)
    if not (Version(TRL_MIN) <= v < Version(TRL_MAX)):
        raise ImportError(
            f"trl-ppo-ext supports trl>={TRL_MIN},<{TRL_MAX} but trl=={installed} is installed"
            + (" (trl 1.13 removed the PPO trainer)" if v >= Version(TRL_MAX) else "")
            + f". Install a supported version: pip install 'trl>={TRL_MIN},<{TRL_MAX}'."
        )
    return installed


def _import_quietly(name: str):
    # trl.experimental warns on every import; our users did not import it themselves.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trl.experimental.*")
        return importlib.import_module(name)


def load_trl_ppo():
    """Return ``(TRLPPOTrainer, TRLPPOConfig, module)`` from wherever TRL keeps them."""
    check_trl_version()
    for module_name, trainer_name, config_name in _LOCATIONS:
        try:
            module = _import_quietly(module_name)
        except ImportError:
            continue
        trainer, config = getattr(module, trainer_name, None), getattr(module, config_name, None)
        if trainer is not None and config is not None:
            return trainer, config, module
    raise ImportError(
        f"trl=={installed_trl_version()} is in the supported range but its PPO trainer was not "
        f"found in any of {[m for m, _, _ in _LOCATIONS]}. Please report this."
    )


_LOADED: dict = {}


def __getattr__(name):
    # TRL's classes are looked up on first use: importing TRL takes seconds, and
    # `trl_ppo_ext.functional` or `trl_ppo_ext.tiny` alone do not need it.
    if name in ("TRLPPOTrainer", "TRLPPOConfig", "trl_ppo_trainer_module"):
        if not _LOADED:
            trainer, config, _ = load_trl_ppo()
            _LOADED.update(
                TRLPPOTrainer=trainer,
                TRLPPOConfig=config,
                trl_ppo_trainer_module=importlib.import_module(trainer.__module__),
            )
        return _LOADED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unwrap_model_for_generation(*args, **kwargs):
    """TRL's context manager that gathers ZeRO-3 weights for generation."""
    from trl.models.utils import unwrap_model_for_generation as _unwrap

    return _unwrap(*args, **kwargs)


def prepare_deepspeed(model, accelerator):
    """TRL's helper that wraps a frozen model in a DeepSpeed inference engine.

    Always ``trl.models.utils.prepare_deepspeed(model, accelerator)``, which has that
    signature in every TRL 1.x. (The one TRL 1.0's PPO module imports is
    ``trl.trainer.utils.prepare_deepspeed(model, per_device_train_batch_size, fp16, bf16)``:
    looked up through the PPO module, ZeRO-1/2 got the accelerator as a batch size.)
    """
    from trl.models.utils import prepare_deepspeed as _prepare

    return _prepare(model, accelerator)
