"""Flax layers for jagged attention: `JaggedMultiHeadAttention` (nnx) and
`JaggedMultiHeadDotProductAttention` (linen), with equal parameters and numerics, and the two helpers that
copy weights between them. Optional: needs pip install 'jagged-flash-jax[flax]'.

There is no `attention_fn` adapter for `nnx.MultiHeadAttention` / `linen.MultiHeadDotProductAttention`:
they pass padded [batch, length, heads, dim] arrays with an arbitrary mask and expect a 1/sqrt(D) scale,
while the op takes offsets and max_seq_len and scales by 1/max_seq_len instead. An adapter would guess
lengths from the mask (wrong for causal or other masks), drop dropout and keep the padding the op avoids;
its semantics cannot be stated exactly, so these layers, on x [T, F] and offsets [B+1], are the way in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import flax.core
    from flax import linen as nn
    from flax import nnx, traverse_util
except ImportError as err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "jagged_flash_jax.flax needs flax (>= 0.12), which is an optional dependency: "
        "pip install 'jagged-flash-jax[flax]'"
    ) from err

import jax
import jax.numpy as jnp

from .api import BACKENDS, multi_head_jagged_flash_attention

__all__ = [
    "JaggedMultiHeadAttention",
    "JaggedMultiHeadDotProductAttention",
    "linen_variables_from_nnx",
    "load_linen_variables",
]

_default_kernel_init = nnx.initializers.lecun_normal()
_default_bias_init = nnx.initializers.zeros_init()


def _head_dim(qkv_features: int, num_heads: int) -> int:
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if qkv_features % num_heads != 0:
        raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})")
    return qkv_features // num_heads


def _check_input(x, in_features: int | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be jagged token features of rank 2 [T, F], got shape {x.shape}")
    if in_features is not None and x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features but the layer expects in_features={in_features}")


def _attend(q, k, v, offsets, max_seq_len, *, backend, allow_tf32):
    """The op on projections [T, H, D], read token-major (layout "THD", no transposes)."""
    return multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, allow_tf32=allow_tf32,
                                             backend=backend, layout="THD")


class JaggedMultiHeadAttention(nnx.Module):
    """Multi-head self-attention over a jagged batch, each sequence attending only to itself (nnx).

    Projections follow `nnx.MultiHeadAttention`: `query`, `key`, `value` are `nnx.LinearGeneral`
    with kernel [in_features, num_heads, head_dim] and bias [num_heads, head_dim]; `out` has kernel
    [num_heads, head_dim, out_features] and bias [out_features]: the names and shapes of
    `JaggedMultiHeadDotProductAttention` (linen) and of `nnx.MultiHeadAttention`.

    Numerics, those of the op: with q, k, v = x W_q + b_q, x W_k + b_k, x W_v + b_v ([T, H, D] each),
        y = a W_o + b_o,   a = multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len),
    so a = softmax(q k^T) v / max_seq_len per sequence and head: NO 1/sqrt(D) scale, and a factor
    1/max_seq_len. A token the op does not attend (past the first max_seq_len of its sequence, or
    outside offsets) gets a = 0, hence y = b_o. For a sequence of n <= max_seq_len tokens this equals
    `nnx.MultiHeadAttention` on the sequence padded to max_seq_len with a key-padding mask, with the
    same weights except W_q, b_q multiplied by sqrt(D) and W_o divided by max_seq_len. As in any softmax
    attention, b_k shifts all scores of a query equally: it has no effect and gets zero gradient. There
    is no mask, dropout, decode cache or cross-attention.

    Args:
      num_heads: number of heads H.
      in_features: features F of the input x [T, F].
      qkv_features: H * D, the width of the query/key/value projections (default: in_features);
        must be divisible by num_heads.
      out_features: features of the output (default: in_features).
      use_bias: whether the four projections have biases.
      dtype: computation dtype of the projections and of the attention (default: promoted from the
        input and the parameters, as in flax). The attention needs float32, bfloat16 or float16.
      param_dtype: dtype of the parameters.
      precision: `jax.lax.Precision` of the projections.
      kernel_init, bias_init: initializers of the projections' kernels and biases.
      rngs: `nnx.Rngs` with a `params` stream.
      backend: backend of the op: "auto", "triton", "interpret" or "xla".
      allow_tf32: whether float32 attention may use TF32 on the GPU.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = _default_bias_init,
        rngs: nnx.Rngs,
        backend: str = "auto",
        allow_tf32: bool = True,
    ):
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.head_dim = _head_dim(self.qkv_features, num_heads)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.backend = backend
        self.allow_tf32 = allow_tf32

        def linear(in_f, out_f, axis):
            return nnx.LinearGeneral(in_f, out_f, axis=axis, use_bias=use_bias, dtype=dtype,
                                     param_dtype=param_dtype, precision=precision,
                                     kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)

        heads = (num_heads, self.head_dim)
        self.query = linear(in_features, heads, -1)
        self.key = linear(in_features, heads, -1)
        self.value = linear(in_features, heads, -1)
        self.out = linear(heads, self.out_features, (-2, -1))

    def __call__(self, x: jax.Array, offsets: jax.Array, max_seq_len: int) -> jax.Array:
        """Attention of the jagged tokens x [T, in_features] split by offsets [B+1].

        Args:
          x: token features [T, in_features] of B sequences packed along T.
          offsets: [B+1] int32/int64; sequence b is x[offsets[b]:offsets[b+1]].
          max_seq_len: static Python int; only the first max_seq_len tokens of a sequence attend.

        Returns:
          [T, out_features]; a token outside the attended ones gets the out bias.
        """
        _check_input(x, self.in_features)
        q, k, v = self.query(x), self.key(x), self.value(x)  # [T, H, D] each
        a = _attend(q, k, v, offsets, max_seq_len, backend=self.backend, allow_tf32=self.allow_tf32)
        return self.out(a)


