"""Benchmarks behind ``kvdb bench ...``. Each returns a dict with its figure next to a baseline
measured in the same run (docs/style.md "Benchmarks"; no test asserts a timing)."""
