"""paramfold: make ``torch.compile`` fast on models that use ``torch.nn.utils.parametrize``.

Find every parametrization (:func:`find`), then hoist, inline or freeze it (:func:`prepare`)
so that dynamo sees (nearly) the model it would see without parametrizations; undo it exactly
with :func:`restore`.
"""

from paramfold.audit import audit_checkpoint, fold_checkpoint
from paramfold.errors import FoldError
from paramfold.export import export
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

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "MODES",
    "audit_checkpoint",
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
