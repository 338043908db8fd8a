"""Whether the installed TRL, transformers and the chat template can run tool calls: checked at
construction, with TRL 1.16 GRPO's gates (``grpo_trainer.py`` G:627-654, G:757-781).

The tool loop uses TRL's own chat-template helpers in ``trl.chat_template_utils``:
``add_response_schema`` (the parser for a known template), ``parse_response``,
``supports_tool_calling``, ``is_chat_template_prefix_preserving`` and
``get_training_chat_template``. Read from the published wheels: all but
``supports_tool_calling`` are in 1.0, which 1.1 adds; ``parse_response(prefix=)``, which the
parsers of transformers >= 5.13 need, arrives in 1.8; ``parse_response(tools=)`` (arguments
typed by the tool's schema) in 1.16. So tools need TRL >= ``TOOLS_MIN_TRL``; on 1.8 - 1.15 the
arguments are parsed untyped.

transformers gates, as TRL's: ``tools`` need >= 5.0, ``environment_factory`` >= 5.2, and below
5.13 the legacy parser needs ``jmespath``.

Example:

>>> from trl_ppo_ext.tiny import build_tiny_chat_tokenizer
>>> tok = build_tiny_chat_tokenizer()                 # TRL's Qwen3 template: not prefix-preserving
>>> template = check_tool_support(tok)
>>> "{%- generation %}" in template                   # so TRL's training variant is rendered with
True
>>> check_tool_support(tok, trl_version="1.7.0")
Traceback (most recent call last):
...
ImportError: Tools and environment_factory need TRL >= 1.8.0 ... the installed TRL is 1.7.0. ...
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version

from packaging.version import Version

__all__ = ["ENVIRONMENTS_MIN_TRANSFORMERS", "TOOLS_MIN_TRANSFORMERS", "TOOLS_MIN_TRL", "check_tool_support",
           "chat_template_helpers"]

TOOLS_MIN_TRL = "1.8.0"
TOOLS_MIN_TRANSFORMERS = "5.0.0"
ENVIRONMENTS_MIN_TRANSFORMERS = "5.2.0"
_RESPONSE_TEMPLATE_TRANSFORMERS = "5.13.0.dev0"  # below it, the legacy response_schema parser (needs jmespath)
_HELPERS = ("add_response_schema", "parse_response", "supports_tool_calling", "is_chat_template_prefix_preserving",
            "get_training_chat_template")


def _upgrade_trl(installed: str) -> ImportError:
    return ImportError(
        f"Tools and environment_factory need TRL >= {TOOLS_MIN_TRL} (its chat-template helpers with "
        f"parse_response(prefix=)); the installed TRL is {installed}. Upgrade: pip install 'trl>={TOOLS_MIN_TRL}'."
    )


def chat_template_helpers(trl_version: str | None = None) -> dict:
    """TRL's chat-template helpers by name (``_HELPERS``), from ``trl.chat_template_utils``.

    Raises:
        ImportError: naming ``TOOLS_MIN_TRL`` and the installed version, when the TRL is older
            or lacks one of them.
    """
    installed = trl_version or version("trl")
    if Version(installed) < Version(TOOLS_MIN_TRL):
        raise _upgrade_trl(installed)
    try:
        from trl import chat_template_utils
    except ImportError as error:
        raise _upgrade_trl(installed) from error
    missing = [name for name in _HELPERS if not hasattr(chat_template_utils, name)]
    if missing:
        raise _upgrade_trl(f"{installed}, whose trl.chat_template_utils lacks {missing}")
    return {name: getattr(chat_template_utils, name) for name in _HELPERS}


def check_tool_support(processing_class, *, environments: bool = False, trl_version: str | None = None,
                       transformers_version: str | None = None) -> str | None:
    """Check that tool calls can run, give the tokenizer its response parser, and choose the
    chat template every render of the tool loop uses.

    Args:
        processing_class: the policy's tokenizer; its ``response_template`` is set (TRL's
            ``add_response_schema``) unless it has one, as TRL's trainer does.
        environments: an ``environment_factory`` is set (a later transformers gate).
        trl_version, transformers_version: the versions to check (default: the installed ones).

    Returns:
        TRL's training variant of the chat template when the tokenizer's own is not
        prefix-preserving (TRL renders with it then, G:776-781), else None (render with the
        tokenizer's own). Pass it as ``chat_template=`` to the tool loop.

    Raises:
        ImportError: the TRL or transformers is too old (naming the version needed), or jmespath
            is missing below transformers 5.13.
        ValueError: the tokenizer has no chat template, the template cannot render a tool-calling
            conversation, TRL's parser does not recognise it, or it is not prefix-preserving and
            TRL has no training variant for it.
    """
    helpers = chat_template_helpers(trl_version)
    transformers_version = transformers_version or version("transformers")
    needed, feature = ((ENVIRONMENTS_MIN_TRANSFORMERS, "environment_factory") if environments
                       else (TOOLS_MIN_TRANSFORMERS, "tools"))
    if Version(transformers_version) < Version(needed):
        raise ImportError(
            f"{feature} needs transformers >= {needed} (as in TRL's GRPOTrainer); the installed transformers is "
            f"{transformers_version}. Upgrade: pip install 'transformers>={needed}'."
        )
    if Version(transformers_version) < Version(_RESPONSE_TEMPLATE_TRANSFORMERS) and \
            importlib.util.find_spec("jmespath") is None:
        raise ImportError(
            f"Tool calls on transformers {transformers_version} (< 5.13) are parsed by its legacy response_schema "
            "parser, which needs jmespath: pip install jmespath (or upgrade transformers to >= 5.13)."
        )
    if getattr(processing_class, "chat_template", None) is None:
        raise ValueError(
            "Tools need a chat template that renders them, and the processing_class has none: set "
            "processing_class.chat_template (e.g. a Qwen3 or Llama 3.1 template TRL knows)."
        )
    if not helpers["supports_tool_calling"](processing_class):
        raise ValueError(
            "The chat template does not support tool calling: it must render a whole tool-calling conversation "
            "(user -> assistant with tool_calls -> tool) with the tool's name, arguments and result visible. Use a "
            "template that does (Qwen2.5/Qwen3, Llama 3.1/3.2, GPT-OSS, GLM-4-MoE, ... as TRL lists)."
        )
    has_parser = any(getattr(processing_class, attr, None) is not None for attr in ("response_template",
                                                                                    "response_schema"))
    if not has_parser:
        try:
            helpers["add_response_schema"](processing_class)
        except ValueError as error:
            raise ValueError(
                "TRL's tool-call parser does not recognise this chat template (trl.chat_template_utils."
                "add_response_schema matches the templates TRL bundles exactly: Qwen2.5/Qwen3/Qwen3.5, Llama "
                "3.1/3.2, GPT-OSS, GLM-4-MoE, LFM2, Gemma 4, Nemotron 3, DeepSeek-R1-distill). Use one of those "
                "templates, or set processing_class.response_template yourself (transformers' response parsing "
                f"docs). TRL said: {error}"
            ) from error
    if helpers["is_chat_template_prefix_preserving"](processing_class):
        return None
    try:
        return helpers["get_training_chat_template"](processing_class)
    except ValueError as error:
        raise ValueError(
            "The chat template is not prefix-preserving (adding a tool message re-renders earlier turns, so the "
            "token ids of a multi-turn episode could not be built by concatenation), and TRL has no training "
            f"variant of it. Use a template that keeps earlier turns as they are. TRL said: {error}"
        ) from error
