"""The kernel-level forward and backward of both ops, with their batching and partitioning rules.

Every implementation runs through `forward` and `backward` here, below each op's one custom_vjp. An op
declares its operands once, by kind (`Signature`: SOFTMAX, HSTU); the rules follow from the kinds:

- `jax.custom_batching.custom_vmap` folds a vmapped axis into the problem, so that vmap costs one
  launch: into the heads for "HTD" with shared offsets (a free reshape), otherwise into the segments
  of the token axis, each with its own row of offsets (and of every per-sequence or per-token operand).
- `jax.experimental.custom_partitioning` runs each device's heads, or each device's segments
  (data parallel: offsets [shards, B+1]), locally under a sharded `jax.jit`, with no collective; any
  other sharding raises an error that says what is supported.
- The folded and the local problems are chosen for again (select.replan): an implementation runs only
  problems it supports.
- Outputs are marked varying over the manual axes their inputs vary over, so that the ops compose
  with `shard_map` and its default `check_vma=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import select
from ._compat import varying_axes
from .jagged import explicit_mesh
from .problem import HstuProblem
from .select import Plan

# ---------------------------------------------------------------------------------------------------
# The ops' operands, by kind
# ---------------------------------------------------------------------------------------------------

# Kinds. Arrays laid out like q (the query side's tokens and heads) or k (the key side's): "q" and "k"
# with the head dimension D, "o" and "v" with the value dimension. Per sequence: "offsets" and
# "kv_offsets" [rows, B+1], "targets" [rows, B] (rows of the query side's). Per query: "stats"
# [Z, H, T] float32; "tokens" [Z*T] (no heads). Per head: "slopes" [Z, H].
ARRAYS = {"q": ("q", "d"), "o": ("q", "e"), "k": ("kv", "d"), "v": ("kv", "e")}
ROWS = {"offsets": "q", "targets": "q", "kv_offsets": "kv"}


@dataclasses.dataclass(frozen=True)
class Operand:
    name: str
    kind: str
    # Present for problems where this holds (None: always); "caller": where the caller passes it.
    when: Callable | str | None = None

    def present(self, p, given: frozenset) -> bool:
        if self.when == "caller":
            return self.name in given
        return self.when is None or bool(self.when(p))


@dataclasses.dataclass(frozen=True)
class Signature:
    """An op's kernel-level forward and backward: their operands and results, in the implementations'
    argument order (absent optional ones passed as None, absent results returned as None)."""

    name: str
    forward_in: tuple[Operand, ...]
    forward_out: tuple[Operand, ...]
    backward_in: tuple[Operand, ...]
    backward_out: tuple[Operand, ...]


SOFTMAX = Signature(
    "softmax",
    forward_in=(Operand("q", "q"), Operand("k", "k"), Operand("v", "v"), Operand("q_offsets", "offsets"),
                Operand("kv_offsets", "kv_offsets"), Operand("slopes", "slopes", lambda p: p.alibi)),
    forward_out=(Operand("o", "o"), Operand("lse", "stats")),
    backward_in=(Operand("q", "q"), Operand("k", "k"), Operand("v", "v"), Operand("q_offsets", "offsets"),
                 Operand("kv_offsets", "kv_offsets"), Operand("o", "o"), Operand("lse", "stats"),
                 Operand("do", "o"), Operand("slopes", "slopes", lambda p: p.alibi),
                 Operand("dlse", "stats", "caller")),
    backward_out=(Operand("dq", "q"), Operand("dk", "k"), Operand("dv", "v")))

_has_scale = lambda p: p.scale is None  # noqa: E731 (HSTU's per-token factor, an operand)
HSTU = Signature(
    "hstu",
    forward_in=(Operand("q", "q"), Operand("k", "k"), Operand("v", "v"), Operand("offsets", "offsets"),
                Operand("num_targets", "targets", lambda p: p.has_targets),
                Operand("scale", "tokens", _has_scale)),
    forward_out=(Operand("o", "o"),),
    backward_in=(Operand("q", "q"), Operand("k", "k"), Operand("v", "v"), Operand("offsets", "offsets"),
                 Operand("num_targets", "targets", lambda p: p.has_targets),
                 Operand("scale", "tokens", _has_scale), Operand("do", "o")),
    backward_out=(Operand("dq", "q"), Operand("dk", "k"), Operand("dv", "v"),
                  Operand("dscale", "stats", _has_scale)))  # per head: summed over them by the op


def _side(p, side: str) -> tuple[int, int, int]:
    """(heads, tokens per segment, offsets rows) of the query side ("q") or the key side ("kv")."""
    if isinstance(p, HstuProblem):
        return p.num_heads, p.tokens, p.offsets_rows
    if side == "q":
        return p.num_heads, p.q_tokens, p.q_offsets_rows
    return p.num_kv_heads, p.kv_tokens, p.kv_offsets_rows


def _resized(p, heads: int = 1, segments: int | None = None, rows: dict | None = None, divide: bool = False):
    """p with its heads (query and kv) multiplied (or, `divide`, divided) by `heads`, `segments` segments
    and the offsets rows of `rows` ({"q": n, "kv": n})."""
    scale = (lambda n: n // heads) if divide else (lambda n: n * heads)
    changes = dict(num_heads=scale(p.num_heads))
    if segments is not None:
        changes["num_segments"] = segments
    rows = rows or {}
    if isinstance(p, HstuProblem):
        if "q" in rows:
            changes["offsets_rows"] = rows["q"]
    else:
        changes["num_kv_heads"] = scale(p.num_kv_heads)
        changes.update({f"{side}_offsets_rows": n for side, n in rows.items()})
    return p.with_(**changes)


# ---------------------------------------------------------------------------------------------------
# Running one problem on its implementation
# ---------------------------------------------------------------------------------------------------


def _varying_like(outputs, inputs):
    """Mark outputs varying over every manual mesh axis some input varies over (shard_map's check_vma)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs))
    return tuple(jax.lax.pcast(out, tuple(sorted(axes - varying_axes(out))), to="varying")
                 for out in outputs)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One kernel-level call: the op's signature, the pass, and which optional operands are given (the
    cache key of its programs, with the problem and the plan)."""

    signature: Signature
    backward: bool
    given: frozenset = frozenset()

    def inputs(self, p) -> tuple[Operand, ...]:
        operands = self.signature.backward_in if self.backward else self.signature.forward_in
        return tuple(o for o in operands if o.present(p, self.given))

    def outputs(self, p) -> tuple[Operand, ...]:
        operands = self.signature.backward_out if self.backward else self.signature.forward_out
        return tuple(o for o in operands if o.present(p, self.given))


def _run(call: _Call, p, plan: Plan, *operands):
    given = dict(zip((o.name for o in call.inputs(p)), operands))
    every = call.signature.backward_in if call.backward else call.signature.forward_in
    args = [given.get(o.name) for o in every]
    if call.backward:
        results = plan.backward.backward(p, plan.backward_config, *args)
    else:
        results = plan.forward.forward(p, plan.forward_config, *args)
    every_out = call.signature.backward_out if call.backward else call.signature.forward_out
    present = {o.name for o in call.outputs(p)}
    results = tuple(r for o, r in zip(every_out, results) if o.name in present)
    return _varying_like(results, operands)


# ---------------------------------------------------------------------------------------------------
# Partitioning: heads and segments stay where they are
# ---------------------------------------------------------------------------------------------------


def _axes(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def _dims(p):
    """(token dim, head dim) of q/k/v-like arrays."""
    return (0, 1) if p.layout == "THD" else (1, 0)


def _sharding_rule(call: _Call, p):
    """Shardy rule: the token axis is (segments, tokens), the query heads are (kv heads, group).

    Factors that appear as a whole dimension somewhere (z and t in the statistics) get their size
    from there; factors of size 1 cannot be part of a compound, so they are left out.
    """
    heads, _, _ = _side(p, "q")
    kv_heads, _, _ = _side(p, "kv")
    group = heads // kv_heads
    z = p.num_segments > 1
    sizes = {}
    tokens = {"q": "(z t)" if z else "t", "kv": "(z s)" if z else "s"}
    if z:
        sizes["s"] = _side(p, "kv")[1]
    q_heads = "(g r)" if group > 1 else "g"
    if group > 1:
        sizes["r"] = group
    head_factor = {"q": q_heads, "kv": "g"}
    batch = {"offsets": "b", "kv_offsets": "b", "targets": "c"}

    def factors(i: int, operand: Operand) -> str:
        kind = operand.kind
        if kind in ARRAYS:
            side, dim = ARRAYS[kind]
            parts = (tokens[side], head_factor[side], dim)
            return " ".join(parts if p.layout == "THD" else (parts[1], parts[0], parts[2]))
        if kind in ROWS:
            rows = _side(p, ROWS[kind])[2]
            return f"{'z' if rows > 1 else f'o{i}'} {batch[kind]}"
        if kind == "stats":
            return f"{'z' if z else 'y'} {q_heads} t"
        if kind == "slopes":
            return f"{'z' if z else 'y'} {q_heads}"
        return tokens["q"]  # "tokens"

    operands = [factors(i, o) for i, o in enumerate(call.inputs(p))]
    results = [factors(len(operands) + i, o) for i, o in enumerate(call.outputs(p))]
    if z and not any(o.kind == "stats" for o in call.inputs(p) + call.outputs(p)):
        sizes["t"] = _side(p, "q")[1]  # no statistic gives it as a whole dimension
    return f"{', '.join(operands)} -> {', '.join(results)}", sizes


class _Sharding:
    """How a problem is split over the mesh: its heads over `head_axes`, its segments over
    `segment_axes`. Built from the shardings XLA proposes; raises ValueError for anything else."""

    def __init__(self, call: _Call, p, plan: Plan, mesh, arg_shapes):
        token_dim, head_dim = _dims(p)
        inputs = call.inputs(p)
        shapes = dict(zip((o.name for o in inputs), arg_shapes))

        def spec(name: str, rank: int) -> tuple[tuple[str, ...], ...]:
            # A mesh axis of size 1 splits nothing: it counts as replicated.
            entries = tuple(shapes[name].sharding.spec) + (None,) * rank
            return tuple(tuple(a for a in _axes(e) if mesh.shape[a] > 1) for e in entries[:rank])

        specs = {o.name: spec(o.name, 3) for o in inputs if o.kind in ARRAYS}
        head_axes = next((s[head_dim] for s in specs.values() if s[head_dim]), ())
        segment_axes = next((s[token_dim] for s in specs.values() if s[token_dim]), ())
        for name, axes in specs.items():
            if axes[2]:
                raise ValueError(f"jagged attention cannot split the head dimension D: {name} is sharded "
                                 f"{P(*axes)}; shard the heads axis or the token axis instead")
            for dim, target, what in ((head_dim, head_axes, "heads"), (token_dim, segment_axes, "tokens")):
                if axes[dim] not in ((), target):
                    raise ValueError(f"jagged attention needs q, k, v (and o, do) split alike: {name} is "
                                     f"sharded {P(*axes)} where another array splits the {what} axis "
                                     f"over {target}")
        self.head_shards = math.prod(mesh.shape[a] for a in head_axes)
        self.segment_shards = math.prod(mesh.shape[a] for a in segment_axes)
        kv_heads = _side(p, "kv")[0]
        if kv_heads % self.head_shards:
            raise ValueError(f"sharding the heads over {head_axes} ({self.head_shards} shards) needs the "
                             f"number of kv heads ({kv_heads}) to be a multiple of {self.head_shards}")
        if p.num_segments % self.segment_shards:
            raise ValueError(
                f"q, k, v are sharded along their token axis over {segment_axes} ({self.segment_shards} "
                f"shards), but the tokens are not split into that many independent segments: sequences "
                f"cannot be cut between devices. Shard the heads axis, or pack each device's sequences "
                f"with jagged_flash_jax.pack_data_parallel (offsets [devices, B+1]) and shard that")
        for operand in inputs:
            if operand.kind in ROWS:
                axes = spec(operand.name, 2)
                rows = _side(p, ROWS[operand.kind])[2]
                if axes[1] or (axes[0] and (rows == 1 or axes[0] != segment_axes)):
                    raise ValueError(f"{operand.name} [{rows}, ...] must be replicated, or split along its "
                                     f"first axis exactly as the tokens of q, k, v are; got {P(*axes)}")
            elif operand.kind == "tokens":
                (axes,) = spec(operand.name, 1)
                if axes not in ((), segment_axes):
                    raise ValueError(f"{operand.name} [tokens] must be replicated, or split as the tokens of "
                                     f"q, k, v are; got {P(axes)}")
        if "interpret" in plan.names and self.head_shards * self.segment_shards > 1:
            # The interpreter is a Python callback, and JAX cannot call one from a partitioned
            # custom_partitioning body (https://github.com/jax-ml/jax/issues/34349): it would crash.
            raise ValueError("backend='interpret' cannot be partitioned by a sharded jax.jit; run it under "
                             "jax.shard_map (or use backend='xla' or 'triton')")
        self.mesh, self.head_axes, self.segment_axes = mesh, head_axes, segment_axes
        self.layout = p.layout

    def sharding(self, operand: Operand, p) -> NamedSharding:
        heads = self.head_axes or None
        segments = self.segment_axes or None
        kind = operand.kind
        if kind in ARRAYS:
            spec = P(segments, heads, None) if self.layout == "THD" else P(heads, segments, None)
        elif kind in ROWS:
            spec = P(None, None) if _side(p, ROWS[kind])[2] == 1 else P(segments, None)
        elif kind == "stats":
            spec = P(segments, heads, None)
        elif kind == "slopes":
            spec = P(segments, heads)
        else:  # "tokens"
            spec = P(segments)
        return NamedSharding(self.mesh, spec)

    def local(self, p):
        z = p.num_segments // self.segment_shards
        rows = {side: 1 if _side(p, side)[2] == 1 else z for side in ("q", "kv")}
        return _resized(p, self.head_shards, z, rows, divide=True)


def _partitioned(call: _Call, p, plan: Plan):
    @custom_partitioning
    def run(*args):
        return _run(call, p, plan, *args)

    def partition(mesh, arg_shapes, result_shape):
        sharding = _Sharding(call, p, plan, mesh, arg_shapes)
        arg_shardings = tuple(sharding.sharding(o, p) for o in call.inputs(p))
        result_shardings = tuple(sharding.sharding(o, p) for o in call.outputs(p))
        local = sharding.local(p)
        # Each device's problem is chosen for again: its implementations must support it.
        run_local = functools.partial(_run, call, local, select.replan(plan, local))
        return mesh, run_local, result_shardings, arg_shardings

    run.def_partition(partition=partition, sharding_rule=lambda *_: _sharding_rule(call, p))
    return run


# ---------------------------------------------------------------------------------------------------
# Batching: fold the vmapped axis into heads or segments
# ---------------------------------------------------------------------------------------------------


def _broadcast(x, batched: bool, size: int):
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


class _Fold:
    """How a vmapped axis of size `size` joins the problem, and each kind's reshapes both ways: into the
    heads for "HTD" when nothing per sequence or per token is batched (a free reshape), else into the
    segments."""

    def __init__(self, call: _Call, p, size: int, batched: dict):
        self.p, self.size = p, size
        # Into the heads, a per-token result would sum every vmapped element's: segments keep them apart.
        per_row = any(batched[o.name] for o in call.inputs(p) if o.kind in ROWS or o.kind == "tokens")
        per_row |= any(o.kind == "tokens" for o in call.outputs(p))
        self.into_heads = p.layout == "HTD" and not per_row
        if self.into_heads:
            self.problem = _resized(p, size)
        else:
            rows = {}
            for o in call.inputs(p):
                if o.kind in ROWS and (batched[o.name] or _side(p, ROWS[o.kind])[2] > 1):
                    rows[ROWS[o.kind]] = size * p.num_segments
            self.problem = _resized(p, segments=size * p.num_segments, rows=rows)

    def fold(self, operand: Operand, x, batched: bool):
        """[V, ...] -> the folded problem's operand (HTD segments need a transpose: a copy)."""
        kind = operand.kind
        if kind in ARRAYS:
            x = _broadcast(x, batched, self.size)
            if self.into_heads or self.p.layout == "THD":
                return x.reshape(-1, *x.shape[2:])
            x = jnp.moveaxis(x, 0, 1)
            return x.reshape(x.shape[0], -1, x.shape[-1])
        if kind in ROWS:  # [V, rows, n] -> [1 or V*Z, n]
            rows = _side(self.p, ROWS[kind])[2]
            if self.into_heads or (not batched and rows == 1):
                return x
            x = _broadcast(x, batched, self.size)
            x = jnp.broadcast_to(x, (self.size, self.p.num_segments, x.shape[-1]))
            return x.reshape(-1, x.shape[-1])
        if kind in ("stats", "slopes"):  # [V, Z, H, ...] -> [Z, V*H, ...] or [V*Z, H, ...]
            x = _broadcast(x, batched, self.size)
            x = x if kind == "stats" else x[..., None]
            if self.into_heads:
                x = jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
            else:
                x = x.reshape(-1, *x.shape[2:])
            return x if kind == "stats" else x[..., 0]
        if self.into_heads:  # "tokens", unbatched (see __init__)
            return x
        return _broadcast(x, batched, self.size).reshape(-1)

    def unfold(self, operand: Operand, x):
        kind = operand.kind
        if kind in ARRAYS:
            if self.into_heads or self.p.layout == "THD":
                return x.reshape(self.size, -1, *x.shape[1:])
            x = x.reshape(x.shape[0], self.size, -1, x.shape[-1])
            return jnp.moveaxis(x, 1, 0)
        if kind == "stats":
            if self.into_heads:
                return jnp.moveaxis(x.reshape(x.shape[0], self.size, -1, x.shape[-1]), 1, 0)
            return x.reshape(self.size, -1, *x.shape[1:])
        return x.reshape(self.size, -1)  # "tokens" (folded into segments, see __init__)


