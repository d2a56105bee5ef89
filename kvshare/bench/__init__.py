"""Benchmarks and experiments (``kvshare bench``)."""
