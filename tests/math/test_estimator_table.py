"""The estimator table: one row per advantage_estimator, read by the config, the inputs, the trainer and
the memory model, and importable without the math."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trl_ppo_ext
from trl_ppo_ext import estimators
from trl_ppo_ext.estimator_table import (
    CRITIC_FREE_ESTIMATORS,
    ESTIMATOR_TABLE,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    estimator,
    needs_critic,
)


def test_the_rows_and_their_columns():
    assert ESTIMATORS == ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae_rloo")
    assert CRITIC_FREE_ESTIMATORS == ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert GROUP_ESTIMATORS == ("grpo", "rloo", "reinforce_pp_baseline", "gae_rloo")
    assert [needs_critic(name) for name in ESTIMATORS] == [True, False, False, False, False, True]


def test_every_rows_function_is_one_of_the_estimators_module():
    for row in ESTIMATOR_TABLE.values():
        assert callable(estimators.TARGET_FUNCTIONS[row.function]), row.name
    # the critic's rows go through critic_targets; compute_targets stays listed as their core
    assert estimators.TARGET_FUNCTIONS["compute_targets"] is estimators.compute_targets


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"advantage_estimator must be one of \['gae', 'grpo'.*got 'ppo'"):
        estimator("ppo")


def test_the_table_and_the_config_import_no_math():
    code = ("import sys, trl_ppo_ext.estimator_table, trl_ppo_ext.config\n"
            "print(sorted(m for m in ('trl_ppo_ext.estimators', 'trl_ppo_ext.advantages', 'trl_ppo_ext.rollout',"
            " 'trl_ppo_ext.models') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(Path(trl_ppo_ext.__file__).parent.parent), "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
