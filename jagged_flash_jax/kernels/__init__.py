"""The Triton kernels of jagged flash attention, pure Triton and Gluon, no JAX: `portable/` runs on any
GPU and in Triton's interpreter, `hopper/` is the Gluon family for sm_90a (compiled only), and both call
`shared.py` for the semantics they share (a sequence's extent, the band, the block ranges, the scores).
HSTU attention's kernels (`portable/hstu.py`, `hopper/hstu_forward.py`, `hopper/hstu_backward.py`) take
its rules from `shared_hstu.py`.
`spec.py` is the contract with the launch code: each kernel's arguments in jax-triton's order (inputs,
the last an int32 array of runtime parameters, then outputs, then compile-time constants by keyword).
"""

import importlib

__all__ = [
    "attention_bwd_kernel", "attention_bwd_preprocess_kernel", "attention_fwd_kernel",
    "attention_fwd_tma_kernel",
    "hopper_attention_bwd_dkdv_dq_kernel", "hopper_attention_bwd_dkdv_dq_tma_kernel",
    "hopper_attention_bwd_dkdv_kernel", "hopper_attention_bwd_dq_kernel", "hopper_attention_fwd_kernel",
    "hopper_hstu_bwd_dkdv_kernel", "hopper_hstu_bwd_dq_kernel", "hopper_hstu_fwd_kernel", "hstu_bwd_kernel",
    "hstu_fwd_kernel", "key_major_kernel",
]

# Each kernel's module; a Hopper kernel's function is named as its portable counterpart (without
# "hopper_"), which its PTX's entry takes.
_MODULES = {
    "key_major_kernel": ".portable.transpose",
    "attention_fwd_kernel": ".portable.forward",
    "attention_fwd_tma_kernel": ".portable.forward",
    "attention_bwd_preprocess_kernel": ".portable.backward",
    "attention_bwd_kernel": ".portable.backward",
    "hopper_attention_fwd_kernel": ".hopper.forward",
    "hopper_attention_bwd_dkdv_kernel": ".hopper.dkdv",
    "hopper_attention_bwd_dkdv_dq_kernel": ".hopper.dkdv",
    "hopper_attention_bwd_dkdv_dq_tma_kernel": ".hopper.dkdv",
    "hopper_attention_bwd_dq_kernel": ".hopper.dq",
    "hstu_fwd_kernel": ".portable.hstu",
    "hstu_bwd_kernel": ".portable.hstu",
    "hopper_hstu_fwd_kernel": ".hopper.hstu_forward",
    "hopper_hstu_bwd_dkdv_kernel": ".hopper.hstu_backward",
    "hopper_hstu_bwd_dq_kernel": ".hopper.hstu_backward",
}


def __getattr__(name: str):
    """The kernels, imported on first use: Triton comes only with the `interpret` and GPU extras, and
    the package (its `xla` backend, the launch plan, kernels/spec.py) imports without it; the Hopper
    kernels need triton.experimental.gluon besides."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name.removeprefix("hopper_"))
