"""Writes results.md and PNG plots from the results.json and/or scaling.json of a folder (measured ratios,
nothing else): `python -m benchmarks.report --results DIR [--fbgemm-json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

OURS = "jfa-triton"
FBGEMM = "fbgemm-pytorch"
FBGEMM_LABEL = "fbgemm-pytorch (measured separately with its PyTorch kernel)"
# NAME-3.9: the same kernels under triton 3.9, where a run is filed so (benchmarks.merge --rename)
IMPL_ORDER = (OURS, "jfa-triton-3.9", "jfa-triton-nondeterministic", "jfa-triton-nondeterministic-3.9",
              "jfa-triton-fused-dq", "jfa-triton-fused-dq-3.9",
              "jfa-triton-hopper-bwd", "jfa-triton-hopper-bwd-3.9", "jfa-triton-portable-bwd",
              "jfa-triton-portable-bwd-3.9", "jfa-triton-pointer-loads", "jfa-triton-pointer-loads-3.9",
              "jfa-triton-tma-loads", "jfa-triton-tma-loads-3.9", "jfa-xla", "cudnn-packed", "cudnn-padded",
              FBGEMM)


def ok(row) -> bool:
    return row is not None and row.get("status") == "ok" and (row.get("ms") or 0) > 0


def merge_fbgemm(results: dict, path) -> int:
    """Replaces the fbgemm-pytorch rows by seed_torch_bench.py's (a list, or {"rows": [...]})."""
    data = json.loads(pathlib.Path(path).read_text())
    ours = {(r["case"], r["dtype"], r["mode"]): r for r in results["rows"] if r["impl"] != FBGEMM}
    results["rows"] = [r for r in results["rows"] if r["impl"] != FBGEMM]
    for row in data.get("rows", []) if isinstance(data, dict) else data:
        mine = ours.get((row.get("case"), row.get("dtype"), row.get("mode")))
        if mine is not None and row.get("ms"):
            results["rows"].append(dict(
                {k: mine[k] for k in ("case", "dtype", "mode", "group", "L", "D", "flops")}, impl=FBGEMM,
                status="ok", ms=row["ms"], tflops=mine["flops"] / row["ms"] / 1e9, timer="cuda-events",
                note=FBGEMM_LABEL, source=str(path)))
    return sum(r["impl"] == FBGEMM for r in results["rows"])


