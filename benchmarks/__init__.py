"""Benchmarks of jagged flash attention: `run` measures (results.json), `report` writes results.md and
plots, `scaling` measures two-GPU scaling, `tune` sweeps kernel tiles. See docs/performance.md.
"""
