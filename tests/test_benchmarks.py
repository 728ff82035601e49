"""The benchmark suite: its FLOP counts against a dense count of the attended pairs, and a quick run that
measures the xla backend on the CPU and writes the report, and the tile sweep (benchmarks.tune) in the
interpreter."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not an installed package
from benchmarks import cases as C  # noqa: E402


def dense_pairs(case: C.Case) -> int:
    """Query-key pairs attended, from the full [n_q, n_k] mask of each sequence (bottom-right aligned)."""
    left, right = case.window or (None, None)
    pairs = 0
    for n_q, n_k in zip(np.minimum(case.lengths(), case.max_seq_len),
                        np.minimum(case.kv_lengths(), case.kv_max_seq_len)):
        i, j = np.arange(n_q)[:, None] + n_k - n_q, np.arange(n_k)[None, :]
        mask = np.ones((n_q, n_k), bool)
        if case.causal:
            mask &= j <= i
        if left is not None:
            mask &= j >= i - left
        if right is not None:
            mask &= j <= i + right
        pairs += int(mask.sum())
    return pairs


CROSS = dict(batch=7, heads=3, head_dim=8, max_seq_len=12, min_len=0, kv_len=(0, 20))  # n_q <, = and > n_k


@pytest.mark.parametrize("case", [
    *C.select(["causal", "window", "window-sweep", "softcap", "cross", "gqa"], quick=True),
    *(C.Case(f"cross-{window}-{causal}", "test", causal=causal, window=window, **CROSS)
      for window in (None, (3, 2), (0, 0), (None, 1), (5, None), (2, 0)) for causal in (False, True)),
], ids=lambda case: case.name)
def test_flops_count_exactly_the_attended_pairs(case):
    pairs = dense_pairs(case)
    assert pairs > 0
    expected = 4.0 * case.heads * case.head_dim * pairs
    assert case.flops("fwd") == expected
    assert case.flops("fwd+bwd") == 3.5 * expected


def test_windows_shrink_with_the_quick_shapes():
    for case in C.select(["window", "window-sweep"], quick=False):
        small = case.shrunk()
        left, right = small.window
        assert right == 0 and (left is None) == (case.window[0] is None)
        assert left is None or 1 <= left < small.max_seq_len
    assert {c.name for c in C.select(["window"], quick=False)} == {
        "L4096-w256", "L4096-w1024", "L16384-w256", "L16384-w1024"}


def test_quick_run_measures_the_xla_backend_and_writes_the_report(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path),
               "--impls", "jfa-xla", "--cases", "L256", "--seconds", "0.01"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    (case,) = C.select(["L256"], quick=True)
    assert sorted(r["mode"] for r in rows) == sorted(C.MODES)
    for row in rows:
        assert row["impl"] == "jfa-xla" and row["status"] == "ok" and row["finite"] and row["ms"] > 0
        assert row["flops"] == case.flops(row["mode"]) and row["tokens"] == case.lengths().sum()
    assert "| L256 | bfloat16 | fwd |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "lsweep.png").stat().st_size > 0


def test_tune_times_each_candidate_and_writes_the_fastest_as_a_table(tmp_path):
    """benchmarks.tune: one benchmarks.run row per candidate tile (the portable kernels, through
    block_sizes=), and tuned_configs.json, a table the library loads, holding the fastest forward."""
    from jagged_flash_jax import configs

    candidates = [[32, 16, 4, 2], [16, 32, 4, 2]]
    command = [sys.executable, "-m", "benchmarks.tune", "--backend", "interpret", "--quick", "--cases",
               "rec-small", "--dtypes", "bfloat16", "--seconds", "0.01", "--out", str(tmp_path),
               "--candidates", json.dumps({"fwd": candidates})]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(r["status"] == "ok" and r["mode"] == "fwd" for r in rows)
    timed = {r["impl"].split(" ", 1)[1]: r["ms"] for r in rows}
    assert sorted(timed) == sorted(json.dumps({"fwd": c}) for c in candidates)
    fastest = json.loads(min(timed, key=timed.get))["fwd"]
    table = json.loads((tmp_path / "tuned_configs.json").read_text())
    ((key, entry),) = configs.table_from_json(table).items()
    assert key[2:4] == (16, 32)  # bfloat16, rec-small's head dimension
    assert entry.fwd == configs.KernelConfig(*fastest)


@pytest.mark.parametrize("causal_best", ["[64, 64, 4, 3]", "[128, 64, 8, 3]"])
def test_tune_chooses_the_forward_of_causal_cases_as_the_entry_fwd_causal(causal_best):
    """benchmarks.tune's choice: forward tiles by their time relative to each case's fastest, those of the
    unmasked cases as the entry's fwd, those of the causal ones as its fwd_causal, dropped where the two
    agree; the backward's tiles from the fwd+bwd rows of both."""
    from benchmarks import tune
    from jagged_flash_jax import configs

    tiles = ["[128, 64, 8, 3]", "[64, 64, 4, 3]"]
    rng = np.random.default_rng(len(causal_best))

    def row(case, causal, length, label, mode, ms):
        return dict(case=case, causal=causal, D=64, L=length, dtype="bfloat16", mode=mode, status="ok", ms=ms,
                    impl=f"jfa-triton {label}")

    rows = []
    for case, causal, length in (("a", False, 4096), ("b", False, 512), ("c", True, 4096), ("d", True, 600)):
        best = causal_best if causal else tiles[0]
        for t in tiles:
            ms = rng.uniform(1, 2) * (1 if t == best else 3)
            rows.append(row(case, causal, length, f'{{"fwd": {t}}}', "fwd", ms))
        for dq, ms in (("[128, 32, 8, 3]", 2.0), ("[64, 32, 4, 3]", 1.0)):
            rows.append(row(case, causal, length, f'{{"dkdv": [32, 64, 4, 3], "dq": {dq}}}', "fwd+bwd", ms))
    ((key, entry),) = tune.choose(rows, "GPU X").items()
    assert key == ("GPU X", "portable", 16, 64, None)
    assert entry.fwd == configs.KernelConfig(*json.loads(tiles[0]))
    want = configs.KernelConfig(*json.loads(causal_best))
    assert entry.fwd_causal == (None if want == entry.fwd else want)
    assert entry.dq == configs.KernelConfig(64, 32, 4, 3)


