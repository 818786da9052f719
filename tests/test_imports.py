"""The import rules of the package, read from the sources (an AST walk, nothing imported):

- no module of mla_bridge or its adapters imports a private name (leading underscore) of another of their modules:
  what modules share is public to the package (argument checks: :mod:`mla_bridge.checks`; switches:
  :mod:`mla_bridge.switches`); a package's private module (``mla_bridge_jax._interop``) may be imported from by
  the package's own modules, by its public names;
- :mod:`mla_bridge.checks` and :mod:`mla_bridge.switches` sit at the bottom: they import no other module of
  mla_bridge;
- each module imports only modules of its own layer or of the layers below it (:data:`LAYERS`, lowest first; the
  map is docs/design/structure.md), and the core never imports an adapter;
- :mod:`mla_bridge.prefill` does not import the kernel choosers of the FlashInfer backend and the Triton launcher
  to refuse a bad switch: it asks :mod:`mla_bridge.switches`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("mla_bridge", "mla_bridge_jax", "mla_bridge_vllm", "mla_bridge_transformers")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources(root: Path) -> list[Path]:
    return sorted(list((root / "mla_bridge").rglob("*.py")) + list((root / "adapters").rglob("*.py")))


def _first_party_imports(path: Path):
    """``(line, module, names)`` of every import of a module of mla_bridge or its adapters in ``path`` (relative
    imports included; ``module`` as written, with its leading dots), at any depth (function-local imports too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level or module.split(".")[0] in FIRST_PARTY:
                yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FIRST_PARTY:
                    yield node.lineno, a.name, []


def private_imports(root: Path) -> list[str]:
    """Every import under ``root``'s mla_bridge/ and adapters/ of a private name of another first-party module:
    ``from m import _name`` (a private submodule ``from . import _m`` too) and ``import mla_bridge._m``."""
    found = []
    for path in _sources(root):
        rel = path.relative_to(root)
        for line, module, names in _first_party_imports(path):
            bad = [n for n in names if _private(n)]
            found += [f"{rel}:{line}: from {module} import {n}" for n in bad]
            if not names and any(_private(part) for part in module.split(".")):
                found.append(f"{rel}:{line}: import {module}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = private_imports(ROOT)
    assert not found, "private names imported across modules (make them public to the package):\n" + "\n".join(found)


def test_the_scan_finds_a_private_import(tmp_path):
    """The scan itself: each form of a private import is reported, multi-line and function-local ones included,
    and imports of public names (from a private module of the package too) or of third-party private modules are
    not."""
    pkg = tmp_path / "mla_bridge"
    pkg.mkdir()
    (tmp_path / "adapters").mkdir()
    (pkg / "a.py").write_text(
        "import torch._dynamo\n"
        "from ._interop import to_torch\n"
        "from .ragged import (\n    shares_memory,\n    _not_a_bool,\n)\n"
        "def f():\n    from ..plan import _check_length_sums\n"
        "from . import _interop\n"
        "import mla_bridge._private\n"
    )
    found = sorted(private_imports(tmp_path), key=lambda f: int(f.split(":")[1]))
    assert [f.split(": ", 1)[1] for f in found] == [
        "from .ragged import _not_a_bool",
        "from ..plan import _check_length_sums",
        "from . import _interop",
        "import mla_bridge._private",
    ]


@pytest.mark.parametrize("module", ["checks", "switches"])
def test_checks_and_switches_sit_at_the_bottom(module):
    imports = list(_first_party_imports(ROOT / "mla_bridge" / f"{module}.py"))
    assert imports == [], imports


def test_prefill_asks_the_switches_module_not_the_kernel_choosers():
    modules = {m for _, m, _ in _first_party_imports(ROOT / "mla_bridge" / "prefill.py")}
    assert ".backends.flashinfer" not in modules and ".kernels.launch" not in modules, modules


#: Lowest first. A module's layer is that of the longest prefix listed; the adapters and the CLI share a layer and
#: the bench sits on top.
LAYERS = (
    (
        "mla_bridge.dims",
        "mla_bridge.checks",
        "mla_bridge.switches",
        "mla_bridge.argtypes",
        "mla_bridge.inference",
        "mla_bridge.profiling",
    ),
    ("mla_bridge.dispatch", "mla_bridge.workspace", "mla_bridge.kernels", "mla_bridge.backends.flashinfer_internals"),
    ("mla_bridge.backends", "mla_bridge.merge", "mla_bridge.weights", "mla_bridge.reference", "mla_bridge.indexer"),
    ("mla_bridge.ragged", "mla_bridge.cache"),
    ("mla_bridge.plan", "mla_bridge.kv", "mla_bridge.plan_cache", "mla_bridge.sparse", "mla_bridge.sparse_mha"),
    ("mla_bridge.prefill",),
    ("mla_bridge.graphs", "mla_bridge"),
    ("mla_bridge.cli", "mla_bridge_jax", "mla_bridge_vllm", "mla_bridge_transformers"),
    ("mla_bridge.bench",),
)
#: Edges allowed upwards: the ``bench`` subcommand of the CLI starts the bench (imported inside the command).
ALLOWED_UP = {("mla_bridge.cli", "mla_bridge.bench")}


def _modules() -> dict[str, Path]:
    found = {}
    for base in (ROOT, ROOT / "adapters"):
        for pkg in FIRST_PARTY:
            for path in (base / pkg).rglob("*.py"):
                parts = path.relative_to(base).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


def _layer(name: str) -> tuple[int, str]:
    best = (-1, "")
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (i, prefix)
    return best


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import kernels` names a submodule; `from .dims import MLADims` names the module
            targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules] or [module]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_every_module_has_a_layer():
    unplaced = [name for name in _modules() if _layer(name)[0] < 0]
    assert unplaced == []


def test_imports_run_downwards():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        layer, home = _layer(name)
        for target in sorted(_imports(name, path, modules)):
            t_layer, t_home = _layer(target)
            if t_layer > layer and (home, t_home) not in ALLOWED_UP:
                upward.append(f"{name} (layer {layer}) imports {target} (layer {t_layer})")
    assert upward == []


@pytest.mark.parametrize("package", ["mla_bridge"])
def test_core_never_imports_an_adapter(package):
    modules = _modules()
    core = {n: p for n, p in modules.items() if n.split(".")[0] == package and not n.startswith("mla_bridge.bench")}
    offending = [
        f"{name} imports {target}"
        for name, path in sorted(core.items())
        for target in _imports(name, path, modules)
        if target.split(".")[0] != "mla_bridge"
    ]
    assert offending == []


def test_the_bench_and_the_cli_do_not_import_each_other_both_ways():
    """The CLI starts the bench (its ``bench`` subcommand); the bench imports nothing of the CLI."""
    modules = _modules()
    back = [
        f"{name} imports {target}"
        for name, path in sorted(modules.items())
        if name.startswith("mla_bridge.bench")
        for target in _imports(name, path, modules)
        if target.startswith("mla_bridge.cli")
    ]
    assert back == []
