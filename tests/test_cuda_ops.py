"""``torch.ops.kvcopy.copy_blocks_``: the copy as a custom op, eager and under torch.compile.

CPU tests run the op over the ``cpu`` backend (same call path as ``cuda``); the GPU
test at the end runs it compiled over ``cuda``.
"""
import re

import pytest
import torch

from kvcopy import BlockCopier, native, ops
from kvcopy.reference import reference_copy_groups
from kvcopy.testing import CopyCase, bytes_equal

cpu_lib, _ = native.load("kvcopy_cpu")


def _setup(case, device, backend, direction):
    poison = "host" if direction == "d2h" else "device"
    dev_ids, host_ids = case.block_ids()
    groups = case.layer_groups()
    bd = {n: case.block_dim() for g in groups for n in g}
    exp_dev, exp_host = case.build(device, poison)
    if direction == "d2h":
        reference_copy_groups(exp_dev, exp_host, groups, dev_ids, host_ids, bd)
    else:
        reference_copy_groups(exp_host, exp_dev, groups, host_ids, dev_ids, bd)
    got_dev, got_host = case.build(device, poison)
    copier = BlockCopier(got_dev, got_host, groups, backend=backend,
                         block_dim=case.block_dim(), kv_layout=case.kv_layout())
    return copier, dev_ids, host_ids, (exp_dev, exp_host), (got_dev, got_host)


def _assert_same(expected, got):
    for exp, act in zip(expected, got):
        for name in exp:
            assert bytes_equal(exp[name], act[name]), name


def test_op_is_registered():
    assert hasattr(torch.ops.kvcopy, "copy_blocks_")
    schema = str(torch.ops.kvcopy.copy_blocks_.default._schema)
    assert re.search(r"Tensor\(a\d*!\)\[\] dsts", schema), schema


@pytest.mark.skipif(cpu_lib is None, reason="CPU library not built")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_op_eager_bit_exact(direction):
    case = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48, host_ids_differ=True)
    copier, dev_ids, host_ids, exp, got = _setup(case, "cpu", "cpu", direction)
    ops.copy(copier, direction, dev_ids, host_ids)
    _assert_same(exp, got)


@pytest.mark.skipif(cpu_lib is None, reason="CPU library not built")
def test_op_under_torch_compile_fullgraph():
    case = CopyCase(layout="nhd", num_groups=2, ids="scattered", aliasing=True, kv_sharing=1)
    copier, dev_ids, host_ids, exp, got = _setup(case, "cpu", "cpu", "h2d")
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(dev_t, host_t):
        ops.copy(copier, "h2d", dev_t, host_t)

    step([torch.tensor(g) for g in dev_ids], [torch.tensor(g) for g in host_ids])
    _assert_same(exp, got)


def test_dead_copier_handle_raises():
    with pytest.raises(ValueError, match="no live BlockCopier"):
        torch.ops.kvcopy.copy_blocks_(10**9, True, [], [], [])


@pytest.mark.gpu
def test_op_compiled_over_cuda_backend():
    case = CopyCase(layout="kv_first", num_groups=2, ids="runs", num_blocks=48)
    copier, dev_ids, host_ids, exp, got = _setup(case, "cuda", "cuda", "h2d")
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(dev_t, host_t):
        ops.copy(copier, "h2d", dev_t, host_t)

    step([torch.tensor(g) for g in dev_ids], [torch.tensor(g) for g in host_ids])
    torch.cuda.synchronize()
    _assert_same(exp, got)
    copier.close()
