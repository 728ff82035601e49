"""The launcher-kernel contract (jagged_flash_jax/kernels/spec.py): each spec against its kernel's own
argument names, the slots the kernels share, and the checks of packing."""

from __future__ import annotations

import pytest

from jagged_flash_jax import kernels
from jagged_flash_jax.kernels import spec

GLUON = {s.name for s in spec.SPECS if s.descriptors}


@pytest.mark.parametrize("kernel_spec", spec.SPECS, ids=lambda s: s.name)
def test_each_spec_names_its_kernels_arguments(kernel_spec):
    if kernel_spec.name in GLUON:
        pytest.importorskip("triton.experimental.gluon")
    assert tuple(getattr(kernels, kernel_spec.name).arg_names) == kernel_spec.arg_names


def test_every_kernel_has_a_spec():
    assert sorted(kernels.__all__) == sorted(s.name for s in spec.SPECS)


def test_the_attention_kernels_share_their_first_slots():
    """kernels/shared.py names these slots once for every softmax attention kernel, kernels/shared_hstu.py
    its own for the HSTU kernels (the Hopper forward's and backward's up to fill_chunk)."""
    for kernel_spec in spec.SPECS:
        if "batch" in kernel_spec.params:
            first = spec.HSTU_PARAMS if kernel_spec.name.startswith("hstu_") else spec.ATTENTION_PARAMS
            if kernel_spec.name.startswith("hopper_hstu_"):  # their blocks in the place of the slots
                first = spec.HSTU_PARAMS[:-1]
            assert kernel_spec.params[:len(first)] == first
    assert spec.KEY_MAJOR.params[:3] == spec.ATTENTION_BWD_PREPROCESS.params
    # kernels/hopper/addressing.py names the Hopper kernels' own slots once for the three.
    assert spec.HOPPER_BWD_DKDV.params == spec.HOPPER_BWD_DQ.params == spec.HOPPER_FWD.params
    # kernels/hopper/hstu_backward.py reads `blocks` at one slot for both of its kernels.
    assert spec.HOPPER_HSTU_BWD_DKDV.params == spec.HOPPER_HSTU_BWD_DQ.params == spec.HOPPER_HSTU_FWD.params


def test_packing_takes_exactly_the_specs_parameters():
    values = dict.fromkeys(spec.KEY_MAJOR.params, 1) | {"padded": 7}
    assert spec.KEY_MAJOR.pack(values) == (1, 1, 1, 7)
    with pytest.raises(ValueError, match="missing \\['padded'\\]"):
        spec.KEY_MAJOR.pack({k: 1 for k in spec.KEY_MAJOR.params if k != "padded"})
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        spec.KEY_MAJOR.pack(values | {"extra": 2})
    with pytest.raises(ValueError, match="constants missing"):
        spec.KEY_MAJOR.check_constants({"D": 8})


def test_an_input_updated_in_place_is_returned_after_the_outputs():
    """The TMA dq-fused kernel's dq_acc: an input (a descriptor) that jax-triton aliases to a result
    after the kernel's outputs, so that their arguments keep their places; the kernel has no output
    argument of its own for it."""
    tma = spec.HOPPER_BWD_DKDV_DQ_TMA
    assert tma.results == ("dk", "dv", "counter", "dq_acc") and tma.aliases == ((10, 3),)
    assert tma.inputs[tma.aliases[0][0]] == "dq_acc" and "dq_acc_desc" in tma.arg_names
    assert "dq_acc_ptr" not in tma.arg_names and tma.zeroed == ("counter",)
    assert spec.HOPPER_BWD_DKDV_DQ.aliases == () and spec.HOPPER_BWD_DKDV_DQ.results[2] == "dq_acc"
    with pytest.raises(ValueError, match="updated"):
        spec.KernelSpec("k", inputs=("x", "params"), outputs=("y",), params=(), constants=(), updated=("y",))
