"""The names a config chooses among live apart from the math: importing ``PPOConfig`` loads no
tensor code, and the math accepts exactly the names the config checks."""

import os
import subprocess
import sys
from pathlib import Path

import trl_ppo_ext
from trl_ppo_ext import choices
from trl_ppo_ext import functional as F


def test_the_math_accepts_the_names_the_config_checks():
    assert F.KL_ESTIMATORS is choices.KL_ESTIMATORS and F.LOSS_TYPES is choices.LOSS_TYPES


def test_importing_the_config_loads_neither_the_math_nor_the_tool_loop():
    code = ("import sys\nfrom trl_ppo_ext import PPOConfig\nPPOConfig\n"
            "print(sorted(m for m in ('trl_ppo_ext.functional', 'trl_ppo_ext.agents.tool_loop',"
            " 'trl_ppo_ext.rewards') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(Path(trl_ppo_ext.__file__).parent.parent), "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_agents_package_still_names_its_public_objects():
    from trl_ppo_ext import agents

    assert agents.ToolLoopStats.__module__ == "trl_ppo_ext.agents.tool_loop"
    assert set(agents.__all__) >= {"AgentRollout", "ToolArguments", "run_tool_loop"}
