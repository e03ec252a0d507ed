"""kvcopy: fused copies of paged KV-cache blocks between GPU KV tensors and host buffers.

    copier = kvcopy.BlockCopier(device_caches, host_buffers, layer_groups)
    copier.to_host(block_ids_per_group)      # d2h, every group's layers, one launch
    copier.to_device(block_ids_per_group)    # h2d

    kvcopy.copy_blocks(src, dst, src_ids, dst_ids, "h2d")   # vLLM's CopyBlocksOp

``kvcopy.nixl.TransferManager`` wraps these copies in NIXL transfers between engines.
The reference copies the tests hold every backend to are test tooling, in
``kvcopy.testing.reference``, not part of this API.

The names below are imported on first use, so ``import kvcopy`` (and ``kvcopy-bench
--help``) does not wait for torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# exported name -> the submodule that defines it
_EXPORTS = {
    "COPY_BACKENDS": ".copy_backends",
    "available_copy_backends": ".copy_backends",
    "BlockCopier": ".core.copier",
    "copy_blocks": ".core.copy_op",
    "PageLayout": ".core.layout",
    "describe": ".core.layout",
}

__all__ = [
    "COPY_BACKENDS",
    "BlockCopier",
    "PageLayout",
    "available_copy_backends",
    "copy_blocks",
    "describe",
]

if TYPE_CHECKING:
    from .copy_backends import COPY_BACKENDS, available_copy_backends
    from .core.copier import BlockCopier
    from .core.copy_op import copy_blocks
    from .core.layout import PageLayout, describe


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcopy' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
