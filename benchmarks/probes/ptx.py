"""The kernels' PTX for sm_90a, without a GPU: what proves a refactor of kernel or launch code changed
nothing the GPU runs.

    python -m benchmarks.probes.ptx capture --out launches.json
    python -m benchmarks.probes.ptx digest launches.json --out ptx.json [--jobs 2] [--dump DIR]
    python -m benchmarks.probes.ptx compare before.json after.json

`capture` runs the public ops (forward and backward) on CASES with a fake jax_triton on a pretended
Hopper GPU, and records every kernel launch: the kernel, its array arguments' dtypes and shapes, the
TMA descriptors' blocks, the compile-time constants, the runtime parameters, warps, stages, backend
options and grid. Two
captures compare equal when the launch code passes the kernels the same things. `digest` compiles each
distinct launch for sm_90a as jax-triton 0.4.1 compiles it (`compile_for_sm90`) under the installed
Triton and keeps a hash of its PTX without the debug records (`.loc`, `.file`, the debug sections and
their labels), which name source lines, not instructions. Run both under triton 3.6 and 3.9.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import warnings

# (name, call arguments): `op` "standard" (jagged_attention) or "fbgemm"; the kernels a case runs follow
# from `kernels` ("hopper": the Hopper kernels wherever they can run; "portable": never) and its shapes.
CASES = [
    ("hopper-d128-thd-bf16", dict(kernels="hopper", dim=128, dtype="bfloat16", layout="THD")),
    ("hopper-d128-htd-fp16-causal", dict(kernels="hopper", dim=128, dtype="float16", layout="HTD",
                                         causal=True)),
    ("hopper-d128-thd-bf16-options-gqa-cross", dict(kernels="hopper", dim=128, dtype="bfloat16", layout="THD",
                                                    kv_heads=2, cross=True, window=(16, 4), softcap=5.0,
                                                    alibi=True)),
    ("hopper-d128-htd-bf16-causal-window-narrow", dict(kernels="hopper", dim=128, dtype="bfloat16",
                                                       layout="HTD", causal=True, window=(64, None),
                                                       max_seq_len=256)),
    ("hopper-d64-thd-bf16-causal", dict(kernels="hopper", dim=64, dtype="bfloat16", layout="THD",
                                        causal=True)),
    ("hopper-d64-htd-fp16-options", dict(kernels="hopper", dim=64, dtype="float16", layout="HTD",
                                         window=(40, 8), softcap=5.0, alibi=True)),
    ("hopper-d256-thd-bf16-options", dict(kernels="hopper", dim=256, dtype="bfloat16", layout="THD",
                                          window=(40, 8), softcap=50.0, alibi=True)),
    ("hopper-d256-htd-fp16-causal", dict(kernels="hopper", dim=256, dtype="float16", layout="HTD",
                                         causal=True)),
    ("portable-d64-thd-fp32-tf32-causal-gqa-cross", dict(kernels="portable", dim=64, dtype="float32",
                                                         layout="THD", causal=True, kv_heads=2, cross=True)),
    ("portable-d25-htd-fp32-ieee", dict(kernels="portable", dim=25, dtype="float32", layout="HTD",
                                        allow_tf32=False)),
    ("portable-d128-thd-fp32-tf32-two-launches", dict(kernels="portable", dim=128, dtype="float32",
                                                       layout="THD", two_launches=True)),
    ("portable-d128-thd-bf16-options", dict(kernels="portable", dim=128, dtype="bfloat16", layout="THD",
                                            window=(16, 4), softcap=5.0, alibi=True, kv_heads=2)),
    ("portable-d64-htd-bf16-fbgemm", dict(kernels="portable", dim=64, dtype="bfloat16", layout="HTD",
                                          op="fbgemm")),
    ("portable-d32-thd-fp16-segments", dict(kernels="portable", dim=32, dtype="float16", layout="THD",
                                            segments=True, causal=True)),
    ("hstu-hopper-d128-thd-bf16-causal", dict(kernels="hopper", op="hstu", dim=128, dtype="bfloat16",
                                             layout="THD", causal=True)),
    ("hstu-portable-d64-v128-htd-bf16-options", dict(kernels="portable", op="hstu", dim=64, value_dim=128,
                                                     dtype="bfloat16", layout="HTD", causal=True,
                                                     max_attn_len=16, contextual_seq_len=4)),
    ("hstu-portable-d128-thd-fp32", dict(kernels="portable", op="hstu", dim=128, dtype="float32",
                                         layout="THD")),
]


# ---------------------------------------------------------------------------------------------------
# Capture: the launches of the public ops, recorded by a fake jax_triton
# ---------------------------------------------------------------------------------------------------


def _fake_jax_triton(calls: list):
    """A jax_triton 0.4.1 whose triton_call records its arguments and returns zeros."""
    import jax.numpy as jnp

    module = types.ModuleType("jax_triton")
    module.__version__ = "0.4.1"

    @dataclasses.dataclass(frozen=True)
    class TensorDescriptor:
        base: object
        block_shape: tuple
        layout: object

        @classmethod
        def from_array(cls, array, block_shape, layout=None):
            return cls(array, tuple(block_shape), layout)

    def triton_call(*args, kernel, out_type, grid, **kwargs):
        arrays = []
        for a in args:
            if isinstance(a, TensorDescriptor):
                arrays.append(dict(dtype=str(a.base.dtype), shape=list(a.base.shape),
                                   block=list(a.block_shape)))
            else:
                arrays.append(dict(dtype=str(a.dtype), shape=list(a.shape)))
        options = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v)
                   for k, v in kwargs.items() if k in ("num_warps", "num_stages", "backend_options",
                                                        "zeroed_outputs", "input_output_aliases")}
        constants = {k: v for k, v in kwargs.items() if k not in options}
        calls.append(dict(kernel=_exported_name(kernel), arrays=arrays,
                          out=[dict(dtype=str(s.dtype), shape=list(s.shape)) for s in out_type],
                          grid=list(grid), constants=constants, **options))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_type)

    module.triton_call = triton_call
    module.TensorDescriptor = TensorDescriptor
    return module


@contextlib.contextmanager
def _pretended_hopper_gpu(calls: list):
    """The ops choose as on an H200 (compute capability 9.0, 132 SMs; the arrays stay on the CPU), and
    jax_triton is the fake."""
    from jagged_flash_jax import select, transforms
    from jagged_flash_jax.implementations import Device
    from jagged_flash_jax.launch import gpu

    saved = dict(module=sys.modules.get("jax_triton"), run=gpu.run)
    run = gpu.run

    def recording_run(call, arrays):  # the runtime parameters, which triton_call sees traced
        outputs = run(call, arrays)
        calls[-1]["params"] = list(call.params)
        return outputs

    from jagged_flash_jax import _compat

    caches = (gpu.jax_triton_module, gpu.unavailable_reason, gpu.ptx_options)
    sys.modules["jax_triton"] = _fake_jax_triton(calls)
    gpu.run = recording_run
    # No ptxas for jaxlib: Triton's own PTX version, whatever ptxas this machine has.
    saved["xla_ptxas"], _compat.xla_ptxas = _compat.xla_ptxas, lambda: None
    for cached in caches:
        cached.cache_clear()
    try:
        with select.use_device(Device("gpu", "NVIDIA H200", (9, 0), 132)):
            yield
    finally:
        gpu.run = saved["run"]
        _compat.xla_ptxas = saved["xla_ptxas"]
        if saved["module"] is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = saved["module"]
        for cached in caches:
            cached.cache_clear()
        transforms.clear_programs()


def _run_case(dim, dtype, layout, kernels, kv_heads=4, cross=False, causal=False, window=(None, None),
              softcap=None, alibi=False, op="standard", allow_tf32=True, two_launches=False, segments=False,
              max_seq_len=2048, value_dim=None, max_attn_len=0, contextual_seq_len=0):
    """Forward and backward of one case: 4 query heads, 96 query tokens in 3 sequences (80 keys in 3
    with `cross`), under `kernels` ("hopper" or "portable" forced for both passes). `op` "hstu" runs
    hstu_attention (v of `value_dim`, default dim; HSTU's causal mask where causal)."""
    import jax
    import jax.numpy as jnp

    import jagged_flash_jax as jfa
    from jagged_flash_jax import configs, select

    os.environ[select.FORWARD_ENV] = kernels
    os.environ[select.BACKWARD_ENV] = kernels
    dtype = jnp.dtype(dtype)
    tokens, kv_tokens = 96, 80 if cross else 96
    shape = lambda t, h: (t, h, dim) if layout == "THD" else (h, t, dim)  # noqa: E731
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], shape(tokens, 4), dtype)
    k = jax.random.normal(keys[1], shape(kv_tokens, 4 if op == "fbgemm" else kv_heads), dtype)
    v = jax.random.normal(keys[2], k.shape, dtype)
    offsets = jnp.asarray([0, 20, 70, 96], jnp.int32)
    block_sizes = None
    if two_launches:
        block_sizes = configs.BlockSizes(fwd=configs.KernelConfig(64, 32, num_warps=4, num_stages=2),
                                         dkdv=configs.KernelConfig(32, 64, num_warps=8, num_stages=2),
                                         dq=configs.KernelConfig(64, 32, num_warps=4, num_stages=2))
    if op == "hstu":
        v = jax.random.normal(keys[2], (*k.shape[:-1], value_dim or dim), dtype)
        f = lambda q, k, v: jfa.hstu_attention(  # noqa: E731
            q, k, v, offsets, max_seq_len, alpha=0.5, causal=causal, layout=layout,
            backend="triton", allow_tf32=allow_tf32, max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len)
    elif op == "fbgemm":
        f = lambda q, k, v: jfa.multi_head_jagged_flash_attention(  # noqa: E731
            q, k, v, offsets, max_seq_len, layout=layout, backend="triton", allow_tf32=allow_tf32)
    else:
        options = dict(causal=causal, window=window, softcap=softcap, layout=layout, backend="triton",
                       allow_tf32=allow_tf32, block_sizes=block_sizes,
                       alibi_slopes=jnp.linspace(0.1, 0.4, 4) if alibi else None)
        if cross:
            options.update(kv_offsets=jnp.asarray([0, 30, 50, 80], jnp.int32), kv_max_seq_len=max_seq_len)
        f = lambda q, k, v: jfa.jagged_attention(q, k, v, offsets, max_seq_len, **options)  # noqa: E731
    if segments:  # two problems in one launch (vmap folds them into offsets segments)
        q, k, v = (jnp.stack([x, x]) for x in (q, k, v))
        f = jax.vmap(f)
    jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))(q, k, v)


