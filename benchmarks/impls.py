"""The implementations compared. For a case, each makes `attend(q, k, v, *aux)` and `prepare(InputSet) ->
(q, k, v, do, aux)`, which puts the inputs in the form attend takes (cudnn-padded pads there, untimed).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp

from jagged_flash_jax import jagged_attention, jagged_to_padded, multi_head_jagged_flash_attention

from .cases import Case, InputSet


class Unsupported(Exception):
    """The implementation cannot run this case (recorded with status "unsupported")."""


def _scale(case: Case) -> float:
    return 1.0 if case.fbgemm else 1.0 / math.sqrt(case.head_dim)


def _finish(case: Case, out):
    return out / case.max_seq_len if case.fbgemm else out


def _options(case: Case) -> dict:
    """The case's window= and softcap=, only when set, so that the suite runs on a package without them."""
    options = {k: v for k, v in (("window", case.window), ("softcap", case.softcap)) if v is not None}
    missing = set(options) - set(inspect.signature(jagged_attention).parameters)
    if missing:
        raise Unsupported(f"this jagged_flash_jax's jagged_attention takes no {', '.join(sorted(missing))}=")
    return options


def _packed(s: InputSet) -> tuple:
    return s.q, s.k, s.v, s.do, (s.offsets, s.kv_offsets)


def jfa(case: Case, backend: str, block_sizes=None, allow_tf32: bool = True, backward_implementation=None,
        deterministic: bool = True, implementation=None):
    """This library; the fbgemm cases through multi_head_jagged_flash_attention. `implementation`, where
    given, replaces `backend` (its candidates: `select.request`)."""
    options = {} if case.fbgemm else _options(case)
    if backward_implementation is not None:
        options["backward_implementation"] = backward_implementation
    if implementation is not None:
        options["implementation"], backend = implementation, "auto"
    if not deterministic:
        options["deterministic"] = False

    def attend(q, k, v, offsets, kv_offsets):
        if case.fbgemm:
            return multi_head_jagged_flash_attention(q, k, v, offsets, case.max_seq_len, layout="THD",
                                                     backend=backend, block_sizes=block_sizes,
                                                     allow_tf32=allow_tf32, **options)
        return jagged_attention(q, k, v, offsets, case.max_seq_len, kv_offsets=kv_offsets,
                                kv_max_seq_len=case.kv_max_seq_len, causal=case.causal, **options,
                                backend=backend, block_sizes=block_sizes, allow_tf32=allow_tf32)
    return attend, _packed


def _cudnn_mask(case: Case) -> tuple[bool, int | None]:
    """(causal, left window) for cuDNN, which bounds windows on the left of a causal mask only and has no
    softcap. Window (w, 0) is causal with w keys on the left, as jagged_attention's."""
    if case.softcap is not None:
        raise Unsupported("cuDNN attention through JAX has no softcap")
    left, right = case.window or (None, None)
    if left is None and right is None:
        return case.causal, None
    if not (case.causal or right == 0):
        raise Unsupported(f"cuDNN bounds windows on the left of a causal mask only, not window={case.window}")
    return True, left


def cudnn_padded(case: Case):
    """jax.nn.dot_product_attention(implementation="cudnn") on [B, L, H, D] inputs padded beforehand (D
    padded with zeros to a multiple of 8, which changes no result)."""
    causal, left = _cudnn_mask(case)

    def pad(x, offsets, length):
        x = jagged_to_padded(x, offsets, length, layout="THD")
        return jnp.pad(x, [(0, 0)] * 3 + [(0, -case.head_dim % 8)])

    def prepare(s):
        return (pad(s.q, s.offsets, case.max_seq_len), pad(s.k, s.kv_offsets, case.kv_max_seq_len),
                pad(s.v, s.kv_offsets, case.kv_max_seq_len), pad(s.do, s.offsets, case.max_seq_len),
                (s.lengths, s.kv_lengths))

    def attend(q, k, v, lengths, kv_lengths):
        return _finish(case, jax.nn.dot_product_attention(
            q, k, v, scale=_scale(case), is_causal=causal, query_seq_lengths=lengths,
            key_value_seq_lengths=kv_lengths, local_window_size=None if left is None else (left, 0),
            implementation="cudnn"))
    return attend, jax.jit(prepare)


