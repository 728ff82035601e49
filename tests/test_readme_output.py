"""What README.md's code blocks show a reader: each prints something to check against its comment, and
the blocks that compare with `jagged_attention_reference` print a max error at rounding level (run in a
fresh process on one CPU device; tests/test_readme.py runs every block)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.M | re.S)
COMPARED = [block for block in BLOCKS if "jagged_attention_reference(" in block]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_block_prints_what_a_reader_can_check(index):
    """A block that prints nothing leaves a reader nothing to compare; its last print's comment says what
    to expect."""
    prints = re.findall(r"^print\(.*$", BLOCKS[index], re.M)
    assert prints, f"README python block {index + 1} prints nothing:\n{BLOCKS[index]}"
    assert "#" in prints[-1], f"block {index + 1}'s print has no comment saying what it shows: {prints[-1]}"


def test_the_first_example_and_the_data_parallel_one_compare_with_the_reference():
    assert len(COMPARED) >= 2 and "jagged_attention(" in COMPARED[0] and "pack_data_parallel" in COMPARED[1]


@pytest.mark.parametrize("block", COMPARED, ids=lambda block: block.strip().splitlines()[1][:40])
def test_a_printed_max_error_is_at_rounding_level(block):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", block], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    error = re.search(r"max error (\S+)", result.stdout)
    assert error is not None, result.stdout
    assert float(error[1]) < 1e-5, result.stdout
