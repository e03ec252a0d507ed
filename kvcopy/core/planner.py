"""Per-call planning: one call's block ids checked and packed into a :class:`~kvcopy.core.tables.CallPlan`.

A call is one id list per KV cache group for each side (source and destination ids,
``src[g][i] -> dst[g][i]``). :class:`CallPlanner`, one per copier direction, checks it
in two steps, each done in one place, and packs it in the same pass as the second:

1. **What the ids are** (:func:`kvcopy.checks.block_ids`): one flat list of integers per
   group; bools, floats, strings, nested lists and values outside int64 are refused
   (``TypeError``/``ValueError``). Plain lists and tuples of ints take a shortcut that
   accepts exactly the same: ``array('q')`` converts them in C and refuses floats,
   strings and values outside int64; bools (which it would take as 0/1) are looked for
   explicitly. Anything else goes through :func:`~kvcopy.checks.block_ids`.
2. **Where they point** (``csrc/call_plan.cpp``, one C pass over every group): each id
   in ``[0, blocks)`` of its side and group, and no destination block twice within a
   group or across groups that write shared destination bytes (a class of groups). The
   pass packs as it goes (runs of ids consecutive on both sides merged, the offsets,
   the block prefix the ``cuda`` kernel reads: :mod:`kvcopy.core.tables` describes the
   array). On the first bad id it stops and reports (what, group, id); that report,
   with the layer and the range, is the exception's message. Where the native library
   is not built, :func:`plan_in_numpy` is the same pass (the same array, the same
   report on the same id).

Cost: for plain lists the host path is two ``array('q')`` conversions, one C call and
the plan object, whatever the number of layers (``kvcopy-bench overhead`` times it;
the README's CPU results give the figures). Numpy arrays and tensors pay for
:func:`~kvcopy.checks.block_ids` and a concatenation on top.
"""
from __future__ import annotations

import array
import ctypes
import itertools
import operator
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .. import native
from ..checks import block_ids, items, shown
from .tables import CallPlan, CopyTables, call_plan

# Error codes of csrc/call_plan.cpp (PlanError).
SRC_RANGE, DST_RANGE, DUPLICATE = 1, 2, 3

Limit = Tuple[int, str]  # (blocks of the side in this group, the layer that sets it)


