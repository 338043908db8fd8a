"""The docstring examples of every package module run, and agree with the code."""

import doctest
import importlib
import pkgutil

import pytest

import trl_ppo_ext

MODULES = sorted(m.name for m in pkgutil.iter_modules(trl_ppo_ext.__path__, "trl_ppo_ext."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


def test_the_examples_are_there():
    finder = doctest.DocTestFinder()
    count = sum(len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name)))
    assert count >= 10
