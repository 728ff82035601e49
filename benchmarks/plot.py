"""The report of a benchmark run: speedups, the markdown tables and the figure, from results.json alone.

Importable without a GPU (matplotlib is imported only to draw). Re-make a report with
`python -m benchmarks.plot benchmarks/results/results.json`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

SEED = "seed-pytorch"
TRITON = "jfa-triton"
CUDNN = "cudnn-padded"
IMPL_ORDER = (SEED, TRITON, CUDNN, "cudnn+convert", "jfa-xla", "xla-padded")
MODES = ("fwd", "fwd+bwd")
MEMORY_TARGET = 1.5  # (argument + output + temp) / minimal bytes, for `long` fwd+bwd jfa-triton


def load_results(path) -> dict:
    """The results dict ({"metadata": ..., "rows": [...]}) of a results.json; a bare list is all rows."""
    data = json.loads(pathlib.Path(path).read_text())
    if isinstance(data, list):
        data = {"metadata": {}, "rows": data}
    add_speedups(data)
    return data


def _ok(row) -> bool:
    return row is not None and row.get("status", "ok") == "ok" and row.get("ms") is not None


def index_rows(rows) -> dict:
    """(case, impl, dtype, mode) -> row; a later row replaces an earlier one."""
    return {(r["case"], r["impl"], r["dtype"], r["mode"]): r for r in rows}


def add_speedups(results: dict) -> None:
    """Set speedup_vs_seed and speedup_vs_cudnn_padded (their ms over this row's ms) on every timed row."""
    index = index_rows(results["rows"])
    for row in results["rows"]:
        if not _ok(row) or row["impl"] == SEED:
            continue
        for key, baseline in (("speedup_vs_seed", SEED), ("speedup_vs_cudnn_padded", CUDNN)):
            other = index.get((row["case"], baseline, row["dtype"], row["mode"]))
            if _ok(other) and row["impl"] != baseline and row["ms"] > 0:
                row[key] = round(other["ms"] / row["ms"], 3)
        # The seed's CUDA-event times hold its launch gaps; our pipelined time holds ours.
        seed = index.get((row["case"], SEED, row["dtype"], row["mode"]))
        if _ok(seed) and row.get("pipelined_ms"):
            row["speedup_vs_seed_pipelined"] = round(seed["ms"] / row["pipelined_ms"], 3)


def _cases(rows) -> list[str]:
    """Case names in the order they ran (seed rows of cases that did not run are left out)."""
    ours = [r["case"] for r in rows if r["impl"] != SEED]
    names = ours or [r["case"] for r in rows]
    return list(dict.fromkeys(names))


def _ms(value: float) -> str:
    if value < 1:
        return f"{value:.3f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _cell(row, with_tflops: bool = False) -> str:
    if row is None:
        return "—"
    status = row.get("status", "ok")
    if status == "skipped":
        return "n/a"
    if not _ok(row):
        return "error"
    text = _ms(row["ms"])
    if with_tflops and row.get("tflops") is not None:
        text += f" ({row['tflops']:.0f})" if row["tflops"] >= 10 else f" ({row['tflops']:.1f})"
    return text


def _speedup(row, key) -> str:
    return f"{row[key]:.2f}x" if row is not None and row.get(key) is not None else "—"


def _table(results: dict, dtype: str, impls: tuple[str, ...], pipelined_column: bool = False) -> list[str]:
    index = index_rows(results["rows"])
    header = ["case", "mode"]
    for impl in impls:
        header.append(f"{impl} ms (TFLOP/s)" if impl == TRITON else f"{impl} ms")
    with_cudnn = CUDNN in impls
    header += ["vs seed", "vs seed (pipelined)"] if pipelined_column else ["vs seed"]
    header += ["vs cuDNN"] if with_cudnn else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in _cases(results["rows"]):
        for mode in MODES:
            row_of = {impl: index.get((case, impl, dtype, mode)) for impl in impls}
            if all(row is None for row in row_of.values()):
                continue
            ours = index.get((case, TRITON, dtype, mode))
            cells = [case, mode] + [_cell(row_of[impl], impl == TRITON) for impl in impls]
            cells.append(_speedup(ours, "speedup_vs_seed"))
            if pipelined_column:
                cells.append(_speedup(ours, "speedup_vs_seed_pipelined"))
            if with_cudnn:
                cells.append(_speedup(ours, "speedup_vs_cudnn_padded"))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_summary(results: dict) -> list[str]:
    """The memory ratio of `long` fwd+bwd jfa-triton against its target, one line per dtype."""
    lines = []
    for row in results["rows"]:
        if (row["impl"] == TRITON and row["mode"] == "fwd+bwd" and row["case"].startswith("long")
                and row.get("memory_ratio") is not None):
            verdict = "meets" if row["memory_ratio"] <= MEMORY_TARGET else "misses"
            lines.append(f"- `{row['case']}` fwd+bwd jfa-triton {row['dtype']}: argument + output + temp "
                         f"= {row['memory']['total_bytes'] / 2**20:.0f} MiB, {row['memory_ratio']:.2f}x the "
                         f"bytes of q, k, v, o, do, dq, dk, dv and the float32 log-sum-exp ({verdict} the "
                         f"target <= {MEMORY_TARGET}).")
    return lines


def markdown_tables(results: dict) -> str:
    """The README's tables: bf16 in full, then smaller fp16 and fp32 tables, with the run's provenance."""
    meta = results.get("metadata", {})
    rows = results["rows"]
    out = [f"### Jagged flash attention benchmarks ({meta.get('device', '?')}, {meta.get('date', '?')})", ""]
    if meta.get("command"):
        out += [f"Command: `{meta['command']}`", ""]
    versions = ", ".join(f"{name} {meta[key]}" for name, key in (
        ("jax", "jax_version"), ("jaxlib", "jaxlib_version"), ("triton", "triton_version"),
        ("jax-triton", "jax_triton_version")) if meta.get(key))
    if versions:
        out += [f"Versions: {versions}.", ""]
    out += [
        "Times are medians in ms. Ours and the JAX baselines: device time summed over kernels (CUPTI), "
        f"{meta.get('iterations', '?')} calls rotating over fresh random input sets; the seed: "
        "`triton.testing.do_bench` medians (CUDA events, L2 flushed). TFLOP/s count useful work: "
        "forward 4·H·D·Σn², forward+backward 3.5× that. \"vs seed\" and \"vs cuDNN\" are the seed's and "
        "cudnn-padded's time over jfa-triton's device time; \"vs seed (pipelined)\" is the seed's time "
        "over jfa-triton's host time per call of many queued calls (launch gaps and JAX's dispatch "
        "included, as the seed's CUDA events include its launch gaps): the fairer ratio where kernels "
        "are short. cudnn-padded and xla-padded get inputs "
        "already padded to [B, max_seq_len, H, D] (padding not timed); cudnn+convert times the jagged -> "
        "padded -> jagged conversion too.", ""]
    if any(r.get("timer") == "wall" for r in rows):
        out += ["**Some rows were timed by the wall clock (no CUPTI here): see `timer` in results.json.**",
                ""]
    present = {r["dtype"] for r in rows}
    for dtype, impls, pipelined_column in (
            ("bfloat16", (SEED, TRITON, CUDNN, "cudnn+convert", "jfa-xla"), True),
            ("float16", (SEED, TRITON, CUDNN, "jfa-xla"), False),
            ("float32", (SEED, TRITON, "xla-padded", "jfa-xla"), False)):
        if dtype not in present:
            continue
        label = dtype + (" (TF32 matrix products; cuDNN has no float32)" if dtype == "float32" else "")
        out += [f"**{label}**", ""] + _table(results, dtype, impls, pipelined_column) + [""]
    memory = memory_summary(results)
    if memory:
        out += ["Memory (XLA's memory analysis of the jitted forward + backward):", ""] + memory + [""]
    errors = [r for r in rows if r.get("status") == "error"]
    if errors:
        out += ["Errors:", ""]
        out += [f"- {r['case']} {r['impl']} {r['dtype']} {r['mode']}: "
                f"{r.get('error', '').splitlines()[0][:160] if r.get('error') else '?'}" for r in errors]
        out.append("")
    return "\n".join(out)


def plot_results(results: dict, path) -> None:
    """Bar charts of bf16 TFLOP/s per case and impl (fwd, fwd+bwd) and jfa-triton's speedups over the
    seed and cudnn-padded (another dtype only where the results hold no bfloat16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    index = index_rows(results["rows"])
    cases = _cases(results["rows"])
    present = [r["dtype"] for r in results["rows"] if _ok(r)]
    dtype = "bfloat16" if "bfloat16" in present or not present else present[0]
    impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in results["rows"])]
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 1.6 * len(cases) + 3), 12), constrained_layout=True)
    x = np.arange(len(cases))
    width = 0.8 / max(1, len(impls))
    for ax, mode in zip(axes[:2], MODES, strict=True):
        for j, impl in enumerate(impls):
            values = [index.get((c, impl, dtype, mode)) for c in cases]
            heights = [r["tflops"] if _ok(r) and r.get("tflops") else np.nan for r in values]
            ax.bar(x + (j - (len(impls) - 1) / 2) * width, heights, width, label=impl)
        ax.set_yscale("log")
        ax.set_ylabel("TFLOP/s (useful work)")
        ax.set_title(f"{dtype} {mode}")
        ax.set_xticks(x, cases)
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=max(1, min(len(impls), 6)))

    series = [(f"vs {base}, {mode}", base, mode) for base in (SEED, CUDNN) for mode in MODES]
    width = 0.8 / len(series)
    ax = axes[2]
    for j, (label, base, mode) in enumerate(series):
        key = "speedup_vs_seed" if base == SEED else "speedup_vs_cudnn_padded"
        rows = [index.get((c, TRITON, dtype, mode)) for c in cases]
        heights = [row[key] if row is not None and row.get(key) else np.nan for row in rows]
        bars = ax.bar(x + (j - (len(series) - 1) / 2) * width, heights, width, label=label)
        ax.bar_label(bars, ["" if np.isnan(h) else f"{h:.2g}" for h in heights], fontsize="x-small")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup of jfa-triton (x)")
    ax.set_title(f"jfa-triton speedup, {dtype} (baseline ms / jfa-triton ms; > 1: jfa-triton is faster)")
    ax.set_xticks(x, cases)
    ax.legend(fontsize="small")
    ax.grid(axis="y", which="both", alpha=0.3)
    meta = results.get("metadata", {})
    axes[0].set_title(f"Jagged flash attention, {meta.get('device', '?')} ({meta.get('date', '?')}): "
                      f"{dtype} fwd")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, out_dir, figure: bool = True) -> str:
    """Write results.md (and results.png) into out_dir; returns the markdown."""
    out_dir = pathlib.Path(out_dir)
    add_speedups(results)
    text = markdown_tables(results)
    (out_dir / "results.md").write_text(text + "\n")
    if figure:
        try:
            plot_results(results, out_dir / "results.png")
        except Exception as err:  # a missing matplotlib must not lose the tables
            print(f"[bench] could not draw results.png: {err!r}")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", help="path of a results.json")
    parser.add_argument("--out", help="folder for results.md and results.png (default: beside the json)")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    print(write_report(results, args.out or pathlib.Path(args.results).parent))


if __name__ == "__main__":
    main()
