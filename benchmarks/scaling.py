"""Scaling over the N devices of jax.devices(): one device doing one share of a bf16 fwd+bwd step (rec-long,
long, dlrm-long; FBGEMM's op), against N devices doing N shares: heads-sharded and data-parallel under
jax.jit, and data-parallel under jax.shard_map. Writes OUT/scaling.json, then the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jagged_flash_jax import offsets_from_lengths, pack_data_parallel

from . import cases as C
from . import impls, report

CASES = ("rec-long", "long", "dlrm-long")
SETUPS = ("one-share", "heads-jit", "data-jit", "data-shard_map")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute")
NOTE = ("one-share: the case on one device; heads-jit: N times the heads, sharded P(None, 'model', None) "
        "(layout THD), offsets replicated; data-jit, data-shard_map: the batch repeated N times, packed by "
        "pack_data_parallel(num_shards=N), tokens and offsets sharded P('data'). ms: wall time per step of "
        "many steps queued then jax.block_until_ready (median of repeats); time / one share: ms over "
        "one-share's; throughput scaling: N x one-share's ms / ms.")


def step_fn(case: C.Case, backend: str):
    """(q, k, v, offsets, do) -> (dq, dk, dv): benchmarks.run's fwd+bwd of FBGEMM's op."""
    step = impls.timed_function(impls.jfa(case, backend)[0], "fwd+bwd")
    return lambda q, k, v, offsets, do: step(q, k, v, (offsets, offsets), do)


def normal(tokens: int, heads: int, dim: int) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, (tokens, heads, dim), jnp.float32).astype(jnp.bfloat16) for key in keys]


def prepare(setup: str, case: C.Case, devices, backend: str):
    """The jitted step of one setup and its arguments, placed on the devices."""
    n, step, lengths = len(devices), step_fn(case, backend), case.lengths()
    if setup == "one-share":
        q, k, v, do = normal(int(lengths.sum()), case.heads, case.head_dim)
        return jax.jit(step), jax.device_put((q, k, v, offsets_from_lengths(lengths), do), devices[0])
    if setup == "heads-jit":
        mesh = Mesh(np.array(devices), ("model",))
        q, k, v, do = jax.device_put(normal(int(lengths.sum()), n * case.heads, case.head_dim),
                                     NamedSharding(mesh, P(None, "model", None)))
        offsets = jax.device_put(offsets_from_lengths(lengths), NamedSharding(mesh, P()))
        return jax.jit(step), (q, k, v, offsets, do)
    mesh = Mesh(np.array(devices), ("data",))
    batch = np.tile(lengths, n)
    packed = pack_data_parallel(normal(int(batch.sum()), case.heads, case.head_dim),
                                offsets_from_lengths(batch), num_shards=n)
    q, k, v, offsets, do = jax.device_put((*packed.values[:3], packed.offsets, packed.values[3]),
                                          NamedSharding(mesh, P("data")))
    if setup == "data-shard_map":
        step = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return jax.jit(step), (q, k, v, offsets, do)


def per_step_ms(compiled, args, calls: int, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([compiled(*args) for _ in range(calls)])
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__)
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--quick", action="store_true", help="tiny shapes (on the CPU: backend xla)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=20, help="steps queued per timing")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    devices = jax.devices()
    meta = dict(date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                device=devices[0].device_kind, device_count=len(devices), jax=jax.__version__,
                backend=args.backend, quick=args.quick, calls=args.calls, repeats=args.repeats, note=NOTE)
    rows = []
    if len(devices) < 2:
        meta["note"] = f"not run: it needs at least 2 devices, JAX sees {len(devices)}"
    for case in (C.select(list(CASES), args.quick) if len(devices) > 1 else []):
        one = None
        for setup in SETUPS:
            row = dict(case=case.name, setup=setup, devices=1 if setup == "one-share" else len(devices))
            try:
                fn, fn_args = prepare(setup, case, devices, args.backend)
                compiled = fn.lower(*fn_args).compile()
                if setup.endswith("-jit"):  # sharded by XLA: the op must stay local to each device
                    text = compiled.as_text() or ""
                    found = [name for name in COLLECTIVES if name in text]
                    row["hlo_check"] = (f"FAILED: {', '.join(found)} in the HLO" if found else
                                        "no collective" if text else "FAILED: no HLO text to check")
                row.update(status="ok", ms=per_step_ms(compiled, fn_args, args.calls, args.repeats))
                one = row["ms"] if setup == "one-share" else one
                if one:
                    row.update(time_ratio=row["ms"] / one, scaling=row["devices"] * one / row["ms"])
            except Exception as err:  # recorded, and the other setups still run
                row.update(status="error", error=f"{type(err).__name__}: {err}"[:2000])
            print(f"[scaling] {json.dumps(row)[:300]}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(dict(metadata=meta, rows=rows), indent=1))
    report.main(["--results", str(args.out)])


if __name__ == "__main__":
    main()
