"""The contract between the launch code and each kernel, declared once: a `KernelSpec` per kernel names its
array inputs and outputs, the slots of its int32 array of runtime parameters, its compile-time constants,
which inputs are TMA descriptors, which outputs the launcher zeroes and which inputs the kernel updates in
place. launch/calls.py packs and checks by it; the kernels read their parameter slots by it;
tests/test_spec.py holds each spec against its kernel's own argument names. Plain Python, so that the
launch code imports it without Triton.

A kernel's arguments, in order (jax-triton's): its inputs (`<name>_ptr`, `<name>_desc` for a
descriptor; the last input is `params`, the runtime parameters), its outputs, then its constants, which
the launcher passes by keyword. Runtime sizes travel in `params` rather than as scalar arguments:
jax-triton turns a scalar equal to 1 into a compile-time constant, so each pattern of ones would
compile a kernel of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str  # the kernel's name in jagged_flash_jax.kernels
    inputs: tuple[str, ...]  # array inputs in order, "params" last
    outputs: tuple[str, ...]
    params: tuple[str, ...]  # slots of the runtime-parameter array, in order
    constants: tuple[str, ...]
    descriptors: tuple[str, ...] = ()  # inputs passed as TMA descriptors (2-D, over a view)
    zeroed: tuple[str, ...] = ()  # outputs the launcher zeroes before the kernel runs
    # Inputs the kernel updates in place (jax-triton's input_output_aliases), returned after the outputs,
    # in this order; the kernel has no output argument of theirs.
    updated: tuple[str, ...] = ()

    def __post_init__(self):
        if self.inputs[-1:] != ("params",):
            raise ValueError(f"{self.name}: the runtime parameters must be the last input")
        for group in ("descriptors", "zeroed", "updated"):
            names = self.outputs if group == "zeroed" else self.inputs
            if not set(getattr(self, group)) <= set(names):
                raise ValueError(f"{self.name}: {group} {getattr(self, group)} not among {names}")

    def slot(self, name: str) -> int:
        """The slot of runtime parameter `name` (what the kernel reads it at)."""
        return self.params.index(name)

    def pack(self, values: Mapping[str, int]) -> tuple[int, ...]:
        """The runtime parameters in slot order: exactly this spec's, each once."""
        if set(values) != set(self.params):
            missing, extra = set(self.params) - set(values), set(values) - set(self.params)
            raise ValueError(f"{self.name}: runtime parameters missing {sorted(missing)}, unknown "
                             f"{sorted(extra)}")
        return tuple(int(values[name]) for name in self.params)

    def check_constants(self, constants: Mapping[str, object]) -> dict:
        """`constants` as a dict, if they are exactly this spec's."""
        if set(constants) != set(self.constants):
            missing, extra = set(self.constants) - set(constants), set(constants) - set(self.constants)
            raise ValueError(f"{self.name}: constants missing {sorted(missing)}, unknown {sorted(extra)}")
        return dict(constants)

    def arrays(self, values: Mapping[str, object]) -> tuple:
        """The array inputs in order, from {name: array} (all of them, "params" included)."""
        if set(values) != set(self.inputs):
            raise ValueError(f"{self.name}: inputs {sorted(values)}, expected {sorted(self.inputs)}")
        return tuple(values[name] for name in self.inputs)

    def index(self, name: str) -> int:
        """The position of an input or output among the kernel's arrays (inputs, then outputs)."""
        return (self.inputs + self.outputs).index(name)

    @property
    def results(self) -> tuple[str, ...]:
        """What a launch returns, in order: the outputs, then the inputs it updates in place."""
        return self.outputs + self.updated

    @property
    def aliases(self) -> tuple[tuple[int, int], ...]:
        """(input index, result index) of each input updated in place (jax-triton's input_output_aliases):
        after the outputs, so that the outputs' kernel arguments keep their places."""
        return tuple((self.inputs.index(name), len(self.outputs) + i) for i, name in enumerate(self.updated))

    @property
    def arg_names(self) -> tuple[str, ...]:
        """The kernel's argument names, as its signature must read."""
        arrays = tuple(f"{name}_desc" if name in self.descriptors else f"{name}_ptr"
                       for name in self.inputs + self.outputs)
        return arrays + self.constants


# The runtime parameters every attention kernel starts with: per segment of the token axis, its
# sequences and tokens; the token and head strides of q, o, do, dq and of k, v, dk, dv (in units of
# the kernel's STRIDE_ALIGN elements, see kernels.common._aligned); the distance between the segments'
# rows of offsets (0: one row shared by every segment).
ATTENTION_PARAMS = ("batch", "q_tokens", "kv_tokens", "q_token_stride", "q_head_stride", "kv_token_stride",
                    "kv_head_stride", "q_offsets_stride", "kv_offsets_stride")
