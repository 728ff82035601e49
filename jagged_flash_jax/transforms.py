"""The kernel-level forward and backward, with their batching and partitioning rules.

Every backend runs through `forward` and `backward` here, below the one custom_vjp of api.py:

- `jax.custom_batching.custom_vmap` folds a vmapped axis into the problem, so that vmap costs one
  launch: into the heads for "HTD" with shared offsets (a free reshape), otherwise into the segments
  of the token axis, each with its own row of offsets.
- ALiBi slopes, when given, are one more operand [Z, H] (float32, a row per segment): vmap folds them
  with the heads or the segments, and partitioning splits them as the heads and segments.
- `jax.experimental.custom_partitioning` runs each device's heads, or each device's segments
  (data parallel: offsets [shards, B+1]), locally under a sharded `jax.jit`, with no collective; any
  other sharding raises an error that says what is supported.
- Outputs are marked varying over the manual axes their inputs vary over, so that the op composes
  with `shard_map` and its default `check_vma=True`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import select
from ._compat import varying_axes
from .jagged import explicit_mesh
from .problem import Problem
from .select import Plan


class ForwardArgs(NamedTuple):
    """The operands of `forward`, in order (and their batched flags under vmap, their shardings)."""

    q: object
    k: object
    v: object
    q_offsets: object
    kv_offsets: object
    slopes: object = None  # ALiBi's [Z, H], only when the problem has ALiBi (Problem.alibi)


class BackwardArgs(NamedTuple):
    """The operands of `backward`: the forward's, its residuals o and lse, the output gradient, and the
    log-sum-exp's gradient (None, and no operand at all, when the caller does not use it)."""

    q: object
    k: object
    v: object
    q_offsets: object
    kv_offsets: object
    o: object
    lse: object
    do: object
    slopes: object = None
    dlse: object = None


# Operands laid out like q, k, v (tokens and heads axes), and the offsets, by name.
_ARRAYS = ("q", "k", "v", "o", "do")
_OFFSETS = (("q_offsets", "offsets"), ("kv_offsets", "kv_offsets"))

# ---------------------------------------------------------------------------------------------------
# Running one problem on its backend
# ---------------------------------------------------------------------------------------------------


def _varying_like(outputs, inputs):
    """Mark outputs varying over every manual mesh axis some input varies over (shard_map's check_vma)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs))
    return tuple(jax.lax.pcast(out, tuple(sorted(axes - varying_axes(out))), to="varying")
                 for out in outputs)


def _fields(kind, p: Problem, with_dlse: bool = False) -> tuple[str, ...]:
    """The fields of ForwardArgs or BackwardArgs that a call passes as operands, in order: ALiBi's
    slopes only with ALiBi, and the log-sum-exp's gradient only when the caller uses it."""
    return tuple(f for f in kind._fields if (f != "slopes" or p.alibi) and (f != "dlse" or with_dlse))


def _operands(args, p: Problem, with_dlse: bool = False) -> tuple:
    """ForwardArgs or BackwardArgs as the operands of a call (see `_fields`)."""
    return tuple(getattr(args, f) for f in _fields(type(args), p, with_dlse))


def _unpack(kind, p: Problem, operands, with_dlse: bool = False):
    """The operands of a call (or their batched flags) as ForwardArgs or BackwardArgs."""
    return kind(**dict(zip(_fields(kind, p, with_dlse), operands)))


def _run_forward(p: Problem, plan: Plan, *operands):
    args = _unpack(ForwardArgs, p, operands)
    outputs = plan.forward.forward(p, plan.forward_config, *args)
    return _varying_like(outputs, operands)


def _run_backward(p: Problem, plan: Plan, *operands, with_dlse: bool = False):
    args = _unpack(BackwardArgs, p, operands, with_dlse)
    outputs = plan.backward.backward(p, plan.backward_config, *args)
    return _varying_like(outputs, operands)


# ---------------------------------------------------------------------------------------------------
# Partitioning: heads and segments stay where they are
# ---------------------------------------------------------------------------------------------------


