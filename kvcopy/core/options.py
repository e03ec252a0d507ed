"""The options every copying surface shares, each field defined and checked once (a value
of the wrong kind raises ``TypeError``, one out of range ``ValueError``).

:class:`CopyOptions` is how a surface copies (which copy backend, its grid cap, the
device views' layout); :class:`ChecksumOptions` adds page sums. The surfaces' own types
extend them: ``ManagerOptions`` (:mod:`kvcopy.nixl.options`), ``OffloadOptions``
(:mod:`kvcopy.offload`), and through them the vLLM connectors' settings
(:mod:`kvcopy.vllm.config`). A surface may inherit a field it does not offer (the
offloading connector has no ``kv_layout`` key): which keys a user can set is the
surface's allowlist, not the type's fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..checks import is_plain_int


@dataclass(frozen=True)
class CopyOptions:
    """How a surface's :class:`~kvcopy.core.copier.BlockCopier` copies."""

    # kvcopy's copy backend ("auto": the measured choice per device and call); an unknown
    # name is refused where the copier is built, with the names available there
    copy_backend: str = "auto"
    max_ctas: Optional[int] = None  # grid cap of the kernel backends (None: kvcopy's default)
    kv_layout: str = "NHD"  # as for BlockCopier
    block_dim: Any = None  # as for BlockCopier: None, an int, or per layer

    def __post_init__(self) -> None:
        if not isinstance(self.copy_backend, str) or not self.copy_backend:
            raise (ValueError if self.copy_backend == "" else TypeError)(
                f"copy_backend must be a backend name, got {self.copy_backend!r}")
        if self.max_ctas is not None and (not is_plain_int(self.max_ctas) or self.max_ctas < 1):
            raise (ValueError if is_plain_int(self.max_ctas) else TypeError)(
                f"max_ctas must be a positive integer, got {self.max_ctas!r}")


@dataclass(frozen=True)
class ChecksumOptions(CopyOptions):
    """:class:`CopyOptions` with page sums (:mod:`kvcopy.core.checksum`): computed by the
    copies that write the host side, compared by those that read it."""

    checksum: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.checksum, bool):
            raise TypeError(f"checksum must be true or false, got {self.checksum!r}")
