"""The torch version matrix: one nox session per supported torch release, each in its own venv.

    nox -s torch-2.15.0            # one version (the newest release)
    nox -t matrix                  # every version, one after another
    nox -s torch-2.13.0 -- tests/test_recompiles.py -x   # arguments after -- go to pytest

Each session writes a constraints file into its venv pinning ``torch==VERSION`` and points
``PIP_CONSTRAINT`` at it, so nothing later in the session (``.[test]``, torchao) can move torch, and a
machine-wide pip constraint (e.g. one capping torch below the newest release) is replaced for that
venv only. Linux wheels from PyPI are CUDA builds (several GB per version); 2.13.0 is the CPU wheel
CI uses. ``--reuse-venv=yes`` keeps an installed venv for the next run; delete ``.nox/`` to reclaim
the disk.
"""

from __future__ import annotations

from pathlib import Path

import nox

# The newest release first; the oldest is the floor README states.
TORCH_VERSIONS = ("2.15.0", "2.14.1", "2.13.0", "2.11.0", "2.8.0", "2.6.0", "2.5.1")

nox.options.sessions = ["torch-2.13.0"]  # plain `nox`: the CI configuration
nox.options.reuse_venv = "yes"


def _suite(session: nox.Session, version: str) -> None:
    venv = Path(session.virtualenv.location)
    constraints = venv / "torch-constraints.txt"
    constraints.write_text(f"torch=={version}\n")
    env = {"PIP_CONSTRAINT": str(constraints)}
    session.install("--quiet", f"torch=={version}", env=env)
    session.install("--quiet", "-e", ".[test]", env=env)
    session.run(
        "python", "-c", "import torch; assert torch.__version__.split('+')[0] == %r, torch.__version__"
        % version,
    )
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--maxprocesses=4", *session.posargs, env={"CI": "true"})


for _version in TORCH_VERSIONS:

    def _session(session: nox.Session, version: str = _version) -> None:
        _suite(session, version)

    nox.session(name=f"torch-{_version}", tags=["matrix"])(_session)
