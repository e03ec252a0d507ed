"""``kvcopy-bench fuzz``: :mod:`kvcopy.testing.nixl.fuzz` (the byte-oracle fuzzer of P/D pull
plans) with a progress bar on stderr: cases done, exact / raised / wrong so far (with
``--inject``: faults injected, missed or wrong), and the time left at the current rate
(a line every few seconds when stderr is a file).
"""
from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from ..testing.nixl import fuzz

    fuzz.add_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar (stderr)")


def run(args: argparse.Namespace) -> int:
    from ..testing.nixl import fuzz
    from .output import Progress

    bar = Progress(args.cases, quiet=args.quiet or args.case is not None or args.verbose, every_s=5.0)

    def progress(done: int, report) -> None:
        if isinstance(report, fuzz.InjectReport):
            bar.step(f"injected {report.injected}, missed/wrong {report.failures}")
        else:
            bar.step(f"exact {report.exact}, raised {report.num_raised}, wrong {report.wrong}")

    return fuzz.run(args, progress=progress)