def _axes(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def _dims(p: Problem):
    """(token dim, head dim) of q/k/v-like arrays."""
    return (0, 1) if p.layout == "THD" else (1, 0)


def _sharding_rule(p: Problem, backward: bool, with_dlse: bool = False):
    """Shardy rule: the token axis is (segments, tokens), the query heads are (kv heads, group).

    Factors that appear as a whole dimension somewhere (z and t in the statistics) get their size
    from there; factors of size 1 cannot be part of a compound, so they are left out.
    """
    group = p.num_heads // p.num_kv_heads
    z = p.num_segments > 1
    sizes = {}
    q_tokens, kv_tokens = ("(z t)", "(z s)") if z else ("t", "s")
    if z:
        sizes["s"] = p.kv_tokens
    q_heads = "(g r)" if group > 1 else "g"
    if group > 1:
        sizes["r"] = group

    def array(tokens, heads):
        return f"{tokens} {heads} d" if p.layout == "THD" else f"{heads} {tokens} d"

    q_like, kv_like = array(q_tokens, q_heads), array(kv_tokens, "g")
    offsets = [("z b" if rows > 1 else f"o{i} b") for i, rows in
               enumerate((p.q_offsets_rows, p.kv_offsets_rows))]
    stats = f"{'z' if z else 'y'} {q_heads} t"
    slopes = [f"{'z' if z else 'y'} {q_heads}"] if p.alibi else []
    if backward:
        operands = [q_like, kv_like, kv_like, *offsets, q_like, stats, q_like, *slopes] + [stats] * with_dlse
        results = [q_like, kv_like, kv_like]
    else:
        operands = [q_like, kv_like, kv_like, *offsets, *slopes]
        results = [q_like, stats]
    return f"{', '.join(operands)} -> {', '.join(results)}", sizes


class _Sharding:
    """How a problem is split over the mesh: its heads over `head_axes`, its segments over
    `segment_axes`. Built from the shardings XLA proposes; raises ValueError for anything else."""

    def __init__(self, p: Problem, plan: Plan, mesh, arg_shapes, backward: bool):
        token_dim, head_dim = _dims(p)
        shapes = (BackwardArgs if backward else ForwardArgs)(*arg_shapes)._asdict()

        def spec(name: str, rank: int) -> tuple[tuple[str, ...], ...]:
            # A mesh axis of size 1 splits nothing: it counts as replicated.
            entries = tuple(shapes[name].sharding.spec) + (None,) * rank
            return tuple(tuple(a for a in _axes(e) if mesh.shape[a] > 1) for e in entries[:rank])

        specs = {name: spec(name, 3) for name in _ARRAYS if name in shapes}
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
        if p.num_kv_heads % self.head_shards:
            raise ValueError(f"sharding the heads over {head_axes} ({self.head_shards} shards) needs the "
                             f"number of kv heads ({p.num_kv_heads}) to be a multiple of {self.head_shards}")
        if p.num_segments % self.segment_shards:
            raise ValueError(
                f"q, k, v are sharded along their token axis over {segment_axes} ({self.segment_shards} "
                f"shards), but the tokens are not split into that many independent segments: sequences "
                f"cannot be cut between devices. Shard the heads axis, or pack each device's sequences "
                f"with jagged_flash_jax.pack_data_parallel (offsets [devices, B+1]) and shard that")
        for operand, name in _OFFSETS:
            axes = spec(operand, 2)
            rows = p.q_offsets_rows if operand == "q_offsets" else p.kv_offsets_rows
            if axes[1] or (axes[0] and (rows == 1 or axes[0] != segment_axes)):
                raise ValueError(f"{name} [{rows}, B+1] must be replicated, or split along its first axis "
                                 f"exactly as the tokens of q, k, v are; got {P(*axes)}")
        if "interpret" in plan.names and self.head_shards * self.segment_shards > 1:
            # The interpreter is a Python callback, and JAX cannot call one from a partitioned
            # custom_partitioning body (https://github.com/jax-ml/jax/issues/34349): it would crash.
            raise ValueError("backend='interpret' cannot be partitioned by a sharded jax.jit; run it under "
                             "jax.shard_map (or use backend='xla' or 'triton')")
        self.mesh, self.head_axes, self.segment_axes = mesh, head_axes, segment_axes
        self.layout = p.layout

    def sharding(self, kind: str) -> NamedSharding:
        heads = self.head_axes or None
        segments = self.segment_axes or None
        spec = {"array": P(segments, heads, None) if self.layout == "THD" else P(heads, segments, None),
                "offsets": P(segments, None), "shared_offsets": P(None, None),
                "stats": P(segments, heads, None), "slopes": P(segments, heads)}[kind]
        return NamedSharding(self.mesh, spec)

    def local(self, p: Problem) -> Problem:
        z = p.num_segments // self.segment_shards
        return p.with_(num_heads=p.num_heads // self.head_shards,
                       num_kv_heads=p.num_kv_heads // self.head_shards, num_segments=z,
                       q_offsets_rows=1 if p.q_offsets_rows == 1 else z,
                       kv_offsets_rows=1 if p.kv_offsets_rows == 1 else z)

    def offsets_sharding(self, rows: int) -> NamedSharding:
        return self.sharding("shared_offsets" if rows == 1 else "offsets")


def _partitioned(p: Problem, plan: Plan, run, backward: bool, with_dlse: bool = False):
    @custom_partitioning
    def call(*args):
        return run(p, plan, *args)

    def partition(mesh, arg_shapes, result_shape):
        sharding = _Sharding(p, plan, mesh, arg_shapes, backward)
        array = sharding.sharding("array")
        offsets = (sharding.offsets_sharding(p.q_offsets_rows), sharding.offsets_sharding(p.kv_offsets_rows))
        arg_shardings = (array, array, array, *offsets)
        if backward:
            arg_shardings += (array, sharding.sharding("stats"), array)
            result_shardings = (array, array, array)
        else:
            result_shardings = (array, sharding.sharding("stats"))
        arg_shardings += (sharding.sharding("slopes"),) * p.alibi + (sharding.sharding("stats"),) * with_dlse
        local = sharding.local(p)
        # Each device's problem is chosen for again: its implementations must support it.
        run_local = functools.partial(run, local, select.replan(plan, local))
        return mesh, run_local, result_shardings, arg_shardings

    call.def_partition(partition=partition,
                       sharding_rule=lambda *_: _sharding_rule(p, backward, with_dlse))
    return call


# ---------------------------------------------------------------------------------------------------
# Batching: fold the vmapped axis into heads or segments
# ---------------------------------------------------------------------------------------------------


def _broadcast(x, batched: bool, size: int):
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


class _Fold:
    """How a vmapped axis of size `size` joins the problem, and the array reshapes both ways."""

    def __init__(self, p: Problem, size: int, offsets_batched: bool):
        self.p, self.size = p, size
        self.into_heads = p.layout == "HTD" and not offsets_batched
        if self.into_heads:
            self.problem = p.with_(num_heads=size * p.num_heads, num_kv_heads=size * p.num_kv_heads)
        else:
            self.problem = p.with_(num_segments=size * p.num_segments)

    def array(self, x, batched: bool):
        """[V, ...] -> the folded problem's array (HTD segments need a transpose: a copy)."""
        x = _broadcast(x, batched, self.size)
        if self.into_heads or self.p.layout == "THD":
            return x.reshape(-1, *x.shape[2:])
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def unarray(self, x):
        if self.into_heads or self.p.layout == "THD":
            return x.reshape(self.size, -1, *x.shape[1:])
        x = x.reshape(x.shape[0], self.size, -1, x.shape[-1])
        return jnp.moveaxis(x, 1, 0)

    def offsets(self, offsets, batched: bool, rows: int):
        """[V, rows, B+1] -> [1 or V*Z, B+1], and the new row count."""
        if self.into_heads or (not batched and rows == 1):
            return offsets, rows
        offsets = _broadcast(offsets, batched, self.size)
        offsets = jnp.broadcast_to(offsets, (self.size, self.p.num_segments, offsets.shape[-1]))
        return offsets.reshape(-1, offsets.shape[-1]), self.problem.num_segments

    def stats(self, x, batched: bool):
        """[V, Z, H, T] -> [Z, V*H, T] (heads) or [V*Z, H, T] (segments)."""
        x = _broadcast(x, batched, self.size)
        if self.into_heads:
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])
        return x.reshape(-1, *x.shape[2:])

    def slopes(self, x, batched: bool):
        """ALiBi's [V, Z, H] -> [Z, V*H] (heads) or [V*Z, H] (segments); None stays None."""
        return None if x is None else self.stats(x[..., None], batched)[..., 0]

    def unstats(self, x):
        if self.into_heads:
            return jnp.moveaxis(x.reshape(x.shape[0], self.size, -1, x.shape[-1]), 1, 0)
        return x.reshape(self.size, -1, *x.shape[1:])

    def fold_offsets(self, q_offsets, kv_offsets, q_batched, kv_batched):
        q_offsets, q_rows = self.offsets(q_offsets, q_batched, self.p.q_offsets_rows)
        kv_offsets, kv_rows = self.offsets(kv_offsets, kv_batched, self.p.kv_offsets_rows)
        self.problem = self.problem.with_(q_offsets_rows=q_rows, kv_offsets_rows=kv_rows)
        return q_offsets, kv_offsets


