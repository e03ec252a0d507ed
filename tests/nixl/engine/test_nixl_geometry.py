"""kvcopy.nixl.engine.geometry: byte segments of a chunk selection, head owners, token pieces."""
import numpy as np
import pytest

from kvcopy.nixl.engine.geometry import (
    ChunkAxes, head_owners, local_segments, rank_heads, remote_ranks, segments, token_pieces,
)


def test_segments_token_slices_and_head_ranges():
    nhd = ChunkAxes(("token", "head", "o0"), (16, 4, 8), (32, 8, 1), 2)  # [16 tokens, 4 heads, 8]
    hnd = ChunkAxes(("head", "token", "o0"), (4, 16, 8), (128, 8, 1), 2)
    # a token slice of an NHD page is one run; of an HND page one run per head
    assert segments(nhd, nhd, ((0, 8), (0, 4)), ((8, 8), (0, 4))) == ((0, 512, 512),)
    assert len(segments(hnd, hnd, ((0, 8), (0, 4)), ((8, 8), (0, 4)))) == 4
    # a head range of an HND page is one run; of an NHD page one run per token
    two = ChunkAxes(("head", "token", "o0"), (2, 16, 8), (128, 8, 1), 2)
    assert segments(two, hnd, ((0, 16), (0, 2)), ((0, 16), (2, 2))) == ((0, 512, 512),)
    assert len(segments(ChunkAxes(("token", "head", "o0"), (16, 2, 8), (16, 8, 1), 2), nhd,
                        ((0, 16), (0, 2)), ((0, 16), (2, 2)))) == 16


@pytest.mark.parametrize("d_rank, d_tp, p_tp, heads, want", [
    (0, 4, 2, 8, [0]), (3, 4, 2, 8, [1]), (1, 2, 4, 8, [2, 3]), (0, 1, 8, 2, [0, 4]),
    (5, 8, 2, 4, [1]), (2, 4, 1, 4, [0]), (3, 4, 2, None, [1]),
])
def test_remote_ranks(d_rank, d_tp, p_tp, heads, want):
    assert remote_ranks(d_rank, d_tp, p_tp, heads) == want


def test_local_segments_are_the_rows_of_a_token_range():
    nhd = ChunkAxes(("token", "head", "o0"), (16, 4, 8), (32, 8, 1), 2)
    assert local_segments(nhd, (2, 3)) == ((2 * 64, 3 * 64),)  # 64 bytes per token, all heads
    hnd = ChunkAxes(("head", "token", "o0"), (4, 16, 8), (128, 8, 1), 2)
    assert local_segments(hnd, (2, 3)) == tuple((h * 256 + 2 * 16, 3 * 16) for h in range(4))


@pytest.mark.parametrize("rank,tp,heads,want", [
    (0, 2, 8, (0, 4)), (1, 2, 8, (4, 4)), (3, 4, 8, (6, 2)),
    (0, 8, 2, (0, 1)), (3, 8, 2, (0, 1)), (4, 8, 2, (1, 1)), (7, 8, 2, (1, 1)),  # heads replicated
])
def test_rank_heads(rank, tp, heads, want):
    assert rank_heads(rank, tp, heads) == want


def test_head_owners_read_each_head_once_and_spread_replicas():
    # this rank holds heads 2..5; peers hold 0..3 and 4..7: two pieces
    assert head_owners((2, 4), [(0, 4), (4, 4)], prefer=0) == [(0, 0, 2, 2), (1, 2, 0, 2)]
    # both peers hold head 0 (replicated): `prefer` picks which one reads it
    assert head_owners((0, 1), [(0, 1), (0, 1)], prefer=0) == [(0, 0, 0, 1)]
    assert head_owners((0, 1), [(0, 1), (0, 1)], prefer=1) == [(1, 0, 0, 1)]
    # MLA (no head axis): one peer, everything
    assert head_owners(None, [None, None], prefer=3) == [(1, 0, 0, 0)]
    with pytest.raises(ValueError, match="KV head 5 is held by none of the given peers"):
        head_owners((4, 2), [(0, 4), (4, 1)], prefer=0)


def test_token_pieces_split_pages_of_different_sizes():
    same = token_pieces(np.array([3, 5]), 16, 16, 1000)
    assert same == {(0, 0, 16): [(3, 3), (5, 5)]}
    # local 32-token pages over remote 16-token pages: two pieces per local page
    pieces = token_pieces(np.array([0, 1]), 32, 16, 1000)
    assert pieces == {(0, 0, 16): [(0, 0), (1, 2)], (16, 0, 16): [(0, 1), (1, 3)]}
    # local 16-token pages over remote 32-token pages: a half of a remote page each
    assert token_pieces(np.array([0, 1, 2]), 16, 32, 1000) == {(0, 0, 16): [(0, 0), (2, 1)],
                                                                (0, 16, 16): [(1, 0)]}
    # past the prompt: the rest of the page is a zero piece, not read
    assert token_pieces(np.array([1]), 32, 16, 40) == {(0, 0, 8 + 8): [(1, 2)], (16, -1, 16): [(1, -1)]}
