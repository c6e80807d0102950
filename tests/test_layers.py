"""The imports form layers, with no import upward (issue 32): ``bench.py`` and ``tools/`` above ``mla_bench/``, which is
above ``mla/``, which is above ``tl_kernels/``; nothing in ``tools/`` or ``mla_bench/`` imports ``bench``. Read from
the source with ``ast`` (no module is imported), so a deferred import inside a function counts too."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Layer of each top-level name; a module may import only names of a lower layer or its own package.
LAYER = {"tl_kernels": 0, "mla": 1, "mla_bench": 2, "tools": 3, "bench": 3}
# What each package must never import (beyond the layer rule: tools and bench share a layer, but tools never import
# bench, the user's command line).
FORBIDDEN = {"tools": {"bench"}, "mla_bench": {"bench", "tools"}}


def _package_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(LAYER)


FILES = sorted(p for pkg in ("tl_kernels", "mla", "mla_bench", "tools") for p in (ROOT / pkg).glob("*.py"))
FILES.append(ROOT / "bench.py")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_upward_import(path):
    package = _package_of(path)
    upward = sorted(name for name in _imported_packages(path)
                    if name != package and (LAYER[name] > LAYER[package] or name in FORBIDDEN.get(package, ())))
    assert not upward, f"{path.relative_to(ROOT)} ({package}, layer {LAYER[package]}) imports {upward}"