class JaggedMultiHeadDotProductAttention(nn.Module):
    """`JaggedMultiHeadAttention` for `flax.linen`: the same parameters and numerics.

    Parameters are `query`, `key`, `value` (`nn.DenseGeneral`, kernel [F, H, D], bias [H, D]) and
    `out` (kernel [H, D, F_out], bias [F_out]), as in `nn.MultiHeadDotProductAttention`, so
    `linen_variables_from_nnx` / `load_linen_variables` copy weights to and from the nnx layer.
    `qkv_features` and `out_features` default to the input's feature count. Call it as
    `layer.apply(variables, x, offsets, max_seq_len)`; the other fields are those of
    `JaggedMultiHeadAttention`.
    """

    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable = _default_kernel_init
    bias_init: Callable = _default_bias_init
    backend: str = "auto"
    allow_tf32: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, offsets: jax.Array, max_seq_len: int) -> jax.Array:
        """[T, out_features] attention of the jagged tokens x [T, F] split by offsets [B+1]."""
        _check_input(x, None)
        features = x.shape[-1]
        qkv_features = self.qkv_features if self.qkv_features is not None else features
        out_features = self.out_features if self.out_features is not None else features
        head_dim = _head_dim(qkv_features, self.num_heads)

        def dense(features, axis, name):
            return nn.DenseGeneral(features=features, axis=axis, use_bias=self.use_bias,
                                   dtype=self.dtype, param_dtype=self.param_dtype,
                                   precision=self.precision, kernel_init=self.kernel_init,
                                   bias_init=self.bias_init, name=name)

        heads = (self.num_heads, head_dim)
        q, k, v = (dense(heads, -1, name)(x) for name in ("query", "key", "value"))
        a = _attend(q, k, v, offsets, max_seq_len, backend=self.backend, allow_tf32=self.allow_tf32)
        return dense(out_features, (-2, -1), "out")(a)


def linen_variables_from_nnx(module: nnx.Module) -> dict:
    """`{"params": ...}` for `JaggedMultiHeadDotProductAttention.apply`, holding `module`'s weights.

    Works for `JaggedMultiHeadAttention` (and `nnx.MultiHeadAttention`, whose projections have the
    same names and shapes); the arrays are shared, not copied.
    """
    return {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}


def load_linen_variables(module: nnx.Module, variables) -> None:
    """Overwrite `module`'s parameters in place with linen `variables` (`{"params": ...}`, or the
    params dict itself); the inverse of `linen_variables_from_nnx`.

    Raises ValueError if a parameter is missing, unexpected, or of another shape.
    """
    variables = flax.core.unfreeze(variables)
    new = traverse_util.flatten_dict(variables.get("params", variables))
    state = nnx.state(module, nnx.Param)
    old = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    missing, unexpected = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if missing or unexpected:
        raise ValueError(f"linen params do not match the module's: missing {['/'.join(k) for k in missing]}, "
                         f"unexpected {['/'.join(k) for k in unexpected]}")
    for path, value in new.items():
        if jnp.shape(value) != old[path].shape:
            raise ValueError(f"param {'/'.join(path)} has shape {jnp.shape(value)}, the module's has "
                             f"{old[path].shape}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
        {path: jnp.asarray(value) for path, value in new.items()}))
    nnx.update(module, state)