# The most problems whose jitted programs are kept (each holds its compiled executables once called
# eagerly): an eager loop over batches of ever new token counts does not grow memory without bound.
PROGRAMS_KEPT = 256


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def _forward_fn(p: Problem, plan: Plan):
    partitioned = _partitioned(p, plan, _run_forward, backward=False)

    @custom_vmap
    def call(*args):
        return partitioned(*args)

    @call.def_vmap
    def rule(size, batched, *args):
        args, batched = (_unpack(ForwardArgs, p, x) for x in (args, batched))
        fold = _Fold(p, size, batched.q_offsets or batched.kv_offsets)
        offsets = fold.fold_offsets(args.q_offsets, args.kv_offsets, batched.q_offsets, batched.kv_offsets)
        arrays = (fold.array(getattr(args, n), getattr(batched, n)) for n in ("q", "k", "v"))
        operands = ForwardArgs(*arrays, *offsets, fold.slopes(args.slopes, batched.slopes))
        # The folded problem is chosen for again: its implementations must support it.
        folded = _forward_fn(fold.problem, select.replan(plan, fold.problem))
        o, lse = folded(*_operands(operands, fold.problem))
        return (fold.unarray(o), fold.unstats(lse)), (True, True)

    return jax.jit(call)  # see `_backward_fn`


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def _backward_fn(p: Problem, plan: Plan, with_dlse: bool):
    partitioned = _partitioned(p, plan, functools.partial(_run_backward, with_dlse=with_dlse), backward=True,
                               with_dlse=with_dlse)

    @custom_vmap
    def call(*args):  # BackwardArgs, without the absent ones (see `_fields`)
        return partitioned(*args)

    @call.def_vmap
    def rule(size, batched, *args):
        args, batched = (_unpack(BackwardArgs, p, x, with_dlse) for x in (args, batched))
        fold = _Fold(p, size, batched.q_offsets or batched.kv_offsets)
        offsets = fold.fold_offsets(args.q_offsets, args.kv_offsets, batched.q_offsets, batched.kv_offsets)
        arrays = [fold.array(getattr(args, n), getattr(batched, n)) for n in ("q", "k", "v")]
        o, do = fold.array(args.o, batched.o), fold.array(args.do, batched.do)
        operands = BackwardArgs(*arrays, *offsets, o, fold.stats(args.lse, batched.lse), do,
                                fold.slopes(args.slopes, batched.slopes),
                                fold.stats(args.dlse, batched.dlse) if with_dlse else None)
        grads = _backward_fn(fold.problem, select.replan(plan, fold.problem), with_dlse)(
            *_operands(operands, fold.problem, with_dlse))
        return tuple(fold.unarray(g) for g in grads), (True, True, True)

    # Jitted, one function per problem (this cache): called eagerly, the ops would run one by one, and
    # the xla backend's lax.scan would be compiled again at every call (its body is a new closure).
    return jax.jit(call)