def test_merge_replaces_rows_by_their_key_and_records_the_run():
    """benchmarks.merge: a new run's rows replace those of the same (case, impl, dtype, mode), renamed
    where asked, the others stay, and the run's commit, date, command and triton are recorded."""
    from benchmarks import merge

    def row(case, impl, ms, status="ok"):
        return dict(case=case, impl=impl, dtype="bfloat16", mode="fwd", ms=ms, status=status)

    into = dict(metadata=dict(runs=[dict(commit="old")]),
                rows=[row("long", "jfa-triton", 1.0), row("long", "cudnn-packed", 2.0),
                      row("long", "jfa-triton-3.9", 9.0), row("L4096", "jfa-triton", 3.0)])
    new = dict(metadata=dict(commit="abc", date="d", command="c", versions=dict(triton="3.9.0")),
               rows=[row("long", "jfa-triton", 1.5), row("long", "cudnn-packed", 2.5),
                     row("L4096", "jfa-triton", 0.0, "skipped")])
    assert merge.merge(into, new, rename={"jfa-triton": "jfa-triton-3.9"}, impls={"jfa-triton"}) == 1
    got = {(r["case"], r["impl"]): (r["ms"], r.get("from_run")) for r in into["rows"]}
    assert got == {("long", "jfa-triton"): (1.0, None), ("long", "cudnn-packed"): (2.0, None),
                   ("long", "jfa-triton-3.9"): (1.5, "d abc triton 3.9.0"),
                   ("L4096", "jfa-triton"): (3.0, None)}
    assert into["metadata"]["runs"][-1] == dict(commit="abc", date="d", command="c", triton="3.9.0", jax=None)
