"""Benchmarks behind ``kvdb bench ...``. Each returns a dict with its figure next to a baseline
measured in the same run (STYLE.md "Tests": benchmarks are not tests; no test asserts a timing)."""