class CallPlanner:
    """Checks and packs the calls of one copier direction.

    ``src_limits``/``dst_limits``: per group, ``(blocks, layer)``: ids must lie in
    ``[0, blocks)``, and ``layer`` (the group's smallest tensor) is named when one does
    not. ``alias_classes``: lists of groups whose destinations share bytes; their ids
    must be disjoint within one call. ``sides``: ``(source side, destination side)``
    names for messages ("device", "host"); ``group_layers``: one layer name per group,
    for messages. ``origin``: the token every plan made here carries.
    """

    def __init__(self, tables: CopyTables, src_limits: Sequence[Limit], dst_limits: Sequence[Limit],
                 alias_classes: Sequence[Sequence[int]], sides: Tuple[str, str], group_layers: Sequence[str],
                 origin: object):
        self._g = tables.num_groups
        self._src_limits, self._dst_limits = list(src_limits), list(dst_limits)
        self._src_side, self._dst_side = sides
        self._group_layers = list(group_layers)
        self._origin = origin
        self._group_bytes = tables.group_block_bytes.tolist()
        self._class_groups = _class_groups(self._g, alias_classes)
        self._src_limit = np.array([n for n, _ in src_limits], dtype=np.int64)
        self._dst_limit = np.array([n for n, _ in dst_limits], dtype=np.int64)
        self._dst_class = np.array(_dense_classes(self._g, alias_classes), dtype=np.int64)
        self._entries_per_group = np.diff(tables.group_offsets).astype(np.int64)
        self._native = _NativePass(self) if plan_call_function() is not None else None

    @property
    def origin(self) -> object:
        """The token of this planner's plans (opaque: no reference to the copier)."""
        return self._origin

    @property
    def engine(self) -> str:
        """"native" (csrc/call_plan.cpp) or "numpy" (no native library)."""
        return "native" if self._native is not None else "numpy"

    def plan(self, src_ids, dst_ids) -> CallPlan:
        """The checked, packed call; ``ValueError``/``TypeError`` naming the group,
        layer and id when the ids are not a valid call."""
        flat = _plain_ids(src_ids, dst_ids, self._g)
        if flat is None:
            flat = self._checked_ids(src_ids, dst_ids)
        return self._pass(*flat)

    def plan_flat(self, src: np.ndarray, dst: np.ndarray, lens) -> CallPlan:
        """:meth:`plan` of ids given as every group's ids concatenated (``src``, ``dst``:
        1-D int64 numpy arrays) and ``lens`` (ids per group, ``G`` ints >= 0 summing to
        their length): no Python list is walked, for callers that build ids with numpy
        (layer-wise staging: thousands of id lists per call in head order). The same
        checks and refusals as :meth:`plan`."""
        for side, ids in ((self._src_side, src), (self._dst_side, dst)):
            if type(ids) is not np.ndarray or ids.dtype != np.int64 or ids.ndim != 1:
                raise TypeError(f"plan_flat: {side} block ids must be a 1-D int64 numpy array, got {shown(ids)}")
        n = np.asarray(lens)
        if n.shape != (self._g,) or n.dtype.kind not in "iu" or (self._g and int(n.min()) < 0):
            raise ValueError(f"plan_flat: lens must be {self._g} counts >= 0 (one per group), got {shown(lens)}")
        counts = n.tolist()  # Python ints: an int64/uint64 sum wraps (4 * 2**62 + 2 sums to 2)
        if max(counts, default=0) > len(src) or sum(counts) != len(src) or len(dst) != len(src):
            raise ValueError(f"plan_flat: lens sum to {sum(counts)}, but {len(src)} {self._src_side} and "
                             f"{len(dst)} {self._dst_side} block ids")
        return self._pass(src, dst, array.array("q", counts))

    def _pass(self, src, dst, lens: array.array) -> CallPlan:
        """Step 2 over every group's ids concatenated (``array('q')`` or int64 numpy)."""
        # The plan keeps the ids as bytes; the C pass reads those same buffers.
        src_bytes = src.tobytes()
        dst_bytes = src_bytes if dst is src else dst.tobytes()
        if self._native is not None:
            words, n = self._native(src_bytes, dst_bytes, lens)
        else:
            words, n = plan_in_numpy(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64), lens,
                                     self._src_limit, self._dst_limit, self._dst_class, self._entries_per_group)
        if n < 0:
            if n == -2:
                raise MemoryError("the call planner could not grow its duplicate-check array")
            if n == -3:
                raise RuntimeError("kvcopy_plan_call: its plan struct is shorter than the library's (another build)")
            raise ValueError(self._refusal(words[:3], src, dst, lens))
        g = self._g
        return call_plan(words.tobytes(), n, int(words[g]), int(words[2 * g + 1]), src_bytes, dst_bytes,
                         tuple(lens), sum(map(operator.mul, self._group_bytes, lens)), self._origin)

    def split(self, plan: CallPlan, part_of_group, parts: int) -> List[CallPlan]:
        """Cut ``plan`` (made by this planner) into ``parts`` plans: plan ``p`` holds the
        ids of the groups ``g`` with ``part_of_group[g] == p`` and leaves every other
        group's list empty (-1: a group in no part); each equals, word for word in its
        call array, the plan of those ids alone. Nothing is checked again: the ids of a
        checked call, some groups' lists emptied, are a valid call (in range, no
        destination block written twice). A few array passes over the plan whatever
        ``parts`` is, then one slice per part (``bench/arena_plan_cost.py --per-step``)."""
        if type(plan) is not CallPlan or plan.origin is not self._origin:
            raise ValueError("split: not a plan made by this planner")
        g = self._g
        part = np.asarray(part_of_group)
        if part.shape != (g,) or part.dtype.kind not in "iu":
            raise ValueError(f"split: part_of_group must be {g} integers (one per group), got {shown(part_of_group)}")
        if parts < 0 or (g and (int(part.min()) < -1 or int(part.max()) >= parts)):
            raise ValueError(f"split: parts are numbered -1 (none) to {parts - 1}, got {shown(part.tolist())}")
        packed = plan.packed
        head = 2 * (g + 1)
        lens = np.asarray(plan.group_lens, dtype=np.int64)
        counts = np.stack((np.diff(packed[:g + 1]), np.diff(packed[g + 1:head])))  # runs, items per group
        # per part, its run offsets and item offsets (what planning its groups alone gives)
        mine = part[None, :] == np.arange(parts)[:, None]  # [parts, groups]
        header = np.zeros((parts, 2, g + 1), dtype=np.int64)
        np.cumsum(np.where(mine[:, None, :], counts[None, :, :], 0), axis=2, out=header[:, :, 1:])
        n_runs, n_items = header[:, 0, g].tolist(), header[:, 1, g].tolist()
        kept = part >= 0
        totals = np.zeros(parts, dtype=np.int64)  # bytes per part (integers: no float sum)
        np.add.at(totals, part[kept], (lens * np.asarray(self._group_bytes, np.int64))[kept])
        totals = totals.tolist()
        # groups, runs and ids sorted by part, stably: each part's in its groups' order, as
        # planned; those of no part (-1) sort first and are left out
        groups = np.argsort(part, kind="stable")
        group_at = np.cumsum(np.bincount(part + 1, minlength=parts + 1)).tolist()
        group_list, lens_list = groups.tolist(), lens[groups].tolist()
        run_part = np.repeat(part, counts[0])
        runs = packed[head:].reshape(-1, 3)[np.argsort(run_part, kind="stable")]
        run_at = np.cumsum(np.bincount(run_part + 1, minlength=parts + 1)).tolist()
        id_part = np.repeat(part, lens)
        id_order = np.argsort(id_part, kind="stable")
        src, dst = plan.src_flat[id_order], plan.dst_flat[id_order]
        id_at = np.cumsum(np.bincount(id_part + 1, minlength=parts + 1)).tolist()
        blocks = np.zeros(len(runs) + 1, dtype=np.int64)  # the block prefix over the sorted runs
        np.cumsum(runs[:, 2], out=blocks[1:])
        zeros = [0] * g
        out = []
        for p in range(parts):
            r0, r1, i0, i1 = run_at[p], run_at[p + 1], id_at[p], id_at[p + 1]
            group_lens = zeros.copy()
            for j, n in zip(group_list[group_at[p]:group_at[p + 1]], lens_list[group_at[p]:group_at[p + 1]]):
                group_lens[j] = n
            words = b"".join((header[p].tobytes(), runs[r0:r1].tobytes(),
                              (blocks[r0:r1 + 1] - blocks[r0]).tobytes()))
            out.append(call_plan(words, head + 3 * n_runs[p], n_runs[p], n_items[p], src[i0:i1].tobytes(),
                                 dst[i0:i1].tobytes(), tuple(group_lens), totals[p], self._origin))
        return out

    # ------------------------------------------------------------ checks in Python
    def _checked_ids(self, src_ids, dst_ids):
        """Step 1 for anything but plain lists: the ids through kvcopy.checks."""
        src_what = f"{self._src_side} block ids (one list per KV cache group)"
        dst_what = f"{self._dst_side} block ids (one list per KV cache group)"
        src_ids = items(src_ids, src_what)
        dst_ids = items(dst_ids, dst_what)
        if len(src_ids) != self._g or len(dst_ids) != self._g:
            raise ValueError(
                f"expected one id list per KV cache group ({self._g}), got "
                f"{len(src_ids)} {self._src_side} and {len(dst_ids)} {self._dst_side} lists")
        srcs = [block_ids(src_ids[g], f"group {g}: {self._src_side} block ids") for g in range(self._g)]
        dsts = [block_ids(dst_ids[g], f"group {g}: {self._dst_side} block ids") for g in range(self._g)]
        for g, (s, t) in enumerate(zip(srcs, dsts)):
            if len(s) != len(t):
                raise ValueError(f"group {g}: {len(s)} {self._src_side} block ids but {len(t)} "
                                 f"{self._dst_side} block ids")
        lens = array.array("q", map(len, srcs))
        src = np.ascontiguousarray(np.concatenate(srcs) if srcs else np.zeros(0, np.int64), dtype=np.int64)
        dst = np.ascontiguousarray(np.concatenate(dsts) if dsts else np.zeros(0, np.int64), dtype=np.int64)
        return src, dst, lens

    # ------------------------------------------------------------ the message
    def _refusal(self, err, src, dst, lens) -> str:
        """The message for the pass's report ``(code, group, id)``."""
        code, g, value = (int(x) for x in err)
        if code in (SRC_RANGE, DST_RANGE):
            side = self._src_side if code == SRC_RANGE else self._dst_side
            blocks, layer = (self._src_limits if code == SRC_RANGE else self._dst_limits)[g]
            return f"group {g}, layer {layer!r}: {side} block id {value} out of range [0, {blocks})"
        if code != DUPLICATE:
            return f"the call planner refused the call (code {code}, group {g}, id {value})"
        starts = np.concatenate(([0], np.cumsum(np.asarray(lens, dtype=np.int64))))
        dst_of = [np.asarray(dst, dtype=np.int64)[starts[h]:starts[h + 1]] for h in range(self._g)]
        earlier = [h for h in self._class_groups[g] if h < g and value in dst_of[h]]
        if not earlier:
            return (f"group {g}, layer {self._group_layers[g]!r}: {self._dst_side} block id {value} "
                    "is written twice in one call")
        owners = [h for h in self._class_groups[g] if value in dst_of[h]]
        return f"groups {owners} share {self._dst_side} storage and both write block id {value}"


