"""The package without its extras: `pip install jagged-flash-jax` brings jax and numpy only, so importing it,
the `xla` backend and the demo must not need triton or jax-triton, and the backends that do must name the
extra that installs them. The checks run in a fresh process (one for the three) in which importing
triton fails, as it does where triton is not installed (.ci/run also installs the package into a fresh
environment without it)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

# Prepended to each child's code: `import triton` and `import jax_triton` fail as when not installed.
WITHOUT_TRITON = textwrap.dedent("""
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("triton", "jax_triton"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
""")


def run_without_triton(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", WITHOUT_TRITON + textwrap.dedent(code), *args], env=env,
                          cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)


# The three checks below share one child process (each prints its own lines, and a crash fails all
# three with the child's stderr): in the order written, the xla check first, before anything has
# tried to import triton.
CHILD = """
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import Batch, reference

    import jagged_flash_jax as jfa

    # The xla backend, and auto (xla on the CPU), without loading triton.
    batch = Batch.make([5, 0, 7], 4, 16, kv_heads=2, seed=1)
    q, k, v, do = batch.arrays(np.float32)
    op = lambda q, k, v: jfa.jagged_attention(q, k, v, batch.offsets, 6, causal=True, backend="xla")
    out, vjp = jax.vjp(op, q, k, v)
    want = reference(batch.q, batch.k, batch.v, batch.do, batch.offsets, 6, scale=0.25, causal=True)
    for got, expected in zip((out, *vjp(do)), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert jfa.jagged_attention(q, k, v, batch.offsets, 6).shape == q.shape  # auto: xla on the CPU
    assert not [name for name in sys.modules if name.split(".")[0] in ("triton", "jax_triton")]
    print("xla ok")

    # The kernel backends name their extra.
    x = jnp.ones((6, 2, 8), jnp.float32)
    for backend in ("interpret", "triton"):
        try:
            jfa.jagged_attention(x, x, x, [0, 2, 6], 4, backend=backend)
        except (ImportError, ValueError) as err:
            print("extra", backend, type(err).__name__, str(err).splitlines()[0])

    # The demo.
    from jagged_flash_jax.__main__ import main

    print("demo exit status", main(["demo"]))
"""


@functools.cache
def _child() -> subprocess.CompletedProcess:
    return run_without_triton(CHILD)


def test_the_xla_backend_runs_without_triton():
    result = _child()
    assert "xla ok" in result.stdout.splitlines(), result.stdout[-2000:] + result.stderr[-3000:]


def test_the_kernel_backends_name_their_extra_without_triton():
    result = _child()
    lines = dict(line.split(" ", 1)[1].split(" ", 1) for line in result.stdout.splitlines()
                 if line.startswith("extra "))
    assert set(lines) == {"interpret", "triton"}, result.stdout[-2000:] + result.stderr[-3000:]
    assert lines["interpret"].startswith("ImportError"), lines
    assert "pip install 'jagged-flash-jax[interpret]'" in lines["interpret"], lines
    # On the CPU the triton backend is refused first for want of a GPU; the message names the GPU extra.
    assert "pip install 'jagged-flash-jax[cuda13]'" in lines["triton"], lines


def test_the_demo_runs_without_triton():
    result = _child()
    assert result.returncode == 0 and "demo exit status 0" in result.stdout.splitlines(), (
        result.stdout[-2000:] + result.stderr[-3000:])
    assert "all checks passed" in result.stdout
    assert "interpret: skipped, triton is not installed" in result.stdout


def test_the_package_requires_no_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda requirements: {Requirement(r).name for r in requirements}
    assert not names(project["dependencies"]) & {"triton", "jax-triton"}, project["dependencies"]
    assert "triton" in names(project["optional-dependencies"]["interpret"])
    assert {"triton", "jax-triton"} <= names(project["optional-dependencies"]["cuda13"])


def _notebook_imports(name: str) -> set[str]:
    """The top-level modules a notebook's code cells import."""
    notebook = json.loads((ROOT / "notebooks" / name).read_text())
    code = "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    return {module.split(".")[0] for module in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, re.M)}


def test_the_flax_extra_installs_what_the_flax_notebook_imports():
    """The README points to notebooks/flax_model.ipynb beside the `flax` extra: the extra with the package's
    own dependencies must give every third-party module the notebook imports (matplotlib was missing)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda requirements: {canonicalize_name(Requirement(r).name) for r in requirements}
    installed = names(project["dependencies"]) | names(project["optional-dependencies"]["flax"])
    distributions = importlib.metadata.packages_distributions()
    modules = _notebook_imports("flax_model.ipynb") - set(sys.stdlib_module_names) - {"jagged_flash_jax"}
    needed = {canonicalize_name(distributions.get(module, [module])[0]) for module in modules}
    assert {"flax", "optax", "matplotlib"} <= needed, needed  # what the notebook imports today
    assert needed <= installed, f"the flax extra lacks {sorted(needed - installed)}"


def test_pytest_runs_without_xdist_and_nbmake():
    """pyproject's addopts name pytest-xdist's and nbmake's options, which only the `test` extra installs:
    without those plugins (disabled here) pytest used to stop at "unrecognized arguments"; it now runs in
    one process and says why."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:nbmake", "-p", "no:cacheprovider",
               "tests/test_readme_output.py", "-k", "every_block"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "xdist and nbmake not loaded" in result.stdout, result.stdout[-2000:]
    assert re.search(r"\d+ passed", result.stdout), result.stdout[-2000:]


def test_the_requirements_name_the_versions_the_code_checks():
    """pyproject's requirement specifiers and the ranges the code refuses outside of (_compat.SUPPORTED,
    whose messages name them) are the same ranges; the GPU extra's jax[cuda13] alone starts higher (the
    jaxlib that allocates the tensor descriptors' scratch memory)."""
    from jagged_flash_jax import _compat

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    checked = {name: SpecifierSet(_compat.requirement(name)[len(name):]) for name in _compat.SUPPORTED}
    seen = set()
    for requirement in requirements:
        if requirement.name in checked and not requirement.extras:
            assert requirement.specifier == checked[requirement.name], (requirement, checked)
            seen.add(requirement.name)
    assert seen == set(checked), seen
