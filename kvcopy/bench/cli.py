"""``kvcopy-bench`` (also ``python -m kvcopy``): the benchmark command line.

    kvcopy-bench                          # the seeds2 preset (presets.py), both directions, default device
    kvcopy-bench --preset hybrid7 --op-counts
    kvcopy-bench sweep --max-ctas 16 --json out.json --plot out.png
    kvcopy-bench nixl                     # NIXL pull vs one bulk READ (two agents, UCX)
    kvcopy-bench fuzz --cases 10000       # byte-oracle fuzzer of P/D plans, progress on stderr
    kvcopy-bench calibrate                # auto's per-device table (GPU)
    kvcopy-bench overhead                 # host cost per call, launch stubbed (no GPU needed)
    kvcopy-bench list                     # presets and which backends run here

This module only dispatches: each subcommand is ``(add_args, run)`` in its own module
(:mod:`.run` for run/sweep/list, :mod:`.nixl.measure`, :mod:`.calibrate`, :mod:`.overhead`,
:mod:`.fuzzing` around :mod:`kvcopy.testing.nixl.fuzz`), imported when it is chosen.
:func:`register` adds one.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Dict, Optional, Sequence

from .args import BenchError


class Subcommand:
    def __init__(self, name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int]):
        self.name, self.help, self.add_args, self.run = name, help, add_args, run

    def parser(self) -> argparse.ArgumentParser:
        prog = "kvcopy-bench" + ("" if self.name == "run" else f" {self.name}")
        p = argparse.ArgumentParser(prog=prog, description=self.help, epilog=_epilog(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_args(p)
        _show_defaults(p)
        return p


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append ``(default: X)`` to each option's help that does not state its default,
    whichever module declared the option."""
    for action in p._actions:
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS \
                or action.nargs == 0:
            continue
        if action.help is argparse.SUPPRESS or "default" in (action.help or ""):
            continue
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        action.help = ((action.help or "").replace("%", "%%") + f" (default: {shown})").strip()


SUBCOMMANDS: Dict[str, Subcommand] = {}


def register(name: str, help: str, add_args, run) -> None:
    """Add a subcommand: ``add_args(parser)`` declares its flags, ``run(args)`` returns
    the exit code."""
    SUBCOMMANDS[name] = Subcommand(name, help, add_args, run)


def _epilog() -> str:
    lines = ["subcommands (the first argument; default: run):"]
    lines += [f"  {s.name:<10} {s.help}" for s in SUBCOMMANDS.values()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == name:
        argv = argv[1:]
    sub = SUBCOMMANDS[name]
    args = sub.parser().parse_args(argv)
    args.argv = [name] + argv
    try:
        return sub.run(args)
    except BenchError as exc:
        print(f"kvcopy-bench: error: {exc}", file=sys.stderr)
        return 2



def _lazy(module: str, add_args: str, run: str):
    """(add_args, run) that import ``module`` only when the subcommand is used."""
    def add(p):
        getattr(importlib.import_module(module, __package__), add_args)(p)

    def go(args):
        return getattr(importlib.import_module(module, __package__), run)(args)
    return add, go


register("run", "measure one scenario (default command)", *_lazy(".run", "add_run_args", "cmd_run"))
register("sweep", "chunk sizes x group counts x directions x methods (GB/s against chunk size)",
         *_lazy(".run", "add_sweep_args", "cmd_sweep"))
register("nixl", "NIXL pull over UCX: PullPlan / per-page / merged descriptors vs one bulk READ",
         *_lazy(".nixl.measure", "add_args", "run"))
register("list", "presets and the backends this install can run", lambda p: None,
         _lazy(".run", "add_run_args", "cmd_list")[1])
register("fuzz", "byte-oracle fuzzer of heterogeneous P/D pull plans, progress on stderr",
         *_lazy(".fuzzing", "add_args", "run"))
register("overhead", "host cost per call with the device launch replaced by a no-op (no GPU needed)",
         *_lazy(".overhead", "add_args", "run"))
register("calibrate", "measure this GPU's backends per descriptor size; store the table auto reads",
         *_lazy(".calibrate", "add_args", "run"))


if __name__ == "__main__":
    sys.exit(main())
