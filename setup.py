# cffi_modules must live here: setuptools rejects it under [tool.setuptools] in pyproject.
#
# The planner's per-block modules are compiled by Cython from their own Python source: a module
# is compiled when a .pxd lies beside its .py. The .py says what it means and is the fallback
# where Cython or a compiler is missing (kvdb/compiled.py); the .pxd types fields and hot locals.
from pathlib import Path

from setuptools import setup

COMPILED = sorted(str(p.with_suffix(".py")) for p in Path("kvdb").rglob("*.pxd"))
# the .py files run unchanged under Python: Cython takes no types from their annotations, and
# keeps Python's negative indexing and its bounds checks (an IndexError, never a stray read)
DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def _compiled():
    try:
        from Cython.Build import cythonize
    except ImportError:  # the pure-Python planner serves, slower
        return []
    return cythonize(COMPILED, compiler_directives=DIRECTIVES, quiet=True)


setup(cffi_modules=["native/build.py:ffibuilder"], ext_modules=_compiled())
