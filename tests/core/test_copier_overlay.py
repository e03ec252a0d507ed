"""BlockCopier over KV cache groups overlaid with different page shapes, bit-exact.

vLLM 0.33 views every KV cache group of a model from byte 0 of one allocation. The
groups' pages may differ in shape (KV heads, tokens), in size (padded to the largest
page), in place (packed side by side in a block-outermost row) and in unit (a block
split into kernel pages next to GDN/Mamba state, which is not split). Each case builds
the views over one byte buffer, copies with every CPU backend and compares every byte
of the destination allocation against the torch reference run on a copy, with the
destination poisoned first; ids that name one block through two groups, and overlays
that can collide at different ids, raise before any byte moves. The Triton kernel runs
the overlays through its interpreter on the CPU; the ``cuda``, ``triton`` and ``ce``
backends on a GPU (``@pytest.mark.gpu``).
"""
import pytest
import torch

import kvcopy
from kvcopy.testing.reference import reference_copy_groups
from kvcopy.testing import POISON_BYTE

CPU_BACKENDS = [b for b in ("torch", "cpu") if kvcopy.available_copy_backends()[b] is None]


class Overlay:
    """Named views over one byte buffer: ``name -> (byte offset, shape, byte strides, dtype)``."""

    def __init__(self, nbytes, views):
        self.raw = torch.zeros(nbytes, dtype=torch.uint8)
        self.specs = views

    def on(self, raw):
        out = {}
        for name, (offset, shape, strides, dtype) in self.specs.items():
            size = torch.empty(0, dtype=dtype).element_size()
            assert offset % size == 0 and all(s % size == 0 for s in strides)
            out[name] = raw.view(dtype).as_strided(shape, [s // size for s in strides], offset // size)
        return out

    def views(self):
        return self.on(self.raw)

    def to(self, device):
        self.raw = self.raw.to(device)
        return self


def _contiguous_host(dev, fill=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    host = {}
    for name, t in dev.items():
        h = torch.empty(t.shape, dtype=t.dtype)
        raw = h.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen) if fill is None
                  else torch.full(raw.shape, fill, dtype=torch.uint8))
        host[name] = h
    return host


def _check(backend, overlay, groups, dev_ids, direction, host=None):
    """Copy ``dev_ids`` per group in ``direction``; every destination byte must equal the
    reference's (poisoned first), the device allocation included outside the views."""
    gen = torch.Generator().manual_seed(5)
    if direction == "h2d":
        overlay.raw.fill_(POISON_BYTE)
        host = host if host is not None else _contiguous_host(overlay.views())
    else:
        overlay.raw.copy_(torch.randint(0, 256, tuple(overlay.raw.shape), dtype=torch.uint8, generator=gen))
        host = host if host is not None else _contiguous_host(overlay.views(), fill=POISON_BYTE)
    want_raw = overlay.raw.clone()
    want_dev = overlay.on(want_raw)
    want_host = {n: t.clone() for n, t in host.items()}
    if direction == "h2d":
        reference_copy_groups(want_host, want_dev, groups, dev_ids, dev_ids)
    else:
        reference_copy_groups(want_dev, want_host, groups, dev_ids, dev_ids)
    copier = kvcopy.BlockCopier(overlay.views(), host, groups, copy_backend=backend)
    (copier.to_device if direction == "h2d" else copier.to_host)(dev_ids)
    if overlay.raw.is_cuda:
        torch.cuda.synchronize()
    copier.close()
    if direction == "h2d":
        assert torch.equal(overlay.raw, want_raw)
        assert (want_raw != POISON_BYTE).any()  # the reference wrote something
    for name, t in host.items():
        assert torch.equal(t.view(torch.uint8), want_host[name].view(torch.uint8)), name
    return host


# ------------------------------------------------------------------- the issue's example
def _issue_example():
    """Two groups over 8 pages of 16 KiB: 4 heads x 16 tokens and 2 heads x 32 tokens."""
    return Overlay(8 * 16384, {
        "full": (0, (8, 4, 16, 128), (16384, 4096, 256, 2), torch.float16),
        "swa": (0, (8, 2, 32, 128), (16384, 8192, 256, 2), torch.float16),
    })


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_issue_example_groups_with_different_page_shapes(backend, direction):
    buf = torch.zeros(8 * 16384, dtype=torch.uint8)
    full = buf.view(torch.float16).view(8, 4, 16, 128)
    swa = buf.view(torch.float16).view(8, 2, 32, 128)
    # the issue's call, verbatim: refused before (overlap without being the same region)
    kvcopy.BlockCopier({"full": full, "swa": swa}, {"full": torch.zeros_like(full), "swa": torch.zeros_like(swa)},
                       [["full"], ["swa"]], copy_backend=backend).close()
    _check(backend, _issue_example(), [["full"], ["swa"]], [[1, 2, 6], [3, 0]], direction)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_same_block_through_two_overlaid_groups_raises_naming_it(backend):
    overlay = _issue_example()
    overlay.raw.fill_(POISON_BYTE)
    dev = overlay.views()
    host = _contiguous_host(dev)
    copier = kvcopy.BlockCopier(dev, host, [["full"], ["swa"]], copy_backend=backend)
    import numpy as np

    for ids in ([[1, 2], [2]], [np.array([1, 2]), np.array([5, 2])]):  # native planner, numpy path
        with pytest.raises(ValueError, match="groups \\[0, 1\\] share device storage and both write block id 2"):
            copier.to_device(ids)
    assert bool((overlay.raw == POISON_BYTE).all())  # nothing written
    copier.to_host([[1, 2], [2]])  # reading one block into two host buffers is fine


# ------------------------------------------------------------------- padded pages
def _padded(num_blocks=6, layers=2):
    """Layer-outermost groups from byte 0: 4 heads (16 KiB pages) and 2 heads (8 KiB
    pages padded to 16 KiB), ``layers`` layers per group."""
    page, nb = 16384, num_blocks
    views = {}
    for layer in range(layers):
        base = layer * nb * page
        views[f"full.{layer}"] = (base, (nb, 4, 16, 128), (page, 4096, 256, 2), torch.bfloat16)
        views[f"swa.{layer}"] = (base, (nb, 2, 16, 128), (page, 4096, 256, 2), torch.bfloat16)
    return Overlay(layers * nb * page, views)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_padded_pages_each_group_at_its_own_blocks(backend, direction):
    groups = [["full.0", "full.1"], ["swa.0", "swa.1"]]
    _check(backend, _padded(), groups, [[0, 3], [4, 1, 5]], direction)


# ------------------------------------------------------------------- packed block rows
def _packed(num_blocks=5):
    """Block-outermost rows of 6 KiB: group 0 packs A (4 KiB) | B (1 KiB) | pad, group 1
    C (2 KiB) | D (4 KiB): D straddles A and B's place in the row."""
    row = 6144
    return Overlay(num_blocks * row, {
        "A": (0, (num_blocks, 2, 8, 128), (row, 2048, 256, 2), torch.float16),
        "B": (4096, (num_blocks, 1, 4, 128), (row, 1024, 256, 2), torch.float16),
        "C": (0, (num_blocks, 1, 8, 128), (row, 2048, 256, 2), torch.float16),
        "D": (2048, (num_blocks, 4, 4, 128), (row, 1024, 256, 2), torch.float16),
    })


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_mixed_pages_in_block_rows(backend, direction):
    _check(backend, _packed(), [["A", "B"], ["C", "D"]], [[0, 4], [2, 1]], direction)


# ------------------------------------------------------------------- GDN state + kernel pages
def _gdn(state_bytes, num_blocks=6, ratio=2):
    """An attention group whose 32 KiB blocks are split into ``ratio`` kernel pages, and a
    GDN group's int8 state ``[NB, 1, 1, state_bytes]`` whose stride is the whole block
    (padded when ``state_bytes`` is smaller)."""
    block = 32768
    kernel = block // ratio
    tokens = kernel // (2 * 256 * 2)
    return Overlay(num_blocks * block, {
        "attn": (0, (num_blocks * ratio, 2, tokens, 256), (kernel, tokens * 512, 512, 2), torch.bfloat16),
        "gdn": (0, (num_blocks, 1, 1, state_bytes), (block, state_bytes, state_bytes, 1), torch.int8),
    })


@pytest.mark.parametrize("state_bytes", [20000, 32768], ids=["padded", "exact"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gdn_state_logical_ids_next_to_attention_kernel_pages(backend, direction, state_bytes):
    """Attention ids are kernel pages (logical block 1 -> pages 2, 3), GDN ids logical
    blocks: logical blocks 1, 4 for attention and 3, 0 for the state."""
    overlay = _gdn(state_bytes)
    host = None
    if state_bytes < 32768:  # a host buffer with the padded stride, as NIXL's regions assume
        dev = overlay.views()
        pad = torch.empty(6, 32768, dtype=torch.int8)
        gdn_host = pad[:, :state_bytes].view(6, 1, 1, state_bytes)
        host = _contiguous_host({"attn": dev["attn"]}, fill=POISON_BYTE if direction == "d2h" else None)
        gdn_host.view(torch.uint8).copy_(torch.full_like(gdn_host.view(torch.uint8), POISON_BYTE)
                                         if direction == "d2h" else torch.randint(0, 256, gdn_host.shape,
                                                                                  dtype=torch.uint8))
        host["gdn"] = gdn_host
    _check(backend, overlay, [["attn"], ["gdn"]], [[2, 3, 8, 9], [3, 0]], direction, host)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gdn_state_and_a_kernel_page_of_the_same_block_raise_naming_both(backend):
    overlay = _gdn(20000)
    overlay.raw.fill_(POISON_BYTE)
    dev = overlay.views()
    copier = kvcopy.BlockCopier(dev, _contiguous_host(dev), [["attn"], ["gdn"]], copy_backend=backend)
    # kernel page 7 is logical block 3, which the state names too
    with pytest.raises(ValueError, match="group 0's block id 7 and group 1's block id 3 are the same block"):
        copier.to_device([[2, 7], [3]])
    import numpy as np

    with pytest.raises(ValueError, match="same block"):  # the numpy path checks it too
        copier.to_device([np.array([6]), np.array([3])])
    assert bool((overlay.raw == POISON_BYTE).all())
    copier.to_device([[2, 5], [3]])  # pages 2 and 5 are blocks 1 and 2: fine
    copier.close()


# ------------------------------------------------------------------- overlays that collide
def _refused(views, groups, match):
    dev = views
    with pytest.raises(ValueError, match=match):
        kvcopy.BlockCopier(dev, _contiguous_host(dev), groups, copy_backend=CPU_BACKENDS[-1])


def test_one_group_overlaid_with_itself_raises():
    dev = _issue_example().views()
    _refused(dev, [["full", "swa"]], "group 0: layers 'full' and 'swa' overlap")
    dev = _gdn(20000).views()
    _refused(dev, [["attn", "gdn"]], "group 0: layers 'attn' and 'gdn' overlap")


def test_head_strided_pages_that_meet_at_different_ids_raise():
    """A layer-compact, head-outer layout with unified block sizes: 4 heads x 16 tokens
    and 2 heads x 32 tokens of one page size, each head a plane of all blocks. Head 2 of
    block 2k is head 1 of block k: a collision at different ids."""
    nb, c = 8, 256
    overlay = Overlay(nb * 4 * 16 * c, {
        "full": (0, (nb, 4, 16, 128), (16 * c, nb * 16 * c, c, 2), torch.float16),
        "swa": (0, (nb, 2, 32, 128), (32 * c, nb * 32 * c, c, 2), torch.float16),
    })
    _refused(overlay.views(), [["full"], ["swa"]], "overlap without being the same region")


def test_pages_shifted_by_part_of_a_block_raise():
    """Same stride, the second view starts half a page in: its block i meets the first
    view's blocks i and i + 1."""
    overlay = Overlay(9 * 4096, {
        "a": (0, (8, 2048), (4096, 2), torch.float16),
        "b": (2048, (8, 2048), (4096, 2), torch.float16),
    })
    _refused(overlay.views(), [["a"], ["b"]], "overlap without being the same region")


def test_block_strides_that_do_not_divide_raise():
    overlay = Overlay(8 * 6144, {
        "a": (0, (8, 2048), (6144, 2), torch.float16),
        "b": (0, (12, 2048), (4096, 2), torch.float16),
    })
    _refused(overlay.views(), [["a"], ["b"]], "overlap without being the same region")


def test_views_side_by_side_in_one_row_need_no_disjoint_ids():
    """Two views in one row that never meet (A at bytes [0, 4K), B at [4K, 5K) of a row)
    may be in one group and in two groups using the same ids."""
    overlay = _packed()
    for groups in ([["A", "B"]], [["A"], ["B"]]):
        dev = overlay.views()
        copier = kvcopy.BlockCopier(dev, _contiguous_host(dev), groups, copy_backend=CPU_BACKENDS[-1])
        copier.to_device([[1, 2]] * len(groups))
        copier.close()


# ------------------------------------------------------------------- GPU backends
_GPU_OVERLAYS = {
    "issue_example": (_issue_example, [["full"], ["swa"]], [[1, 2, 6], [3, 0]]),
    "padded": (_padded, [["full.0", "full.1"], ["swa.0", "swa.1"]], [[0, 3], [4, 1, 5]]),
    "packed": (_packed, [["A", "B"], ["C", "D"]], [[0, 4], [2, 1]]),
    "gdn_exact": (lambda: _gdn(32768), [["attn"], ["gdn"]], [[2, 3, 8, 9], [3, 0]]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("overlay", sorted(_GPU_OVERLAYS))
@pytest.mark.parametrize("backend", ["cuda", "triton", "ce"])
def test_overlays_on_the_gpu_backends(backend, overlay, direction):
    build, groups, ids = _GPU_OVERLAYS[overlay]
    _check(backend, build().to("cuda"), groups, ids, direction)


@pytest.mark.parametrize("overlay", sorted(_GPU_OVERLAYS))
def test_overlays_through_the_triton_interpreter(overlay, monkeypatch):
    """The Triton kernel's addressing over overlaid views, on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    build, groups, ids = _GPU_OVERLAYS[overlay]
    for direction in ("h2d", "d2h"):
        _check("triton", build(), groups, ids, direction)
