"""Small arithmetic shared by the launch code and the pure-JAX paths (no imports from this package)."""

import jax.numpy as jnp


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0: Python ints, NumPy or JAX integer arrays alike."""
    return -(-a // b)


def lse_gradient(lse, dlse, ds_scale: float):
    """The log-sum-exp's gradient as a term to take from delta. A backward that takes
    dL/ds_ij = ds_scale * p_ij * (dp_ij - delta_i), s the unscaled scores, gets the term
    dlse_i * dlse_i/ds_ij = dlse_i * p_ij of lse_i = log(sum_j exp(scale * s_ij)) / scale by taking
    dlse_i / ds_scale from delta_i. Zero where lse is +inf (no key, p = 0), so that no inf or nan in
    dlse there reaches delta; the rows no query attends get dlse = 0 from the public op's mask, and no
    backward reads their delta."""
    return jnp.where(lse < jnp.inf, dlse, 0.0) * (1.0 / ds_scale)


def slopes_in_score_units(slopes, scale: float):
    """ALiBi's slopes divided by the scale, float32, clamped to float32's range: a traced slope whose
    ratio overflows (a concrete one is refused, checks.as_slopes) gives a saturated bias, not inf, whose
    product with a distance of 0 would be NaN."""
    limit = float(jnp.finfo(jnp.float32).max)
    return jnp.clip(slopes.astype(jnp.float32) / scale, -limit, limit)
