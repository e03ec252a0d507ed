"""The keyword options of a ``TransferManager``, checked once, as one frozen value.

``TransferManager(name, caches, groups, tokens_per_block, ..., **options)`` takes these
by name (or ``options=ManagerOptions(...)``, with keywords overriding it); the buffer
modes (:mod:`kvcopy.nixl.modes.base`) read what they need from the same value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from ..checks import integer, seconds
from ..core.options import ChecksumOptions
from .agent import MAX_NICE, PROGRESS_DELAY_US
from .wire.framing import check_key
from .planning.pack_order import ORDERS

# The shortest arena TTL a manager takes. Below it a span is freed before a D can have
# asked for its record and read it (a side-channel round trip plus a READ on a loaded
# host); the project's own late-READ tests run P's TTL at this, equal to D's deadline.
MIN_ARENA_TTL_S = 0.5


@dataclass(frozen=True)
class ManagerOptions(ChecksumOptions):
    """Everything a manager takes besides its name, caches, groups and block sizes: how
    its copies run (:class:`~kvcopy.core.options.ChecksumOptions`: ``copy_backend`` for
    save and complete, ``max_ctas``, ``kv_layout``, ``block_dim``, ``checksum``: page
    sums computed by the copies, compared on D, docs/nixl.md "Checksums"), and these."""

    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: Any = None  # an int or per layer; default: heads in the tensor x tp_size
    pull_timeout_s: Optional[float] = None  # default deadline of every pull; None: none
    key: Optional[bytes] = field(default=None, repr=False)  # shared HMAC key (bytes, >= 16)
    arena_bytes: int = 1 << 30  # arena mode: the staging arena's size
    arena_ttl_s: float = 60.0  # arena mode: how long P keeps a staged span without D's notification
    arena_order: str = "token"  # arena mode: "token" or "head" (HND pages)
    progress_delay_us: int = PROGRESS_DELAY_US  # NIXL progress-thread poll timeout
    nixl_thread_nice: int = 0  # nice of the threads NIXL starts for the agent (0-19; kvcopy.nixl.agent)
    require_checksum: bool = False  # D: refuse a pull whose pages cannot be compared (plan_pull raises)
    # NIXL's transport plugins the agent loads (NIXL calls them "backends"; kvcopy's own
    # backends, which copy on the host or GPU, are copy_backend)
    transports: Tuple[str, ...] = ("UCX",)

    def __post_init__(self) -> None:
        super().__post_init__()
        put = object.__setattr__  # frozen: normalized values are set once, here
        put(self, "tp_size", integer(self.tp_size, "tp_size", minimum=1))
        put(self, "tp_rank", integer(self.tp_rank, "tp_rank", minimum=0))
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        put(self, "pull_timeout_s", seconds(self.pull_timeout_s, "pull_timeout_s"))
        put(self, "key", check_key(self.key))
        put(self, "arena_bytes", integer(self.arena_bytes, "arena_bytes", minimum=1))
        ttl = seconds(self.arena_ttl_s, "arena_ttl_s")
        if ttl is None:
            raise TypeError("arena_ttl_s must be a number of seconds, got None")
        if ttl < MIN_ARENA_TTL_S:
            raise ValueError(f"arena_ttl_s must be at least {MIN_ARENA_TTL_S} s (a span must outlive D's "
                             f"question for its record and its READ), got {self.arena_ttl_s!r}")
        put(self, "arena_ttl_s", ttl)
        if self.arena_order not in ORDERS:
            raise ValueError(f"arena_order must be one of {sorted(ORDERS)}, got {self.arena_order!r}")
        put(self, "progress_delay_us", integer(self.progress_delay_us, "progress_delay_us", minimum=0))
        put(self, "nixl_thread_nice", integer(self.nixl_thread_nice, "nixl_thread_nice", minimum=0, maximum=MAX_NICE))
        if not isinstance(self.require_checksum, bool):
            raise TypeError(f"require_checksum must be True or False, got {type(self.require_checksum).__name__}")
        if self.require_checksum and not self.checksum:
            raise ValueError("require_checksum needs checksum=True (without sums no pull could be compared)")
        if isinstance(self.transports, (str, bytes)) or not isinstance(self.transports, (tuple, list)) \
                or not self.transports or not all(isinstance(t, str) and t for t in self.transports):
            raise TypeError(f"transports must be a non-empty sequence of NIXL plugin names (strings), "
                            f"got {self.transports!r}")
        put(self, "transports", tuple(self.transports))

