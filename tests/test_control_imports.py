"""The control plane needs no torch: every module of ``distsgd.control`` and the parameter
server (every module of ``distsgd.ps``) import with torch blocked, and none of ``launcher/``,
``control/``, ``plan/`` and the comparison and manifests outside the core (``extras/``) imports
from ``distsgd.runtime`` (imports inside functions included)."""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import loadclock

import distsgd.control
import distsgd.plan
import distsgd.ps

SRC = Path(distsgd.control.__file__).resolve().parents[1]
EXTRAS = Path(__file__).resolve().parents[1] / "extras"


def _modules(package: ModuleType) -> list[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    )


def test_control_and_the_server_import_with_torch_blocked() -> None:
    modules = ["distsgd.control", *_modules(distsgd.control), "distsgd.ps", *_modules(distsgd.ps)]
    modules += ["distsgd.plan", *_modules(distsgd.plan)]  # the cost model: planning, no torch
    assert "distsgd.control.recovery" in modules and "distsgd.control.checkpoint.store" in modules
    assert "distsgd.plan.cost" in modules and "distsgd.plan.simulate" in modules
    assert "distsgd.ps.server" in modules and "distsgd.ps.wal" in modules
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert sys.modules['torch'] is None\n"
    )
    done = loadclock.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_run_settings_import_without_grpc() -> None:
    """``control.config`` (what the launcher, the planner and every flag's check read) needs no
    network: the packages below it export their names lazily (issue 39)."""
    code = "import sys, distsgd.control.config\nassert 'grpc' not in sys.modules, 'grpc loaded'\n"
    done = loadclock.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_launcher_compare_and_control_import_nothing_from_runtime() -> None:
    folders = [SRC / package for package in ("launcher", "control", "plan")]
    folders += [EXTRAS / "distsgd_compare", EXTRAS / "distsgd_k8s"]  # outside the core
    assert all(folder.is_dir() for folder in folders), folders
    found = [
        f"{path}: {name}"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        for name in sorted(_imported(path))
        if name == "distsgd.runtime" or name.startswith("distsgd.runtime.")
    ]
    assert found == []
