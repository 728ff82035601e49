"""Flax layers for jagged attention: `JaggedMultiHeadAttention` (nnx) and
`JaggedMultiHeadDotProductAttention` (linen), with equal parameters and numerics, and the two helpers that
copy weights between them; and `HSTUBlock` (nnx), a generative-recommender layer around
`hstu_attention`. Optional: needs pip install 'jagged-flash-jax[flax]'.

Each layer projects jagged token features x [T, F] to q [T, H, D] and k, v [T, H_kv, D], runs one of the
two ops on them (token-major, layout "THD": no transposes) and projects the result back to [T, F_out]:

- `semantics="fbgemm"` (the default): `multi_head_jagged_flash_attention`, softmax(q k^T) v / max_seq_len
  per sequence and head (no 1/sqrt(D) scale, no causal mask, H_kv = H);
- `semantics="standard"`: `jagged_attention`, softmax(scale * q k^T) v per sequence and head, with
  `scale` (default 1/sqrt(D)), an optional causal mask and grouped-query heads (H_kv dividing H), and
  its `window`, `softcap` and `alibi_slopes` (a static tuple of H floats here).
  On a sequence of at most max_seq_len tokens, this is `nnx.MultiHeadAttention` (without dropout) on
  that sequence alone.

`heads_axis` names a mesh axis to split the heads over (tensor parallelism): the projection kernels carry
`nnx.with_partitioning` / `nn.with_partitioning` annotations, so that under a sharded `jax.jit` each device
projects and attends its own heads, and only the output projection sums over devices (an all-reduce).

There is no `attention_fn` adapter for `nnx.MultiHeadAttention` / `linen.MultiHeadDotProductAttention`:
they pass padded [batch, length, heads, dim] arrays with an arbitrary mask; an adapter would have to guess
the lengths from the mask (wrong for a mask that is not a key-padding or causal one), drop dropout and keep
the padding the ops avoid. Its semantics cannot be stated exactly, so these layers, on x [T, F] and
offsets [B+1], are the way in.
"""

from __future__ import annotations

import math
import numbers
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
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .api import jagged_attention, multi_head_jagged_flash_attention
from .hstu import hstu_attention
from .jagged import explicit_mesh
from .select import BACKENDS

__all__ = [
    "SEMANTICS",
    "HSTUBlock",
    "JaggedMultiHeadAttention",
    "JaggedMultiHeadDotProductAttention",
    "linen_variables_from_nnx",
    "load_linen_variables",
]

SEMANTICS = ("fbgemm", "standard")

_default_kernel_init = nnx.initializers.lecun_normal()
_default_bias_init = nnx.initializers.zeros_init()


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _check_config(*, num_heads, num_kv_heads, semantics, causal, scale, backend, heads_axis,
                  window=(None, None), softcap=None, alibi_slopes=None, deterministic=True) -> int:
    """Checks the layer's settings (those that do not depend on the input); returns num_kv_heads."""
    _check_int(num_heads, "num_heads")
    num_kv_heads = num_heads if num_kv_heads is None else _check_int(num_kv_heads, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None (1/sqrt(head_dim)), got {scale!r}")
    if semantics == "fbgemm":
        unsupported = [what for what, bad in (
            ("causal=True", causal), (f"scale={scale!r}", scale is not None),
            (f"window={window!r}", tuple(window) != (None, None)),
            (f"softcap={softcap!r}", softcap is not None),
            ("alibi_slopes", alibi_slopes is not None),
            (f"num_kv_heads={num_kv_heads} != num_heads={num_heads}", num_kv_heads != num_heads)) if bad]
        if unsupported:
            raise ValueError(f"semantics='fbgemm' (FBGEMM's op: softmax(q k^T) v / max_seq_len, full "
                             f"attention, as many kv heads as query heads) cannot take "
                             f"{', '.join(unsupported)}; use semantics='standard' (jagged_attention)")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, (tuple, list))
                                     or len(alibi_slopes) != num_heads):
        raise ValueError(f"alibi_slopes must be a tuple of num_heads={num_heads} floats or None, got "
                         f"{alibi_slopes!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if heads_axis is not None and not isinstance(heads_axis, str):
        raise ValueError(f"heads_axis must be a mesh axis name (str) or None, got {heads_axis!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    return num_kv_heads


def _head_dim(qkv_features: int, num_heads: int) -> int:
    _check_int(qkv_features, "qkv_features")
    if qkv_features % num_heads != 0:
        raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})")
    return qkv_features // num_heads


