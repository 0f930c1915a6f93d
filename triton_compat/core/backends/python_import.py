"""Importing a python model's `model.py` into the server's one interpreter.

Triton runs each model instance in a stub process of its own, with the model's version folder
and model folder on `sys.path`, and imports the file as `<version>.model` (python_backend
src/pb_stub.cc, ModelContext::StubSetup): a `model.py` may `import model_common` (a file beside
it) or `from . import helper`. Here every instance shares one interpreter, so this module owns
what keeps them apart:
- each loaded file becomes `continuum_pymodel_<n>.<stem>`, the submodule of a package of its
  own whose path is the version folder (relative imports work);
- while the file runs, both folders are on `sys.path` (appended, as Triton does) and the
  sibling modules that other models imported are out of `sys.modules`; the siblings this file
  imported are taken out afterwards, so the next model imports its own `model_common`;
- an import that runs later (inside `execute`) and finds nothing on the normal path is looked
  up in the folders of the model whose code asked (the calling frames tell), and forgotten
  again when that model's `execute` ends (`forget_lazy`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
import types
from pathlib import Path

_ids = itertools.count()
_lock = threading.RLock()
_packages: dict[str, tuple[str, str]] = {}   # package -> (version folder, model folder)
_lazy: dict[str, list[str]] = {}             # model folder -> names imported after load


def _inside(file: str | None, folder: str) -> bool:
    return bool(file) and file.startswith(folder + os.sep)


def _folders_of(file: str | None) -> tuple[str, str] | None:
    """The (version, model) folders of the loaded model whose folder holds `file`."""
    found = None
    for version_dir, model_dir in list(_packages.values()):    # any importing thread, unlocked
        if _inside(file, version_dir):
            return version_dir, model_dir
        if found is None and _inside(file, model_dir):
            found = (version_dir, model_dir)
    return found


class _SiblingFinder(importlib.abc.MetaPathFinder):
    """Last on `sys.meta_path`: a top-level name nothing else found, looked up in the folders
    of the model whose code (the nearest calling frame from a model file) imports it."""

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or not _packages:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            folders = _folders_of(frame.f_globals.get("__file__"))
            if folders is not None:
                spec = importlib.machinery.PathFinder.find_spec(fullname, list(folders))
                if spec is not None:
                    with _lock:
                        _lazy.setdefault(folders[1], []).append(fullname)
                return spec
            frame = frame.f_back
        return None


_finder = _SiblingFinder()


def load(path: Path) -> types.ModuleType:
    """Import the model file `path` (`<model>/<version>/model.py`) as a module of its own,
    with `triton_python_backend_utils` importable. Exceptions from the file propagate."""
    from triton_compat.core import pb_utils
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    path = Path(os.path.abspath(path))      # a symlinked model.py keeps its folders
    version_dir, model_dir = str(path.parent), str(path.parent.parent)
    package = f"continuum_pymodel_{next(_ids)}"
    name = f"{package}.{path.stem}"
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.append(_finder)
        stashed = {n: m for n, m in list(sys.modules.items())
                   if _folders_of(getattr(m, "__file__", None)) and not n.startswith(
                       "continuum_pymodel_")}
        for n in stashed:
            del sys.modules[n]
        before = set(sys.modules)
        sys.path += [version_dir, model_dir]
        try:
            pkg = types.ModuleType(package)
            pkg.__path__ = [version_dir]
            sys.modules[package] = pkg
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            sys.modules.pop(package, None)
            raise
        finally:
            _drop_last(sys.path, model_dir)
            _drop_last(sys.path, version_dir)
            for n in set(sys.modules) - before:
                if not n.startswith(package) and (
                        _inside(getattr(sys.modules[n], "__file__", None), model_dir)):
                    del sys.modules[n]
            for n, m in stashed.items():
                sys.modules.setdefault(n, m)
        _packages[package] = (version_dir, model_dir)
        return module


def _drop_last(items: list, value) -> None:
    """Remove the last occurrence of `value` (one this module appended), if still there."""
    for i in range(len(items) - 1, -1, -1):
        if items[i] == value:
            del items[i]
            return


def forget_lazy(model_dir: str) -> None:
    """Drop from `sys.modules` the siblings the model in `model_dir` imported after its load
    (its own references stay valid), so another model's same-named import finds its own."""
    if model_dir not in _lazy:       # after every execution: most models import nothing late
        return
    with _lock:
        names = _lazy.pop(model_dir, None)
    for n in names or ():
        module = sys.modules.get(n)
        if module is not None and _inside(getattr(module, "__file__", None), model_dir):
            del sys.modules[n]


def folders(module: types.ModuleType) -> tuple[str, str]:
    """(version folder, model folder) of a module `load` returned."""
    return _packages[module.__name__.partition(".")[0]]


def unload(module: types.ModuleType) -> None:
    """Forget a module `load` returned (the model instance is finalized)."""
    package = module.__name__.partition(".")[0]
    with _lock:
        folders_ = _packages.pop(package, None)
        for n in [n for n in list(sys.modules) if n == package or n.startswith(package + ".")]:
            del sys.modules[n]
    if folders_ is not None:
        forget_lazy(folders_[1])
