"""Defer a heavy import until first use.

A parameter-server process runs numpy and gRPC only, but the scheme modules that hold its
update rules also hold their PyTorch worker halves, and say ``import torch`` at the top.
Importing PyTorch costs over a second of CPU, which a restarted server would spend before it
serves again. :func:`defer_import` puts a stand-in module under the name: ``import torch``
binds it at no cost, and the real module is imported the first time an attribute of it is
used, which a server never does (``tests/test_ps_process.py`` checks it).

The rule for modules a server imports: no use of ``torch.<anything>`` while the module is
being imported (no ``from torch import nn``, no ``@torch.no_grad()`` decorator, no
``import torch.distributed`` at the top); inside functions, anything goes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

_lock = threading.RLock()


class _Deferred(types.ModuleType):
    """Stands in for a module until one of its attributes is used."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        # What the import system reads of a module it finds in sys.modules.
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def __getattr__(self, attr: str) -> Any:
        return getattr(_load(self.__name__), attr)


def _load(name: str) -> types.ModuleType:
    with _lock:
        module = sys.modules.get(name)
        if isinstance(module, _Deferred):
            del sys.modules[name]
            try:
                module = importlib.import_module(name)
            except BaseException:
                sys.modules[name] = _Deferred(name)
                raise
        assert module is not None
        return module


class _AlreadyLoaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import torch.x`` while ``torch`` is deferred: reading the stand-in's ``__path__``
    imports the real package, which may import ``torch.x`` itself; the import system would
    then execute ``torch.x`` a second time. This finder, first on ``sys.meta_path``, hands it
    the module that is already there instead."""

    packages: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if fullname != top and top in self.packages and fullname in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _AlreadyLoaded()


def defer_import(name: str) -> bool:
    """Make later ``import name`` statements bind a stand-in that imports the real module on
    first use; False (nothing changes) when the module is already imported."""
    with _lock:
        if name in sys.modules:
            return False
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        _FINDER.packages.add(name)
        sys.modules[name] = _Deferred(name)
        return True


def is_loaded(name: str) -> bool:
    """Whether module ``name`` has really been imported (a deferred one only once used)."""
    module = sys.modules.get(name)
    return module is not None and not isinstance(module, _Deferred)


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package that re-exports names from its modules on
    first use (PEP 562), so importing one module of the package does not import the others."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return getattr_, dir_