def _check_input(x, in_features: int | None) -> None:
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x must be jagged token features of rank 2 [T, F], got shape {jnp.shape(x)}")
    if in_features is not None and x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features but the layer expects in_features={in_features}")


def _partitioning(heads_axis: str | None) -> dict[str, tuple]:
    """Partition specs by parameter: the heads split over `heads_axis`, everything else replicated."""
    return {"qkv_kernel": (None, heads_axis, None), "qkv_bias": (heads_axis, None),
            "out_kernel": (heads_axis, None, None), "out_bias": (None,)}


def _out_sharding(a) -> NamedSharding | None:
    """The sharding of the output projection of `a` [T, H, D] when `a` has its heads (or D) split over
    Explicit mesh axes (sharding in types): the contraction over them is an all-reduce, which
    `dot_general` wants to be told. Tokens keep their sharding, the features are replicated. None
    otherwise (no mesh, or Auto axes: XLA's propagation decides)."""
    mesh = explicit_mesh(a)
    if mesh is None:
        return None
    spec = tuple(jax.typeof(a).sharding.spec) + (None,) * 3
    if spec[1] is None and spec[2] is None:
        return None
    return NamedSharding(mesh, P(spec[0], None))


def _attend(q, k, v, offsets, max_seq_len, *, semantics, causal, scale, backend, allow_tf32,
            window=(None, None), softcap=None, alibi_slopes=None, return_lse=False, deterministic=True):
    """The op on projections q [T, H, D], k, v [T, H_kv, D], read token-major (no transposes); with
    return_lse, (a, lse [T, H])."""
    if semantics == "fbgemm":
        if return_lse:
            raise ValueError("return_lse=True needs semantics='standard' (jagged_attention); FBGEMM's op "
                             "has no log-sum-exp output")
        return multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, allow_tf32=allow_tf32,
                                                 backend=backend, layout="THD", deterministic=deterministic)
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
    return jagged_attention(q, k, v, offsets, max_seq_len, scale=scale, causal=causal, layout="THD",
                            backend=backend, allow_tf32=allow_tf32, window=tuple(window), softcap=softcap,
                            alibi_slopes=slopes, return_lse=return_lse, deterministic=deterministic)


