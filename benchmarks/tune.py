"""Sweeps the portable kernels' tiles per (case, dtype) through the public block_sizes= argument, as
benchmarks.run rows (OUT/results.json: same workers, timing and crash records), and writes
OUT/tuned_configs.json, the table $JAGGED_FLASH_JAX_TUNED_CONFIGS takes, in the form of configs.py's
built-in table. The portable kernels run wherever the Hopper ones would (their tiles are the table's
"hopper" entries, not block_sizes=): the entries serve every GPU, and Hopper problems the Hopper kernels
cannot take.
"""

from __future__ import annotations

import json
import os

from jagged_flash_jax import configs, select

from . import impls, run

# (bits, padded D up to) -> forward tiles (block_m, block_n, warps, stages) and backward tiles, pairs of
# (dk/dv, dq) tiles of that form, tried one kernel at a time with the default for the other. dk/dv and dq
# with unequal warps or stages run in separate launches.
CANDIDATES = {
    (16, 64): dict(fwd=[(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)],
                   bwd=[((32, 64, 4, 3), (64, 32, 4, 3)), ((32, 64, 4, 3), (128, 32, 8, 3)),
                        ((32, 64, 4, 2), (128, 32, 8, 3)), ((64, 128, 8, 2), (128, 64, 8, 2)),
                        ((64, 64, 8, 2), (64, 64, 8, 2)), ((32, 64, 4, 2), (64, 32, 4, 3))]),
    (16, 128): dict(fwd=[(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
                    bwd=[((64, 128, 8, 2), (128, 128, 8, 2)), ((64, 128, 8, 2), (128, 64, 8, 2)),
                         ((64, 128, 8, 2), (128, 64, 8, 3)), ((32, 64, 4, 3), (128, 32, 4, 3)),
                         ((32, 128, 8, 2), (128, 64, 8, 2)), ((128, 128, 8, 2), (128, 64, 8, 2))]),
    (16, 256): dict(fwd=[(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3)],
                    bwd=[((64, 64, 8, 2), (128, 32, 8, 3)), ((64, 64, 8, 2), (128, 32, 8, 2)),
                         ((64, 64, 8, 2), (64, 64, 8, 2)), ((32, 64, 4, 1), (64, 32, 4, 1))]),
    (32, 64): dict(fwd=[(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2), (32, 16, 2, 2), (64, 16, 4, 2)],
                   bwd=[((32, 64, 4, 2), (64, 32, 4, 2)), ((32, 128, 8, 2), (128, 32, 8, 2)),
                        ((32, 128, 8, 2), (64, 32, 4, 2))]),
    (32, 128): dict(fwd=[(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
                    bwd=[((32, 128, 8, 2), (128, 32, 8, 2)), ((16, 128, 8, 2), (128, 16, 8, 2)),
                         ((32, 64, 8, 2), (128, 32, 8, 2)), ((32, 128, 8, 2), (128, 64, 8, 1))]),
}
TUNE_CASES = "long,rec-long,L4096-D256,L4096-D64,rec-mid,rec-small"  # one per entry of the table


def tile_jobs(case, dtype: str, backend: str, candidates: dict | None = None) -> list[tuple]:
    """benchmarks.run jobs, one per candidate (CANDIDATES' for the case, or `candidates`, of the form of
    one CANDIDATES value); the impl label holds the tiles tried."""
    bits = configs.table_bits(dtype)
    table = candidates or next((v for (b, d), v in sorted(CANDIDATES.items())
                                if b == bits and d >= case.head_dim), {})
    tries = [("fwd", dict(fwd=t)) for t in table.get("fwd", [])]
    tries += [("fwd+bwd", dict(dkdv=dkdv, dq=dq)) for dkdv, dq in table.get("bwd", [])]
    jobs = []
    for mode, tiles in tries:
        def make(case, tiles=tiles):
            default = configs.default_block_sizes(
                case.head_dim, dtype, case.max_seq_len, case.kv_max_seq_len,
                configs.band_width(case.window or (None, None), case.causal), causal=case.causal)
            entry = dict(configs.entry_to_json(("", "portable", bits, 0, None), default), **tiles)
            return impls.jfa(case, backend, configs.entry_from_json(entry)[1])
        jobs.append((f"jfa-{backend} {json.dumps(tiles)}", mode, make, backend == "triton"))
    return jobs


def choose(rows: list[dict], gpu: str) -> dict:
    """For each table key, per kernel: the tiles with the least time relative to each case's fastest, summed
    over the cases of the key (among the tiles that ran on all of them). The forward's tiles of causal
    cases are the entry's fwd_causal, kept where they differ from fwd's."""
    rows = [r for r in rows if r.get("status") == "ok"]
    fastest = {}
    for r in rows:
        slot = (r["case"], r["dtype"], r["mode"])
        fastest[slot] = min(r["ms"], fastest.get(slot, r["ms"]))
    scores = {}
    for r in rows:
        key = (gpu, *configs.table_key(r["D"], r["dtype"], r["L"], gpu=configs.FALLBACK_GPU)[1:])
        tiles, mode = r["impl"].split(" ", 1)[1], r["mode"]
        if r.get("causal") and "fwd" in json.loads(tiles):
            tiles, mode = json.dumps(dict(fwd_causal=json.loads(tiles)["fwd"])), "fwd_causal"
        scores.setdefault(key, {}).setdefault(mode, {}).setdefault(tiles, []).append(
            r["ms"] / fastest[r["case"], r["dtype"], r["mode"]])
    table = {}
    for key, by_mode in scores.items():
        entry = configs.entry_to_json(key, configs.BUILTIN_TABLE[(configs.FALLBACK_GPU, *key[1:])])
        for by_tiles in by_mode.values():
            count = max(len(v) for v in by_tiles.values())
            entry.update(json.loads(min((t for t, v in by_tiles.items() if len(v) == count),
                                        key=lambda t: sum(by_tiles[t]))))
        if entry.get("fwd_causal") and configs.KernelConfig(*entry["fwd_causal"]) == configs.KernelConfig(
                *entry["fwd"]):
            entry["fwd_causal"] = None
        table.update([configs.entry_from_json(entry)])
    return table


def main(argv=None) -> None:
    p = run.parser("python -m benchmarks.tune", __doc__)
    p.add_argument("--backend", default="triton", help="'interpret' checks this script on a CPU")
    p.add_argument("--candidates", type=json.loads,
                   help='tiles to try instead of CANDIDATES\', as JSON: {"fwd": [[block_m, block_n, warps, '
                        'stages(, max_registers)], ...], "bwd": [[dkdv, dq], ...]}')
    p.set_defaults(cases=TUNE_CASES, dtypes="bfloat16,float32", seconds=0.1)
    args = p.parse_args(argv)
    for env in (select.FORWARD_ENV, select.BACKWARD_ENV):  # for the workers too
        os.environ[env] = "portable"
    jobs = lambda case, dtype: tile_jobs(case, dtype, args.backend, args.candidates)  # noqa: E731
    results = run.run_cases(args, argv, jobs, "benchmarks.tune")
    if results is None:  # a worker
        return
    gpu = results["metadata"].get("device", "unknown")
    gpu = gpu if args.backend == "triton" else f"{gpu} ({args.backend} backend: not a real table)"
    table = configs.table_to_json(choose(results["rows"], gpu))
    (args.out / "tuned_configs.json").write_text(json.dumps(table, indent=1))
    for row in results["rows"]:
        if row["status"] != "ok":
            print(f"[tune] {row['case']} {row['dtype']} {row['impl']} {row['mode']}: {row['status']}: "
                  f"{(row.get('error') or row.get('reason', '')).splitlines()[0][:200]}")
    print("\n".join(f"[tune] {json.dumps(entry)}" for entry in table))
    print(f"[tune] wrote results.json (every row) and tuned_configs.json in {args.out}")


if __name__ == "__main__":
    main()