# The most problems whose jitted programs are kept (each holds its compiled executables once called
# eagerly): an eager loop over batches of ever new token counts does not grow memory without bound.
PROGRAMS_KEPT = 256


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def _program(call: _Call, p, plan: Plan):
    """The jitted program of one call of one problem on its plan: vmap folds into one launch, sharded
    jit runs each device's part."""
    partitioned = _partitioned(call, p, plan)

    @custom_vmap
    def run(*args):
        return partitioned(*args)

    @run.def_vmap
    def rule(size, batched, *args):
        inputs = call.inputs(p)
        batched = dict(zip((o.name for o in inputs), batched))
        fold = _Fold(call, p, size, batched)
        folded = [fold.fold(o, x, batched[o.name]) for o, x in zip(inputs, args)]
        # The folded problem is chosen for again: its implementations must support it.
        results = _program(call, fold.problem, select.replan(plan, fold.problem))(*folded)
        outputs = call.outputs(p)
        return tuple(fold.unfold(o, r) for o, r in zip(outputs, results)), (True,) * len(outputs)

    # Jitted, one function per problem (this cache): called eagerly, the ops would run one by one, and
    # the xla implementation's lax.scan would be compiled again at every call (its body is a new closure).
    return jax.jit(run)


def clear_programs() -> None:
    """Forget the per-problem programs: the next call of each problem is traced again. For tests and
    probes that change what a trace reads (a tile table, say)."""
    _program.cache_clear()


