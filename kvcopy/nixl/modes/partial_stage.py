"""P: one request staged into its span unit by unit, over one or several steps (layer-wise staging).

:meth:`ArenaStaging.begin <kvcopy.nixl.modes.arena.ArenaStaging.begin>` allocates the
request's span exactly as ``stage`` does (from the token count and the handshake alone;
:class:`~kvcopy.nixl.modes.spans.ArenaFull` before anything is copied) and returns a
:class:`PartialStage`. Then, once per engine step:

* ``settle(part, block_ids, done_tokens)`` plans the copies of the page positions that
  *settled* since the last step (:func:`settled_pages`: every token of the page
  computed, or the prompt's last page once the prefill ends; a state group's one
  position only then) into a :class:`StepCopies`: per unit, one planned call per span
  copier holding it (the copier's own planner with every other triple's id lists
  empty), all checked before any runs. A settling position P holds no page for (a
  sliding window's null block) stays a hole.
* :meth:`StepCopies.run` copies one unit (any thread: it touches its planned calls,
  the span and the device pages, nothing shared); :meth:`StepCopies.left` names the
  units not run yet (the caller's sweep).
* ``finish(part)`` (every position settled, every step's units run) makes the record.

Sums: each unit's call sums its own pages inside the copy, as the whole-request pack
does; a page's sum depends on its bytes and on where they sit in the staged block only,
not on the call, and the fold (:mod:`kvcopy.nixl.modes.span_sums`) is a sum over
triples, so the values folded unit by unit and step by step add up to the
whole-request values: **the record is byte-identical to** ``stage``'s for the same
block table (``tests/nixl/modes/test_nixl_partial_stage.py``). A block is *held* when
every page position of it that holds prompt tokens was copied.

Host cost per step: one ``SpanCopiers.flat_ids`` and one checked plan per copier per request,
cut into one call per unit (``BlockCopier.split``: array passes, no id checked twice).
On the CPU each unit's sums are folded as its copy ends (:meth:`StepCopies.run`, the copy
thread, while the forward runs), so ``finish`` after the last layer only adds one
vector per unit call: 0.2-0.3 ms instead of 0.8-1.1 ms for 16 units of 1024 tokens
(``bench/push_chunks_serve.py``, the 2-core machine shared). On a GPU the sums' storage
is planned with the step (:func:`plan_step`, before the forward): one device buffer and
one pinned host buffer per :class:`StepCopies` (per request and step), a slice per unit
call, the units of one layer side by side; each call writes its device slice,
:meth:`StepCopies.read_back` copies a run of units' slices to the host in one copy on
the copy's stream (per layer and request: one, not one per call), and ``finish``
folds them after an event that follows them (no host wait on the GPU there). The pinned
buffer comes from torch's caching host allocator, which hands a freed block out again
only after the events it recorded for the copies into it completed; it is freed with
the step, after the fold (or with a dropped request, whose sums are never folded), so
no read-back lands in memory another step uses. (Before: a device tensor and a pinned
host tensor per unit call, while the forward ran; a cache miss of the host allocator
calls ``cudaHostAlloc``.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ...core.copier import CallPlan
from ..planning.plan import NO_BLOCK, expand_blocks
from ..wire.handshake import EngineInfo
from .span_copiers import SpanCopiers
from .span_sums import SumLayout, fold_sealed
from .spans import Span


def settled_pages(num_tokens: int, done_tokens: int, tokens_per_page: int) -> int:
    """How many leading page positions of a ``num_tokens`` prompt are settled once
    ``done_tokens`` of it are computed: whole pages, and the last (partial) page once
    the prompt is done. A state group (one page for any prompt) settles at the end."""
    if done_tokens >= num_tokens:
        return -(-num_tokens // tokens_per_page)
    return done_tokens // tokens_per_page


def deferred_sums(device: torch.device) -> bool:
    """Whether a step's page sums on ``device`` are read back and folded at ``finish``
    (a GPU: they are in host memory only after an event) rather than as each call
    returns (the CPU). Tests run the GPU's way on the CPU by replacing this."""
    return device.type != "cpu"


def host_sums(n: int) -> torch.Tensor:
    """``n`` int64 of pinned host memory for one step's page sums (torch's caching host
    allocator; module docstring). Tests replace it to count the allocations."""
    return torch.empty(n, dtype=torch.int64, pin_memory=True)


class _UnitCall:
    """One planned copier call of one unit: which copier, the plan, and for the fold
    the triples' numbers ``J`` (in the call's order) and the unit's page positions;
    ``at``: where its sums start in its step's buffers (deferred sums)."""

    __slots__ = ("copier", "call", "js", "group", "positions", "at")

    def __init__(self, copier: int, call: CallPlan, js: np.ndarray, group: int, positions: np.ndarray):
        self.copier, self.call, self.js, self.group, self.positions = copier, call, js, group, positions
        self.at = 0


