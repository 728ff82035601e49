"""Device time (CUPTI, through jax.experimental.mosaic.gpu.profiler.measure), wall-clock and pipelined
times, and XLA's memory analysis of one function, rotating over several input sets: `measure`.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

DEVICE_NOTE = ("device_ms: CUPTI sums the kernels' own durations (launch gaps and memsets are not in "
               "it); one program runs the op on each input set in turn, and the median over iterations "
               "of its time divided by the number of sets is the time per call.")
HOST_NOTE = ("wall_ms: median of single calls each followed by jax.block_until_ready (dispatch and "
             "synchronization included); pipelined_ms: many calls queued, one synchronization, per call.")


def calls_for(seconds: float, call_s: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(seconds / max(call_s, 1e-6)))))


def every_set(fn):
    """One jitted program that calls fn on each input set in turn (its argument: the list of sets)."""
    return jax.jit(lambda sets: [fn(*args) for args in sets])


def device_ms(program, arg_sets: list, iterations: int) -> dict:
    """{"device_ms", "device_ms_min", "kernels"} from CUPTI for `every_set(fn)` (jitted or compiled);
    {"timer_note": why} where CUPTI cannot time."""
    if jax.default_backend() != "gpu":
        return {"timer_note": f"no CUPTI: JAX's default backend is {jax.default_backend()!r}"}
    try:
        from jax.experimental.mosaic.gpu.profiler import measure

        _, timings = measure(program, aggregate=False, iterations=iterations)(arg_sets)
    except Exception as err:  # no Mosaic GPU build, CUPTI busy, inconsistent kernels: wall times remain
        return {"timer_note": f"CUPTI failed: {type(err).__name__}: {str(err)[:300]}"}
    if not timings:
        return {"timer_note": "CUPTI recorded no kernels"}
    timings = [timings] if iterations == 1 else timings
    per_call = [sum(ms for _, ms in iteration) / len(arg_sets) for iteration in timings]
    median = sorted(timings, key=lambda it: sum(ms for _, ms in it))[len(timings) // 2]
    kernels: dict[str, float] = {}
    for name, ms in median:
        kernels[name[:100]] = kernels.get(name[:100], 0.0) + ms / len(arg_sets)
    return dict(device_ms=statistics.median(per_call), device_ms_min=min(per_call),
                cupti_iterations=iterations, kernels={k: round(v, 5) for k, v in kernels.items()})


def host_ms(compiled, arg_sets: list, wall_calls: int, pipelined_calls: int) -> dict:
    walls = []
    for i in range(wall_calls):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arg_sets[i % len(arg_sets)]))
        walls.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    outputs = [compiled(*arg_sets[i % len(arg_sets)]) for i in range(pipelined_calls)]
    jax.block_until_ready(outputs)
    pipelined = (time.perf_counter() - start) * 1e3 / pipelined_calls
    return dict(wall_ms=statistics.median(walls), wall_calls=wall_calls, pipelined_ms=pipelined,
                pipelined_calls=pipelined_calls)


def memory(compiled) -> dict:
    """Argument, output and temporary bytes of XLA's memory analysis of the compiled function."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in ("argument", "output", "temp")}
    return dict(out, total=sum(out.values()))


def measure(single, program, arg_sets: list, seconds: float, iterations: int) -> dict:
    """Every figure of one row: `single` compiled for one input set, `program` is every_set's (None off
    the GPU); about `seconds` of timed calls, at most `iterations` of CUPTI."""
    start = time.perf_counter()  # a warm-up pass (allocations, cuDNN plans) that sizes the loops
    outputs = jax.block_until_ready([single(*a) for a in arg_sets])
    call_s = (time.perf_counter() - start) / len(arg_sets)
    row = dict(finite=all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(outputs)),
               rotation_sets=len(arg_sets), memory_bytes=memory(single))
    del outputs
    calls = lambda seconds, hi: calls_for(seconds, call_s, 1, hi)  # noqa: E731
    row.update(device_ms(program, arg_sets, calls(seconds / len(arg_sets), iterations)))
    row.update(host_ms(single, arg_sets, calls(seconds / 2, 10), calls(seconds / 2, 30)))
    row["timer"] = "cupti" if "device_ms" in row else "wall"
    row["ms"] = row.get("device_ms", row["wall_ms"])
    row["measure_s"] = round(time.perf_counter() - start, 2)
    return row
