"""kvcopy.vllm.arena.stage: how many D ranks read each P rank (vLLM env; the staging itself: test_vllm_arena.py)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)


@pytest.mark.parametrize("p_tp,d_tp,heads,expected", [
    (1, 1, 2, [1]), (2, 4, 8, [2, 2]), (4, 2, 8, [1, 1, 1, 1]), (2, 1, 8, [1, 1]),
    (4, 1, None, [1, 0, 0, 0]),  # MLA: one D rank reads one P rank; the others keep their span to the TTL
])
def test_each_p_rank_counts_the_d_ranks_that_read_it(p_tp, d_tp, heads, expected):
    from kvcopy.nixl import remote_ranks
    from kvcopy.vllm.arena.stage import readers_of

    assert [readers_of(r, p_tp, d_tp, heads) for r in range(p_tp)] == expected
    assert sum(expected) == sum(len(remote_ranks(r, d_tp, p_tp, heads)) for r in range(d_tp))


def test_a_record_still_finishing_on_the_gpu_is_not_taken_for_a_span_freed_at_its_ttl():
    """Layer-wise on CUDA: ``close_step`` hands the stager a record still being finished
    (its copies' event pending) while the span is not yet among the arena's staged ones.
    A tick in that window must neither forget the request nor report it released (D would
    be told its span was freed), and D's notification after the record must free it."""
    from types import SimpleNamespace

    from kvcopy.nixl.sum_check import PendingResult
    from kvcopy.vllm.arena.meta import READ
    from kvcopy.vllm.config import ArenaOptions
    from kvcopy.vllm.arena.stage import ArenaStager

    class Event:  # a CUDA event, not yet reached
        done = False

        def query(self):
            return self.done

    class Finishing(PendingResult):
        def ready(self):
            return True

        def result(self):
            return SimpleNamespace(to_bytes=lambda key: b"record")

    arena = SimpleNamespace(staged=[], released=[])
    arena.release = arena.released.append
    manager = SimpleNamespace(arena=arena, notifications=lambda: {})
    stager = ArenaStager(manager, ArenaOptions(), 0, 1, 8, None)
    event = Event()
    stager.live.add("r")
    stager.syncing["r"] = (Finishing(), event)  # what step() does with close_step's output on CUDA
    stager.tick()
    assert stager.live == {"r"} and "r" not in stager.report.released
    event.done = True
    arena.staged = ["r"]  # finish() staged the span
    stager.tick()
    assert list(stager.records) == ["r"] and "r" in stager.report.staged
    stager._note("r", "D0", 1, READ, 0.0)
    assert arena.released == ["r"] and "r" not in stager.live and "r" not in stager.records


def test_namesakes_lists_every_request_with_the_base_id_and_a_notification_takes_only_a_sole_one():
    """Concurrent dispatch: D names its own id (P's base id, D's suffix). ``namesakes``
    lists all of P's requests with that base, so two are seen as two (ambiguous), and the
    stager frees a span for D's id only where it is the sole one; else the notification
    is kept under D's id, as the push sender refuses such a reservation."""
    from types import SimpleNamespace

    from kvcopy.vllm.arena.meta import GAVE_UP
    from kvcopy.vllm.arena.stage import ArenaStager, namesakes
    from kvcopy.vllm.config import ArenaOptions

    d_id = "chat-7-0123abcd"
    assert namesakes(d_id, ["chat-7-89abcdef", "chat-7-fedcba98", "chat-70-89abcdef", "chat-7"]) == [
        "chat-7-89abcdef", "chat-7-fedcba98", "chat-7"]
    assert namesakes(d_id, ["chat-8-89abcdef"]) == []

    for live, freed in [({"chat-7-89abcdef", "chat-8-89abcdef"}, ["chat-7-89abcdef"]),
                        ({"chat-7-89abcdef", "chat-7-fedcba98"}, [])]:
        arena = SimpleNamespace(staged=list(live), released=[])
        arena.release = arena.released.append
        stager = ArenaStager(SimpleNamespace(arena=arena), ArenaOptions(), 0, 1, 8, None)
        stager.live.update(live)
        stager._note(d_id, "d-agent", 1, GAVE_UP, 0.0)
        assert arena.released == freed
        assert list(stager.early) == ([] if freed else [d_id])