def cudnn_packed(case: Case):
    """JAX's cuDNN fused attention on the same packed [T, H, D] data, through its private API (with one
    row that no sequence covers added to an odd token count: cuDNN's backward takes even ones only)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except Exception as err:  # a private module: it may move or go
        raise Unsupported(f"jax._src.cudnn.fused_attention_stablehlo is unavailable: {err!r}") from err
    if case.head_dim % 8:
        raise Unsupported(f"cuDNN needs D % 8 == 0, got D={case.head_dim}")
    causal, left = _cudnn_mask(case)
    window = {} if left is None else dict(sliding_window_length=left + 1)  # keys (i - length, i]

    def attend(q, k, v, offsets, kv_offsets, lengths, kv_lengths):
        out = dot_product_attention(
            q[None], k[None], v[None], q_seqlen=lengths[None], kv_seqlen=kv_lengths[None],
            q_offsets=offsets[None], kv_offsets=kv_offsets[None], scale=_scale(case),
            mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, **window)
        return _finish(case, out[0])

    def prepare(s):
        q, k, v, do = (jnp.pad(x, [(0, x.shape[0] % 2), (0, 0), (0, 0)]) for x in (s.q, s.k, s.v, s.do))
        return q, k, v, do, (s.offsets, s.kv_offsets, s.lengths, s.kv_lengths)
    return attend, prepare


def _portable(**settings):
    """The portable kernels (GPU) with other settings (implementations.Portable's fields)."""
    return _implementation("portable", **settings)


def _implementation(name: str, **settings):
    """Implementation `name` with other settings (its class's fields)."""
    import dataclasses

    from jagged_flash_jax.implementations import IMPLEMENTATIONS

    return dataclasses.replace(IMPLEMENTATIONS[name], **settings)


def _hopper_ordered(case: Case, longest_first: bool):
    """The Hopper kernels, forward and backward, wherever they run (else portable, else xla), taking the
    sequences longest first or in the offsets' order."""
    chosen = (_implementation("hopper", longest_first=longest_first), "portable", "xla")
    return jfa(case, "triton", implementation=chosen, backward_implementation=chosen)


IMPLS = {  # name -> (make(case), needs a GPU)
    "jfa-triton": (lambda case: jfa(case, "triton"), True),
    # deterministic=False: what auto then runs (the dq-fused backward where it measured faster)
    "jfa-triton-nondeterministic": (lambda case: jfa(case, "triton", deterministic=False), True),
    # the Hopper backward with dq fused into dk/dv (float32 adds: TMA reduce-adds under triton >= 3.7,
    # atomics under 3.6), where it runs
    "jfa-triton-fused-dq": (lambda case: jfa(case, "triton", backward_implementation=(
        "hopper-fused-dq", "portable", "xla")), True),
    # the Hopper backward wherever it runs, where auto would take the portable one too (D = 64, short rows)
    "jfa-triton-hopper-bwd": (lambda case: jfa(case, "triton", backward_implementation=(
        "hopper", "portable", "xla")), True),
    # the portable backward, where auto takes the Hopper one (to compare the two)
    "jfa-triton-portable-bwd": (lambda case: jfa(case, "triton", backward_implementation=("portable", "xla")),
                                True),
    # the portable kernels, the forward's key blocks loaded by pointers (cp.async) and its unmasked ones
    # by TMA (what Hopper GPUs take under triton >= 3.7), whatever the Triton: their forward rows compare
    # the two loads (auto takes the portable forward at D = 64 and on sequences up to 1024 tokens)
    "jfa-triton-pointer-loads": (lambda case: jfa(case, "triton", implementation=_portable(tma_loads=False)),
                                 True),
    "jfa-triton-tma-loads": (lambda case: jfa(case, "triton", implementation=_portable(tma_loads=True)),
                             True),
    # the Hopper kernels wherever they run, the sequences with the most work first or in the offsets'
    # order (auto's; implementations.Hopper's longest_first): the scheduler's order compared
    "jfa-triton-hopper-longest-first": (lambda case: _hopper_ordered(case, True), True),
    "jfa-triton-hopper-given-order": (lambda case: _hopper_ordered(case, False), True),
    "jfa-xla": (lambda case: jfa(case, "xla"), False),
    "cudnn-packed": (cudnn_packed, True),
    "cudnn-padded": (cudnn_padded, True),
}


def timed_function(attend, mode: str):
    """The function timed: the output (fwd), or jax.vjp's (dq, dk, dv) for the cotangent do (fwd+bwd)."""
    if mode == "fwd":
        return lambda q, k, v, aux: attend(q, k, v, *aux)

    def step(q, k, v, aux, do):
        return jax.vjp(lambda q, k, v: attend(q, k, v, *aux), q, k, v)[1](do)
    return step


def arguments(prepared: tuple, mode: str) -> tuple:
    q, k, v, do, aux = prepared
    return (q, k, v, aux) if mode == "fwd" else (q, k, v, aux, do)
