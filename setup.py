# cffi_modules must live here: setuptools rejects it under [tool.setuptools] in pyproject.
from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
