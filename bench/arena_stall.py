"""Does any READ of the arena connector stall between real engines? Batches through one pair.

    VLLM_TARGET_DEVICE=cpu build/engine-env/bin/python bench/arena_stall.py [--batches 8] [--load 2]

One P and one D (``KvcopyArenaConnector``, vLLM's default CPU binding, the connector's
default deadlines: ``pull_timeout_s`` 30 s), a 2-layer Llama; ``--batches`` batches of 6
prompts (1, 31, 32, 33, 100, 500 tokens), each through P then D with all in flight. With
``--load N``, N busy processes run beside the engines for the whole run (a loaded
machine). Per batch: D's time, and how many requests D loaded against how many it had to
recompute (a READ that passed its deadline is recomputed); the exit status is 1 when any
was recomputed. The stall this looks for, and its cause: docs/vllm.md, "With a real engine".
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcopy.testing.engine.models import build_model  # noqa: E402
from kvcopy.testing.engine.pd import engine_config, kv_transfer_config, random_prompts, run_pd, start_pair  # noqa: E402

LENGTHS = [1, 31, 32, 33, 100, 500]


def _spin(stop):
    while not stop.is_set():
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the engines")
    ap.add_argument("--out", default=None, help="folder for the model and engine logs (default: a temporary one)")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="arena-stall-")
    os.makedirs(out, exist_ok=True)
    model = build_model("llama", os.path.join(out, "model"), seed=0).path
    cfg = engine_config(model, 32, 1024, kv=kv_transfer_config("arena"))
    stop = mp.Event()
    hogs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    recomputed = 0
    try:
        pair = start_pair(out, "stall", cfg, cfg)
        try:
            for b in range(args.batches):
                prompts = random_prompts(LENGTHS, seed=100 + b)
                t0 = time.monotonic()
                batch = run_pd(pair, prompts, 8)
                lost = sum(1 for n, c in zip(LENGTHS, batch.cached) if n > 1 and c == 0)
                recomputed += lost
                print(f"batch {b}: D {batch.d_seconds:6.2f} s (P {batch.p_seconds:5.2f} s, total "
                      f"{time.monotonic() - t0:6.2f} s), loaded {sum(1 for c in batch.cached if c)}, "
                      f"recomputed {lost}", flush=True)
        finally:
            pair.close()
    finally:
        stop.set()
        for h in hogs:
            h.join(10)
    print(f"{args.batches} batches, {recomputed} requests recomputed (load {args.load}); logs: {out}")
    return 1 if recomputed else 0


if __name__ == "__main__":
    sys.exit(main())
