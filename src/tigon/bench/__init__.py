"""Benchmark harness: one timing/memory/limit routine for every op (see ``harness.py``)."""
