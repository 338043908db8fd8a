"""Tools and environments with TRL 1.16 GRPO's names and meanings, independent of any trainer.

- `tools`: run parsed tool calls (sync and async, errors, ``tool_timeout``) into ``tool`` messages;
- `environments`: ``environment_factory`` (probe, pool, ``reset(**row)``, ``get_reward`` rewards);
- `adapters`: a gym-style or OpenEnv environment as an ``environment_factory`` class with one
  tool (`gym_environment`, `openenv_environment`);
- `tool_loop`: the batched multi-turn loop, token ids in and out, for any ``generate`` callable;
- `support`: the construction-time check of TRL, transformers and the chat template;
- `rollout_func`: all of it as one ``rollout_func`` (`AgentRollout`);
- `arguments`: the config fields (`ToolArguments`: ``max_tool_calling_iterations``,
  ``chat_template_kwargs``, ``tool_timeout``), which ``PPOConfig`` inherits.

The facts of TRL's contract are cited by file and line of TRL 1.16's ``trl/trainer/grpo_trainer.py`` (G:line)
in each module.

>>> from trl_ppo_ext import agents
>>> agents.ToolLoopStats(rollouts=3, calls=2, failures=1).metrics()["tools/failure_frequency"]
0.5
"""

import importlib

# Public names, imported on first use: `PPOConfig` inherits `arguments.ToolArguments`, and importing it
# loads this package, which must not load the tool loop, the rewards and the math with it.
_LAZY = {
    "StepEnvironment": ".adapters", "gym_environment": ".adapters", "openenv_environment": ".adapters",
    "ToolArguments": ".arguments",
    "EnvironmentBatch": ".environments", "Environments": ".environments", "environment_methods": ".environments",
    "AgentRollout": ".rollout_func",
    "TOOLS_MIN_TRL": ".support", "check_tool_support": ".support",
    "ToolLoopResult": ".tool_loop", "ToolLoopStats": ".tool_loop", "run_tool_loop": ".tool_loop",
    "tool_suffix_ids": ".tool_loop",
    "ToolExecutor": ".tools", "ToolResults": ".tools", "tool_dict": ".tools",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
