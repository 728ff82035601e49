"""The test session: 4 CPU devices for the sharding tests, hypothesis profiles, the `gpu` marker
(tests that need a GPU with jax-triton skip elsewhere), the longest tests first, and no traced program
kept from one test to the next. Tests import what they share from helpers.py."""

from __future__ import annotations

import os

import jax
import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # not the test extra: only the property tests need it, and they say so at import
    HealthCheck = settings = None

# pyproject's addopts run the suite over every core (pytest-xdist's `--numprocesses auto --dist
# worksteal`) and the notebooks (nbmake's `--nbmake`), which the `test` extra installs. Without those
# plugins (or with them disabled, `-p no:xdist`), pytest would stop at its arguments ("unrecognized
# arguments"); here the missing plugin's options are taken and ignored instead: the tests run in one
# process, and the notebooks are not collected.
STAND_IN_OPTIONS = {
    "xdist": [("--numprocesses", "store"), ("--dist", "store")],
    "nbmake": [("--nbmake", "store_true")],
}


def pytest_addoption(parser, pluginmanager):
    for plugin, options in STAND_IN_OPTIONS.items():
        if not pluginmanager.has_plugin(plugin):
            group = parser.getgroup(f"{plugin} (not installed)")
            for name, action in options:
                group.addoption(name, action=action, dest=f"stand_in_{name.lstrip('-')}",
                                help=f"ignored: the {plugin} plugin is not installed here (pip install -e "
                                     f"'.[test]')")


def pytest_report_header(config):
    missing = [plugin for plugin in STAND_IN_OPTIONS if not config.pluginmanager.has_plugin(plugin)]
    if missing:
        effects = {"xdist": "one process", "nbmake": "no notebooks"}
        return (f"{' and '.join(missing)} not loaded: pyproject's options for them ignored "
                f"({', '.join(effects[plugin] for plugin in missing)}); pip install -e '.[test]' for the "
                f"full run")
    return None


# Set before JAX starts its backends: the sharding tests need several devices; on a GPU machine this
# only adds CPU devices, and the default device stays the GPU.
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", False)

# Reproducible property tests: a fixed seed and a bounded number of examples on CI; `dev` explores more.
if settings is not None:
    settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=60, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from helpers import GPU_AVAILABLE  # noqa: E402

# The longest tests (a process or a notebook kernel of their own, or the interpreter's many programs),
# longest first: they start first, on the first xdist worker (pyproject's addopts: --dist worksteal
# gives each worker half of the tests in order, and an idle worker takes half of the other's rest), and
# the workers end together on short tests. test_install.py's checks share one child process: together.
LONGEST_FIRST = (
    "tests/test_memory_safety.py::test_adversarial_offsets_are_memory_safe",
    "notebooks/flax_model.ipynb",
    "notebooks/hstu_model.ipynb",
    "notebooks/quickstart.ipynb",
    "tests/test_install.py",
    "tests/test_properties.py::test_kernels_on_random_batches",
    "tests/test_readme.py::test_readme_block_runs",
    "tests/test_ptxas.py::test_a_hopper_cases_kernels_assemble_with_the_local_ptxas",
    "tests/test_readme_output.py::test_a_printed_max_error_is_at_rounding_level",
    "tests/test_hopper.py::test_the_hopper_",
    "tests/test_launchers.py::test_first_use_from_several_threads",
    "tests/test_transforms.py::test_heads_shard_map_with_check_vma",
    "tests/test_transforms.py::test_data_parallel_jit_and_shard_map",
    "tests/test_properties.py::test_xla_backend_on_random_batches",
    "tests/test_benchmarks.py::test_quick_run",
)


def _rank(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU with jax-triton")
    for item in items:
        if "gpu" in item.keywords and not GPU_AVAILABLE:
            item.add_marker(skip)
    items.sort(key=_rank)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _fresh_programs():
    """The op jits its programs once per problem (jagged_flash_jax.transforms' caches): each test starts
    without them, so that what it patches (plan.key_major, plan.L2_REUSE_BYTES, a spy) reaches a trace
    of its own instead of one cached by an earlier test in the same worker."""
    from jagged_flash_jax import transforms

    transforms.clear_programs()
