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

from .adapters import StepEnvironment, gym_environment, openenv_environment
from .arguments import ToolArguments
from .environments import EnvironmentBatch, Environments, environment_methods
from .rollout_func import AgentRollout
from .support import TOOLS_MIN_TRL, check_tool_support
from .tool_loop import ToolLoopResult, ToolLoopStats, run_tool_loop, tool_suffix_ids
from .tools import ToolExecutor, ToolResults, tool_dict

__all__ = [
    "AgentRollout", "EnvironmentBatch", "Environments", "StepEnvironment", "TOOLS_MIN_TRL", "ToolArguments",
    "ToolExecutor", "ToolLoopResult", "ToolLoopStats", "ToolResults", "check_tool_support", "environment_methods",
    "gym_environment", "openenv_environment", "run_tool_loop", "tool_dict", "tool_suffix_ids",
]
