"""Small arithmetic shared by the launch code and the pure-JAX paths (no imports from this package)."""


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0: Python ints, NumPy or JAX integer arrays alike."""
    return -(-a // b)
