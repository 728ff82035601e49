"""Merges one benchmarks.run results.json into the committed one: each new row replaces the row of the same
(case, impl, dtype, mode), records its run (`from_run`), and the run's commit, date, command and Triton go
to metadata.runs. Then `python -m benchmarks.report --results benchmarks/results` rewrites results.md.

    python -m benchmarks.merge NEW.json [--into benchmarks/results/results.json]
        [--rename jfa-triton=jfa-triton-3.9] [--impls jfa-triton,cudnn-packed] [--note TEXT] [--commit C]

--rename files a run's rows under another implementation's name (the same kernels under another Triton,
as a column of their own); --impls keeps only those implementations' rows (before renaming)."""

from __future__ import annotations

import argparse
import json
import pathlib

DEFAULT = pathlib.Path(__file__).parent / "results" / "results.json"


def _key(row: dict) -> tuple:
    return row["case"], row["impl"], row["dtype"], row["mode"]


def merge(into: dict, new: dict, rename: dict[str, str] | None = None, impls: set[str] | None = None,
          note: str | None = None, commit: str | None = None) -> int:
    """Merges `new`'s measured rows into `into` (both benchmarks.run results); returns how many. `commit`:
    the code's, where the run could not tell (a copy without git)."""
    meta = new["metadata"]
    versions = meta.get("versions", {})
    run = dict(commit=meta.get("commit") or commit, date=meta.get("date"), command=meta.get("command"),
               triton=versions.get("triton"), jax=versions.get("jax"))
    if note:
        run["note"] = note
    tag = f"{run['date']} {run['commit']} triton {run['triton']}"
    rows = [dict(r) for r in new["rows"]
            if r.get("status") != "skipped" and (impls is None or r["impl"] in impls)]
    for row in rows:
        row["impl"] = (rename or {}).get(row["impl"], row["impl"])
        row["from_run"] = tag
    replaced = {_key(r) for r in rows}
    into["rows"] = [r for r in into["rows"] if _key(r) not in replaced] + rows
    into["metadata"].setdefault("runs", []).append(run)
    return len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=__doc__.split("\n\n")[0])
    p.add_argument("new", type=pathlib.Path, help="a benchmarks.run results.json")
    p.add_argument("--into", type=pathlib.Path, default=DEFAULT)
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    p.add_argument("--impls", help="comma-separated implementations to take (default: all)")
    p.add_argument("--note")
    p.add_argument("--commit", help="the code's commit, where the run has none")
    args = p.parse_args(argv)
    try:
        rename = dict(item.split("=", 1) for item in args.rename)
    except ValueError:
        p.error(f"--rename takes OLD=NEW, got {args.rename}")
    into = json.loads(args.into.read_text())
    count = merge(into, json.loads(args.new.read_text()), rename,
                  set(args.impls.split(",")) if args.impls else None, args.note, args.commit)
    args.into.write_text(json.dumps(into, indent=1, default=str) + "\n")
    print(f"{count} rows of {args.new} merged into {args.into}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
