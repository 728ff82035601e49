"""jaxlib's ptxas and the kernels' PTX version, on the CPU: where jaxlib looks for ptxas (fake ptxas
executables in temporary folders standing for the working folder, PATH, $CUDA_HOME, /usr/local/cuda,
/opt/cuda and pip's CUDA package), the PTX version each accepts, the `ptx_version` option and the reason
to refuse; then a Hopper case's kernels compiled for sm_90a with that option and assembled by this
machine's CUDA 13.0 ptxas, which refuses Triton 3.9's own `.version 9.4`."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import triton
import triton.language as tl

from jagged_flash_jax import _compat

ROOT = Path(__file__).resolve().parents[1]
LOCAL_PTXAS = "/usr/local/bin/ptxas"


def fake_ptxas(folder: Path, release: str = "13.0", patch: int = 88, status: int = 0,
               executable: bool = True) -> str:
    """folder/ptxas: a script printing `--version` as CUDA's ptxas does, exiting with `status`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ptxas"
    path.write_text("#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.{patch}'\nexit {status}\n")
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


class Places:
    """Where jaxlib looks, all under tmp_path: the working folder, PATH's folders, $CUDA_HOME, the fixed
    CUDA roots (/usr/local/cuda and /opt/cuda) and the jax CUDA plugin's site-packages."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp, self.monkeypatch = tmp_path, monkeypatch
        self.work = tmp_path / "work"
        self.work.mkdir()
        monkeypatch.chdir(self.work)
        monkeypatch.setenv("PATH", "")
        monkeypatch.delenv("CUDA_HOME", raising=False)
        monkeypatch.delenv("XLA_FLAGS", raising=False)
        self.usr_local_cuda, self.opt_cuda = tmp_path / "usr-local-cuda", tmp_path / "opt-cuda"
        monkeypatch.setattr(_compat, "_XLA_FIXED_CUDA_ROOTS", (str(self.usr_local_cuda), str(self.opt_cuda)))
        self.site = tmp_path / "site-packages"
        plugin = self.site / "jax_cuda13_plugin"
        plugin.mkdir(parents=True)
        monkeypatch.setattr(_compat, "_jax_cuda_plugin", lambda: (str(plugin), "nvidia/cu13"))

    def path(self, *folders: Path) -> None:
        self.monkeypatch.setenv("PATH", os.pathsep.join(map(str, folders)))

    def cuda_home(self, folder: Path) -> None:
        self.monkeypatch.setenv("CUDA_HOME", str(folder))


@pytest.fixture
def places(tmp_path, monkeypatch) -> Places:
    return Places(tmp_path, monkeypatch)


# ---------------------------------------------------------------------------------------------------
# Where jaxlib looks
# ---------------------------------------------------------------------------------------------------


# Each place, given a ptxas of its own release, in jaxlib's order.
ORDER = ["working folder's bin", "PATH's first", "PATH's second", "CUDA_HOME", "/usr/local/cuda",
         "/opt/cuda", "pip nvidia/cu13"]


@pytest.mark.parametrize("first", range(len(ORDER)), ids=ORDER)
def test_jaxlib_takes_the_first_ptxas_in_its_order(places, first):
    """With a ptxas in each place from `first` on (none before), the one at `first` is taken."""
    t = places.tmp
    folders = [places.work / "bin", t / "path-a", t / "path-b", t / "cuda-home" / "bin",
               places.usr_local_cuda / "bin", places.opt_cuda / "bin",
               places.site / "nvidia" / "cu13" / "bin"]
    releases = ["12.5", "12.6", "12.8", "12.9", "13.0", "13.1", "13.2"]
    made = {i: fake_ptxas(folders[i], releases[i]) for i in range(first, len(ORDER))}
    places.path(t / "path-a", t / "path-b")
    places.cuda_home(t / "cuda-home")
    assert _compat.xla_ptxas() == made[first]
    assert _compat.ptxas_ptx_version(_compat.xla_ptxas()) == [85, 85, 87, 88, 90, 91, 92][first]


def test_ptxas_that_jaxlib_would_not_take_are_skipped(places):
    """XLA's FindCudaExecutable skips a ptxas whose `--version` fails, one it cannot run, one older than
    11.8.0 and 12.3.103 (a release with a known bug)."""
    t = places.tmp
    fake_ptxas(t / "fails", "13.0", status=1)
    fake_ptxas(t / "not-executable", "13.0", executable=False)
    fake_ptxas(t / "old", "11.7", patch=99)
    fake_ptxas(t / "excluded", "12.3", patch=103)
    chosen = fake_ptxas(t / "fine", "12.3", patch=107)
    places.path(t / "fails", t / "not-executable", t / "old", t / "excluded", t / "fine")
    assert _compat.xla_ptxas() == chosen


def test_xla_flags_cuda_data_dir_does_not_reach_jaxlibs_triton_kernels(places, monkeypatch):
    """jaxlib's Triton kernel call asks XLA for ptxas with an empty preferred CUDA folder: the folder of
    --xla_gpu_cuda_data_dir, which XLA's own compiler uses, is not searched for these kernels."""
    fake_ptxas(places.tmp / "flagged" / "bin", "13.4")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_cuda_data_dir={places.tmp / 'flagged'}")
    assert _compat.xla_ptxas() is None
    assert _compat.ptx_version_option(94) == {}
    assert _compat.ptxas_unsupported_reason() is None


# ---------------------------------------------------------------------------------------------------
# The PTX version a ptxas accepts, the option and the reason
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release,ptx", [("12.4", 84), ("12.8", 87), ("12.9", 88), ("13.0", 90),
                                         ("13.4", 94)])
def test_the_ptx_version_a_ptxas_accepts(tmp_path, release, ptx):
    assert _compat.ptxas_ptx_version(fake_ptxas(tmp_path, release)) == ptx


