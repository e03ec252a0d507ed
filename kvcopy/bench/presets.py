"""The scenario presets of ``kvcopy-bench`` as plain data, and the dtype and layout
names the flags accept (no torch here: ``--help`` lists them without importing it).

:mod:`.scenarios` turns each preset into a :class:`~kvcopy.bench.scenarios.Scenario`;
the names below are those of :data:`kvcopy.testing.DTYPES` and
:data:`kvcopy.testing.LAYOUTS` (``tests/bench/test_bench_cli.py`` checks they agree).
"""
from __future__ import annotations

from typing import Dict

DTYPE_NAMES = ("bf16", "fp16", "fp8", "uint8", "fp32")
LAYOUT_NAMES = ("nhd", "hnd", "hnd_view_of_nhd", "kv_first", "blocks_first_kv", "mla", "lbnhc", "blnhc", "bhlnc",
                "lhbnc", "kv_first_hnd", "flashinfer_hnd", "host_lbnhc")

# name -> Scenario fields (over the dataclass defaults), group counts, one-line help
PRESETS: Dict[str, dict] = {
    # The benchmark of the vLLM pull request that coalesced host-buffer copies for hybrid
    # models (one copy per layer instead of one per KV cache group and layer), measured
    # there on an RTX 4090: 16 layers, 1/2/3/6 groups, 6 blocks per request.
    "seeds2": dict(fields={}, num_groups=[1, 2, 3, 6],
                   help="seeds2: the benchmark of the vLLM pull request that coalesced host-buffer copies for "
                        "hybrid models (measured there on an RTX 4090): 16 layers, groups 1/2/3/6, 6 blocks/group, "
                        "16-token blocks, 8 KV heads x 128, bf16 (every group's ids on every layer)"),
    # A dense Llama-3-8B-like model, one group, a 512-token prompt.
    "dense": dict(fields=dict(num_layers=32, blocks_per_request=32), num_groups=[1],
                  help="dense: 32 layers, 1 group, 8 KV heads x 128, 32 blocks (512 tokens)"),
    # Gemma-3-1B-like hybrid: 26 layers, every 6th full attention, 7 groups of <= 4
    # layers sharing 4 storages, 1 KV head x 256, a 2K prompt, 512-token window.
    "hybrid7": dict(fields=dict(num_layers=26, layer_map="hybrid", sliding_per_full=5, blocks_per_request=128,
                                window_blocks=32, num_kv_heads=1, head_size=256), num_groups=[7],
                    help="hybrid7: Gemma-3-like, 26 layers (4 full + 22 sliding) in 7 groups on "
                         "4 shared storages, 1 KV head x 256, 2K-token prompt (128 blocks), "
                         "512-token window (32 blocks)"),
    # DeepSeek-V2-Lite-like MLA: 27 layers, one latent vector (512 + 64) per token.
    "mla": dict(fields=dict(num_layers=27, blocks_per_request=8, block_size=64, num_kv_heads=1, head_size=576,
                            layout="mla"), num_groups=[1],
                help="mla: DeepSeek-V2-Lite-like, 27 layers, latent 576 bf16, 64-token blocks, 8 blocks"),
    # A layout-converting copy: vLLM's LBNHC cache ([B, H, N, C] view of [B, N, H, C])
    # against a contiguous [B, H, N, C] host buffer (enable_permute_local_kv): 512-byte
    # runs (C = 2 x 128 bf16), 8 x 16 runs per page.
    "convert512": dict(fields=dict(layout="lbnhc"), num_groups=[1],
                       help="convert512: layout-converting copy, LBNHC cache vs contiguous [B,H,N,C] host, "
                            "16 layers, 6 blocks, 16 tokens x 8 heads x 2x128 bf16: 512-byte runs"),
}
