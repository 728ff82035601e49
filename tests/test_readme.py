"""Every ```python block of README.md runs as written, each in a fresh process on the CPU: on one device,
and the blocks that build a mesh on 4 devices too (as the README says to try them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.M | re.S)
FOUR_CPU_DEVICES = 'import jax\njax.config.update("jax_num_cpu_devices", 4)\n'

def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the device count is the block's own (conftest gives this process 4)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _cases():
    for i, block in enumerate(BLOCKS):
        first_line = block.strip().splitlines()[0]
        for devices in (1, 4) if "make_mesh" in block else (1,):
            yield pytest.param(block, devices, id=f"block{i}-{devices}dev-{first_line[:30]}")


def test_the_readme_has_code_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block,devices", list(_cases()))
def test_readme_block_runs(block, devices):
    result = _run((FOUR_CPU_DEVICES if devices > 1 else "") + block)
    assert result.returncode == 0, f"README block failed on {devices} CPU device(s):\n{result.stderr[-3000:]}"
    if "train_step" in block:  # the README says its losses decrease
        losses = [float(x) for x in re.findall(r"[-+0-9.e]+", result.stdout.strip().splitlines()[-1])]
        assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
