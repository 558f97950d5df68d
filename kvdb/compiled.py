"""Which kvdb modules run compiled, and the switch that runs their Python source instead.

Two kinds of native code serve kvdb: the C core (native/, built by cffi as ``kvdb._native``,
its twins in kvdb/native.py) and the planner's per-block modules, which Cython compiles from
their own ``.py`` with a ``.pxd`` beside each that types fields and hot locals (setup.py
``COMPILED``). A compiled module is the same source: its ``.py`` says what it means, and runs
where Cython or a compiler was missing.

``KVDB_PURE_PYTHON=1`` (read once, at ``import kvdb``) makes every kvdb module load from its
``.py``, compiled or not, and the C core from its twins: tests/planner/test_compiled.py replays
the same traces both ways and requires the same decisions.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.util
import inspect
import os
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PURE = bool(os.environ.get("KVDB_PURE_PYTHON"))  # read once: kvdb/native.py's twins follow it too


def compiled_modules() -> list[str]:
    """Dotted names of the kvdb modules that import from a compiled extension (not the C core)."""
    names = []
    for so in sorted(PACKAGE_DIR.rglob("*.so")):
        rel = so.relative_to(PACKAGE_DIR.parent).with_suffix("")
        name = ".".join(rel.parts).split(".cpython-")[0].split(".abi3")[0]
        if name != "kvdb._native" and so.with_name(so.name.split(".")[0] + ".py").exists():
            names.append(name)
    return names


def copy_fields(obj, memo: dict):
    """A deep copy of ``obj`` field by field, for the ``__deepcopy__`` of a class that may be
    compiled: there the fields its ``.pxd`` declares are not in ``__dict__`` and its arrays are read
    through typed views; the copy takes each view's array, so two views of one array stay one."""
    cls = type(obj)
    new = cls.__new__(cls)
    memo[id(obj)] = new
    fields = dict(getattr(obj, "__dict__", {}))
    for klass in cls.__mro__:
        for name, d in vars(klass).items():
            if (inspect.isgetsetdescriptor(d) or inspect.ismemberdescriptor(d)) and not name.startswith("__"):
                value = getattr(obj, name)
                fields[name] = getattr(value, "base", value) if type(value).__name__ == "_memoryviewslice" else value
    for name, value in fields.items():
        setattr(new, name, copy.deepcopy(value, memo))
    return new


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds ``kvdb.*`` modules by their ``.py`` before the path finder sees an extension."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("kvdb.") or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for folder in path:
            source = Path(folder) / f"{leaf}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def use_python_source() -> None:
    """Load kvdb's modules from their ``.py`` from now on (modules already imported stay)."""
    if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


if PURE:
    use_python_source()
