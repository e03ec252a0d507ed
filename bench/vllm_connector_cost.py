"""Host cost of one request-sync through kvcopy.vllm (48 layers x 6 groups by default),
and (``--transport``) the arena connector against vLLM's NixlConnector with host buffers.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu build/venv-vllm/bin/python bench/vllm_connector_cost.py \
        [--layers 48] [--groups 6] [--blocks 8] [--rounds 2000] [--model hybrid|gdn] [--kernel-pages 4]
    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 build/venv-vllm/bin/python bench/vllm_connector_cost.py \
        --transport [options of bench/vllm_transport_cost.py]

Runs in the vLLM environment (``.ci/run``'s ``build/venv-vllm``). Pages are tiny (tens
of bytes), so the bytes moved are negligible and the figure is the host work.

* ``--model hybrid`` (default): vLLM's sliding-window + full shape: ``groups`` KV cache
  groups overlaid from byte 0 (layer i of every group is a view of one device tensor),
  one host buffer per layer, ``blocks`` blocks per group per request, pages of one
  token x one head x 16 bytes.
* ``--model gdn``: a Qwen3-Next style attention + gated-delta-net hybrid of ``layers``
  layers, every 4th full attention, grouped as vLLM groups them (12 layers per group for
  48: one attention group, three GDN groups), all overlaid from byte 0 of one
  allocation, layer-outermost. Attention blocks are split into ``kernel-pages`` kernel
  pages; GDN state is an int8 ``[NB, 1, 1, 40]`` view whose block stride is the padded
  64-byte page, with host buffers of that stride (what the connector allocates). A
  request is ``blocks`` attention blocks (``blocks x kernel-pages`` kernel-page ids)
  and one state block per GDN group: the copier checks per call that no state block is
  an attention kernel page's block (its row check for overlays of different strides).

It reports, per request-sync (median and p90 over ``rounds``):

* ``validate``: ``BlockCopier.plan("h2d", ids)``: checks and packing, no copy;
* ``sync``: ``KvcopyNixlWorker.sync_recved_kv_to_device`` end to end (the ``cpu``
  backend's one native call included);
* ``vllm op``: vLLM 0.33's ``copy_kv_blocks`` on the same caches with the flattened
  ids (what the stock worker calls, ``dst[idx] = src[idx]`` per layer; on the CPU), for
  a side-by-side ratio. Its bytes are wrong for this model (it overwrites received KV
  of one group with another's unfilled host pages); only its time is compared (with
  ``--model gdn`` its flattened ids index the state tensors with kernel pages: vLLM 0.33
  raises ``IndexError`` once they pass the state's block count).
"""
from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
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


def _hybrid(args):
    """``groups`` overlaid groups of ``layers / groups`` layers, 16-byte pages."""
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
    ids = [list(range(1 + g * args.blocks, 1 + (g + 1) * args.blocks)) for g in range(args.groups)]
    return device, host, groups, ids


def _gdn(args, page=64, state=40):
    """Attention every 4th layer (kernel pages of ``page / kernel_pages`` bytes), GDN
    state (``state`` of ``page`` bytes) elsewhere; vLLM's grouping: per group as many
    layers as there are attention layers, groups overlaid layer-outermost from byte 0."""
    nb, r = args.num_blocks, args.kernel_pages
    attn = [i for i in range(args.layers) if i % 4 == 3]
    gdn = [i for i in range(args.layers) if i % 4 != 3]
    per_group = len(attn)
    n_gdn_groups = len(gdn) // per_group
    layers = [[f"model.layers.{i}.self_attn.attn" for i in attn]]
    layers += [[f"model.layers.{i}.linear_attn" for i in gdn[g::n_gdn_groups]] for g in range(n_gdn_groups)]
    raw = torch.zeros(per_group * nb * page, dtype=torch.uint8)
    kernel = page // r
    device, host = {}, {}
    for slot in range(per_group):
        base = slot * nb * page
        name = layers[0][slot]
        device[name] = raw.view(torch.float16).as_strided((nb * r, 1, 1, kernel // 2), (kernel // 2, 1, 1, 1),
                                                           base // 2)
        host[name] = torch.zeros(device[name].shape, dtype=torch.float16)
        for g in range(1, len(layers)):
            name = layers[g][slot]
            device[name] = raw.view(torch.int8).as_strided((nb, 1, 1, state), (page, state, state, 1), base)
            host[name] = torch.zeros(nb, page, dtype=torch.int8)[:, :state].view(nb, 1, 1, state)
    blocks = list(range(1, 1 + args.blocks))
    ids = [[b * r + j for b in blocks for j in range(r)]]
    ids += [[1 + args.blocks + g] for g in range(n_gdn_groups)]  # one state block per GDN group
    return device, host, layers, ids


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--transport" in argv:  # the arena connector against vLLM's NixlConnector: its own options
        from vllm_transport_cost import main as transport  # beside this script

        return transport([a for a in argv if a != "--transport"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Listed for --help only: "--transport" is dispatched above, before this parser, because
    # the transport benchmark's options (--rounds, --blocks) differ from these.
    ap.add_argument("--transport", action="store_true",
                    help="run bench/vllm_transport_cost.py instead (the arena connector against vLLM's "
                         "NixlConnector); every other option is then its own (--transport --help)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per group per request")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--model", choices=("hybrid", "gdn"), default="hybrid")
    ap.add_argument("--kernel-pages", type=int, default=4, help="gdn: attention kernel pages per block")
    args = ap.parse_args(argv)
    device, host, groups, ids = (_gdn if args.model == "gdn" else _hybrid)(args)
    copier = kvcopy.BlockCopier(device, host, groups)
    worker = object.__new__(KvcopyNixlWorker)
    worker.kvcopy_copier, worker.device_kv_caches = copier, device
    meta = ReqMeta(local_block_ids=ids, local_physical_block_ids=ids, tp_size=1)
    flat = [b for g in ids for b in g]
    _stock_platform_ops()

    rows = [
        ("validate (BlockCopier.plan)", lambda: copier.plan("h2d", ids)),
        (f"sync ({copier.copy_backends()['to_device']} backend)", lambda: worker.sync_recved_kv_to_device("r", meta)),
        ("vllm op (copy_kv_blocks)", lambda: kv_utils.copy_kv_blocks(host, device, flat, flat, "h2d")),
    ]
    if args.model == "gdn":
        print(f"{args.layers}-layer attention + GDN hybrid, {len(groups)} groups of {len(groups[0])} layers, "
              f"{args.blocks} attention blocks x {args.kernel_pages} kernel pages + 1 state block per GDN group "
              f"per request, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    else:
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