def test_a_ptxas_that_does_not_run_accepts_nothing(tmp_path):
    assert _compat.ptxas_ptx_version(fake_ptxas(tmp_path, "13.0", status=2)) is None
    assert _compat.ptxas_ptx_version(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("release,triton_default,option", [
    ("13.0", 94, {"ptx_version": 90}),  # triton 3.9's PTX 9.4, CUDA 13.0's ptxas: the GPU machine's case
    ("12.8", 94, {"ptx_version": 87}),
    ("13.0", 87, {}),  # triton 3.6's PTX 8.7 assembles with CUDA 13.0's ptxas as it is
    ("13.4", 94, {}),
    (None, 94, {}),  # no ptxas found: jaxlib says where it looked
    ("13.0", None, {}),  # no NVIDIA backend in Triton
])
def test_the_ptx_version_option(places, release, triton_default, option):
    if release is not None:
        fake_ptxas(places.tmp / "bin", release)
        places.path(places.tmp / "bin")
    assert _compat.ptx_version_option(triton_default) == option


def test_a_ptxas_older_than_the_kernels_need_is_refused_with_what_to_install(places):
    path = fake_ptxas(places.tmp / "cuda-12.4" / "bin", "12.4")
    places.path(places.tmp / "cuda-12.4" / "bin")
    reason = _compat.ptxas_unsupported_reason()
    assert reason is not None
    assert f"{path} (CUDA 12.4)" in reason and "PTX up to 8.4" in reason and "PTX 8.7 (CUDA 12.8)" in reason
    pip_bin = os.path.normpath(places.site / "nvidia" / "cu13" / "bin")
    assert "pip install -U 'nvidia-cuda-nvcc>=13'" in reason and f"PATH={pip_bin}:$PATH" in reason


@pytest.mark.parametrize("release", ["12.8", "13.0", None])
def test_a_ptxas_the_kernels_were_tested_with_or_none_is_not_refused(places, release):
    if release is not None:
        fake_ptxas(places.tmp / "bin", release)
        places.path(places.tmp / "bin")
    assert _compat.ptxas_unsupported_reason() is None


# ---------------------------------------------------------------------------------------------------
# Real compilations
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _add_one(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(o_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)


def _ptx_version_written(options: dict) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(_add_one, {"x_ptr": "*fp32", "o_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 16})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    major, minor = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.MULTILINE).groups()
    return int(major) * 10 + int(minor)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
def test_triton_writes_its_default_ptx_version_unless_given_one():
    default = _compat.triton_ptx_version(90)
    assert default == {"3.6": 87, "3.9": 94}.get(triton.__version__[:3], default)
    assert _ptx_version_written({}) == default
    assert _ptx_version_written({"ptx_version": 84}) == 84


def _assemble(ptxas: str, ptx: str, folder: Path) -> subprocess.CompletedProcess:
    (folder / "kernel.ptx").write_text(ptx)
    command = [ptxas, "-arch=sm_90a", str(folder / "kernel.ptx"), "-o", str(folder / "kernel.cubin")]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not os.access(LOCAL_PTXAS, os.X_OK), reason=f"needs a ptxas at {LOCAL_PTXAS}")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
def test_a_hopper_cases_kernels_assemble_with_the_local_ptxas(places, monkeypatch):
    """The forward and backward launches of a causal bfloat16 D = 64 problem on a pretended Hopper GPU,
    compiled for sm_90a as jax-triton compiles them, with the option for the ptxas jaxlib finds here
    (/usr/local/bin's, CUDA 13.0's on the machine this was written on): each assembles; the PTX differs
    from Triton's own only in its `.version` line; and Triton's own is refused by that ptxas wherever the
    option lowers the version (triton 3.9's PTX 9.4 against CUDA 13.0's 9.0)."""
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is a folder of the repository, not a package
    from benchmarks.probes import ptx as probe

    places.path(Path(LOCAL_PTXAS).parent)
    assert _compat.xla_ptxas() == LOCAL_PTXAS
    default = _compat.triton_ptx_version(90)
    option = _compat.ptx_version_option(default)
    accepted = _compat.ptxas_ptx_version(LOCAL_PTXAS)
    assert option == ({"ptx_version": accepted} if accepted < default else {})
    launches = probe.capture([("case", dict(kernels="hopper", dim=64, dtype="bfloat16", layout="THD",
                                            causal=True))])["case"]
    assert {"hopper_attention_bwd_dkdv_kernel", "hopper_attention_bwd_dq_kernel"} <= {
        launch["kernel"] for launch in launches}
    for launch in launches:
        kernel = probe._kernel(launch["kernel"])
        signature, attrs = probe.kernel_signature(kernel, launch)
        # The launch's own options (register caps) without any PTX version the launcher may have asked for.
        own = {key: value for key, value in launch.get("backend_options", {}).items() if key != "ptx_version"}
        compiled = {}
        for name, extra in (("triton's", {}), ("ours", option)):
            compiled[name], _ = probe.compile_for_sm90(
                kernel, signature, launch["constants"], attrs, launch["num_warps"], launch["num_stages"],
                {**own, **extra})
        ours = _assemble(LOCAL_PTXAS, compiled["ours"], places.tmp)
        assert ours.returncode == 0, f"{launch['kernel']}: {ours.stderr[-2000:]}"
        without_version = [re.sub(r"^\.version .*$", "", ptx, flags=re.MULTILINE)
                           for ptx in compiled.values()]
        assert without_version[0] == without_version[1], launch["kernel"]
        if option:
            theirs = _assemble(LOCAL_PTXAS, compiled["triton's"], places.tmp)
            assert theirs.returncode != 0 and "Unsupported .version" in theirs.stderr, launch["kernel"]
