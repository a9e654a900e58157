"""Every example in a public docstring runs and prints what it says."""

from __future__ import annotations

import doctest
import gc
import importlib
import pkgutil

import pytest
import torch

import paramfold

MODULES = sorted(
    name for _, name, _ in pkgutil.iter_modules(paramfold.__path__, prefix="paramfold.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(module, name)
    try:
        for test in tests:
            # doctest.testmod clears each example's globals right after it runs. Code that dynamo
            # compiled there installed helpers (``__builtins_dict___N``) in those globals and deletes
            # them when the compiled code is freed: a KeyError ("Exception ignored in ...", printed
            # by pytest as PytestUnraisableExceptionWarning) if the dict was cleared first. So the
            # globals are kept until dynamo's caches are reset and the compiled code is collected.
            runner.run(test, clear_globs=False)
    finally:
        torch._dynamo.reset()
        gc.collect()
        for test in tests:
            test.globs.clear()
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {name}"
