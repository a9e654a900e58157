"""Every example in a public docstring runs and prints what it says."""

from __future__ import annotations

import doctest
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
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        torch._dynamo.reset()
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
