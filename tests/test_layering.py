"""The import rules between layers (docs/architecture.md, "Layers"), read from the source.

Static: every ``import`` statement of every module of the installed package is read with
``ast`` (module level, inside functions and under ``if``, all alike), nothing is imported. A
violation prints as ``file:line imports X (rule: ...)``. The subprocess check that the
scheduler really loads without torch and Ray is ``tests/scheduler/test_imports.py``.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Contracts: the plain types every layer shares (they import only stdlib, msgspec, numpy and
# each other).
CONTRACTS = ("tetris.config", "tetris.plan", "tetris.sampling_params", "tetris.token_ids",
             "tetris.errors", "tetris.model_files", "tetris.device", "tetris.transfer_config",
             "tetris.feature_config")
CONTRACT_DEPS = ("msgspec", "numpy", *CONTRACTS)

# (rule, modules it binds, prefixes they may not import). A rule binds a package whether or not
# it exists yet (``tetris.control`` was bound before it was written).
FORBIDDEN = [
    ("the engine imports no actors, serving, simulator or Ray",
     ("tetris.engine", "tetris.model", "tetris.kernels"),
     ("tetris.actors", "tetris.serve", "tetris.sim", "ray")),
    ("scheduler, control plane and simulator import no Ray and no torch",
     ("tetris.scheduler", "tetris.control", "tetris.sim"),
     ("ray", "torch")),
    ("the actors import no simulator",
     ("tetris.actors",),
     ("tetris.sim",)),
    ("only the CLI imports tetris.cli",
     ("",),   # every module; tetris.cli itself is exempt below
     ("tetris.cli",)),
    ("only the CLI imports the benchmarks",
     ("",),
     ("tetris.bench",)),
]
EXEMPT = {"only the CLI imports tetris.cli": ("tetris.cli",),
          "only the CLI imports the benchmarks": ("tetris.cli", "tetris.bench")}
CONTRACT_RULE = "contracts import only stdlib, msgspec, numpy and each other"


def _within(name: str, prefixes) -> bool:
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _roots() -> dict[str, Path]:
    """Top package name -> its folder (pyproject's ``package-dir``: ``actors/`` is
    ``tetris.actors``, and so on)."""
    return {pkg: ROOT / d for pkg, d in sorted(_setuptools()["package-dir"].items())}


def package_files() -> dict[str, Path]:
    """Module name -> source file, for every module under the package folders (a package
    folder not yet in pyproject's ``packages`` is read too)."""
    out: dict[str, Path] = {}
    for pkg, folder in _roots().items():
        for f in sorted(folder.rglob("*.py")):
            parts = f.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = f
    return out


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in ``path``, and every
    ``import_module("name")`` / ``__import__("name")`` of a literal name; ``from a import b``
    names ``a.b`` when that is a module of the package, else ``a``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.stem == "__init__"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolve against this module's package
                parts = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in known else base))
        elif isinstance(node, ast.Call) and _call_name(node.func) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return list(dict.fromkeys(found))   # ``from a import b, c`` is one import of ``a``


def _call_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def violations(files: dict[str, Path] | None = None) -> list[str]:
    """Every import that breaks a rule, as ``file:line imports X (rule: ...)``."""
    files = package_files() if files is None else files
    known = set(files) | set(package_files())
    out = []
    for module, path in sorted(files.items()):
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, name in imports_of(module, path, known):
            for rule, bound, banned in FORBIDDEN:
                if (_within(module, bound) and not _within(module, EXEMPT.get(rule, ()))
                        and _within(name, banned)):
                    out.append(f"{rel}:{line} imports {name} (rule: {rule})")
            if module in CONTRACTS:
                top = name.split(".")[0]
                if not (top in sys.stdlib_module_names or _within(name, CONTRACT_DEPS)):
                    out.append(f"{rel}:{line} imports {name} (rule: {CONTRACT_RULE})")
    return out


def test_the_rules_read_every_package():
    files = package_files()
    for module in ("tetris.config", "tetris.engine.engine", "tetris.actors.prefill.worker",
                   "tetris.transfer.send_manager", "tetris.transfer.backends.base",
                   "tetris.kernels.dispatch", "tetris.bench.soak", "tetris.cli.main"):
        assert module in files, module


def test_every_package_folder_is_installed():
    """A package folder missing from pyproject's ``packages`` is left out of a wheel."""
    listed = set(_setuptools()["packages"])
    folders = sorted(m for m, f in package_files().items() if f.name == "__init__.py")
    assert [m for m in folders if m not in listed] == []


def test_lazy_and_relative_imports_are_read(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n"
                   "def f():\n"
                   "    import ray\n"
                   "    from tetris import cli\n"
                   "from . import plan\n")
    got = imports_of("tetris.x", src, {"tetris.cli", "tetris.plan"})
    assert got == [(1, "os"), (5, "tetris.plan"), (3, "ray"), (4, "tetris.cli")]


def test_a_leak_is_named_with_its_file_line_and_rule(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import math\n\n\ndef f():\n    import torch.distributed\n")
    contract = tmp_path / "contract.py"
    contract.write_text("import msgspec\nfrom tetris.transfer import states\n")
    cli = tmp_path / "cli_user.py"
    cli.write_text("import importlib\nimportlib.import_module('tetris.cli.args')\n")
    got = violations({"tetris.control.lazy": lazy, "tetris.plan": contract,
                      "tetris.serve.cli_user": cli})
    assert got == [
        f"{lazy}:5 imports torch.distributed (rule: scheduler, control plane and simulator "
        "import no Ray and no torch)",
        f"{contract}:2 imports tetris.transfer.states (rule: {CONTRACT_RULE})",
        f"{cli}:2 imports tetris.cli.args (rule: only the CLI imports tetris.cli)",
    ]


def test_every_import_keeps_to_its_layer():
    found = violations()
    for v in found:
        print(v)
    assert not found, f"{len(found)} import(s) break the layering:\n" + "\n".join(found)
