"""Every public name of the core and of each adapter (its package's ``__all__``) has a docstring: the API reference
of the documentation site (docs/api/, mkdocstrings reading the source statically) is made of them.

Read statically, as the docs build reads it (no import: the adapters' frameworks need not be installed): a function
or class needs a docstring; a module-level constant a string right after its assignment or a ``#:`` comment right
above it (docs/griffe_docstrings.py shows those comments in the reference); a re-exported name is followed to where
it is defined.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "mla_bridge": ROOT / "mla_bridge",
    "mla_bridge_jax": ROOT / "adapters" / "mla_bridge_jax",
    "mla_bridge_vllm": ROOT / "adapters" / "mla_bridge_vllm",
    "mla_bridge_transformers": ROOT / "adapters" / "mla_bridge_transformers",
}
#: Public constants still without a ``#:`` line (a comment each, in the pass over the core's docstrings); the test
#: fails when one of them gets its documentation, so that this list only shrinks.
PENDING: set[str] = set()


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    base = PACKAGES.get(parts[0])
    if base is None:
        return None
    path = base.joinpath(*parts[1:])
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def _parse(module: str) -> ast.Module:
    path = _module_file(module)
    assert path is not None, module
    return ast.parse(path.read_text(), filename=str(path))


def _exports(module: str) -> list[str]:
    for node in _parse(module).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no __all__")


def _comment_above(module: str, lineno: int) -> str:
    lines = _module_file(module).read_text().splitlines()
    text, i = [], lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        text.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    return " ".join(text)


def _is_package(module: str) -> bool:
    return _module_file(module).name == "__init__.py"


def _resolve(module: str, name: str, depth: int = 0) -> tuple[str, str]:
    """``(where, docstring)`` of ``name`` as bound in ``module``, following imports."""
    assert depth < 10, (module, name)
    tree = _parse(module)
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return f"{module}.{name}", ast.get_docstring(node) or ""
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            after = tree.body[i + 1] if i + 1 < len(tree.body) else None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                return f"{module}.{name}", after.value.value
            return f"{module}.{name}", _comment_above(module, node.lineno)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                if node.level:
                    base = module if _is_package(module) else module.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module
                if _module_file(f"{source}.{alias.name}") is not None:  # a submodule: its module docstring
                    return f"{source}.{alias.name}", ast.get_docstring(_parse(f"{source}.{alias.name}")) or ""
                return _resolve(source, alias.name, depth + 1)
    raise AssertionError(f"{name} is in {module}.__all__ but not bound there")


def _public_names():
    for package in PACKAGES:
        for name in _exports(package):
            if not (name.startswith("__") and name.endswith("__")):  # __version__: a dunder says what it is
                yield package, name


@pytest.mark.parametrize("package,name", list(_public_names()), ids=lambda x: x)
def test_public_name_has_a_docstring(package, name):
    where, doc = _resolve(package, name)
    key = f"{package}.{name}"
    if key in PENDING:
        assert not doc.strip(), f"{key} ({where}) is documented now: take it off PENDING"
        return
    assert doc.strip(), f"{key} ({where}) has no docstring (a constant: a '#:' comment line right above it)"


def test_every_package_exports_something_documented():
    names = list(_public_names())
    assert {p for p, _ in names} == set(PACKAGES)
    assert len(names) >= 40
