"""Partial staging (kvcopy.nixl.modes.partial_stage): a request's span filled unit by unit,
in forward order, in random order and over several steps, gives the same span bytes
and a byte-identical record to ``ArenaStaging.stage``, and D's caches equal the torch
reference (geometries.expected, D poisoned) for every family and layout the fuzzer
draws; also with the page sums the GPU's way (``deferred``: read back into a poisoned
host buffer by runs of units, folded at finish)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcopy.nixl.modes import partial_stage
from kvcopy.nixl.modes.partial_stage import settled_pages
from kvcopy.nixl.modes.spans import ArenaFull
from kvcopy.nixl.planning.plan import NO_BLOCK
from kvcopy.testing.nixl import fuzz
from kvcopy.testing.nixl.engines import one_torch_thread
from kvcopy.testing.nixl.geometries import arena_staging, build_caches, logical_kv, random_spec

POISON = 0xA5
SEEDS = range(60)


def splits(rng, n: int, steps: int):
    """``steps`` increasing done-token counts ending at ``n`` (a chunked prefill)."""
    cuts = sorted(set(int(x) for x in rng.integers(1, max(n, 2), steps - 1))) if n > 1 else []
    return [c for c in cuts if c < n] + [n]


def stage_in_parts(st, info, block_ids, n, rid, rng, steps=1, how="forward"):
    """Stage ``rid`` unit by unit over ``steps`` steps: per step, ``how`` "forward" (span
    order), "random" (shuffled), or "sweep" (a random half in order, then ``left()``)."""
    part = st.begin(info, n, rid, 1)
    for done in splits(rng, n, steps):
        step = st.settle(part, block_ids, done)
        units = step.units
        if how == "random":
            units = list(rng.permutation(units))
        elif how == "sweep":
            units = sorted(rng.choice(units, len(units) // 2, replace=False).tolist()) if units else []
        for u in units:
            step.run(int(u))
        if len(units) > 1:  # deferred sums: the layers' read-backs, here two runs of units
            step.read_back([int(u) for u in units[:len(units) // 2]])
        step.read_back([int(u) for u in units])
        left = step.left()
        for u in left:  # the completeness sweep
            step.run(u)
        step.read_back(left)
        assert not step.left()
        if step.units:
            with pytest.raises(RuntimeError, match="copied already"):  # a unit is never copied twice
                step.run(step.units[0])
    return st.finish(part)


def _pair(spec, rank):
    caches = build_caches(spec, "p", rank, logical_kv(spec))
    whole, info = arena_staging(spec, "p", rank, caches, "P")
    parts, _ = arena_staging(spec, "p", rank, caches, "P")
    for st in (whole, parts):
        st.buffer[st.arena.granule:].fill_(POISON)  # destinations poisoned
    return whole, parts, info


def _deferred(monkeypatch):
    """The GPU's sums path on the CPU: one poisoned host buffer per step (counted)."""
    allocated = []

    def host(n):
        allocated.append(n)
        return torch.full((n,), -0x5A5A5A5A5A5A5A5B, dtype=torch.int64)
    monkeypatch.setattr(partial_stage, "deferred_sums", lambda device: True)
    monkeypatch.setattr(partial_stage, "host_sums", host)
    return allocated


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("how,steps", [("forward", 1), ("random", 1), ("sweep", 3), ("random", 3)])
def test_unit_by_unit_equals_the_whole_request_byte_for_byte(monkeypatch, how, steps, deferred):
    allocated = _deferred(monkeypatch) if deferred else []
    rng = np.random.default_rng(steps * 7 + len(how))
    with one_torch_thread():
        compared = 0
        for seed in SEEDS:
            spec = random_spec(np.random.default_rng(seed), seed)
            whole, parts, info = _pair(spec, spec.p_ranks[0])
            try:
                a = whole.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
                b = stage_in_parts(parts, info, spec.p.block_ids, spec.num_tokens, b"req", rng, steps, how)
                assert a.sums is not None
                assert a.to_bytes() == b.to_bytes(), seed  # the record, sums included, byte for byte
                assert torch.equal(whole.buffer, parts.buffer), seed  # every arena byte
                assert parts.staged == ["req"] and parts.stats()["partial_requests"] == 0
                # where a push WRITEs the record from: the payload's end and the slot after it
                assert ((parts._staged[b"req"].payload, parts._staged[b"req"].slot)
                        == (whole._staged[b"req"].payload, whole._staged[b"req"].slot)), seed
                compared += 1
            finally:
                whole.close()
                parts.close()
        assert compared == len(SEEDS)
        assert not deferred or 0 < len(allocated) <= len(SEEDS) * steps  # one host buffer per step at most


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("steps", [1, 3])
def test_d_loads_a_request_staged_in_parts_exactly(monkeypatch, steps, deferred):
    """D's caches after the pull equal the torch reference for every drawn family and
    layout; the case counts match the whole-request fuzz (exact where it is exact)."""
    if deferred:
        _deferred(monkeypatch)
    rng = np.random.default_rng(steps)
    with one_torch_thread():
        exact = 0
        for seed in SEEDS:
            spec = random_spec(np.random.default_rng(seed), seed)
            out = fuzz.run_arena_case(spec, lambda st, info, ids, n, rid: stage_in_parts(
                st, info, ids, n, rid, rng, steps, "random"))
            assert out.status != "wrong", (seed, out.reason, out.detail)
            exact += out.status == "exact"
        assert exact >= len(SEEDS) - 3  # infeasible draws raise (the whole-request fuzz's counts)


