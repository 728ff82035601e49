"""Times generative-recommenders' Triton HSTU attention (`triton_hstu_mha`, PyTorch) on the cases of
hstu_cases.py: forward and forward+backward, median of triton.testing.do_bench, and the peak memory of
one call (torch.cuda.max_memory_allocated). Writes JSON rows like the library's other external timings:

    python benchmarks/hstu_torch_bench.py --out hstu_gr.json [--cases NAME ...] [--no-long]
        [--dtypes bfloat16 float32] [--autotune full|pinned] [--tma]

It needs torch and triton only (no JAX), and gr's kernel module in the git-ignored folder .gr/ at the
repository's root: .gr/gr_hstu/ holds generative_recommenders/ops/triton/triton_hstu_attention.py and
the three modules it imports (triton_attention_utils.py, ../utils.py, ../../common.py), unchanged but
for their imports, made relative (see .gr/gr_hstu/__init__.py; the commit they come from in .gr/COMMIT).

Autotuning: gr's kernels carry their own triton autotune configs (29 forward, 20 backward on CUDA), keyed
on (batch rounded down to a power of 2, H, D, V, max_seq_len bucket); the harness sets gr's
use_runtime_max_seq_len so that each max_seq_len is tuned for itself (by default gr keys every length
alike, and the first case's choice would serve them all). The first call of a case autotunes (compiling
each config once per head size and option set: minutes for the whole suite); the timed calls come after.
`--autotune pinned` skips it with one config per kernel (a quick look, not gr's speed). The chosen
configs are recorded per row.

What gr's kernel computes (checked in the interpreter against the library's float64 reference): gr's
semantics for causal attention without attn_scale and min_full_attn_seq_len, lengths at most
max_seq_len, except two cases the benchmark avoids: its backward drops some rows' share of the context
keys' dk and dv (and those rows' dq from them) when contextual_seq_len exceeds the backward's key tile
and there is a window (here the context is 8 tokens, under every tile), and its forward counts the
diagonal block twice for rows in the context when the targets reach into it (here n - targets >= c).

`--smoke` runs the same code on the CPU in Triton's interpreter on shrunk cases (wall-clock times, no
memory figures; float32 only: bfloat16 in Triton 3.6's interpreter gives garbage), with two interpreter
gaps filled for the kernels' meaning: libdevice's fast_expf and fast_dividef (CUDA externs) as exp and a
division, and `and`/`or` between tensors as elementwise logic (the compiler's meaning; the interpreter
would take one tensor's truth). It checks the outputs and gradients against a float64 dense computation
of gr's semantics (exit status 1 past 1e-2), and says nothing about speed. It needs numpy < 2.4 (Triton
3.6's interpreter converts size-1 arrays to Python ints).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GR = ROOT / ".gr"

if "--smoke" in sys.argv:  # before triton is imported: the interpreter is chosen when kernels are made
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(GR))
from benchmarks.hstu_cases import MODES, HstuCase, select  # noqa: E402

IMPL = "gr-triton"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_gr():
    """gr's kernel module from .gr/ (an ImportError that says where it should be otherwise)."""
    try:
        from gr_hstu import common, triton_hstu_attention
    except ImportError as err:
        raise ImportError(f"generative-recommenders' Triton HSTU attention is expected in {GR}/gr_hstu "
                          f"(see this file's docstring): {err}") from err
    common.set_use_runtime_max_seq_len(True)
    return triton_hstu_attention


def pin_configs(gr) -> None:
    """One config per kernel instead of the autotuning: forward 128x64 (8 warps), backward 64x64 without
    sequence parallelism (8 warps), both among gr's own."""
    fwd = [c for c in gr._hstu_attn_fwd.configs
           if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) == (128, 64, 8)]
    bwd = [c for c in gr._hstu_attn_bwd.configs
           if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["SEQUENCE_PARALLEL"], c.num_warps)
           == (64, 64, False, 8)]
    gr._hstu_attn_fwd.configs, gr._hstu_attn_bwd.configs = fwd[:1], bwd[:1]


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _divide(a, b):
    return a / b