# The problem as the kernels take it: heads, head dimension, lengths, the band (CAUSAL, WINDOW_LEFT,
# WINDOW_RIGHT: -1 for no bound), the score options (SOFTCAP, ALIBI) and QK_SCALE.
_SHAPE = ("KV_GROUP", "D")
_LENGTHS = ("Q_MAX_LEN", "KV_MAX_LEN")
_BAND = ("CAUSAL", "WINDOW_LEFT", "WINDOW_RIGHT")
_SCORES = ("SOFTCAP", "ALIBI", "QK_SCALE")
# Kernels over the tokens of one array (the backward preprocess, the key-major transpose).
_ARRAY_PARAMS = ("tokens", "token_stride", "head_stride")

KEY_MAJOR = KernelSpec(
    "key_major_kernel", inputs=("x", "params"), outputs=("out",), params=_ARRAY_PARAMS + ("padded",),
    constants=("D", "BLOCK_D", "BLOCK_T", "STRIDE_ALIGN", "KEY_MAJOR_ALIGN"))

ATTENTION_FWD = KernelSpec(
    "attention_fwd_kernel", inputs=("q", "k", "v", "q_offsets", "kv_offsets", "slopes", "params"),
    outputs=("o", "lse"), params=ATTENTION_PARAMS + ("fill_chunk", "slots", "v_d_stride"),
    constants=("NUM_HEADS", *_SHAPE, "BLOCK_D", *_LENGTHS, *_BAND, *_SCORES, "OUT_SCALE", "INPUT_PRECISION",
               "BLOCK_M", "BLOCK_N", "STRIDE_ALIGN", "FILL_BLOCK", "V_KEY_MAJOR", "KEY_MAJOR_ALIGN"))

# The forward with its unmasked key blocks' keys and values loaded by TMA (k_tiles, v_tiles: descriptors
# over 2-D views of k and v, beside k and v themselves for the masked blocks); token-major v, BLOCK_D = D.
ATTENTION_FWD_TMA = KernelSpec(
    "attention_fwd_tma_kernel",
    inputs=("q", "k", "v", "k_tiles", "v_tiles", "q_offsets", "kv_offsets", "slopes", "params"),
    outputs=("o", "lse"), params=ATTENTION_FWD.params,
    constants=tuple(name for name in ATTENTION_FWD.constants
                    if name not in ("BLOCK_D", "V_KEY_MAJOR", "KEY_MAJOR_ALIGN")),
    descriptors=("k_tiles", "v_tiles"))

ATTENTION_BWD_PREPROCESS = KernelSpec(
    "attention_bwd_preprocess_kernel", inputs=("o", "do", "params"), outputs=("delta",), params=_ARRAY_PARAMS,
    constants=("NUM_HEADS", "D", "BLOCK_D", "OUT_SCALE", "BLOCK_M", "STRIDE_ALIGN"))

ATTENTION_BWD = KernelSpec(
    "attention_bwd_kernel",
    inputs=("q", "k", "v", "do", "lse", "delta", "q_offsets", "kv_offsets", "q_km", "do_km", "slopes",
            "params"),
    outputs=("dq", "dk", "dv"),
    params=ATTENTION_PARAMS + ("q_fill_chunk", "kv_fill_chunk", "slots", "km_d_stride"),
    constants=("NUM_HEADS", *_SHAPE, "BLOCK_D", *_LENGTHS, *_BAND, *_SCORES, "DS_SCALE", "OUT_SCALE",
               "INPUT_PRECISION", "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N", "STRIDE_ALIGN",
               "FILL_BLOCK", "QDO_KEY_MAJOR", "KEY_MAJOR_ALIGN", "DQ_PROGRAMS", "DKDV_PROGRAMS"))

# The persistent Hopper kernels: per (sequence, head) `blocks` blocks of work, taken from a counter (an
# output the launcher zeroes) after each program's share of the zero fills, in chunks of `fill_chunk`,
# with ORDERED the sequences in the order of `order` (int32 [batch], a permutation of 0..batch-1 that the
# launcher makes: kernels/hopper/scheduler._take; the kernels index sequences by it unchecked), else in
# the offsets' order (`order` a one-element placeholder, never read).
_HOPPER_PARAMS = ATTENTION_PARAMS + ("blocks", "fill_chunk")
_HOPPER_CONSTANTS = ("BLOCK_M", "BLOCK_N", "STAGES", "STRIDE_ALIGN", "FILL_BLOCK", "CONSUMER_REGS",
                     "PRODUCER_REGS", "ORDERED")