class JaggedMultiHeadAttention(nnx.Module):
    """Multi-head self-attention over a jagged batch, each sequence attending only to itself (nnx).

    Projections follow `nnx.MultiHeadAttention`: `query` is an `nnx.LinearGeneral` with kernel
    [in_features, num_heads, head_dim] and bias [num_heads, head_dim]; `key` and `value` have
    num_kv_heads heads instead; `out` has kernel [num_heads, head_dim, out_features] and bias
    [out_features]: the names and shapes of `JaggedMultiHeadDotProductAttention` (linen) and of
    `nnx.MultiHeadAttention`.

    Numerics: with q = x W_q + b_q [T, H, D] and k, v = x W_k + b_k, x W_v + b_v [T, H_kv, D],
        y = a W_o + b_o, where per sequence (of n tokens, the first min(n, max_seq_len) attended) and
        query head h (reading kv head h // (H / H_kv)):
        - semantics="fbgemm" (default): a = multi_head_jagged_flash_attention(q, k, v, offsets,
          max_seq_len) = softmax(q k^T) v / max_seq_len: NO 1/sqrt(D) scale and a factor 1/max_seq_len,
          FBGEMM's op. It takes no `causal`, `scale` or `num_kv_heads != num_heads` (ValueError).
        - semantics="standard": a = jagged_attention(q, k, v, offsets, max_seq_len, scale=scale,
          causal=causal) = softmax(scale q k^T) v, scale defaulting to 1/sqrt(D); with causal=True,
          token i attends to tokens j <= i of its sequence.
    A token the op does not attend (past the first max_seq_len of its sequence, or outside offsets)
    gets a = 0, hence y = b_o. For a sequence of n <= max_seq_len tokens, "standard" equals
    `nnx.MultiHeadAttention` (same weights, num_kv_heads, no dropout) on the sequence padded to
    max_seq_len with a key-padding mask (and a causal mask if causal); "fbgemm" equals it with W_q, b_q
    multiplied by sqrt(D) and W_o divided by max_seq_len. As in any softmax attention, b_k shifts all
    scores of a query equally: it has no effect and gets zero gradient. There is no arbitrary mask,
    dropout, decode cache or cross-attention.

    Tensor parallelism: with `heads_axis="model"`, the parameters carry `nnx.with_partitioning`
    annotations: query/key/value kernels [F, H, D] (None, "model", None) and biases [H, D] ("model", None),
    out kernel [H, D, F_out] ("model", None, None), out bias replicated. Flax shards annotated parameters
    as it creates them (`nnx.use_eager_sharding`, on by default), which needs a mesh: create the layer
    (and its `nnx.Optimizer`) under `jax.set_mesh(mesh)`, or create it under
    `nnx.use_eager_sharding(False)` and place its state with
    `jax.device_put(state, nnx.get_named_sharding(state, mesh))`. Under `jax.jit` with the state so
    sharded, each device projects and attends its own heads (the op partitions over heads with no
    collective) and the output projection ends in an all-reduce over "model": no q, k or v is gathered.
    num_kv_heads must be a multiple of the axis size. Mesh axes may be Auto or Explicit. The tokens may
    be split over another (data) axis too, with per-shard offsets [shards, B+1] (`pack_data_parallel`).

    Args:
      num_heads: number of query heads H.
      in_features: features F of the input x [T, F].
      qkv_features: H * D, the width of the query projection (default: in_features); must be divisible
        by num_heads. The key/value projections have num_kv_heads * D features.
      out_features: features of the output (default: in_features).
      num_kv_heads: heads H_kv of the key and value projections (default: num_heads); must divide
        num_heads (grouped-query attention; 1 is multi-query). Needs semantics="standard" if != H.
      semantics: "fbgemm" (default: FBGEMM's op, as in earlier versions) or "standard" (see above).
      causal: causal mask within each sequence (semantics="standard" only).
      scale: factor of q k^T (semantics="standard" only); None means 1/sqrt(D).
      window, softcap: `jagged_attention`'s sliding window (left, right) and logit soft cap
        (semantics="standard" only).
      alibi_slopes: a static tuple of num_heads floats, `jagged_attention`'s ALiBi slopes (not trained),
        or None (semantics="standard" only).
      heads_axis: name of the mesh axis to split the heads over (see above), or None.
      use_bias: whether the four projections have biases.
      dtype: computation dtype of the projections and of the attention (default: promoted from the
        input and the parameters, as in flax). The attention needs float32, bfloat16 or float16.
      param_dtype: dtype of the parameters.
      precision: `jax.lax.Precision` of the projections.
      kernel_init, bias_init: initializers of the projections' kernels and biases.
      rngs: `nnx.Rngs` with a `params` stream.
      backend: backend of the op: "auto", "triton", "interpret" or "xla".
      allow_tf32: whether float32 attention may use TF32 on the GPU.
      deterministic: the op's `deterministic` (the backward's reproducibility: this layer has no
        dropout). False lets the backend's choice take the faster, non-deterministic dq-fused backward
        on long sequences (see `jagged_attention`).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        num_kv_heads: int | None = None,
        semantics: str = "fbgemm",
        causal: bool = False,
        scale: float | None = None,
        window: tuple[int | None, int | None] = (None, None),
        softcap: float | None = None,
        alibi_slopes: tuple[float, ...] | None = None,
        heads_axis: str | None = None,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = _default_bias_init,
        rngs: nnx.Rngs,
        backend: str = "auto",
        allow_tf32: bool = True,
        deterministic: bool = True,
    ):
        self.num_kv_heads = _check_config(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                          semantics=semantics, causal=causal, scale=scale, backend=backend,
                                          heads_axis=heads_axis, window=window, softcap=softcap,
                                          alibi_slopes=alibi_slopes, deterministic=deterministic)
        self.num_heads = num_heads = int(num_heads)
        self.in_features = _check_int(in_features, "in_features")
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = _check_int(out_features if out_features is not None else in_features,
                                       "out_features")
        self.head_dim = _head_dim(self.qkv_features, num_heads)
        self.semantics, self.causal = semantics, bool(causal)
        self.scale = None if scale is None else float(scale)
        self.window, self.softcap = tuple(window), softcap
        self.alibi_slopes = None if alibi_slopes is None else tuple(float(s) for s in alibi_slopes)
        self.heads_axis = heads_axis
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.backend = backend
        self.allow_tf32 = allow_tf32
        self.deterministic = bool(deterministic)
        specs = _partitioning(heads_axis)

        def linear(in_f, out_f, axis, kind):
            kernel, bias = kernel_init, bias_init
            if heads_axis is not None:
                kernel = nnx.with_partitioning(kernel_init, specs[f"{kind}_kernel"])
                bias = nnx.with_partitioning(bias_init, specs[f"{kind}_bias"])
            return nnx.LinearGeneral(in_f, out_f, axis=axis, use_bias=use_bias, dtype=dtype,
                                     param_dtype=param_dtype, precision=precision,
                                     kernel_init=kernel, bias_init=bias, rngs=rngs)

        self.query = linear(in_features, (num_heads, self.head_dim), -1, "qkv")
        self.key = linear(in_features, (self.num_kv_heads, self.head_dim), -1, "qkv")
        self.value = linear(in_features, (self.num_kv_heads, self.head_dim), -1, "qkv")
        self.out = linear((num_heads, self.head_dim), self.out_features, (-2, -1), "out")

    def __call__(self, x: jax.Array, offsets: jax.Array, max_seq_len: int, *, return_lse: bool = False):
        """Attention of the jagged tokens x [T, in_features] split by offsets [B+1].

        Args:
          x: token features [T, in_features] of B sequences packed along T.
          offsets: [B+1] int32/int64; sequence b is x[offsets[b]:offsets[b+1]]. Or [shards, B+1], local
            to each of `shards` equal slices of the token axis (data parallelism: `pack_data_parallel`).
          max_seq_len: static Python int; only the first max_seq_len tokens of a sequence attend.
          return_lse: also return the attention's log-sum-exp [T, H] (semantics="standard" only; see
            `jagged_attention`), for merging with another attention over other keys before `out`.

        Returns:
          [T, out_features]; a token outside the attended ones gets the out bias. With return_lse, the
          pair (that, lse).
        """
        _check_input(x, self.in_features)
        q, k, v = self.query(x), self.key(x), self.value(x)  # [T, H, D], [T, H_kv, D] x 2
        a = _attend(q, k, v, offsets, max_seq_len, semantics=self.semantics, causal=self.causal,
                    scale=self.scale, backend=self.backend, allow_tf32=self.allow_tf32, window=self.window,
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes, return_lse=return_lse,
                    deterministic=self.deterministic)
        if return_lse:
            a, lse = a
            return self.out(a, out_sharding=_out_sharding(a)), lse
        return self.out(a, out_sharding=_out_sharding(a))


class _DenseGeneral(nn.Module):
    """`nn.DenseGeneral` without batch dims: the same parameters, initial values and arithmetic (those of
    `nnx.LinearGeneral` too), with `nn.with_partitioning` boxes on the parameters at their own shapes.
    (`nn.DenseGeneral` unboxes such a box inside its initializer, at a flattened shape: a sharding
    constraint that fails under a mesh, and an assertion that fails under Explicit mesh axes.)"""

    features: int | tuple[int, ...]
    axis: int | tuple[int, ...]
    use_bias: bool
    dtype: Any
    param_dtype: Any
    precision: Any
    kernel_init: Callable
    bias_init: Callable
    kernel_names: tuple | None = None
    bias_names: tuple | None = None
    out_sharding: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = tuple(self.features) if isinstance(self.features, tuple) else (self.features,)
        axis = tuple(a % x.ndim for a in (self.axis if isinstance(self.axis, tuple) else (self.axis,)))
        kernel_shape = tuple(x.shape[a] for a in axis) + features

        def kernel_init(rng, shape, dtype):  # as nn.DenseGeneral: initialized flat [in, out], reshaped
            return jnp.reshape(self.kernel_init(rng, (math.prod(shape[:len(axis)]), math.prod(features)),
                                                dtype), shape)

        def bias_init(rng, shape, dtype):
            return jnp.reshape(self.bias_init(rng, (math.prod(shape),), dtype), shape)

        def boxed(init, names):
            return init if names is None else nn.with_partitioning(init, names)

        kernel = self.param("kernel", boxed(kernel_init, self.kernel_names), kernel_shape, self.param_dtype)
        bias = (self.param("bias", boxed(bias_init, self.bias_names), features, self.param_dtype)
                if self.use_bias else None)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        out = jax.lax.dot_general(x, kernel, ((axis, tuple(range(len(axis)))), ((), ())),
                                  precision=self.precision, out_sharding=self.out_sharding)
        if bias is not None:
            out += jnp.reshape(bias, (1,) * (x.ndim - len(axis)) + features)
        return out


class JaggedMultiHeadDotProductAttention(nn.Module):
    """`JaggedMultiHeadAttention` for `flax.linen`: the same parameters and numerics.

    Parameters are `query` (kernel [F, H, D], bias [H, D]), `key` and `value` (kernel [F, H_kv, D], bias
    [H_kv, D]) and `out` (kernel [H, D, F_out], bias [F_out]), with the names, shapes and initial values
    of `nn.DenseGeneral` projections in `nn.MultiHeadDotProductAttention`, so `linen_variables_from_nnx`
    / `load_linen_variables` copy weights to and from the nnx layer. `qkv_features` and `out_features`
    default to the input's feature count. With `heads_axis`, the parameters are wrapped in
    `nn.with_partitioning` (the specs of the nnx layer): `init` returns `nn.Partitioned` boxes, and
    `nn.get_partition_spec(variables)` gives the shardings to place the params with (`jax.device_put`
    of `nn.unbox(variables)`, or the `out_shardings` of a jitted `init`); Auto or Explicit mesh axes.
    Call it as `layer.apply(variables, x, offsets, max_seq_len)`; the other fields (`num_kv_heads`,
    `semantics`, `causal`, `scale`, ...) are those of `JaggedMultiHeadAttention`, and so are the
    numerics.
    """

    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    semantics: str = "fbgemm"
    causal: bool = False
    scale: float | None = None
    window: tuple[int | None, int | None] = (None, None)
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    heads_axis: str | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable = _default_kernel_init
    bias_init: Callable = _default_bias_init
    backend: str = "auto"
    allow_tf32: bool = True
    deterministic: bool = True

    def __post_init__(self):
        _check_config(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, semantics=self.semantics,
                      causal=self.causal, scale=self.scale, backend=self.backend, heads_axis=self.heads_axis,
                      window=self.window, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                      deterministic=self.deterministic)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, offsets: jax.Array, max_seq_len: int, *, return_lse: bool = False):
        """[T, out_features] attention of the jagged tokens x [T, F] split by offsets [B+1]; with
        return_lse, the pair (that, the attention's log-sum-exp [T, H]), as the nnx module's."""
        _check_input(x, None)
        features = x.shape[-1]
        qkv_features = self.qkv_features if self.qkv_features is not None else features
        out_features = self.out_features if self.out_features is not None else features
        head_dim = _head_dim(qkv_features, self.num_heads)
        num_kv_heads = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        specs = _partitioning(self.heads_axis)

        def dense(features, axis, name, kind, out_sharding=None):
            boxed = self.heads_axis is not None
            return _DenseGeneral(features=features, axis=axis, use_bias=self.use_bias, dtype=self.dtype,
                                 param_dtype=self.param_dtype, precision=self.precision,
                                 kernel_init=self.kernel_init, bias_init=self.bias_init,
                                 kernel_names=specs[f"{kind}_kernel"] if boxed else None,
                                 bias_names=specs[f"{kind}_bias"] if boxed else None,
                                 out_sharding=out_sharding, name=name)

        q = dense((self.num_heads, head_dim), -1, "query", "qkv")(x)
        k, v = (dense((num_kv_heads, head_dim), -1, name, "qkv")(x) for name in ("key", "value"))
        a = _attend(q, k, v, offsets, max_seq_len, semantics=self.semantics, causal=self.causal,
                    scale=self.scale, backend=self.backend, allow_tf32=self.allow_tf32, window=self.window,
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes, return_lse=return_lse,
                    deterministic=self.deterministic)
        if return_lse:
            a, lse = a
            return dense(out_features, (-2, -1), "out", "out", _out_sharding(a))(a), lse
        return dense(out_features, (-2, -1), "out", "out", _out_sharding(a))(a)


def linen_variables_from_nnx(module: nnx.Module) -> dict:
    """`{"params": ...}` for `JaggedMultiHeadDotProductAttention.apply`, holding `module`'s weights.

    Works for `JaggedMultiHeadAttention` (and `nnx.MultiHeadAttention`, whose projections have the
    same names and shapes); the arrays are shared, not copied, and keep their shardings.
    """
    return {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}


def load_linen_variables(module: nnx.Module, variables) -> None:
    """Overwrite `module`'s parameters in place with linen `variables` (`{"params": ...}`, or the
    params dict itself, boxed by `nn.with_partitioning` or not); the inverse of
    `linen_variables_from_nnx`. Each new array is placed with the sharding of the parameter it replaces.

    Raises ValueError if a parameter is missing, unexpected, or of another shape.
    """
    variables = flax.core.meta.unbox(flax.core.unfreeze(variables))
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

    def place(value, like):
        if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer):
            return jax.device_put(value, like.sharding)
        return jnp.asarray(value)

    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
        {path: place(value, old[path]) for path, value in new.items()}))
    nnx.update(module, state)


class HSTUBlock(nnx.Module):
    """One HSTU layer (generative recommenders' "Actions Speak Louder than Words"), on jagged token
    features x [T, F] and offsets [B+1]:

        u, v, q, k = silu(LayerNorm(x) W_uvqk + b)           # one fused projection, split by columns
        a = hstu_attention(q, k, v, offsets, max_seq_len, alpha=1/sqrt(D), num_targets=..., ...)
        y = x + (u * LayerNorm(a)) W_o + b_o                 # the output norm, the gate u, a residual

    with u, v [T, H, V] (V = `linear_dim`), q, k [T, H, D] (D = `attention_dim`). The attention's options
    (`causal`, `max_attn_len`, `contextual_seq_len`, `min_full_attn_seq_len`) are fixed at construction;
    num_targets is a call argument. Dropout is left out (add it around the block).
    """

    def __init__(self, in_features: int, num_heads: int, *, attention_dim: int, linear_dim: int,
                 causal: bool = True, max_attn_len: int = 0, contextual_seq_len: int = 0,
                 min_full_attn_seq_len: int = 0, backend: str = "auto", allow_tf32: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        for name, value in (("in_features", in_features), ("num_heads", num_heads),
                            ("attention_dim", attention_dim), ("linear_dim", linear_dim)):
            _check_int(value, name)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.num_heads, self.attention_dim, self.linear_dim = num_heads, attention_dim, linear_dim
        self.options = dict(causal=causal, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
                            min_full_attn_seq_len=min_full_attn_seq_len, backend=backend,
                            allow_tf32=allow_tf32)
        self.input_norm = nnx.LayerNorm(in_features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.uvqk = nnx.Linear(in_features, num_heads * (2 * linear_dim + 2 * attention_dim), dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.output_norm = nnx.LayerNorm(num_heads * linear_dim, dtype=dtype, param_dtype=param_dtype,
                                         rngs=rngs)
        self.output = nnx.Linear(num_heads * linear_dim, in_features, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)

    def __call__(self, x: jax.Array, offsets: jax.Array, max_seq_len: int, *, num_targets=None) -> jax.Array:
        _check_input(x, self.input_norm.num_features)
        h, d, v_dim = self.num_heads, self.attention_dim, self.linear_dim
        uvqk = jax.nn.silu(self.uvqk(self.input_norm(x)))
        u, v, q, k = jnp.split(uvqk, np.cumsum([h * v_dim, h * v_dim, h * d]), axis=-1)
        tokens = x.shape[0]
        attended = hstu_attention(q.reshape(tokens, h, d), k.reshape(tokens, h, d),
                                  v.reshape(tokens, h, v_dim), offsets, max_seq_len, alpha=1.0 / math.sqrt(d),
                                  num_targets=num_targets, **self.options)
        return x + self.output(u * self.output_norm(attended.reshape(tokens, h * v_dim)))
