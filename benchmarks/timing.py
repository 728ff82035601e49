"""Device time (CUPTI, through JAX's Mosaic GPU profiler), wall-clock time and memory of compiled functions.

CUPTI sums the kernels' own durations: launch gaps and memsets (jax-triton zeroes some outputs with a
memset, not a kernel) are not in it. The wall clock of one synchronized call has them, plus the host's
dispatch and synchronization; the pipelined time (many calls queued, one synchronization) has the gaps
but not a synchronization per call.
"""

from __future__ import annotations

import statistics
import time

import jax

CUPTI_UNAVAILABLE = None  # the reason, once a first attempt failed
# Keep CUPTI loaded between measurements (as `Cupti(finalize=False)` does): detaching and attaching
# it again for each of ~150 rows costs time and changes nothing measured.
FINALIZE = False


def _mosaic_gpu_ext():
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # raises where JAX has no Mosaic GPU build

    return mosaic_gpu_lib._mosaic_gpu_ext


def _split_iterations(timings, iterations: int):
    if len(timings) % iterations:
        raise RuntimeError(f"{len(timings)} kernel launches do not divide into {iterations} iterations")
    per_iteration = len(timings) // iterations
    return [timings[i * per_iteration:(i + 1) * per_iteration] for i in range(iterations)]


def _cupti_rotating(compiled, arg_sets, iterations: int):
    """Per-iteration [(kernel, ms)] with the input set changing at every call (one CUPTI session)."""
    ext = _mosaic_gpu_ext()
    ext._cupti_init()
    try:
        outputs = [compiled(*arg_sets[i % len(arg_sets)]) for i in range(iterations)]
        jax.block_until_ready(outputs)
    finally:
        timings = ext._cupti_get_timings(FINALIZE)
    del outputs
    return _split_iterations(list(timings or []), iterations)


def _cupti_public(compiled, arg_sets, iterations: int):
    """The same through the public `measure`, one call per input set (consecutive calls share a set)."""
    from jax.experimental.mosaic.gpu.profiler import measure

    per_set = max(1, -(-iterations // len(arg_sets)))
    result = []
    for args in arg_sets:
        _, timings = measure(compiled, aggregate=False, iterations=per_set)(*args)
        if timings is None:
            return []
        result.extend([timings] if per_set == 1 else timings)
    return result


def device_times(compiled, arg_sets, iterations: int) -> tuple[list[list[tuple[str, float]]], str]:
    """Per-iteration kernel timings and how they were taken ("cupti" or "cupti-measure").

    Raises RuntimeError when CUPTI cannot time here (no GPU, no Mosaic GPU build).
    """
    global CUPTI_UNAVAILABLE
    if CUPTI_UNAVAILABLE is not None:
        raise RuntimeError(CUPTI_UNAVAILABLE)
    if jax.default_backend() != "gpu":
        CUPTI_UNAVAILABLE = f"CUPTI needs a GPU (JAX's default backend is {jax.default_backend()!r})"
        raise RuntimeError(CUPTI_UNAVAILABLE)
    try:
        _mosaic_gpu_ext()
    except Exception as err:  # any import failure means no CUPTI here
        CUPTI_UNAVAILABLE = f"no Mosaic GPU extension for CUPTI: {err!r}"
        raise RuntimeError(CUPTI_UNAVAILABLE) from err
    try:
        timings, how = _cupti_rotating(compiled, arg_sets, iterations), "cupti"
    except (AttributeError, TypeError):  # the private extension changed: use the public API
        timings, how = _cupti_public(compiled, arg_sets, iterations), "cupti-measure"
    if not timings or not timings[0]:
        raise RuntimeError("CUPTI recorded no kernels")
    return timings, how


def summarize_kernels(timings: list[list[tuple[str, float]]]) -> dict:
    """Median total ms over iterations, its spread, and the median of each kernel in launch order."""
    totals = [sum(ms for _, ms in iteration) for iteration in timings]
    kernels = []
    for index, (name, _) in enumerate(timings[0]):
        samples = [iteration[index][1] for iteration in timings
                   if index < len(iteration) and iteration[index][0] == name]
        kernels.append([name[:160], round(statistics.median(samples), 5)])
    return dict(ms=statistics.median(totals), ms_min=min(totals), ms_max=max(totals),
                kernels_per_call=len(timings[0]), kernels=kernels)


def wall_times(compiled, arg_sets, calls: int) -> list[float]:
    """Milliseconds of `calls` block_until_ready'd calls, rotating through the input sets."""
    times = []
    for i in range(calls):
        args = arg_sets[i % len(arg_sets)]
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def pipelined_time(compiled, arg_sets, calls: int) -> float:
    """Milliseconds per call of `calls` calls dispatched back to back and synchronized once.

    Like CUDA events around each of many queued calls (the seed's do_bench), this counts the launch gaps
    when the host cannot keep the GPU busy, but not a host synchronization per call.
    """
    start = time.perf_counter()
    outputs = [compiled(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
    jax.block_until_ready(outputs)
    return (time.perf_counter() - start) * 1e3 / calls


def compiled_memory(compiled) -> dict:
    """Argument, output and temporary bytes from XLA's memory analysis of the compiled function."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    fields = dict(argument_bytes="argument_size_in_bytes", output_bytes="output_size_in_bytes",
                  temp_bytes="temp_size_in_bytes", alias_bytes="alias_size_in_bytes",
                  generated_code_bytes="generated_code_size_in_bytes")
    memory = {key: int(getattr(stats, attr)) for key, attr in fields.items() if hasattr(stats, attr)}
    if all(key in memory for key in ("argument_bytes", "output_bytes", "temp_bytes")):
        memory["total_bytes"] = memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
    return memory


def device_memory_stats() -> dict:
    """The device allocator's counters (process-wide; peak is a high-water mark since start)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # not every backend has them
        return {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {key: int(stats[key]) for key in keys if key in stats}