def clear_programs() -> None:
    """Forget the per-problem programs (`_forward_fn`, `_backward_fn`): the next call of each problem is
    traced again. For tests and probes that change what a trace reads (a plan rule, a tile table)."""
    _forward_fn.cache_clear()
    _backward_fn.cache_clear()


def _with_auto_axes(p: Problem, plan: Plan, fn, args, result_types, backward: bool):
    """Run `fn` with explicit mesh axes turned into auto ones (custom_partitioning works with those),
    checking the shardings at trace time, and give results the shardings of `result_types`."""
    mesh = explicit_mesh(args[0])
    if mesh is None:
        return fn(*args)
    sharding = _Sharding(p, plan, mesh, [jax.typeof(x) for x in args], backward)
    out = tuple(sharding.sharding("stats") if kind == "stats" else jax.typeof(like).sharding
                for kind, like in result_types)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, out_sharding=out)(*args)


def forward(p: Problem, plan: Plan, q, k, v, q_offsets, kv_offsets, slopes=None):
    """o and the float32 log-sum-exp [Z, H, T_q] (the kernels' convention, every implementation's), by
    the plan's forward. slopes: ALiBi's [Z, H] float32 when p.alibi, else None."""
    args = _operands(ForwardArgs(q, k, v, q_offsets, kv_offsets, slopes), p)
    return _with_auto_axes(p, plan, _forward_fn(p, plan), args, (("array", q), ("stats", None)),
                           backward=False)


def backward(p: Problem, plan: Plan, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes=None, dlse=None):
    """dq, dk, dv from the residuals of `forward` (none for the slopes), the output gradient and, unless
    None, the gradient of the log-sum-exp residual ([Z, H, T_q] float32, in its units)."""
    with_dlse = dlse is not None
    args = _operands(BackwardArgs(q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse), p, with_dlse)
    return _with_auto_axes(p, plan, _backward_fn(p, plan, with_dlse), args,
                           (("array", q), ("array", k), ("array", v)), backward=True)
