"""The implementations compared: each builds the function timed for one case and mode.

Jagged implementations take (q, k, v, offsets[, do]) with q, k, v [H, T, D]; padded ones take
(q, k, v, lengths[, do]) already in [B, max_seq_len, H, Dp], so their padding is not timed.
"fwd+bwd" is jax.vjp of the output against the cotangent do, returning (dq, dk, dv).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jagged_flash_jax import multi_head_jagged_flash_attention, padded_to_jagged

from .cases import Case, jagged_to_cudnn_layout


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    padded_inputs: bool
    needs_gpu: bool
    half_only: bool  # cuDNN's flash attention takes float16 and bfloat16 only
    make_attention: Callable[[Case], Callable]
    doc: str

    def skip_reason(self, dtype: str, platform: str) -> str | None:
        if self.needs_gpu and platform != "gpu":
            return f"needs a GPU (JAX's default backend is {platform!r})"
        if self.half_only and dtype == "float32":
            return "cuDNN flash attention supports only float16 and bfloat16"
        return None

    def function(self, case: Case, mode: str) -> Callable:
        attention = self.make_attention(case)
        if mode == "fwd":
            return attention

        def forward_backward(q, k, v, aux, do):
            _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, aux), q, k, v)
            return vjp(do)

        return forward_backward


def _jfa(backend: str):
    def make(case: Case):
        return lambda q, k, v, offsets: multi_head_jagged_flash_attention(
            q, k, v, offsets, case.max_seq_len, allow_tf32=True, backend=backend)
    return make


def _dot_product_attention(case: Case, implementation: str):
    def attention(q, k, v, lengths):
        out = jax.nn.dot_product_attention(q, k, v, scale=1.0, query_seq_lengths=lengths,
                                           key_value_seq_lengths=lengths, implementation=implementation)
        return out / case.max_seq_len
    return attention


def _padded(implementation: str):
    return lambda case: _dot_product_attention(case, implementation)


def _cudnn_with_conversion(case: Case):
    """What a user with jagged data pays for cuDNN: pad, transpose, attend, transpose, unpad."""
    padded_attention = _dot_product_attention(case, "cudnn")

    def attention(q, k, v, offsets):
        lengths = jnp.minimum(offsets[1:] - offsets[:-1], case.max_seq_len).astype(jnp.int32)
        qp, kp, vp = (jagged_to_cudnn_layout(x, offsets, case.max_seq_len, case.padded_head_dim)
                      for x in (q, k, v))
        out = padded_attention(qp, kp, vp, lengths)[..., :case.head_dim]  # [B, L, H, D]
        return padded_to_jagged(jnp.swapaxes(out, 1, 2), offsets, q.shape[1])

    return attention


IMPLS = (
    Impl("jfa-triton", False, True, False, _jfa("triton"), "this library's Triton kernels"),
    Impl("jfa-xla", False, False, False, _jfa("xla"), "this library's pure-JAX backend (pads inside)"),
    Impl("cudnn-padded", True, True, True, _padded("cudnn"),
         "jax.nn.dot_product_attention(implementation='cudnn') on inputs padded outside the timing"),
    Impl("xla-padded", True, False, False, _padded("xla"),
         "jax.nn.dot_product_attention(implementation='xla') on inputs padded outside the timing"),
    Impl("cudnn+convert", False, True, True, _cudnn_with_conversion,
         "cuDNN with the jagged -> padded -> jagged conversion inside the timing"),
)
IMPLS_BY_NAME = {impl.name: impl for impl in IMPLS}
