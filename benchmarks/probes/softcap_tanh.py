"""The soft cap's cost by its tanh: the repository copied to /tmp once per variant of kernels/shared.py's
`tanh` body, and benchmarks.run timing the soft-capped rows (and L4096 without a cap, for scale) in each
copy, one process per variant. On the GPU, from the repository root:

    python -m benchmarks.probes.softcap_tanh --out DIR [--cases L4096,L4096-softcap50] [--seconds 0.3]

Variants: "series" (the library's: the odd series below |y| = 0.3, else (1 - e) / (1 + e)), "quotient"
(the quotient alone, which cancels far below the cap) and "series-0.1" (four terms below |y| = 0.1).
Each variant's rows go to DIR/VARIANT.json and its log to DIR/VARIANT.log."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = "jagged_flash_jax/kernels/shared.py"
# The body of `tanh` after its docstring, through its return.
BODY = re.compile(r"(def tanh\(y[^)]*\):\n    \"\"\"(?:.|\n)*?\"\"\"\n)((?:.|\n)*?return [^\n]*\n)")
EXP = "    e = tl.math.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|), in [0, 1]\n" \
      "    t = (1.0 - e) / (1.0 + e)\n"
VARIANTS = {
    "series": None,
    "quotient": EXP + "    return tl.where(y < 0, -t, t)\n",
    "series-0.1": EXP + "    y2 = y * y\n"
                        "    series = y * (1.0 + y2 * (-0.3333333333333333 + y2 * (0.13333333333333333"
                        " + y2 * -0.05396825396825397)))\n"
                        "    return tl.where(tl.abs(y) < 0.1, series, tl.where(y < 0, -t, t))\n",
}


def copy_with(variant: str, where: pathlib.Path) -> pathlib.Path:
    """The repository's package and benchmarks in `where`, with `tanh`'s body replaced by the variant's."""
    shutil.rmtree(where, ignore_errors=True)
    for name in ("jagged_flash_jax", "benchmarks"):
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    body = VARIANTS[variant]
    if body is not None:
        path = where / SHARED
        text, count = BODY.subn(lambda m: m.group(1) + body, path.read_text())
        if count != 1:
            raise SystemExit(f"tanh not found in {path}")
        path.write_text(text)
    return where


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--cases", default="L4096,L4096-softcap50,L4096-causal-softcap50")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seconds", default="0.3")
    p.add_argument("--budget-s", default="60")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for variant in args.variants.split(","):
        where = copy_with(variant, pathlib.Path("/tmp/softcap-tanh") / variant)
        command = [sys.executable, "-m", "benchmarks.run", "--out", str(where / "out"), "--cases", args.cases,
                   "--dtypes", "bfloat16", "--impls", "jfa-triton", "--seconds", args.seconds,
                   "--budget-s", args.budget_s]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")])}
        with open(args.out / f"{variant}.log", "w") as log:
            result = subprocess.run(command, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT)
        status |= result.returncode
        if (where / "out" / "results.json").exists():
            shutil.copy(where / "out" / "results.json", args.out / f"{variant}.json")
        lines = (args.out / f"{variant}.log").read_text().splitlines()
        print(f"== {variant} (rc={result.returncode})", *[line for line in lines if " ok: " in line],
              sep="\n", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
