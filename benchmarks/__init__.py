"""Benchmarks of jagged flash attention against cuDNN, XLA and the seed PyTorch kernel.

Run `python -m benchmarks.run --help`; `benchmarks.plot` re-makes the figure and tables from results.json.
"""
