"""What keeps the suite honest across torch versions: broken optional installs count as missing,
and the nox matrix covers the versions README claims."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import conftest
import paramfold.testing as pt

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("error", ["ImportError", "AttributeError"])
def test_recipe_with_a_broken_install_is_unavailable(tmp_path, monkeypatch, error):
    # What torchao 0.18 does on an older torch: installed (find_spec finds it), fails at import.
    pkg = tmp_path / f"broken_{error.lower()}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise {error}('built for a newer torch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = pt.Recipe(
        name="needs_broken", apply=lambda *a, **k: None, supports=lambda spec: True,
        options=lambda spec: None, requires=pkg.name,
    )
    assert not recipe.available
    assert pkg.name not in sys.modules
    ok = pt.Recipe(name="needs_json", apply=recipe.apply, supports=recipe.supports,
                   options=recipe.options, requires="json")
    assert ok.available


def test_an_unusable_package_makes_importorskip_skip_with_the_real_reason(monkeypatch):
    finder = conftest._Unusable("torchao is installed but unusable with torch 2.5.1 (AttributeError: x)")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(pytest.skip.Exception, match="unusable with torch 2.5.1"):
        pytest.importorskip("torchao")
    with pytest.raises(ModuleNotFoundError):
        import torchao.quantization  # noqa: F401


def test_nox_matrix_covers_the_versions_readme_claims():
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (versions,) = [
        ast.literal_eval(node.value) for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TORCH_VERSIONS"
    ]
    readme = (ROOT / "README.md").read_text()
    floor = re.search(r"torch >= (\d+\.\d+)", readme)
    assert floor, "README states the oldest supported torch as 'torch >= X.Y'"
    key = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    assert min(map(key, versions)) == key(floor[1])
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={floor[1]}"' in pyproject
    for v in versions:  # every session appears in README's measured table
        assert re.search(rf"^\| {re.escape(v)} \|", readme, re.M), v