def interpreter_fixes(gr) -> None:
    """For --smoke only: make Triton's interpreter run gr's kernels as the compiler would (see the module
    docstring). Touches the interpreter's AST rewrite and two globals of gr's module, not the kernels."""
    import ast

    from triton.runtime import interpreter

    gr.fast_expf, gr.fast_dividef = _exp, _divide

    def boolop(op, *values):
        result = values[0]
        for value in values[1:]:
            if not hasattr(result, "handle"):  # a Python value: Python's semantics
                if (op == "and") != bool(result):
                    return result
                result = value
            else:
                result = (result & value) if op == "and" else (result | value)
        return result

    def visit_boolop(self, node):
        self.generic_visit(node)
        return ast.Call(func=ast.Name(id="_smoke_boolop", ctx=ast.Load()),
                        args=[ast.Constant(value="and" if isinstance(node.op, ast.And) else "or"),
                              *node.values], keywords=[])

    visit_assign = interpreter.ASTTransformer.visit_Assign

    def visit_assign_deep(self, node):  # the interpreter's own visit_Assign skips the value
        node.value = self.visit(node.value)
        return visit_assign(self, node)

    interpreter.ASTTransformer.visit_BoolOp = visit_boolop
    interpreter.ASTTransformer.visit_Assign = visit_assign_deep
    gr._smoke_boolop = boolop
    gr._hstu_attn_fwd.configs = [c for c in gr._hstu_attn_fwd.configs
                                 if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (16, 32)][:1]
    gr._hstu_attn_bwd.configs = [c for c in gr._hstu_attn_bwd.configs
                                 if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (16, 32)][:1]


