"""Resolve ``MODULE:FACTORY`` (``fold --model``) to the callable that builds a parametrized model.

Folding a kind that the keys cannot compute (``orthogonal``, ``torchao_subclass``, ``custom``) needs
the model itself; the command line names it as ``MODULE:FACTORY``. This module imports ``MODULE``
(a dotted module or a ``.py`` file) and returns ``FACTORY``, or raises ``CheckpointError`` with exit
code 2 (a command-line problem) and a one-line message.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paramfold.checkpoint import CheckpointError
from paramfold.errors import one_line

__all__ = ["load_factory"]


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """Resolve ``"MODULE:FACTORY"`` to a callable that builds the parametrized model.

    ``MODULE`` is a dotted module importable from ``sys.path`` (``mypkg.models``) or a path to a
    ``.py`` file (``./models/vocoder.py``, whose folder is put first on ``sys.path`` while it is
    imported); ``FACTORY`` names a callable in it taking no arguments (a function or a class).

    Example::

        >>> load_factory("torch.nn:Identity")()
        Identity()
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(
            f"--model {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build or ./make_model.py:build",
            exit_code=2,
        )
    try:
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except CheckpointError:
        raise
    except (Exception, SystemExit) as e:  # sys.exit() at import: not this command's exit code
        raise CheckpointError(f"--model {spec}: cannot import {module_name}: {type(e).__name__}: {one_line(str(e))}",
                              exit_code=2) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CheckpointError(f"--model {spec}: {module_name} has no callable named {attr!r}", exit_code=2)
    return factory


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"--model: no such file {path}", exit_code=2)
    name = f"_paramfold_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CheckpointError(f"--model: cannot import {path} as a Python module", exit_code=2)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module