class StepCopies:
    """One step's planned copies of one request, per unit (see the module docstring).
    :meth:`run` may be called from another thread than the one that planned it; each
    unit is run at most once (a second run raises)."""

    def __init__(self, cps: SpanCopiers, calls: Dict[int, List[_UnitCall]], summed: bool, device: torch.device):
        self._cps = cps
        self._calls = calls
        self._summed = summed
        self._device = device
        self.done: Set[int] = set()
        self.folded: List[Tuple[_UnitCall, np.ndarray]] = []  # CPU: (call, its folded sums), folded at run
        self._fold_now = not deferred_sums(device)  # a CPU copy's sums are in when run returns
        # Deferred sums (a GPU): every call's sums in one device buffer and, read back, one
        # pinned host buffer, both allocated here, before the forward (module docstring).
        # Units laid out in the order their last layers run, so that one layer's units
        # of this request are one slice: one read-back per layer. _span[u]: unit u's slice.
        self._span: Dict[int, Tuple[int, int]] = {}
        self.read: Set[int] = set()  # units whose sums were read back
        self._dev: Optional[torch.Tensor] = None
        self.host: Optional[torch.Tensor] = None
        if summed and not self._fold_now:
            at = 0
            for u in sorted(calls, key=lambda u: (cps.last_layer[u], u)):
                start = at
                for uc in calls[u]:
                    uc.at = at
                    at += uc.call.num_blocks
                self._span[u] = (start, at)
            if at:
                # device memory from torch's caching allocator on this (the forward's)
                # stream; the side stream writes it and the forward's stream waits for the
                # side stream at every step's close, before the step (and the buffer) can go
                self._dev = torch.empty(at, dtype=torch.int64, device=device)
                self.host = host_sums(at)

    @property
    def units(self) -> List[int]:
        """The units this step copies (those of groups with settling pages)."""
        return sorted(self._calls)

    def has(self, unit: int) -> bool:
        """Whether this step copies pages of ``unit``."""
        return unit in self._calls

    def left(self) -> List[int]:
        """Units not run yet (in span order)."""
        return [u for u in sorted(self._calls) if u not in self.done]

    def run(self, unit: int, max_ctas: Optional[int] = None) -> None:
        """Copy unit ``unit``'s settling pages into the span (no-op for a unit with none);
        ``max_ctas``: the calls' grid cap (``BlockCopier.run``'s: layer-wise copies on a
        GPU's side stream, :mod:`kvcopy.nixl.modes.side_stream`). On a GPU the copies
        are enqueued on the current stream, each call's page sums into its slice of the
        step's device buffer: :meth:`read_back` then copies them to host memory."""
        if unit in self.done:
            raise RuntimeError(f"unit {unit} was copied already this step")
        self.done.add(unit)
        for uc in self._calls.get(unit, ()):
            copier = self._cps.copiers[uc.copier]
            if not self._summed:
                copier.run("d2h", uc.call, max_ctas=max_ctas)
            elif self._fold_now:
                out = torch.empty(uc.call.num_blocks, dtype=torch.int64, device=self._device)
                copier.run("d2h", uc.call, out, max_ctas=max_ctas)
                self.folded.append((uc, _fold(uc, out)))
            else:  # no buffer: the step's calls have no block (an empty slice would do)
                out = self._dev[uc.at:uc.at + uc.call.num_blocks] if self._dev is not None else \
                    torch.empty(0, dtype=torch.int64, device=self._device)
                copier.run("d2h", uc.call, out, max_ctas=max_ctas)

    def read_back(self, units: Sequence[int]) -> int:
        """Deferred sums (a GPU): enqueue, on the current stream after the units' copies,
        the copy of ``units``' sums (units run already) to the pinned host buffer: one
        copy per run of adjacent slices (one layer's units of this step: one). ``finish``,
        after an event that follows it, folds them without touching the GPU. A no-op
        elsewhere. Returns the copies enqueued."""
        if self._dev is None or self.host is None:
            return 0
        for u in units:
            if u not in self.done:
                raise RuntimeError(f"unit {u}'s sums read back before it was copied")
        runs: List[List[int]] = []
        for a, b in sorted(self._span[u] for u in set(units) - self.read if u in self._span):
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            elif b > a:
                runs.append([a, b])
        self.read.update(u for u in units if u in self._span)
        for a, b in runs:
            self.host[a:b].copy_(self._dev[a:b], non_blocking=True)
        return len(runs)

    def folds(self) -> List[Tuple[_UnitCall, np.ndarray]]:
        """Every call's folded sums (module docstring): the CPU's, folded at run; a GPU's
        from the host buffer (after the event that follows the read-backs)."""
        if self._dev is None:
            return self.folded
        unread = self.done - self.read
        if any(self._span[u][1] > self._span[u][0] for u in unread if u in self._span):
            raise RuntimeError(f"units {sorted(unread)} copied but their sums never read back")
        assert self.host is not None
        return [(uc, _fold(uc, self.host[uc.at:uc.at + uc.call.num_blocks]))
                for u in sorted(self.read) for uc in self._calls[u]]


