"""paramfold: make ``torch.compile`` fast on models that use ``torch.nn.utils.parametrize``.

Find every parametrization (:func:`find`), then hoist, inline or freeze it (:func:`prepare`)
so that dynamo sees (nearly) the model it would see without parametrizations; undo it exactly
with :func:`restore`.

The public names are imported on first use (PEP 562 module ``__getattr__``): ``import paramfold``
and ``paramfold --help`` do not import torch. ``paramfold.testing`` (its strategies need the
``paramfold[testing]`` extra) and the other submodules are reachable as attributes too.
"""

from __future__ import annotations

import importlib
import sys
import types

# Not `from typing import TYPE_CHECKING`: typing takes ~10 ms to import, which is the window before
# the command line's own Ctrl-C handling starts (paramfold.__main__); annotations here are strings.
TYPE_CHECKING = False

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "AuditReport": "audit",
    "CheckpointError": "checkpoint",
    "audit_checkpoint": "audit",
    "fold_checkpoint": "fold",
    "FoldError": "errors",
    "export": "export",
    "MODES": "prepare",
    "calls_lock": "scope",
    "prepare": "prepare",
    "prepared": "prepare",
    "CompileRecord": "recompiles",
    "GuardFailure": "recompiles",
    "RecompileLimitError": "recompiles",
    "RecompileLimitWarning": "recompiles",
    "RecompileReport": "recompiles",
    "recompiles": "recompiles",
    "restore": "restore",
    "KINDS": "sites",
    "Site": "sites",
    "find": "sites",
    "plain_state_dict": "state_dict",
}
_SUBMODULES = ("audit", "bench", "checkpoint", "cli", "fold", "output", "testing")

__all__ = [
    "AuditReport",
    "CheckpointError",
    "KINDS",
    "MODES",
    "audit_checkpoint",
    "calls_lock",
    "export",
    "fold_checkpoint",
    "CompileRecord",
    "FoldError",
    "GuardFailure",
    "RecompileLimitError",
    "RecompileLimitWarning",
    "RecompileReport",
    "Site",
    "find",
    "plain_state_dict",
    "prepare",
    "prepared",
    "recompiles",
    "restore",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these are resolved by __getattr__
    from typing import Any

    from paramfold.audit import audit_checkpoint, fold_checkpoint
    from paramfold.errors import FoldError
    from paramfold.prepare import MODES, prepare, prepared
    from paramfold.recompiles import (
        CompileRecord,
        GuardFailure,
        RecompileLimitError,
        RecompileLimitWarning,
        RecompileReport,
        recompiles,
    )
    from paramfold.restore import restore
    from paramfold.sites import KINDS, Site, find
    from paramfold.state_dict import plain_state_dict


class _Package(types.ModuleType):
    """``paramfold.prepare``, ``.recompiles`` and ``.restore`` are functions named like their modules.

    Importing a submodule sets it as an attribute of the package, which would hide the function
    of the same name (the eager imports this package used to do rebound it afterwards): keep the
    function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and _EXPORTS.get(name) == name
            and value.__name__ == f"{__name__}.{name}"
            and hasattr(value, name)
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"paramfold.{module}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"paramfold.{name}")
    raise AttributeError(f"module 'paramfold' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
