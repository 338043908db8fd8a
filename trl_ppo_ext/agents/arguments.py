"""``ToolArguments``: the tool-calling fields of a PPO config, with TRL GRPO's names and meanings.

``PPOConfig`` inherits this dataclass (as it does ``VLLMArguments``) and calls its
``__post_init__``; on its own it is readable by ``HfArgumentParser``. The fields are read
only when the trainer is given ``tools`` or an ``environment_factory``.

Example:

>>> from trl_ppo_ext.agents.arguments import ToolArguments
>>> ToolArguments(chat_template_kwargs='{"enable_thinking": false}').chat_template_kwargs
{'enable_thinking': False}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .._utils import help_metadata as _help

__all__ = ["ToolArguments"]


@dataclass
class ToolArguments:
    """How an episode with tools runs: the cap on tool-calling rounds, the chat template's extra
    keywords (TRL GRPO's fields) and how long one tool call may take (ours)."""

    max_tool_calling_iterations: int | None = field(default=None, metadata=_help(
        "The most rounds of tool calls in one episode (TRL GRPO's name). None: no cap; the episode ends on a "
        "turn without a tool call or at the response_length budget, tool tokens included."))
    chat_template_kwargs: dict | str | None = field(default=None, metadata=_help(
        "Keywords passed to every apply_chat_template call: prompts, tool results, reward-model texts (TRL "
        "GRPO's name). A JSON string from the command line, e.g. '{\"enable_thinking\": false}'."))
    tool_timeout: float | None = field(default=None, metadata=_help(
        "Seconds one tool call may take; a call that runs longer becomes an {\"error\": ...} result and a counted "
        "failure. None: no limit (as TRL)."))

    def __post_init__(self):
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(f"chat_template_kwargs={self.chat_template_kwargs!r} is not JSON: {err}") from err
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(
                f"chat_template_kwargs must be a dict (or a JSON object string), got "
                f"{type(self.chat_template_kwargs).__name__}")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 1:
            raise ValueError(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations}: give at least 1 round, or None "
                "for no cap")
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout={self.tool_timeout}: give seconds > 0, or None for no limit")