@dataclass
class PartialStage:
    """P: a request staged unit by unit (made by ``ArenaStaging.begin``; the staging's
    caller drives it: one thread at a time, as the manager)."""

    info: EngineInfo
    rid: bytes
    span: Span
    segs: List[int]
    counts: List[int]  # page positions per group holding prompt tokens
    num_tokens: int
    readers: int
    order: str
    done_tokens: int = 0  # computed prompt tokens so far (the last settle's)
    copied: List[np.ndarray] = field(default_factory=list)  # per group: bool per page position
    steps: List[StepCopies] = field(default_factory=list)
    writing: int = 0  # push WRITEs of some of its units in flight (ArenaStaging.hold_part)
    finished: bool = False  # its record made (ArenaStaging.finish): the span is a staged one now

    def restart(self) -> None:
        """The request's computed tokens went back (preempted on P): every position settles again."""
        self.done_tokens = 0
        self.copied = [np.zeros(n, bool) for n in self.counts]
        self.steps = []

    @property
    def complete(self) -> bool:
        """Every position settled and every step's units copied."""
        return self.done_tokens >= self.num_tokens and all(not s.left() for s in self.steps)

    def held(self, tokens_per_block: Sequence[int], tokens_per_page: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
        """Per group, per block covering the prompt: 1 when every page position of it
        holding prompt tokens was copied."""
        out = []
        for g, copied in enumerate(self.copied):
            r = tokens_per_block[g] // tokens_per_page[g]
            n_blocks = -(-self.num_tokens // tokens_per_block[g])
            padded = np.concatenate([copied, np.ones(n_blocks * r - len(copied), bool)])
            out.append(tuple(padded.reshape(n_blocks, r).all(axis=1).astype(int).tolist()))
        return tuple(out)

    def values(self, layout: SumLayout) -> List[np.ndarray]:
        """Per group, the folded page sums of every copied position (0 for a hole):
        the sum over every step's unit calls (module docstring)."""
        values = [np.zeros(n, np.uint64) for n in self.counts]
        with np.errstate(over="ignore"):
            for step in self.steps:
                for uc, vec in step.folds():
                    values[uc.group][uc.positions] += vec
        return values


def _fold(uc: _UnitCall, out: torch.Tensor) -> np.ndarray:
    """One unit call's page sums (a host tensor) sealed and summed over its triples: per
    page position of ``uc.positions``, its share of the fold (module docstring)."""
    return fold_sealed(uc.js, uc.positions, out.numpy().view(np.uint64).reshape(len(uc.js), len(uc.positions)))


def plan_step(part: PartialStage, cps: SpanCopiers, layout: Optional[SumLayout], block_ids: List[np.ndarray],
              done_tokens: int, device: torch.device) -> StepCopies:
    """The copies of the positions settling between ``part.done_tokens`` and
    ``done_tokens`` (checked ids ``block_ids`` per group, this step's table), planned
    per unit (see the module docstring); marks them copied in ``part``."""
    info = part.info
    new_pos, new_pages = [], []
    for g, arr in enumerate(block_ids):
        tpp = info.tokens_per_page[g]
        lo = settled_pages(part.num_tokens, part.done_tokens, tpp)
        hi = settled_pages(part.num_tokens, done_tokens, tpp)
        pages = expand_blocks(arr, info.tokens_per_block[g] // tpp)[:hi]
        pages = np.concatenate([pages, np.full(max(0, hi - len(pages)), NO_BLOCK, np.int64)])
        pos = np.arange(lo, hi, dtype=np.int64)
        pos = pos[pages[lo:hi] != NO_BLOCK]  # a position P holds no page for stays a hole
        new_pos.append(pos)
        new_pages.append(pages[pos])
    ids = cps.flat_ids(part.span.offset, part.segs, part.counts, new_pages, new_pos)
    settling = np.array([len(p) > 0 for p in new_pos])
    calls: Dict[int, List[_UnitCall]] = {}
    for k, ((dev, host, lens), (_, _, group, _, _)) in enumerate(zip(ids, cps.index)):
        live = settling[group]  # the copier groups (triples) of units with settling pages
        if not live.any():
            continue
        # one checked plan of every triple, cut into one call per unit (no id checked twice)
        whole = cps.copiers[k].plan_flat("d2h", dev, host, lens)
        for u, call, triples in cps.split_by_unit(k, "d2h", whole, live):
            g = cps.units[u].group
            js = layout.numbers[k][triples] if layout is not None else np.zeros(0, np.int64)
            calls.setdefault(u, []).append(_UnitCall(k, call, js, g, new_pos[g]))
    for g, pos in enumerate(new_pos):
        part.copied[g][pos] = True
    part.done_tokens = max(part.done_tokens, min(done_tokens, part.num_tokens))
    step = StepCopies(cps, calls, layout is not None, device)
    part.steps.append(step)
    return step
