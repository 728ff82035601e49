"""Triton kernels of jagged flash attention: the forward, the backward preprocess and the backward.

Pure Triton, no JAX: the same functions are compiled for the GPU (launch/gpu.py) and run by Triton's
interpreter on the CPU (launch/interpret.py). `common.py` holds what every kernel family shares (the
runtime-parameter layout, addressing, a sequence's extent, masks and key/query ranges, the online
softmax, the zero fills); `portable.py` the kernels that run on any GPU and in the interpreter;
`hopper.py` a forward for Hopper GPUs in Gluon (TMA, wgmma, warp specialization; compiled only, it has
no interpreter), with the portable forward's contract, and `hopper_backward.py` the matching dk/dv and
dq kernels, with the portable backward's. Parameters come in the order jax-triton passes
them: input arrays (the last an int32 array of runtime sizes, its slots named in `spec.py`), outputs,
then compile-time constants (always given by keyword).

Addressing. q, o, do, dq share one layout and k, v, dk, dv another; the launcher passes each family's
token and head strides (in units of STRIDE_ALIGN elements, see `common._aligned`), so "THD" and "HTD"
(and anything else with unit stride along D) share one code path. The token axis may hold several
independent segments of `*_tokens` tokens, each with its own row of offsets (data-parallel shards, or
vmapped problems); offsets rows are `*_offsets_stride` apart (0 when every segment shares one row). The
float32 log-sum-exp and delta are [segments, H, q_tokens]. Every pointer is rebased once per program by
`common._rows`.

Grid. (segment, sequence, head) and slot, on two axes or one (see `common._program`). There is one extra
"sequence" per segment whose programs zero the tokens that no sequence covers. A sequence's slots are
its row blocks, the last ones first so that the costly blocks of long sequences start early, and last a
program that zeroes the sequence's own tokens past the maximum length. So every output element is
written by the kernels: no memset is needed. The zeroing programs return without touching the
attention code: ptxas 12.8 (Triton 3.6's) miscompiled programs that zeroed the tail and then went on
to their block, clobbering a uniform register that held the offsets pointer. (The persistent Hopper
kernels do their share of the fills and then their blocks in one program: their GPU tests of the zeroed
rows and of poisoned tokens pass under Triton 3.6, tests/gpu_results/.)

Semantics per sequence: n_q = min(len_q, Q_MAX_LEN) queries attend n_k = min(len_kv, KV_MAX_LEN) keys
(causal: key j <= query i + n_k - n_q), o = OUT_SCALE * softmax(scale * q k^T) v. The float32
log-sum-exp is kept in units of the unscaled scores (base 2 after scaling), and both passes subtract
before they scale: at large logits the top score of a row gets probability exactly 1 in both. Rows with
no key get o = 0 and log-sum-exp +inf.
"""

__all__ = [
    "attention_bwd_kernel", "attention_bwd_preprocess_kernel", "attention_fwd_kernel",
    "hopper_attention_bwd_dkdv_kernel", "hopper_attention_bwd_dq_kernel", "hopper_attention_fwd_kernel",
    "key_major_kernel",
]


def __getattr__(name: str):
    """The kernels, imported on first use: Triton, which they need, comes only with the `interpret` and
    GPU extras, and the package (its `xla` backend, the launch plan, kernels/spec.py) imports
    without it."""
    if name == "hopper_attention_fwd_kernel":  # needs triton.experimental.gluon
        from . import hopper

        return hopper.attention_fwd_kernel
    if name in ("hopper_attention_bwd_dkdv_kernel", "hopper_attention_bwd_dq_kernel"):
        from . import hopper_backward

        return getattr(hopper_backward, name.removeprefix("hopper_"))
    if name in __all__:
        from . import portable

        return getattr(portable, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
