"""Every example in a public docstring runs and prints what it says."""

from __future__ import annotations

import doctest
import gc
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import paramfold

# Subpackages' modules too: the finder skips objects a package only re-exports.
MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(paramfold.__path__, prefix="paramfold.")
)


def test_every_module_of_the_package_is_searched():
    src = Path(paramfold.__file__).parent
    files = {
        ".".join(("paramfold", *path.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
        for path in src.rglob("*.py")
    }
    assert set(MODULES) == files - {"paramfold"}


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