HOPPER_FWD = KernelSpec(
    "hopper_attention_fwd_kernel",
    inputs=("q", "k", "v", "q_offsets", "kv_offsets", "order", "slopes", "params"),
    outputs=("o", "lse", "counter"), params=_HOPPER_PARAMS,
    constants=("NUM_HEADS", *_SHAPE, *_LENGTHS, *_BAND, *_SCORES, "OUT_SCALE", *_HOPPER_CONSTANTS),
    descriptors=("q", "k", "v"), zeroed=("counter",))

_HOPPER_BWD_INPUTS = ("q", "do", "k", "v", "lse", "delta", "q_offsets", "kv_offsets", "order", "slopes",
                      "params")

HOPPER_BWD_DKDV = KernelSpec(
    "hopper_attention_bwd_dkdv_kernel", inputs=_HOPPER_BWD_INPUTS, outputs=("dk", "dv", "counter"),
    params=_HOPPER_PARAMS,
    constants=("NUM_KV_HEADS", *_SHAPE, *_LENGTHS, *_BAND, *_SCORES, "DS_SCALE", "OUT_SCALE",
               *_HOPPER_CONSTANTS),
    descriptors=("q", "do", "k", "v"), zeroed=("counter",))

# dk/dv with dq fused in (kernels/hopper/dkdv.attention_bwd_dkdv_dq_kernel, its FUSED_DQ): besides dk and
# dv, dq_acc, float32 of q's shape, into which the kernel adds each tile's dq atomically; zeroed by the
# launcher, which casts it to q's dtype. A kernel of its own, not a constant of the dk/dv kernel's: the
# unfused kernel keeps its arguments, and so its PTX.
HOPPER_BWD_DKDV_DQ = KernelSpec(
    "hopper_attention_bwd_dkdv_dq_kernel", inputs=_HOPPER_BWD_INPUTS,
    outputs=("dk", "dv", "dq_acc", "counter"),
    params=_HOPPER_PARAMS, constants=HOPPER_BWD_DKDV.constants, descriptors=HOPPER_BWD_DKDV.descriptors,
    zeroed=("dq_acc", "counter"))

# The same with dq added by TMA reduce-adds from shared memory (`attention_bwd_dkdv_dq_tma_kernel`, where
# Triton's Gluon has them: 3.7 on): dq_acc, float32 [q_tokens + batch * BLOCK_M, H * D] (each sequence's
# queries padded by a query tile, which its last tile's rows past the sequence land in; dq_rows, int32
# [B], the row where each sequence's queries start), is an input passed as a TMA descriptor that the kernel
# updates in place (jax-triton makes descriptors over inputs only), zeros made by the launcher, which
# gathers the sequences' rows from it and casts them to q's dtype.
HOPPER_BWD_DKDV_DQ_TMA = KernelSpec(
    "hopper_attention_bwd_dkdv_dq_tma_kernel",
    inputs=_HOPPER_BWD_INPUTS[:-1] + ("dq_acc", "dq_rows", "params"),
    outputs=("dk", "dv", "counter"), params=_HOPPER_PARAMS, constants=HOPPER_BWD_DKDV.constants,
    descriptors=HOPPER_BWD_DKDV.descriptors + ("dq_acc",), zeroed=("counter",), updated=("dq_acc",))

HOPPER_BWD_DQ = KernelSpec(
    "hopper_attention_bwd_dq_kernel", inputs=_HOPPER_BWD_INPUTS, outputs=("dq", "counter"),
    params=_HOPPER_PARAMS,
    constants=("NUM_HEADS", *_SHAPE, *_LENGTHS, *_BAND, *_SCORES, "DS_SCALE", *_HOPPER_CONSTANTS),
    descriptors=("q", "do", "k", "v"), zeroed=("counter",))

# HSTU attention's kernels (kernels/portable/hstu.py): q, k, dq, dk have the head dimension D, v, o, do,
# dv the value dimension V. Their runtime parameters: per segment of the token axis, its sequences and
# tokens; the token and head strides of q, k, dq, dk and of v, o, do, dv (in units of STRIDE_ALIGN
# elements); the distances between the segments' rows of offsets and of num_targets (0: one row shared
# by every segment); the tokens each zero-fill program clears; the programs per (segment, sequence or
# fill, head).
HSTU_PARAMS = ("batch", "tokens", "qk_token_stride", "qk_head_stride", "v_token_stride", "v_head_stride",
               "offsets_stride", "targets_stride", "fill_chunk", "slots")
# The problem as they take it: heads, the two head dimensions, the attended length, the factors of the
# scores (ALPHA before silu; SCALE after it, or with TOKEN_SCALE one per query token, an operand) and the
# mask's options.
_HSTU_PROBLEM = ("NUM_HEADS", "D", "BLOCK_D", "V", "BLOCK_V", "MAX_LEN", "ALPHA", "SCALE", "TOKEN_SCALE",
                 "CAUSAL", "MAX_ATTN_LEN", "CONTEXT_LEN", "MIN_FULL_LEN", "HAS_TARGETS", "INPUT_PRECISION")
