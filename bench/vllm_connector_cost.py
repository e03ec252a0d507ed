"""Host cost of one request-sync through kvcopy.vllm (48 layers x 6 groups by default).

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu build/venv-vllm/bin/python bench/vllm_connector_cost.py \
        [--layers 48] [--groups 6] [--blocks 8] [--rounds 2000]

Runs in the vLLM environment (``.ci/run``'s ``build/venv-vllm``). The caches are vLLM's
hybrid shape: ``groups`` KV cache groups overlaid from byte 0 (layer i of every group is
a view of one device tensor), one host buffer per layer, ``blocks`` blocks per group per
request, pages of one token x one head x 16 bytes, so the bytes moved are negligible
and the figure is the host work. It reports, per request-sync (median and p90 over
``rounds``):

* ``validate``: ``BlockCopier.plan("h2d", ids)``: checks and packing, no copy;
* ``sync``: ``KvcopyNixlWorker.sync_recved_kv_to_device`` end to end (the ``cpu``
  backend's one native call included);
* ``vllm op``: vLLM 0.33's ``copy_kv_blocks`` on the same caches with the flattened
  ids (what the stock worker calls, ``dst[idx] = src[idx]`` per layer; on the CPU), for
  a side-by-side ratio. Its bytes are wrong for this model (seeds/1); only its time is
  compared.
"""
from __future__ import annotations

import argparse
import ast
import os
import statistics
import textwrap
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import kvcopy  # noqa: E402
from kvcopy.vllm import KvcopyNixlWorker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402


def _stock_platform_ops():
    """vLLM's CUDA platform copy methods, compiled from vllm/platforms/cuda.py (it needs
    libcuda to import), installed on the CPU platform so copy_kv_blocks can run."""
    import vllm.platforms as platforms

    path = os.path.join(os.path.dirname(platforms.__file__), "cuda.py")
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.FunctionDef) and node.name in ("insert_blocks_to_device", "swap_out_blocks_to_host"):
            node.decorator_list = []
            ns = {"torch": torch}
            exec(compile(textwrap.dedent(ast.unparse(node)), path, "exec"), ns)
            setattr(type(current_platform), node.name, classmethod(ns[node.name]))


def _time(fn, rounds):
    for _ in range(min(50, rounds)):
        fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t) / 1e3)
    out.sort()
    return statistics.median(out), out[int(0.9 * len(out))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per group per request")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args(argv)
    per_group = args.layers // args.groups
    shape = (args.num_blocks, 1, 1, 8)  # [B, H, N, C] fp16: 16-byte pages
    storages = [torch.zeros(shape, dtype=torch.float16) for _ in range(per_group)]
    device, host, groups = {}, {}, []
    for g in range(args.groups):
        names = [f"model.layers.{g * per_group + i}.self_attn.attn" for i in range(per_group)]
        for i, n in enumerate(names):
            device[n] = storages[i]
            host[n] = torch.zeros(shape, dtype=torch.float16)
        groups.append(names)
    copier = kvcopy.BlockCopier(device, host, groups)
    worker = object.__new__(KvcopyNixlWorker)
    worker.kvcopy_copier, worker.device_kv_caches = copier, device
    ids = [list(range(1 + g * args.blocks, 1 + (g + 1) * args.blocks)) for g in range(args.groups)]
    meta = ReqMeta(local_block_ids=ids, local_physical_block_ids=ids, tp_size=1)
    flat = [b for g in ids for b in g]
    _stock_platform_ops()

    rows = [
        ("validate (BlockCopier.plan)", lambda: copier.plan("h2d", ids)),
        (f"sync ({copier.backends()['to_device']} backend)", lambda: worker.sync_recved_kv_to_device("r", meta)),
        ("vllm op (copy_kv_blocks)", lambda: kv_utils.copy_kv_blocks(host, device, flat, flat, "h2d")),
    ]
    print(f"{args.layers} layers x {args.groups} groups, {args.blocks} blocks/group/request, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    results = {}
    for name, fn in rows:
        med, p90 = _time(fn, args.rounds)
        results[name] = med
        print(f"  {name:34s} median {med:9.1f} us   p90 {p90:9.1f} us")
    stock = results["vllm op (copy_kv_blocks)"]
    sync = [v for k, v in results.items() if k.startswith("sync")][0]
    print(f"  vllm op / kvcopy sync: {stock / sync:.1f}x")


if __name__ == "__main__":
    main()