def capture(cases=CASES) -> dict:
    """{case: [launch, ...]} in launch order (see the module docstring)."""
    launches = {}
    names = ("JAGGED_FLASH_JAX_FORWARD", "JAGGED_FLASH_JAX_BACKWARD")
    saved_env = {name: os.environ.get(name) for name in names}
    try:
        for name, arguments in cases:
            calls = []
            with _pretended_hopper_gpu(calls):
                _run_case(**arguments)
            launches[name] = calls
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return launches


# ---------------------------------------------------------------------------------------------------
# Digest: each launch compiled for sm_90a as jax-triton 0.4.1 compiles it
# ---------------------------------------------------------------------------------------------------

_TYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64"}


def _exported_name(kernel) -> str:
    """The name under which jagged_flash_jax.kernels exports a kernel (the Hopper kernels' functions share
    the portable ones' names)."""
    import jagged_flash_jax.kernels as kernels

    return next(name for name in kernels.__all__ if getattr(kernels, name) is kernel)


def _kernel(name: str):
    import jagged_flash_jax.kernels as kernels

    return getattr(kernels, name)


def kernel_signature(kernel, launch: dict) -> tuple[dict, dict]:
    """The signature and attributes jax-triton 0.4.1 builds: descriptors as
    `tensordesc<dtype[block],layout>` (a Gluon kernel's, in the NVMMA layout the launcher gives them) or
    `tensordesc<dtype[block]>` (a Triton kernel's: Triton chooses), 16-divisible pointers, the constants
    as constexprs."""
    from jagged_flash_jax.launch.calls import is_gluon

    params = [name for name in kernel.arg_names if name not in launch["constants"]]
    arrays = launch["arrays"] + launch["out"]
    signature = {}
    for name, array in zip(params, arrays, strict=True):
        type_name = _TYPE_NAMES[array["dtype"]]
        if "block" in array and not is_gluon(kernel):
            signature[name] = f"tensordesc<{type_name}[{','.join(map(str, array['block']))}]>"
        elif "block" in array:
            from triton.experimental.gluon import language as gl

            block = array["block"]
            layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, array["dtype"]))
            signature[name] = f"tensordesc<{type_name}[{','.join(map(str, block))}],{layout!r}>"
        else:
            signature[name] = f"*{type_name}"
    signature.update(dict.fromkeys(launch["constants"], "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name.endswith("_ptr")}
    return signature, attrs


def compile_for_sm90(kernel, signature: dict, constants: dict, attrs: dict, num_warps: int, num_stages: int,
                     backend_options: dict | None = None) -> tuple[str, dict]:
    """A kernel compiled for sm_90a as jax-triton 0.4.1 compiles it: the AST to IR (GluonASTSource for
    Gluon kernels, ASTSource else), then the CUDA backend's make_ttir, make_ttgir, make_llir, make_ptx
    (jax-triton runs make_ttir on Gluon modules too, which triton.compile skips). Returns (ptx,
    metadata)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from jagged_flash_jax.launch.calls import is_gluon

    target = GPUTarget("cuda", 90, 128 if is_gluon(kernel) else 32)
    backend = CUDABackend(target)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages,
                                         **(backend_options or {})))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source_class = GluonASTSource if is_gluon(kernel) else ASTSource
    source = source_class(kernel, signature, dict(constants), attrs)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    metadata = {}
    module = backend.make_ttir(module, metadata, options, 90)
    module = backend.make_ttgir(module, metadata, options, 90)
    llir = backend.make_llir(module, metadata, options, 90)
    return backend.make_ptx(llir, metadata, options, 90), metadata


def assemble_sm90a(ptx: str, ptxas: str | None = None, sass: bool = False) -> tuple[str, str | None]:
    """`ptx` assembled for sm_90a by `ptxas` (default: the one Triton compiles sm_90 with; triton 3.9's PTX
    needs its CUDA 13 `ptxas-blackwell`) with -v: (ptxas's report, its stderr; the SASS listing by the
    same toolkit's cuobjdump where `sass`, else None)."""
    if ptxas is None:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", source, "-o", cubin], capture_output=True,
                                text=True, check=True).stderr
        listing = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", cubin],
                                 capture_output=True, text=True, check=True).stdout if sass else None
    return report, listing


def normalized(ptx: str) -> str:
    """The PTX without its debug records: `.loc` and `.file` lines, the debug sections and the labels only
    they use (`$L__tmp`, `$L__func_begin`, `$L__func_end`), and comments."""
    ptx = ptx.split("\t.section\t.debug_", 1)[0]
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        debug_label = re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", stripped)
        if stripped.startswith((".loc", ".file", "//")) or debug_label:
            continue
        lines.append(line.rstrip())
    return "\n".join(lines)


def _launch_key(launch: dict) -> str:
    keep = {k: launch[k] for k in ("kernel", "constants", "num_warps", "num_stages", "backend_options")
            if k in launch}
    # (the results of inputs updated in place, jax-triton's input_output_aliases, have no argument)
    aliased = {int(result) for result in launch.get("input_output_aliases", {}).values()}
    outputs = [out for i, out in enumerate(launch["out"]) if i not in aliased]
    keep["types"] = [(a["dtype"], a.get("block")) for a in launch["arrays"] + outputs]
    return json.dumps(keep, sort_keys=True)


def compile_quietly(kernel, signature: dict, constants: dict, attrs: dict, num_warps: int, num_stages: int,
                    backend_options: dict | None = None) -> tuple[str, dict]:
    """`compile_for_sm90` without the compiler's warnings and printed output."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return compile_for_sm90(kernel, signature, constants, attrs, num_warps, num_stages, backend_options)


def _digest_one(key: str, dump: str | None) -> tuple[str, dict]:
    launch = json.loads(key)
    kernel = _kernel(launch["kernel"])
    arrays = [dict(dtype=t, **({"block": b} if b else {})) for t, b in launch["types"]]
    fake = dict(constants=launch["constants"], arrays=arrays, out=[])
    signature, attrs = kernel_signature(kernel, fake)
    ptx, metadata = compile_quietly(kernel, signature, launch["constants"], attrs, launch["num_warps"],
                                    launch["num_stages"], launch.get("backend_options"))
    text = normalized(ptx)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{launch['kernel']}-{digest}.ptx"), "w") as f:
            f.write(text)
    return key, dict(kernel=launch["kernel"], ptx=digest, shared=metadata.get("shared"),
                     instructions=sum(1 for line in text.splitlines() if line.startswith("\t") and
                                      not line.strip().startswith(".")))


def digest(launches: dict, jobs: int = 1, dump: str | None = None) -> dict:
    """{case: [{kernel, ptx (hash), shared, instructions}, ...]} for the launches of `capture`."""
    import triton

    keys = sorted({_launch_key(launch) for calls in launches.values() for launch in calls})
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        results = dict(pool.map(_digest_one, keys, [dump] * len(keys)))
    return dict(triton=triton.__version__,
                cases={case: [results[_launch_key(launch)] for launch in calls]
                       for case, calls in launches.items()})


def compare(a: dict, b: dict) -> list[str]:
    """The differences between two captures or two digests, one line each (none: identical)."""
    a_cases, b_cases = a.get("cases", a), b.get("cases", b)
    lines = [f"only in one: {case}" for case in sorted(set(a_cases) ^ set(b_cases))]
    for case in sorted(set(a_cases) & set(b_cases)):
        x, y = a_cases[case], b_cases[case]
        if len(x) != len(y):
            lines.append(f"{case}: {len(x)} launches against {len(y)}")
            continue
        for i, (u, w) in enumerate(zip(x, y)):
            if u != w:
                diff = {k: (u.get(k), w.get(k)) for k in sorted(set(u) | set(w)) if u.get(k) != w.get(k)}
                lines.append(f"{case} launch {i} ({u.get('kernel')}): {diff}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.ptx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("capture")
    p.add_argument("--out", required=True)
    p = sub.add_parser("digest")
    p.add_argument("launches")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--dump", default=None, help="write each normalized PTX into this folder")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = parser.parse_args(argv)
    if args.command == "capture":
        result = capture()
    elif args.command == "digest":
        with open(args.launches) as f:
            result = digest(json.load(f), args.jobs, args.dump)
    else:
        with open(args.a) as f, open(args.b) as g:
            lines = compare(json.load(f), json.load(g))
        print("\n".join(lines) or "identical")
        sys.exit(1 if lines else 0)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