def _with_auto_axes(call: _Call, p, plan: Plan, fn, args):
    """Run `fn` with explicit mesh axes turned into auto ones (custom_partitioning works with those),
    checking the shardings at trace time, and give results the shardings of their kind."""
    mesh = explicit_mesh(args[0])
    if mesh is None:
        return fn(*args)
    sharding = _Sharding(call, p, plan, mesh, [jax.typeof(x) for x in args])
    # An array result takes the (explicit) sharding of the first input of its kind (dq q's, dk k's), or of
    # q or k (the forward's o).
    typed = {o.kind: jax.typeof(x).sharding for o, x in reversed(tuple(zip(call.inputs(p), args)))}

    def result(o: Operand):
        if o.kind not in ARRAYS:
            return sharding.sharding(o, p)
        return typed.get(o.kind) or typed["q" if ARRAYS[o.kind][0] == "q" else "k"]

    out = tuple(result(o) for o in call.outputs(p))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, out_sharding=out)(*args)


def _apply(signature: Signature, backward: bool, p, plan: Plan, operands: dict) -> tuple:
    given = frozenset(name for name, x in operands.items() if x is not None)
    call = _Call(signature, backward, given)
    args = tuple(operands[o.name] for o in call.inputs(p))
    results = iter(_with_auto_axes(call, p, plan, _program(call, p, plan), args))
    every = signature.backward_out if backward else signature.forward_out
    return tuple(next(results) if o.present(p, given) else None for o in every)


def forward(signature: Signature, p, plan: Plan, **operands) -> tuple:
    """The op's kernel-level forward on the plan's implementation: its results in the signature's order
    (None for an absent one). The softmax op's: o and the float32 log-sum-exp [Z, H, T_q] (in units of
    the unscaled scores, +inf without keys); HSTU's: o."""
    return _apply(signature, False, p, plan, operands)


def backward(signature: Signature, p, plan: Plan, **operands) -> tuple:
    """The op's kernel-level backward on the plan's implementation: the gradients of its inputs in the
    signature's order (None for an absent one). An optional operand given as None is absent (the
    softmax op's dlse where the caller's loss does not read the log-sum-exp)."""
    return _apply(signature, True, p, plan, operands)
