"""kvcopy.core.aliasing on its own: how two views of one allocation alias, decided from
their layouts alone (the copies over such views are tests/core/test_copier_overlay.py)."""
import pytest
import torch

from kvcopy.core.aliasing import DISJOINT, interleaved, merge_classes, shared_rows
from kvcopy.core.layout import describe


def views(raw, *specs):
    """Views of ``raw`` (int8): ``(element offset, shape, strides)`` each, with layouts."""
    out = []
    for offset, shape, strides in specs:
        t = raw.as_strided(shape, strides, offset)
        out.append((t, describe(t, block_dim=0)))
    return out


RAW = torch.zeros(1 << 16, dtype=torch.int8)
BASE = RAW.data_ptr()


def test_groups_viewed_from_byte_0_with_pages_padded_to_the_largest_share_rows_one_to_one():
    (a, la), (b, lb) = views(RAW, (0, (8, 64), (128, 1)), (0, (8, 96), (128, 1)))
    assert shared_rows(la, lb, a.data_ptr(), b.data_ptr()) == (1, 1)


def test_a_block_split_into_kernel_pages_against_an_unsplit_view_shares_rows_of_four():
    # attention: 32 kernel pages of 64 bytes; state: 8 blocks of 256 bytes, 100 used
    (a, la), (b, lb) = views(RAW, (0, (32, 64), (64, 1)), (0, (8, 100), (256, 1)))
    assert shared_rows(la, lb, a.data_ptr(), b.data_ptr()) == (4, 1)


def test_packed_pages_side_by_side_in_a_row_never_meet():
    (a, la), (b, lb) = views(RAW, (0, (8, 64), (128, 1)), (64, (8, 64), (128, 1)))
    assert shared_rows(la, lb, a.data_ptr(), b.data_ptr()) == DISJOINT


@pytest.mark.parametrize("second", [(0, (8, 64), (96, 1)),  # block strides 128 and 96: no common row
                                    (100, (8, 64), (128, 1))])  # a page runs past its row
def test_overlays_kvcopy_cannot_order_are_told_apart(second):
    (a, la), (b, lb) = views(RAW, (0, (8, 64), (128, 1)), second)
    assert shared_rows(la, lb, a.data_ptr(), b.data_ptr()) is None


def test_per_layer_views_of_a_cross_layer_allocation_are_interleaved():
    # [B, L, page]: layer l at offset l * page, block stride L * page
    (a, la), (b, lb) = views(RAW, (0, (8, 32), (96, 1)), (32, (8, 32), (96, 1)))
    assert interleaved(la, lb, a.data_ptr(), b.data_ptr())
    (c, lc), = views(RAW, (16, (8, 32), (96, 1)))  # half a page off: bytes in common
    assert not interleaved(la, lc, a.data_ptr(), c.data_ptr())
    assert not interleaved(la, la, a.data_ptr(), a.data_ptr())


def test_classes_that_share_a_group_merge_transitively():
    assert merge_classes([{0, 1}, {3, 4}, {1, 2}], 6) == [[0, 1, 2], [3, 4]]
    assert merge_classes([], 3) == []