def inputs(case: HstuCase, dtype, device, grad: bool):
    """q, k [T, H, D], v and the cotangent do [T, H, V] (standard normal, seeded), offsets [B+1] and
    num_targets [B] (int64) or None."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens = int(case.lengths().sum())

    def normal(dim):
        x = torch.randn((tokens, case.heads, dim), generator=generator).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = normal(case.head_dim), normal(case.head_dim), normal(case.value_dim)
    do = normal(case.value_dim).detach()
    offsets = torch.tensor(case.offsets(), dtype=torch.int64, device=device)
    targets = case.num_targets()
    targets = None if targets is None else torch.tensor(targets, dtype=torch.int64, device=device)
    return q, k, v, do, offsets, targets


def call(gr, case: HstuCase, q, k, v, offsets, targets, tma: bool):
    return gr.triton_hstu_mha(case.max_seq_len, case.alpha, q, k, v, offsets, num_targets=targets,
                              max_attn_len=case.max_attn_len, contextual_seq_len=case.contextual_seq_len,
                              sort_by_length=False, enable_tma=tma)


def step(gr, case, mode, arrays, tma):
    """The timed function: the forward, or the forward and its backward."""
    q, k, v, do, offsets, targets = arrays
    if mode == "fwd":
        return lambda: call(gr, case, q, k, v, offsets, targets, tma)

    def forward_backward():
        call(gr, case, q, k, v, offsets, targets, tma).backward(do)

    return forward_backward


def best_configs(gr) -> dict:
    def describe(kernel):
        config = getattr(kernel, "best_config", None)
        return None if config is None else dict(config.all_kwargs(), num_warps=config.num_warps,
                                                num_stages=config.num_stages)

    return {"fwd": describe(gr._hstu_attn_fwd), "bwd": describe(gr._hstu_attn_bwd)}


def measure(gr, case: HstuCase, dtype: str, mode: str, *, tma: bool, smoke: bool) -> dict:
    row = dict(case=case.name, impl=IMPL, dtype=dtype, mode=mode, **case.describe(), flops=case.flops(mode))
    device = "cpu" if smoke else "cuda"
    try:
        arrays = inputs(case, DTYPES[dtype], device, grad=mode != "fwd")
        fn = step(gr, case, mode, arrays, tma)
        grads = list(arrays[:3]) if mode != "fwd" else None
        if smoke:
            fn()  # autotuning (none here) and first use
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            row.update(ms=statistics.median(times), timer="wall-clock (interpreter)",
                       max_error=smoke_check(gr, case, arrays, mode))
        else:
            fn()  # autotuning and compilation, outside the timings and the memory figure
            for x in grads or ():
                x.grad = None  # so that the peak counts the gradients' allocation
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            row.update(peak_bytes=peak, peak_over_inputs_bytes=peak - base)
            row.update(ms=triton.testing.do_bench(fn, grad_to_none=grads, return_mode="median"),
                       timer="triton.testing.do_bench median")
        row.update(status="ok", tflops=row["flops"] / row["ms"] / 1e9, configs=best_configs(gr))
    except Exception as err:  # one case failing (memory, compilation) leaves the others
        row.update(status=f"error: {type(err).__name__}: {str(err)[:300]}")
    finally:
        if not smoke:
            torch.cuda.empty_cache()
    return row


def smoke_check(gr, case: HstuCase, arrays, mode: str) -> float:
    """Largest error of o (and dq, dk, dv) against a float64 dense computation of gr's semantics, over
    the largest value: a check that the harness calls the kernel right, for --smoke."""
    q, k, v, do, offsets, targets = arrays
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = call(gr, case, q, k, v, offsets, targets, False)
    want = torch.zeros_like(v64)
    for b in range(case.batch):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n, c = end - start, case.contextual_seq_len
        ids = torch.arange(n)
        history_end = n
        if c > 0:
            ids, history_end = torch.clamp(ids - c + 1, min=0), n - c + 1
        if targets is not None:
            history_end -= int(targets[b])
            ids = torch.clamp(ids, max=history_end)
        d = ids[:, None] - ids[None, :]
        mask = torch.eye(n, dtype=torch.bool) | (d > 0)
        if case.max_attn_len > 0:
            mask &= d <= case.max_attn_len
        if c > 0:
            mask |= (ids[:, None] == 0) & (ids[None, :] < history_end)
        u = case.alpha * torch.einsum("ihd,jhd->hij", q64[start:end], k64[start:end])
        weights = torch.nn.functional.silu(u) * mask / case.max_seq_len
        want[start:end] = torch.einsum("hij,jhv->ihv", weights, v64[start:end])
    errors = [((out.double() - want).abs().max() / want.abs().max()).detach()]
    if mode != "fwd":
        grads = torch.autograd.grad(out, (q, k, v), do)
        expected = torch.autograd.grad(want, (q64, k64, v64), do.double())
        errors += [(g.double() - e).abs().max() / e.abs().max() for g, e in zip(grads, expected)]
    return float(max(errors))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, help="JSON output (rows and the run's metadata)")
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--no-long", action="store_true", help="leave out the long cases (L >= 4096)")
    p.add_argument("--dtypes", nargs="*", default=["bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--autotune", choices=("full", "pinned"), default="full")
    p.add_argument("--tma", action="store_true", help="gr's enable_tma=True (host TMA descriptors)")
    p.add_argument("--tf32", action="store_true", help="float32 matmuls in TF32 (gr reads the flag)")
    p.add_argument("--smoke", action="store_true", help="the CPU interpreter on shrunk cases (a check)")
    args = p.parse_args(argv)

    gr = load_gr()
    if args.smoke:
        interpreter_fixes(gr)
        args.dtypes = ["float32"]  # the interpreter's bfloat16 (3.6) gives garbage: not gr's kernel
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --smoke for the CPU check")
    elif args.autotune == "pinned":
        pin_configs(gr)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    cases = select(args.cases, long=not args.no_long)
    if args.smoke:
        cases = [c.shrunk() for c in cases]
    gpu = torch.cuda.is_available() and not args.smoke
    meta = dict(impl=IMPL, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), device=torch.cuda.get_device_name() if gpu else "cpu",
                autotune="interpreter" if args.smoke else args.autotune, tma=args.tma, tf32=args.tf32,
                gr_commit=(GR / "COMMIT").read_text().strip() if (GR / "COMMIT").exists() else None,
                note="alpha = 1/sqrt(D); attention scale 1/max_seq_len; causal; inputs standard normal")
    rows = []
    for case in cases:
        for dtype in args.dtypes:
            for mode in args.modes:
                row = measure(gr, case, dtype, mode, tma=args.tma, smoke=args.smoke)
                rows.append(row)
                shown = (f"{row['ms']:.3f} ms {row['tflops']:.1f} TF/s" if row["status"] == "ok"
                         else row["status"])
                extra = f" max error {row['max_error']:.1e}" if "max_error" in row else ""
                peak = f" peak {row['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in row else ""
                print(f"{case.name:42s} {dtype:9s} {mode:8s} {shown}{peak}{extra}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    failed = [r for r in rows if r["status"] != "ok" or r.get("max_error", 0) > 1e-2]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
