"""The public op: argument checks, backend choice, and the one custom_vjp of the kernel backends."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import launch
from .configs import INTERPRET_BLOCK_SIZES, MAX_HEAD_DIM, BlockSizes, default_block_sizes
from .launch import plan
from .reference import jagged_attention_reference

BACKENDS = ("auto", "triton", "interpret", "xla")
LAYOUTS = ("HTD", "THD")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Offsets inside one sequence are int32 in the kernels: (max_seq_len + a block) rows of H * D elements.
_MAX_SEQUENCE_ELEMENTS = 2**31 - 1


def default_backend() -> str:
    """"triton" when JAX's default backend is a GPU and jax-triton imports, else "xla"."""
    from .launch import gpu

    return "triton" if gpu.available() else "xla"


def _resolve_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return default_backend()
    if backend == "triton":
        from .launch import gpu

        if jax.default_backend() not in ("gpu", "cuda"):
            raise ValueError(f"backend='triton' needs a GPU, but JAX's default backend is "
                             f"{jax.default_backend()!r}; use backend='xla' or 'interpret', or "
                             f"{gpu.INSTALL_HINT}")
        try:
            gpu.jax_triton_module()
        except ImportError as err:
            raise ValueError(str(err)) from err
    return backend


def _check_arrays(q, k, v, offsets, layout: str) -> tuple[int, int, int]:
    """(H, T, D) of q, k, v after checking ranks, shapes and dtypes; raises TypeError or ValueError."""
    names = ("q", "k", "v")
    dims = "[H, T, D]" if layout == "HTD" else "[T, H, D]"
    for name, x in zip(names, (q, k, v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(f"{name} must have rank 3 {dims} (layout={layout!r}), got shape {x.shape}")
    for name, x in zip(names[1:], (k, v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {q.shape}, got {x.shape}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q, k, v must be float32, bfloat16 or float16, got {q.dtype}")
    if not hasattr(offsets, "shape") or not hasattr(offsets, "dtype"):
        raise TypeError(f"offsets must be an integer array [B+1], got {type(offsets).__name__}")
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be 1-D [B+1] with B >= 0, got shape {offsets.shape}")
    if offsets.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    heads, total, dim = q.shape if layout == "HTD" else (q.shape[1], q.shape[0], q.shape[2])
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"head dimension D must be at most {MAX_HEAD_DIM}, got D={dim}")
    return heads, total, dim


def _check_static(max_seq_len, allow_tf32, layout) -> int:
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        try:
            max_seq_len = operator.index(max_seq_len)
        except TypeError:
            raise TypeError(f"max_seq_len must be a static Python int, got "
                            f"{type(max_seq_len).__name__}") from None
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"allow_tf32 must be a bool, got {type(allow_tf32).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return int(max_seq_len)


def multi_head_jagged_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets: jax.Array,
    max_seq_len: int,
    *,
    allow_tf32: bool = True,
    backend: str = "auto",
    layout: str = "HTD",
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Multi-head attention over a jagged batch, each sequence attending only to itself.

    For sequence b (tokens offsets[b] to offsets[b+1]) and head h, with n_b = min(len_b, max_seq_len),
    the first n_b tokens get softmax(q k^T) v / max_seq_len over those n_b keys (no 1/sqrt(D) scale).
    Every other token (past n_b, or outside offsets) gets output 0 and gradient 0.

    Args:
      q, k, v: [H, T, D] (layout "HTD") or [T, H, D] ("THD", read through strides with no transpose);
        one dtype among float32, bfloat16, float16; D <= 256.
      offsets: [B+1] int32 or int64, non-decreasing, within [0, T] (others are clamped, never unsafe).
      max_seq_len: static Python int >= 1.
      allow_tf32: float32 only: whether the matrix products may use TF32 on the GPU.
      backend: "triton" (GPU kernels via jax-triton), "interpret" (the same kernels in Triton's
        interpreter on the CPU, bfloat16 computed in float32 there), "xla" (pure JAX, any device),
        or "auto": "triton" when JAX's default backend is a GPU and jax-triton imports, else "xla".
      layout: "HTD" or "THD".
      block_sizes: tile configuration of the kernel backends; None picks a tuned default.

    Returns:
      The output, with the shape and dtype of q. Differentiable in q, k and v.
    """
    max_seq_len = _check_static(max_seq_len, allow_tf32, layout)
    heads, total, dim = _check_arrays(q, k, v, offsets, layout)
    if (max_seq_len + MAX_HEAD_DIM) * heads * dim > _MAX_SEQUENCE_ELEMENTS:
        raise ValueError(f"max_seq_len * H * D = {max_seq_len * heads * dim} elements in one sequence "
                         f"is more than the kernels address (< 2**31)")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    backend = _resolve_backend(backend)
    if backend == "xla":
        return jagged_attention_reference(q, k, v, offsets, max_seq_len, allow_tf32=allow_tf32,
                                          layout=layout)
    if block_sizes is None:
        block_sizes = (INTERPRET_BLOCK_SIZES if backend == "interpret"
                       else default_block_sizes(dim, q.dtype, max_seq_len))
    problem = plan.Problem(
        num_heads=heads, num_tokens=total, head_dim=dim, batch=offsets.shape[0] - 1,
        max_seq_len=max_seq_len, head_major=layout == "HTD",
        input_precision="tf32" if allow_tf32 else "ieee", block_sizes=block_sizes, launcher=backend)
    plan.check_grid(problem)
    return _attention(q, k, v, offsets, problem)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, offsets, problem: plan.Problem):
    o, _ = plan.forward(launch.runner(problem.launcher), problem, q, k, v, offsets)
    return o


def _attention_fwd(q, k, v, offsets, problem: plan.Problem):
    o, lse = plan.forward(launch.runner(problem.launcher), problem, q, k, v, offsets)
    # Named so that remat policies (jax.checkpoint_policies.save_only_these_names) can keep or drop them.
    o = checkpoint_name(o, "jagged_attention_out")
    lse = checkpoint_name(lse, "jagged_attention_lse")
    return o, (q, k, v, offsets, o, lse)


def _attention_bwd(problem: plan.Problem, residuals, do):
    q, k, v, offsets, o, lse = residuals
    dq, dk, dv = plan.backward(launch.runner(problem.launcher), problem, q, k, v, offsets, o, lse,
                               do.astype(q.dtype))
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
