"""The arena-mode hardening probe: hostile and unlucky inputs, counted per class.

    python bench/hardening_probe.py                        # every class, defaults below
    python bench/hardening_probe.py --only records threads
    python bench/hardening_probe.py --reps 20 --threads 8 --calls 100000

Each class runs in a child process of its own, so a crash shows as the child dying by a
signal and a hang as the child passing ``--timeout``; the parent prints one row per
class: cases run, completions that said ``ok=True`` with bytes other than the
request's, crashes, hangs, exceptions other than the documented ones (``ValueError``,
``TypeError``; ``ArenaFull``, ``PagesHeld`` and deadlines where the case expects them),
and other broken promises (a bad input accepted, a good one refused, a span not freed),
with up to three examples.

Classes (the cases: ``kvcopy/testing/nixl/{hostile,misuse,stopped_peer}.py``):

``records``        every bit flip, 256 byte changes, every truncation, extensions and
                   re-framed JSON edits of a keyed record, each given to D's ``plan_pull``
                   (must be refused; one accepted is pulled and its bytes compared)
``plan-edits``     every field of a host-mode and an arena-mode plan (and of what they
                   hold) edited: refused, or A, B and C land byte for byte
``late-reads``     the stopped-P late-READ case over TCP, arena, host and device mode,
                   ``--reps`` each
``reader-gives-up`` readers=2, reader 1 aborts or closes after its READ landed,
                   ``--reps`` each
``discard-after-pull``  ``--reps``
``threads``        one BlockCopier from ``--threads`` threads, ``--calls`` calls each, two
                   of every three bad (duplicate or out-of-range ids, wrong types and
                   shapes): every bad one refused, every good one exact
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List

CLASSES = ("records", "plan-edits", "late-reads", "reader-gives-up", "discard-after-pull", "threads")
KEY = b"kvcopy-hardening-probe-key-0123"


def _row(cases=0, wrong=0, unexpected=0, problems=0, examples=()) -> Dict[str, object]:
    return {"cases": cases, "wrong_bytes": wrong, "unexpected": unexpected, "problems": problems,
            "examples": list(examples)[:3]}


def _tally(outcomes, unexpected=0, errors=()) -> Dict[str, object]:
    examples = [p for o in outcomes for p in o.problems] + list(errors)
    return _row(len(outcomes) + unexpected, sum(o.wrong_bytes for o in outcomes), unexpected,
                sum(bool(o.problems) for o in outcomes), examples)


# ---------------------------------------------------------------------- classes (child side)
def records(args) -> Dict[str, object]:
    from kvcopy.nixl import StagedRequest
    from kvcopy.testing.nixl.engines import ManagerPairs, expected_pull, wait
    from kvcopy.testing.nixl.oracle import clone_caches, same_bytes
    from kvcopy.testing.nixl.hostile import record_mutations

    cases = wrong = unexpected = accepted = 0
    examples: List[str] = []
    with ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", 48, buffer="arena", arena_bytes=1 << 20, key=KEY)
        p.save([[7, 8, 9]], num_tokens=40, request_id="other")  # another live span to point at
        record = p.save([[1, 2, 3]], num_tokens=40, request_id="A")
        wire = record.to_bytes(KEY)
        assert StagedRequest.from_bytes(wire, KEY) == record
        for what, data in record_mutations(wire, KEY, d.arena.arena.granule):
            cases += 1
            try:
                plan = d.plan_pull(peer, data, 40, [[10, 11, 12]], request_id="A")
            except (ValueError, TypeError):
                continue
            except Exception as exc:
                unexpected += 1
                examples.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            accepted += 1
            examples.append(f"{what}: accepted")
            before = clone_caches(de.device_caches)
            h = d.pull(plan, notify=b"A")
            done = wait(d, h) == "DONE" and d.complete(h).ok
            want = expected_pull(before, de, [[10, 11, 12]], pe.device_caches, pe, [[1, 2, 3]], 40)
            wrong += int(done and not same_bytes(de.device_caches, want))
        # the genuine record, last: accepted and exact (the probe can tell the two apart)
        before = clone_caches(de.device_caches)
        h = d.pull(d.plan_pull(peer, wire, 40, [[20, 21, 22]], request_id="A"), notify=b"A")
        want = expected_pull(before, de, [[20, 21, 22]], pe.device_caches, pe, [[1, 2, 3]], 40)
        if not (wait(d, h) == "DONE" and d.complete(h).ok and same_bytes(de.device_caches, want)):
            accepted += 1
            examples.append("the genuine record did not land byte for byte")
    return _row(cases, wrong, unexpected, accepted, examples)


def plan_edits(args) -> Dict[str, object]:
    from kvcopy.testing.nixl.hostile import plan_edits as edits
    from kvcopy.testing.nixl.misuse import edit_case

    outcomes = [edit_case(buffer, edit) for buffer in ("host", "arena") for edit in edits(buffer)]
    return _tally(outcomes)


def late_reads(args) -> Dict[str, object]:
    from kvcopy.testing.nixl.stopped_peer import run_case

    return _tally([run_case(buffer) for buffer in ("arena", "host", "device") for _ in range(args.reps)])


def reader_gives_up(args) -> Dict[str, object]:
    from kvcopy.testing.nixl.misuse import reader_gives_up_case

    return _tally([reader_gives_up_case(how) for how in ("abort", "close") for _ in range(args.reps)])


def discard_after_pull(args) -> Dict[str, object]:
    from kvcopy.testing.nixl.misuse import discard_after_pull_case

    return _tally([discard_after_pull_case() for _ in range(args.reps)])


def _bad_calls(blocks: int, good: List[int]):
    """Calls a copier must refuse with ValueError or TypeError (each: a group list)."""
    import numpy as np
    import torch

    dup = list(good)
    dup[-1] = dup[0]
    far = list(good)
    far[-1] = blocks
    return [[dup], [far], [[-2] + good[1:]], [[float(b) for b in good]], [[True] + good[1:]],
            [[str(b) for b in good]], [[good]], [np.asarray(good, np.float32)], [set(good)],
            [np.ma.masked_array(good)], [torch.tensor([good])], [good, good], [], [[2 ** 64 - 1]], None, "0"]


def threads(args) -> Dict[str, object]:
    import numpy as np
    import torch

    import kvcopy

    blocks = 4096
    dev = torch.randint(0, 256, (blocks, 8), dtype=torch.uint8)
    host = torch.zeros(blocks, 8, dtype=torch.uint8)
    backend = "cpu" if kvcopy.available_copy_backends()["cpu"] is None else "torch"
    copier = kvcopy.BlockCopier({"a": dev}, {"a": host}, [["a"]], copy_backend=backend)
    rng = np.random.default_rng(0)
    perms = [rng.permutation(blocks).tolist() for _ in range(args.threads)]
    counts = {"cases": 0, "accepted_bad": 0, "refused_good": 0, "unexpected": 0}
    examples: List[str] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        good, bad = perms[k], _bad_calls(blocks, perms[k])
        mine = dict.fromkeys(counts, 0)
        for i in range(args.calls):
            mine["cases"] += 1
            call = [good] if i % 3 == 0 else bad[i % len(bad)]
            try:
                (copier.to_host if i % 3 == 0 and i % 300 == 0 else lambda ids: copier.plan("d2h", ids))(call)
                if i % 3:
                    mine["accepted_bad"] += 1
                    with lock:
                        examples.append(f"thread {k}: bad call {i % len(bad)} accepted")
            except (ValueError, TypeError) as exc:
                if i % 3 == 0:
                    mine["refused_good"] += 1
                    with lock:
                        examples.append(f"thread {k}: good call refused: {exc}")
            except Exception as exc:
                mine["unexpected"] += 1
                with lock:
                    examples.append(f"thread {k}: {type(exc).__name__}: {exc}")
        with lock:
            for key, v in mine.items():
                counts[key] += v

    pool = [threading.Thread(target=work, args=(k,)) for k in range(args.threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    copier.close()
    exact = torch.equal(host, dev)  # every thread's good calls copied every block
    wrong = 0 if exact else 1
    if not exact:
        examples.append("host != device after the good calls")
    return _row(counts["cases"], wrong, counts["unexpected"], counts["accepted_bad"] + counts["refused_good"],
                examples)


RUN = {"records": records, "plan-edits": plan_edits, "late-reads": late_reads, "reader-gives-up": reader_gives_up,
       "discard-after-pull": discard_after_pull, "threads": threads}


# ---------------------------------------------------------------------- the parent
def _run_class(name: str, args) -> Dict[str, object]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--reps", str(args.reps),
           "--threads", str(args.threads), "--calls", str(args.calls)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**_row(), "hangs": 1, "crashes": 0, "seconds": args.timeout}
    row = {"crashes": 0, "hangs": 0}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        crashed = done.returncode < 0
        row.update(_row(examples=[f"exit {done.returncode}: {done.stderr.strip()[-300:]}"]), crashes=int(crashed),
                   unexpected=int(not crashed))
    else:
        row.update(json.loads(lines[-1]))
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=CLASSES, default=list(CLASSES))
    ap.add_argument("--reps", type=int, default=20, help="repeats of each fault case (default 20)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--calls", type=int, default=100_000, help="copier calls per thread (default 100,000)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per class before it counts as a hang")
    ap.add_argument("--child", choices=CLASSES, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="one JSON object per class instead of the table")
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's kvcopy
        import torch

        torch.set_num_threads(1)
        print(json.dumps(RUN[args.child](args)))
        return 0
    print(f"{'class':<20}{'cases':>9}{'ok+wrong':>9}{'crashes':>8}{'hangs':>6}{'unexpected':>11}{'problems':>9}"
          f"{'s':>8}", flush=True)
    bad = 0
    for name in args.only:
        row = _run_class(name, args)
        bad += sum(int(row[k]) for k in ("wrong_bytes", "crashes", "hangs", "unexpected", "problems"))
        if args.json:
            print(json.dumps({"class": name, **row}), flush=True)
            continue
        print(f"{name:<20}{row['cases']:>9}{row['wrong_bytes']:>9}{row['crashes']:>8}{row['hangs']:>6}"
              f"{row['unexpected']:>11}{row['problems']:>9}{row['seconds']:>8}", flush=True)
        for example in row["examples"]:
            print(f"    {example}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
