"""kvcopy: fused copies of paged KV-cache blocks between GPU KV tensors and host buffers.

    copier = kvcopy.BlockCopier(device_caches, host_buffers, layer_groups)
    copier.to_host(block_ids_per_group)      # d2h, every group's layers, one launch
    copier.to_device(block_ids_per_group)    # h2d

    kvcopy.copy_blocks(src, dst, src_ids, dst_ids, "h2d")   # vLLM's CopyBlocksOp

``kvcopy.nixl.TransferManager`` wraps these copies in NIXL transfers between engines.
The reference copies the tests hold every backend to are test tooling, in
``kvcopy.testing.reference``, not part of this API.
"""
from .backends import BACKENDS, available_backends
from .copier import BlockCopier
from .copy_op import copy_blocks
from .layout import PageLayout, describe

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BlockCopier",
    "PageLayout",
    "available_backends",
    "copy_blocks",
    "describe",
]