# After the arrays of tokens: each segment's row of offsets and of num_targets (a placeholder without
# targets), the scale of each query token (a placeholder without TOKEN_SCALE), the runtime parameters.
_HSTU_ROWS = ("offsets", "num_targets", "scale", "params")

HSTU_FWD = KernelSpec(
    "hstu_fwd_kernel", inputs=("q", "k", "v", *_HSTU_ROWS), outputs=("o",), params=HSTU_PARAMS,
    constants=(*_HSTU_PROBLEM, "BLOCK_M", "BLOCK_N", "STRIDE_ALIGN", "FILL_BLOCK"))

# dscale: the per-token scale's gradient per head, float32 [Z*T, H] (the launcher sums the heads).
HSTU_BWD = KernelSpec(
    "hstu_bwd_kernel", inputs=("q", "k", "v", "do", *_HSTU_ROWS), outputs=("dq", "dk", "dv", "dscale"),
    params=HSTU_PARAMS,
    constants=(*_HSTU_PROBLEM, "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N", "STRIDE_ALIGN",
               "FILL_BLOCK", "DQ_PROGRAMS", "DKDV_PROGRAMS"))

# HSTU's Hopper forward (kernels/hopper/hstu_forward.py), persistent as the softmax one: the portable
# forward's slots up to fill_chunk (one offsets segment: the row strides are 0), then, in the place of
# its slots, the query blocks of each (sequence, head); its constants without the padded dimensions and
# the precision (16-bit inputs, D and V the tiles' own), with the Hopper kernels'.
# The sequences are handed out as the softmax Hopper kernels' (ORDERED, `order`: _HOPPER_PARAMS).
HOPPER_HSTU_PARAMS = HSTU_PARAMS[:HSTU_PARAMS.index("slots")] + ("blocks",)
_HOPPER_HSTU_ROWS = ("offsets", "num_targets", "order", "scale", "params")

HOPPER_HSTU_FWD = KernelSpec(
    "hopper_hstu_fwd_kernel", inputs=("q", "k", "v", *_HOPPER_HSTU_ROWS), outputs=("o", "counter"),
    params=HOPPER_HSTU_PARAMS,
    constants=(*(c for c in _HSTU_PROBLEM if c not in ("BLOCK_D", "BLOCK_V", "INPUT_PRECISION")),
               *_HOPPER_CONSTANTS),
    descriptors=("q", "k", "v"), zeroed=("counter",))

# HSTU's Hopper backward (kernels/hopper/hstu_backward.py): a dk/dv kernel (blocks of 128 keys, `blocks`
# of them per (sequence, head)) and a dq kernel (blocks of 128 queries), each persistent as the forward,
# on its runtime parameters and constants; q, do (the arrays of queries) and k, v as TMA descriptors.
# dscale is HSTU_BWD's (the per-token scale's gradient per head, float32 [T, H], a one-element
# placeholder without TOKEN_SCALE), zeroed by the launcher: the dq kernel writes the attended tokens only.
_HOPPER_HSTU_BWD_INPUTS = ("q", "do", "k", "v", *_HOPPER_HSTU_ROWS)

HOPPER_HSTU_BWD_DKDV = KernelSpec(
    "hopper_hstu_bwd_dkdv_kernel", inputs=_HOPPER_HSTU_BWD_INPUTS, outputs=("dk", "dv", "counter"),
    params=HOPPER_HSTU_PARAMS, constants=HOPPER_HSTU_FWD.constants, descriptors=("q", "do", "k", "v"),
    zeroed=("counter",))

HOPPER_HSTU_BWD_DQ = KernelSpec(
    "hopper_hstu_bwd_dq_kernel", inputs=_HOPPER_HSTU_BWD_INPUTS, outputs=("dq", "dscale", "counter"),
    params=HOPPER_HSTU_PARAMS, constants=HOPPER_HSTU_FWD.constants, descriptors=("q", "do", "k", "v"),
    zeroed=("dscale", "counter"))

SPECS = (KEY_MAJOR, ATTENTION_FWD, ATTENTION_FWD_TMA, ATTENTION_BWD_PREPROCESS, ATTENTION_BWD, HOPPER_FWD,
         HOPPER_BWD_DKDV, HOPPER_BWD_DKDV_DQ, HOPPER_BWD_DKDV_DQ_TMA, HOPPER_BWD_DQ, HSTU_FWD, HSTU_BWD,
         HOPPER_HSTU_FWD, HOPPER_HSTU_BWD_DKDV, HOPPER_HSTU_BWD_DQ)
