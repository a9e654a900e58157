"""Hypothesis profiles, a dynamo reset fixture, torchao made skippable when it is installed but
cannot work, and the longest tests' files collected first (for pytest-xdist's workers).

``fresh_dynamo``: every prepared ``nn.Sequential`` root compiles the same frame (paramfold's root
forward), so without a reset around each test a module's tests after dynamo's recompile limit
would run their "compiled" calls eagerly. Modules opt in with
``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``.

Profiles: "ci" (default) has no deadline (first calls of torch ops are slow) and is derandomized
when CI=true so that CI runs are reproducible; "dev" explores randomly.

torchao: ``.[test]`` installs torchao 0.18, which on an older torch fails at import with an
ImportError or AttributeError rather than ModuleNotFoundError -- and ``pytest.importorskip`` only
skips on ModuleNotFoundError, so collection would abort. When the modules the tests use cannot be
imported, every later ``import torchao...`` raises ModuleNotFoundError carrying the real error, so
each ``importorskip("torchao")`` skips with that reason; the header of the run says it once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=os.environ.get("CI", "").lower() == "true",
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every torchao module the tests and paramfold.testing's recipes import.
_TORCHAO_MODULES = (
    "torchao.quantization",
    "torchao.utils",
    "torchao.prototype.sparsity.sparsifier.utils",
    "torchao.prototype.sparsity.sparsifier.weight_norm_sparsifier",
)


def _torchao_problem() -> str | None:
    """Why the installed torchao cannot be used here, or None (usable, or simply not installed)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        for name in _TORCHAO_MODULES:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 -- any import-time failure makes it unusable
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torchao is installed but unusable with torch {torch.__version__} ({type(e).__name__}: {first})"
    return None


class _Unusable(importlib.abc.MetaPathFinder):
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname == "torchao" or fullname.startswith("torchao."):
            raise ModuleNotFoundError(self.reason, name=fullname)
        return None


TORCHAO_PROBLEM = _torchao_problem()
if TORCHAO_PROBLEM is not None:
    for _name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        del sys.modules[_name]
    sys.meta_path.insert(0, _Unusable(TORCHAO_PROBLEM))


#: Files holding the suite's longest tests (examples run as subprocesses, one under valgrind;
#: Hypothesis state machines; bench runs; the multi-process tests), run first: under
#: pytest-xdist the last minutes are otherwise one worker finishing a long test while the others
#: idle. Order within a file, and of the other files, is unchanged.
_LONG_FIRST = ("test_examples.py", "test_stateful.py", "test_distributed.py", "test_bench.py",
               "test_docstrings.py", "test_export.py")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_report_header(config):  # noqa: ANN001
    lines = [f"torch {torch.__version__}"]
    if TORCHAO_PROBLEM is not None:
        lines.append(f"{TORCHAO_PROBLEM}: its tests skip")
    return lines


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