def test_settled_pages():
    assert [settled_pages(40, d, 16) for d in (0, 15, 16, 31, 32, 39, 40, 99)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [settled_pages(40, d, 1 << 20) for d in (0, 39, 40)] == [0, 0, 1]  # a state group: at the end


def test_a_position_p_does_not_hold_when_it_settles_is_a_hole_and_not_held():
    """A sliding window's null block in the step's table: the block is not held, its
    pages' sums are zero, nothing is written there (the poison stays)."""
    with one_torch_thread():
        for seed in SEEDS:
            spec = random_spec(np.random.default_rng(seed), seed)
            if spec.num_tokens > spec.p.tokens_per_block[0]:
                break
        whole, parts, info = _pair(spec, spec.p_ranks[0])
        try:
            ids = [list(g) for g in spec.p.block_ids]
            ids[0][0] = NO_BLOCK
            a = whole.stage(info, ids, spec.num_tokens, b"req", 1)
            b = stage_in_parts(parts, info, ids, spec.num_tokens, b"req", np.random.default_rng(0), 2)
            assert a.blocks[0][0] == 0 and a.to_bytes() == b.to_bytes()
            assert torch.equal(whole.buffer, parts.buffer)
        finally:
            whole.close()
            parts.close()


def test_begin_is_back_pressure_and_finish_refuses_an_unfinished_request():
    spec = random_spec(np.random.default_rng(3), 3)
    with one_torch_thread():
        whole, parts, info = _pair(spec, spec.p_ranks[0])
        try:
            part = parts.begin(info, spec.num_tokens, b"req", 1)
            with pytest.raises(ValueError, match="already staged"):
                parts.begin(info, spec.num_tokens, b"req", 1)
            others = []
            with pytest.raises(ArenaFull):  # spans are held from begin: the arena fills
                for i in range(64):
                    others.append(parts.begin(info, spec.num_tokens, f"other{i}", 1))
            for o in others:
                parts.abandon(o)
            step = parts.settle(part, spec.p.block_ids, spec.num_tokens)
            with pytest.raises(ValueError, match="not copied"):
                parts.finish(part)
            with pytest.raises(ValueError, match="went back"):
                parts.settle(part, spec.p.block_ids, spec.num_tokens - 1)
            for u in step.units:
                step.run(u)
            part.restart()  # preempted: every position settles again
            with pytest.raises(ValueError, match="tokens settled"):
                parts.finish(part)
            parts.abandon(part)
            assert parts.stats()["spans"] == 0 and parts.stats()["partial_requests"] == 0
        finally:
            whole.close()
            parts.close()
