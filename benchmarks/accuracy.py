"""Error of the output and of the three gradients against a float64 computation, as logits grow.

Two studies, on FBGEMM's op (no scale, output / max_seq_len):
- "logits": float32 (no TF32), standard-normal q and k times c, so |q.k| grows as c^2;
- "fp16": float16 with q, k uniform in [20, 26] and D = 128, where q.k passes float16's 65504.
The error of x is max|x - x64| / max|x64| over the whole array, x64 from jagged_attention_reference
(dense, in float64 on the CPU) on the same rounded inputs; where x64 is 0 everywhere (dq and dk once
every softmax row is one-hot in float64), the error is max|x| itself, marked "abs". Writes
OUT/accuracy.json and accuracy.md.

    python -m benchmarks.accuracy --out OUT [--impls jfa-interpret,jfa-xla] [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jagged_flash_jax import jagged_attention_reference, offsets_from_lengths

from . import impls
from .cases import Case, InputSet

LOGIT_FACTORS = (1.0, 8.0, 21.0, 70.0, 210.0, 1e10)
NAMES = ("o", "dq", "dk", "dv")


def _impl(name: str, case: Case):
    """(attend, prepare) as in benchmarks.impls; this library without TF32."""
    if name == "cudnn-packed":
        return impls.cudnn_packed(case)
    if not name.startswith("jfa-"):
        raise ValueError(f"unknown implementation {name!r}: jfa-<backend> or cudnn-packed")
    return impls.jfa(case, name.removeprefix("jfa-"), allow_tf32=False)


def max_logit(s: InputSet) -> float:
    """max |q_i . k_j| over the attended pairs."""
    q, k = (np.asarray(x.astype(jnp.float32), np.float64) for x in s[:2])
    bounds = np.asarray(s.offsets)
    return max(float(np.max(np.abs(np.einsum("ihd,jhd->hij", q[a:a + n], k[a:a + n]))))
               for a, n in zip(bounds[:-1], np.asarray(s.lengths)) if n)


def inputs(case: Case, dtype, study: str, factor: float, seed: int = 0) -> InputSet:
    lengths = case.lengths()
    shape = (int(lengths.sum()), case.heads, case.head_dim)
    rng = np.random.default_rng(seed)
    if study == "fp16":
        q, k = (rng.uniform(20.0, 26.0, shape) for _ in range(2))
    else:
        q, k = (factor * rng.standard_normal(shape) for _ in range(2))
    v, do = (rng.standard_normal(shape) for _ in range(2))
    n = jnp.asarray(np.minimum(lengths, case.max_seq_len), jnp.int32)
    offsets = offsets_from_lengths(lengths)
    return InputSet(*(jnp.asarray(x, dtype) for x in (q, k, v, do)), offsets, offsets, n, n)


def float64_results(case: Case, s: InputSet) -> list[np.ndarray]:
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        q, k, v, do = (jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in s[:4])
        offsets = jnp.asarray(np.asarray(s.offsets))
        op = lambda q, k, v: jagged_attention_reference(q, k, v, offsets, case.max_seq_len, scale=1.0,
                                                        out_scale=1.0 / case.max_seq_len)
        o, vjp = jax.vjp(op, q, k, v)
        return [np.asarray(x) for x in (o, *vjp(do))]


def measure(name: str, case: Case, s: InputSet, expected: list[np.ndarray]) -> dict:
    try:
        attend, prepare = _impl(name, case)
    except impls.Unsupported as err:
        return dict(status="unsupported", reason=str(err))
    q, k, v, do, aux = prepare(s)
    try:
        o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *aux), q, k, v)
        got = [np.asarray(x[:e.shape[0]].astype(jnp.float32), np.float64)  # cudnn-packed pads a row
               for x, e in zip((o, *vjp(do)), expected)]
    except Exception as err:  # e.g. cuDNN refusing a shape: recorded, the other rows go on
        return dict(status="error", reason=f"{type(err).__name__}: {str(err)[:300]}")
    errors = {n: float(np.max(np.abs(g - e)) / (np.max(np.abs(e)) or 1.0))
              for n, g, e in zip(NAMES, got, expected)}
    absolute = [n for n, e in zip(NAMES, expected) if not np.any(e)]
    finite = all(bool(np.all(np.isfinite(g))) for g in got)
    return dict(status="ok", finite=finite, absolute=absolute, **errors)


def studies(quick: bool):
    scale = 8 if quick else 1
    logits = Case("acc-logits", "fbgemm", 4, 2, 64, 256 // scale, 64 // scale)
    fp16 = Case("acc-fp16", "fbgemm", 8, 2, 128, 512 // scale, 128 // scale)
    yield "logits", logits, jnp.float32, LOGIT_FACTORS
    yield "fp16", fp16, jnp.float16, (1.0,)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--impls", default="jfa-interpret,jfa-xla",
                   help="comma-separated: jfa-<backend> (this library, no TF32) or cudnn-packed")
    p.add_argument("--quick", action="store_true", help="smaller sequences")
    args = p.parse_args(argv)
    rows = []
    for study, case, dtype, factors in studies(args.quick):
        for factor in factors:
            s = inputs(case, dtype, study, factor)
            expected = float64_results(case, s)
            logit = max_logit(s)
            for name in args.impls.split(","):
                row = dict(study=study, dtype=jnp.dtype(dtype).name, factor=factor, impl=name,
                           max_logit=logit, **measure(name, case, s, expected))
                rows.append(row)
                print(f"[accuracy] {json.dumps(row)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows),
                                                       indent=1))
    lines = ["| study | dtype | q, k factor | max abs logit | impl | o | dq | dk | dv |", "|---" * 9 + "|"]
    for r in rows:
        cells = [(f"{r[n]:.1e}" + " abs" * (n in r["absolute"])) if r["status"] == "ok" else r["status"]
                 for n in NAMES]
        lines.append(f"| {r['study']} | {r['dtype']} | {r['factor']:g} | {r['max_logit']:.2g} | "
                     f"{r['impl']} | " + " | ".join(cells) + " |")
    (args.out / "accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
