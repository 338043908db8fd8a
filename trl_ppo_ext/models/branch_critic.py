"""A critic that branches from the policy's pass at a decoder layer: the value adapter's own
parameters on the layers above the branch only, at the price of those layers.

The full value adapter (``SharedActorCritic(value_lora_config=...)``) runs the whole backbone a
second time under its adapter. The branch critic at layer ``k`` of an ``N``-layer decoder reads the
hidden state the policy's own pass feeds into layer ``k`` (the output of layers ``0 .. k-1`` under
the policy adapter), *detached*, and runs layers ``k .. N-1`` and the final norm again under the
value adapter, whose LoRA weights sit on those layers only (PEFT's ``layers_to_transform``). So:

* the critic costs ``N - k`` layers instead of ``N`` (forward and backward);
* the value loss reaches the value adapter and the value head only: the detach at the branch keeps
  it off the policy's adapter and off everything below the branch;
* the policy's pass is untouched (its logits are those of a run without a critic).

The layers above the branch are called with the keyword arguments the policy's pass gave them
(:func:`capture_layer_inputs`): the family's own causal or sliding-window mask, rotary cos/sin and
position ids, exactly as the backbone built them. This needs a backbone whose forward is
"embed, then each decoder layer on the running hidden state, then one final norm", with nothing
else between the layers; :data:`BRANCH_FAMILIES` lists the families checked to be so. Others
(GPT-2, OPT, remote-code models) are refused by :func:`decoder_stack` with an error naming the
family: use the full value adapter there.

Values alone (``models.values.value_forward``, the on-policy scoring pass) run one backbone pass
that switches from the policy adapter to the value adapter at the branch
(:func:`switch_adapter_at_branch`): ``N`` layers, no LM head, the same values as ``forward``'s.

Notation: ``B`` sequences, ``L`` positions, ``H`` hidden size, ``N`` decoder layers, ``k`` the
branch layer (``1 <= k <= N - 1``).

Example:

>>> resolve_branch_layer(6, num_layers=12), resolve_branch_layer(-3, num_layers=12)
(6, 9)
>>> layers_above(9, num_layers=12)
[9, 10, 11]
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

# model_type of the families whose backbone is embed -> layers -> norm, with every decoder layer
# called as layer(hidden_states, **kwargs) and nothing between two layers (checked in their
# transformers modeling files); the tests run Llama, Mistral, Qwen2 and Qwen3.
BRANCH_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def resolve_branch_layer(layer: int, num_layers: int) -> int:
    """The branch layer ``k`` in ``1 .. N-1`` from ``value_branch_layer`` (negative: from the top).

    Args:
        layer: the layer whose input the critic branches from; ``-1`` is the last layer
            (the critic then has one layer of its own).
        num_layers: ``N``, the decoder's layer count.

    Raises:
        ValueError: ``layer`` resolves outside ``1 .. N-1`` (0 would be the full value adapter;
            ``N`` would leave the critic no layer of its own).
    """
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"value_branch_layer={layer!r}: pass an int (a decoder layer index), or None.")
    k = layer + num_layers if layer < 0 else layer
    if not 1 <= k <= num_layers - 1:
        raise ValueError(
            f"value_branch_layer={layer} on a decoder of {num_layers} layers: the branch must leave layers both "
            f"below it (shared with the policy) and above it (the critic's own), i.e. 1..{num_layers - 1} or "
            f"-{num_layers - 1}..-1. For a critic over the whole backbone pass value_branch_layer=None."
        )
    return k


def layers_above(k: int, num_layers: int) -> list[int]:
    """Indices of the layers the critic runs under its adapter: ``k .. N-1``."""
    return list(range(k, num_layers))


def decoder_stack(base: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """``(layers, final_norm)`` of a causal LM whose layers can be run as a slice.

    Args:
        base: a ``*ForCausalLM`` (the PeftModel's base model).

    Raises:
        ValueError: the family is not one of :data:`BRANCH_FAMILIES`, or its backbone lacks
            ``layers`` / ``norm``; the message names the family and the way out.
    """
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    family = getattr(config, "model_type", None)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    layers, norm = getattr(backbone, "layers", None), getattr(backbone, "norm", None)
    if family not in BRANCH_FAMILIES or not isinstance(layers, nn.ModuleList) or norm is None:
        raise ValueError(
            f"value_branch_layer is set, and {type(base).__name__} (model_type={family!r}) is not a family whose "
            f"decoder layers this package runs as a slice (supported: {', '.join(BRANCH_FAMILIES)}). Use "
            "value_branch_layer=None: the full value adapter works on every family."
        )
    return layers, norm


def num_decoder_layers(base: nn.Module) -> int:
    """``N``: the decoder layer count of a :data:`BRANCH_FAMILIES` causal LM."""
    return len(decoder_stack(base)[0])


def branch_lora_config(lora_config, k: int, num_layers: int):
    """``lora_config`` copied with ``layers_to_transform`` = the layers above the branch.

    A config that names its layers already must name layers above the branch only (the critic
    never runs the ones below under its adapter); the caller's config is not changed.

    Raises:
        ValueError: ``lora_config.layers_to_transform`` names a layer below ``k``.
    """
    config = copy.deepcopy(lora_config)
    given = config.layers_to_transform
    if given is None:
        config.layers_to_transform = layers_above(k, num_layers)
        return config
    check_adapter_above_branch(given, k)
    return config


def check_adapter_above_branch(layers_to_transform, k: int) -> None:
    """Refuse a value adapter with weights on layers below the branch (they would never train).

    Raises:
        ValueError: ``layers_to_transform`` is None (every layer) or names a layer below ``k``.
    """
    named = [layers_to_transform] if isinstance(layers_to_transform, int) else layers_to_transform
    below = None if named is None else sorted(i for i in named if i < k)
    if named is None or below:
        where = "every layer" if named is None else f"layers {below}"
        raise ValueError(
            f"the value adapter has weights on {where}, below value_branch_layer={k}: the branch critic runs "
            f"only layers >= {k} under its adapter. Build the value adapter with layers_to_transform on layers "
            f">= {k} (or value_lora_config without layers_to_transform: it is set for you), or "
            "value_branch_layer=None."
        )


@contextlib.contextmanager
def capture_layer_inputs(layers: nn.ModuleList, k: int) -> Iterator[list[tuple[tuple, dict]]]:
    """Record ``(args, kwargs)`` of every call of ``layers[k:]`` inside the block (the policy's pass).

    Yields a list filled as the layers run: one ``(args, kwargs)`` per layer above the branch, in
    order; ``args[0]`` (or ``kwargs["hidden_states"]``) of the first is the branch hidden state
    ``(B, L, H)``. Only references are kept (the tensors exist for the policy's pass anyway).
    """
    captured: list[tuple[tuple, dict]] = []
    hooks = [layer.register_forward_pre_hook(lambda module, args, kwargs: captured.append((args, dict(kwargs))),
                                             with_kwargs=True) for layer in layers[k:]]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def run_layers_above(layers: nn.ModuleList, norm: nn.Module, k: int,
                     captured: list[tuple[tuple, dict]]) -> torch.Tensor:
    """The critic's hidden states: layers ``k .. N-1`` and the final norm, from the branch.

    Args:
        layers, norm: :func:`decoder_stack`'s.
        k: the branch layer.
        captured: :func:`capture_layer_inputs`' record of the policy's pass.
    Returns:
        ``(B, L, H)`` final-norm hidden states; the branch input is detached, so no gradient
        reaches the layers below ``k`` or the policy's adapter.

    Equivalent to ``h = hidden_states[k].detach(); for i in k..N-1: h = layers[i](h, **kw[i]);
    norm(h)``, ``hidden_states`` being the policy pass's ``output_hidden_states``.
    """
    expected = len(layers) - k
    if len(captured) != expected:
        raise RuntimeError(
            f"the policy's pass ran {len(captured)} of the {expected} decoder layers above value_branch_layer={k}; "
            "the branch critic needs each layer called once per forward."
        )
    hidden = None
    for layer, (args, kwargs) in zip(layers[k:], captured):
        kwargs = dict(kwargs)
        if hidden is None:  # the branch: the policy's hidden state entering layer k
            hidden = (args[0] if args else kwargs.pop("hidden_states")).detach()
        else:
            kwargs.pop("hidden_states", None)
        out = layer(hidden, *args[1:], **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return norm(hidden)


@contextlib.contextmanager
def switch_adapter_at_branch(layers: nn.ModuleList, k: int,
                             enter_value: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Inside the block, a backbone pass switches to the value adapter between layers ``k-1`` and ``k``.

    A forward hook on ``layers[k-1]`` detaches its output (the branch hidden state) and enters
    ``enter_value()``; the block's exit leaves it. Layers ``0 .. k-1`` thus run under the adapter
    active before (the policy's), ``k .. N-1`` under the value adapter. The switch happens before
    layer ``k`` is called, so a checkpointed layer recomputes under the adapter it ran with.
    """
    stack = contextlib.ExitStack()

    def at_branch(module, args, output):
        stack.enter_context(enter_value())
        if isinstance(output, tuple):
            return (output[0].detach(), *output[1:])
        return output.detach()

    hook = layers[k - 1].register_forward_hook(at_branch)
    try:
        with stack:
            yield
    finally:
        hook.remove()
