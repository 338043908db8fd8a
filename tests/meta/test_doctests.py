"""The docstring examples of every package module run, and agree with the code: every module of
every subpackage (``walk_packages``), so a new folder cannot hide modules without examples."""

import doctest
import importlib
import pkgutil

import pytest

import trl_ppo_ext

MODULES = sorted(m.name for m in pkgutil.walk_packages(trl_ppo_ext.__path__, "trl_ppo_ext."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


PUBLIC = [name for name in MODULES if not any(part.startswith("_") for part in name.split(".")[1:])]


def test_the_examples_are_there():
    """Every public module has a docstring example, and it runs: one that printed nothing
    would pass ``test_docstring_examples`` without showing anything."""
    without, silent = [], []
    for name in PUBLIC:
        module = importlib.import_module(name)
        tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
        if not tests:
            without.append(name)
            continue
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        for test in tests:
            runner.run(test, out=lambda _: None)
        result = runner.summarize(verbose=False)
        if result.attempted == 0 or result.failed:
            silent.append(name)
        if not any(example.want for test in tests for example in test.examples):
            silent.append(name)
    assert without == [], f"public modules without a docstring example: {without}"
    assert silent == [], f"public modules whose examples failed or show no output: {silent}"
    assert len(PUBLIC) >= 40  # the package's public modules were found at all, subpackages included
    assert {"trl_ppo_ext.generation.base", "trl_ppo_ext.rewards.remote", "trl_ppo_ext.run.guards"} <= set(PUBLIC)