def _ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def group_table(rows: list[dict], group: str) -> list[str]:
    """One line per (case, dtype, mode): ms (TF/s) per implementation, then each one's time over ours."""
    rows = [r for r in rows if r["group"] == group]
    index = {(r["case"], r["impl"], r["dtype"], r["mode"]): r for r in rows}
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
    ratios = [i for i in impls if i != OURS and any(ok(r) and r["impl"] == i for r in rows)]
    ratios = ratios if any(ok(r) and r["impl"] == OURS for r in rows) else []
    header = ["case", "dtype", "mode", *(f"{i} ms (TF/s)" for i in impls), *(f"{i} / {OURS}" for i in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case, dtype, mode in dict.fromkeys((r["case"], r["dtype"], r["mode"]) for r in rows):
        cells = [case, dtype, mode]
        for impl in impls:
            row = index.get((case, impl, dtype, mode)) or {"status": "-"}
            cells.append(f"{_ms(row['ms'])} ({row['tflops']:.3g})" if ok(row) else row["status"])
        ours = index.get((case, OURS, dtype, mode))
        for impl in ratios:
            row = index.get((case, impl, dtype, mode))
            cells.append(f"{row['ms'] / ours['ms']:.2f}" if ok(row) and ok(ours) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(data: dict) -> str:
    out = []
    if "results" in data:
        meta, rows = data["results"]["metadata"], data["results"]["rows"]
        versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
        out += [f"## Benchmarks: {meta.get('device')}, {meta.get('date')}", "",
                f"`{meta.get('command')}`{' (quick: tiny shapes)' if meta.get('quick') else ''}; {versions}; "
                f"tiles: {meta.get('tuned_configs')}.", "",
                f"Cells: median ms per call (TF/s of useful work); `x / {OURS}`: x's time over {OURS}'s. "
                + " ".join(meta.get("notes", [])), ""]
        if any(r["impl"] == FBGEMM for r in rows):
            out += [f"{FBGEMM_LABEL}: CUDA-event times from seed_torch_bench.py, not from this run.", ""]
        if any(ok(r) and r.get("timer") == "wall" for r in rows):
            out += ["Rows without CUPTI (`timer: wall`) show wall-clock times.", ""]
        for group in dict.fromkeys(r["group"] for r in rows):
            out += [f"### {group}", "", *group_table(rows, group), ""]
        problems = [r for r in rows if r["status"] in ("error", "unsupported") or r.get("finite") is False]
        out += ["### Errors, unsupported rows, non-finite outputs", ""] * bool(problems)
        out += [f"- {r['case']} {r['impl']} {r['dtype']} {r['mode']}: {r['status']}"
                f"{' (non-finite output)' if r.get('finite') is False else ''} "
                f"{(r.get('error') or ' ').splitlines()[0][:200]}" for r in problems] + [""]
    if "scaling" in data:
        meta, rows = data["scaling"]["metadata"], data["scaling"]["rows"]
        out += ["## Scaling", "", f"{meta['device_count']} x {meta['device']}: {meta['note']}",
                "", "| case | setup | ms per step | time / one share | throughput scaling | HLO check |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['case']} | {r['setup']} | " + (
            f"{_ms(r['ms'])} | {r['time_ratio']:.2f} | {r['scaling']:.2f} | {r.get('hlo_check', '')} |"
            if "scaling" in r else f"{r['status']}: {r.get('error', '')[:150]} | | | |") for r in rows]
    return "\n".join(out) + "\n"


def _sweep_plot(plt, rows: list[dict], x, xlabel: str, y: str):
    """One panel per mode: y against x(row) per implementation, log-2 x axis."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl in IMPL_ORDER:
            points = sorted((x(r), r[y]) for r in rows if r["impl"] == impl and r["mode"] == mode)
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel, ylabel={"tflops": "TF/s", "ms": "ms"}[y], title=f"bfloat16 {mode}")
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def plot(data: dict, folder: pathlib.Path) -> list[str]:
    """lsweep.png (bf16 TF/s against L), window.png (bf16 ms against the window at the window sweep's L)
    and scaling.png (throughput scaling per case); the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = [r for r in data.get("results", {}).get("rows", []) if r["dtype"] == "bfloat16" and ok(r)]
    sweep = [r for r in rows if r["group"] == "L-sweep"]
    if sweep:
        _sweep_plot(plt, sweep, lambda r: r["L"], "L (lengths uniform in [L/2, L], ~65k tokens, H=8, D=128)",
                    "tflops").savefig(folder / "lsweep.png", dpi=100)
        written.append("lsweep.png")
    length = max((r["L"] for r in rows if r["group"] == "window-sweep"), default=None)
    windows = [r for r in rows if r["group"] in ("window", "window-sweep") and r["L"] == length]
    if windows:  # an unbounded window is drawn at L
        left = lambda r: length if r["window"][0] is None else r["window"][0]  # noqa: E731
        fig = _sweep_plot(plt, windows, left, f"w in window=(w, 0) ({length}: None, unbounded)", "ms")
        fig.suptitle(f"local attention: L={length} (~65k tokens, H=8, D=128)")
        for ax in fig.axes:
            ax.set_yscale("log")
        fig.savefig(folder / "window.png", dpi=100)
        written.append("window.png")
    scaling = [r for r in data.get("scaling", {}).get("rows", []) if "scaling" in r and r["devices"] > 1]
    if scaling:
        meta = data["scaling"]["metadata"]
        cases, setups = (list(dict.fromkeys(r[k] for r in scaling)) for k in ("case", "setup"))
        fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
        for j, setup in enumerate(setups):
            for i, case in enumerate(cases):
                value = [r["scaling"] for r in scaling if (r["case"], r["setup"]) == (case, setup)]
                ax.bar(i + (j - (len(setups) - 1) / 2) * 0.8 / len(setups), value or [0], 0.8 / len(setups),
                       color=f"C{j}", label=setup if i == 0 else None)
        ax.axhline(meta["device_count"], color="black", lw=0.8, ls="--", label="device count")
        ax.set_xticks(range(len(cases)), cases)
        ax.set(ylabel="N x one-share time / N-device time",
               title=f"{meta['device_count']} x {meta['device']}")
        ax.legend(fontsize="small")
        fig.savefig(folder / "scaling.png", dpi=100)
        written.append("scaling.png")
    plt.close("all")
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    p.add_argument("--results", type=pathlib.Path, required=True, help="has results.json, scaling.json")
    p.add_argument("--fbgemm-json", type=pathlib.Path, help="seed_torch_bench.py's rows to merge")
    args = p.parse_args(argv)
    data = {name: json.loads((args.results / f"{name}.json").read_text())
            for name in ("results", "scaling") if (args.results / f"{name}.json").exists()}
    if not data:
        raise SystemExit(f"no results.json or scaling.json in {args.results}")
    if args.fbgemm_json and "results" in data:
        print(f"[report] {merge_fbgemm(data['results'], args.fbgemm_json)} rows from {args.fbgemm_json}")
        (args.results / "results.json").write_text(json.dumps(data["results"], indent=1))
    (args.results / "results.md").write_text(markdown(data))
    print(f"[report] wrote {', '.join(['results.md', *plot(data, args.results)])} in {args.results}")


if __name__ == "__main__":
    main()
