"""``torch.ops.kvcopy.copy_blocks_``: the copy as a custom op, eager and under torch.compile.

CPU tests run the op over the ``cpu`` backend (same call path as ``cuda``); the GPU
test at the end runs it compiled over ``cuda``.
"""
import re

import pytest
import torch

from kvcopy import ops
from kvcopy import native
from kvcopy.testing import CopyCase, prepare_check

cpu_lib, _ = native.load("kvcopy_cpu")


def test_op_is_registered():
    assert hasattr(torch.ops.kvcopy, "copy_blocks_")
    schema = str(torch.ops.kvcopy.copy_blocks_.default._schema)
    assert re.search(r"Tensor\(a\d*!\)\[\] dsts", schema), schema


@pytest.mark.skipif(cpu_lib is None, reason="CPU library not built")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_op_eager_bit_exact(direction):
    case = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48, host_ids_differ=True)
    c = prepare_check("cpu", case, direction)
    ops.copy(c.copier, direction, c.dev_ids, c.host_ids)
    c.assert_matches()


def _compiled_h2d(backend, case, device):
    """to_device through the custom op inside a fullgraph torch.compile region."""
    c = prepare_check(backend, case, "h2d", device)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(dev_t, host_t):
        ops.copy(c.copier, "h2d", dev_t, host_t)

    step([torch.tensor(g) for g in c.dev_ids], [torch.tensor(g) for g in c.host_ids])
    c.assert_matches()
    c.copier.close()


@pytest.mark.skipif(cpu_lib is None, reason="CPU library not built")
def test_op_under_torch_compile_fullgraph():
    _compiled_h2d("cpu", CopyCase(layout="nhd", num_groups=2, ids="scattered", aliasing=True, kv_sharing=1), "cpu")


def test_dead_copier_handle_raises():
    with pytest.raises(ValueError, match="no live BlockCopier"):
        torch.ops.kvcopy.copy_blocks_(10**9, True, [], [], [])


@pytest.mark.gpu
def test_op_compiled_over_cuda_backend():
    _compiled_h2d("cuda", CopyCase(layout="kv_first", num_groups=2, ids="runs", num_blocks=48), "cuda")
