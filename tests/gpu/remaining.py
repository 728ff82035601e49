"""The GPU tests a suite's log did not reach (a stage stopped by its time limit): the node ids that
`pytest --collect-only` finds for the suite's selection, less those the log (pytest -v, xdist) names as
passed, skipped, failed or errored, one per line, for a second run of the rest:

    python3 tests/gpu/remaining.py tests/gpu_results/.../suite-triton3.9.log > /tmp/rest.txt
    mapfile -t rest < /tmp/rest.txt; python3 -m pytest "${rest[@]}" ...

Run it where the suite ran (the collection depends on the installed packages).
"""

import re
import subprocess
import sys

# (a log's last outcome may have its `rc=` line appended: pytest, stopped by the limit, ended no line)
OUTCOME = re.compile(r"\b(?:PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS) (tests/\S+(?: \S+)*?)"
                     r"(?= - |\s*(?:rc=\d+)?$)")


def reached(log: str) -> set[str]:
    done = set()
    with open(log) as f:
        for line in f:
            if match := OUTCOME.search(line.rstrip("\n")):
                done.add(match.group(1))
    return done


def collected() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-o", "addopts=",
                          "--deselect", "tests/test_memory_safety.py::"
                          "test_adversarial_offsets_on_the_gpu_under_compute_sanitizer"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def main() -> None:
    done = reached(sys.argv[1])
    rest = [node for node in collected() if node not in done]
    print(f"{len(done)} reached, {len(rest)} remaining", file=sys.stderr)
    print("\n".join(rest))


if __name__ == "__main__":
    main()
