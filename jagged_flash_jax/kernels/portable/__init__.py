"""The portable kernels (any GPU Triton supports, and Triton's interpreter): the forward (forward.py),
the backward preprocess and backward (backward.py), the key-major transpose of an operand (transpose.py),
HSTU attention's forward and backward (hstu.py), on the addressing and masked memory access of memory.py
and the zero fills of fills.py.
"""