class _NativePass:
    """Step 2 in C: the planner's constants in one ``kvcopy_plan_static`` struct, made
    once per planner; a call passes its address and the call's four buffers.

    Reentrant: the call's buffers are its own, and the duplicate check's stamp array is
    per thread in the library (``csrc/call_plan.cpp``), so calls on one planner from
    several threads never see each other's stamps."""

    def __init__(self, planner: CallPlanner):
        self._fn = plan_call_function()
        g = planner._g
        self._g = g
        self._keep = (planner._src_limit, planner._dst_limit, planner._dst_class, planner._entries_per_group)
        self._static = native.PlanStatic.make(
            num_groups=g, src_limit=planner._src_limit.ctypes.data, dst_limit=planner._dst_limit.ctypes.data,
            dst_class=planner._dst_class.ctypes.data, num_classes=int(planner._dst_class.max()) + 1 if g else 0,
            entries_per_group=planner._entries_per_group.ctypes.data,
            dst_capacity=int(planner._dst_limit.max()) if g else 0)
        self._static_at = ctypes.addressof(self._static)
        self._words_fixed = 2 * (g + 1) + 1  # words of a call besides 4 per id

    def __call__(self, src: bytes, dst: bytes, lens: array.array):
        """``(words, n)`` for the int64 ids in ``src``/``dst`` (ctypes passes a ``bytes``
        object as the address of its data); ``words[0:3]`` is the pass's report
        ``(code, group, id)`` when n < 0."""
        words = _ZERO_WORD * (self._words_fixed + len(src) // 2)  # 4 words per id, 8 bytes each
        return words, self._fn(self._static_at, src, dst, lens.buffer_info()[0], words.buffer_info()[0])


def plan_in_numpy(src: np.ndarray, dst: np.ndarray, lens, src_limit: np.ndarray, dst_limit: np.ndarray,
                  dst_class: np.ndarray, entries_per_group: np.ndarray):
    """``csrc/call_plan.cpp`` in numpy: ``(words, n)`` with the packed call in
    ``words[:n]`` and the block prefix after it, or ``((code, group, id), -1)`` for the
    first id (in call order) the C pass would refuse, with the same code."""
    g_count = len(lens)
    written: Dict[int, np.ndarray] = {}  # class -> destination ids of its earlier groups
    runs, pos = [], 0
    for g in range(g_count):
        n = int(lens[g])
        s, t = src[pos:pos + n], dst[pos:pos + n]
        pos += n
        cls = int(dst_class[g])
        src_bad = (s < 0) | (s >= src_limit[g])
        dst_bad = (t < 0) | (t >= dst_limit[g])
        repeat = np.ones(n, dtype=bool)
        repeat[np.unique(t, return_index=True)[1]] = False
        if cls in written:
            repeat |= np.isin(t, written[cls])
        bad = src_bad | dst_bad | repeat
        if bad.any():
            i = int(np.argmax(bad))
            code = SRC_RANGE if src_bad[i] else DST_RANGE if dst_bad[i] else DUPLICATE
            return (code, g, int(s[i] if code == SRC_RANGE else t[i])), -1
        written[cls] = np.concatenate([written[cls], t]) if cls in written else t
        runs.append(merge_runs(s, t))
    run_counts = np.array([len(r) for r in runs], dtype=np.int64)
    header = np.zeros(2 * (g_count + 1), dtype=np.int64)
    np.cumsum(run_counts, out=header[1:g_count + 1])
    np.cumsum(np.asarray(entries_per_group, dtype=np.int64) * run_counts, out=header[g_count + 2:])
    flat_runs = np.concatenate([r.ravel() for r in runs]) if runs else np.zeros(0, np.int64)
    prefix = np.zeros(int(run_counts.sum()) + 1, dtype=np.int64)
    np.cumsum(flat_runs[2::3], out=prefix[1:])
    words = np.ascontiguousarray(np.concatenate([header, flat_runs, prefix]), dtype=np.int64)
    return words, len(header) + len(flat_runs)


def merge_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``[R, 3]`` runs (src start, dst start, count) of ids consecutive on both sides."""
    n = len(src)
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [n])))
    return np.stack((src[starts], dst[starts], counts), axis=1)


_function = None
_ZERO_WORD = array.array("q", [0])  # times n: a zeroed call array, made in one C loop


def plan_call_function():
    """``kvcopy_plan_call`` from the host library (csrc/call_plan.cpp), typed, or None
    where the library is not built (or is refused: :mod:`kvcopy.native`)."""
    global _function
    if _function is None:
        lib, _ = native.load("kvcopy_cpu")
        if lib is not None:
            _function = lib.kvcopy_plan_call
    return _function


# ---------------------------------------------------------------- plain lists
_PLAIN = (list, tuple)
_INT_ONLY = frozenset((int,))


def _plain_ids(src_ids, dst_ids, g: int):
    """``(src, dst, lens)`` as ``array('q')`` buffers when both sides are lists or tuples
    of ``g`` plain lists/tuples of ints of matching lengths, else None (the checked path
    then runs, and raises where the ids are bad: a set, frozenset or dict view outside,
    whose order would decide which group gets which ids, included)."""
    same = dst_ids is src_ids  # to_host(ids)/to_device(ids): one id list for both sides
    if type(src_ids) not in _PLAIN or type(dst_ids) not in _PLAIN or len(src_ids) != g or len(dst_ids) != g:
        return None
    for x in (src_ids if same else itertools.chain(src_ids, dst_ids)):
        # a bool among the ids (array('q') would take it as 0/1): `in` is a C loop comparing
        # by identity, then value; the type scan runs only for lists holding a 0 or 1
        if type(x) not in _PLAIN or ((True in x or False in x) and not _INT_ONLY.issuperset(map(type, x))):
            return None
    lens = array.array("q", map(len, src_ids))
    if not same and array.array("q", map(len, dst_ids)) != lens:
        return None
    try:
        src = array.array("q", itertools.chain.from_iterable(src_ids))
        dst = src if same else array.array("q", itertools.chain.from_iterable(dst_ids))
    except (TypeError, OverflowError):
        return None
    return src, dst, lens


def _dense_classes(g_count: int, alias_classes: Sequence[Sequence[int]]) -> List[int]:
    """Per group, its class numbered from 0: the groups of one alias class share a
    number, every other group has one of its own (one stamp row per class)."""
    cls = list(range(len(alias_classes), len(alias_classes) + g_count))
    for c, groups in enumerate(alias_classes):
        for g in groups:
            cls[g] = c
    dense = {c: i for i, c in enumerate(sorted(set(cls)))}
    return [dense[c] for c in cls]


def _class_groups(g_count: int, alias_classes: Sequence[Sequence[int]]) -> List[List[int]]:
    """Per group, the groups of its class (itself alone when it shares nothing)."""
    out: List[List[int]] = [[g] for g in range(g_count)]
    for groups in alias_classes:
        for g in groups:
            out[g] = sorted(groups)
    return out

