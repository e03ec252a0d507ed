"""kvcopy's settings in vLLM's ``kv_connector_extra_config["kvcopy"]``: one parser, one
options type per connector.

:func:`parse` is the only reader of that object. Each connector (and the offloading spec)
calls it once, in its constructor, with its :class:`Surface`, and hands the result down.
It checks, in order: the value is a JSON object (or absent: the defaults); every key is
one the surface takes (otherwise ``ValueError`` naming the unknown keys and the known
ones); then it builds the surface's options type, whose own checks run once there. Every
error is a ``ValueError`` starting with :data:`PREFIX`, so a user sees where the value
came from.

* ``MIRROR_SURFACE``: :class:`MirrorOptions` (``KvcopyNixlConnector``).
* ``ARENA_SURFACE``: :class:`ArenaOptions` (``KvcopyArenaConnector``); sizes in bytes, times in
  seconds.
* ``OFFLOAD_SURFACE``: :class:`~kvcopy.offload.OffloadOptions` (``KvcopyOffloadingSpec``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple

from ..nixl.planning.pack_order import ORDERS
from ..offload import OffloadOptions

PREFIX = "kv_connector_extra_config['kvcopy']"
TRANSFER_MODES = ("pull", "push")  # D's choice; P serves both
# The shortest arena TTL the connector takes: P's side channel stops serving a record a
# margin of max(1 s, 10% of the TTL) before its span expires, so below 2 s nothing would
# be served for long enough to be read.
MIN_ARENA_TTL_S = 2.0


class Surface(NamedTuple):
    """One connector's part of the extra config: the keys a user may set, and what builds
    its options from them."""

    keys: Tuple[str, ...]
    build: Callable[..., Any]


def parse(raw: Any, surface: Surface) -> Any:
    """``raw`` (``kv_connector_extra_config["kvcopy"]``, None when absent) as the
    surface's options; see the module docstring for the checks."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{PREFIX} must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(surface.keys))
    if unknown:
        raise ValueError(f"{PREFIX}: unknown key(s) {unknown}; known: {sorted(surface.keys)}")
    try:
        return surface.build(**raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{PREFIX}.{exc}") from None


def from_transfer_config(kv_transfer_config, surface: Surface) -> Any:
    """:func:`parse` of a ``KVTransferConfig``'s ``"kvcopy"`` entry."""
    return parse(kv_transfer_config.get_from_extra_config("kvcopy", None), surface)


@dataclass(frozen=True)
class MirrorOptions:
    """``KvcopyNixlConnector``'s settings."""

    # On vLLM's CPU platform, stage through host buffers all the same. vLLM turns host
    # buffers off on a CPU worker (NIXL reads the KV in place), so there the mirror
    # connector is vLLM's connector and kvcopy's copier never runs. With this flag on a CPU
    # worker and kv_buffer_device="cpu", the connector runs the path a GPU worker with host
    # buffers runs, step for step, with kvcopy's cpu backend in place of a GPU one and no
    # stream synchronized: for testing and measuring that path without a GPU. On a GPU
    # worker it changes nothing.
    host_buffer_on_cpu: bool = False
    # Only false: the mirror's bytes travel by vLLM's own NIXL transfers and handshake, which
    # carry no page sums, so nothing could compare them end to end; true is refused rather
    # than ignored. Page sums need kvcopy's transport (the arena connector).
    checksum: bool = False

    def __post_init__(self) -> None:
        for flag in ("host_buffer_on_cpu", "checksum"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.checksum:
            raise ValueError("checksum=true needs kvcopy's transport; KvcopyNixlConnector moves KV with vLLM's own "
                             "NIXL transfers, which carry no page sums to compare. Use KvcopyArenaConnector (page "
                             "sums on by default) or set checksum to false")


@dataclass(frozen=True)
class ArenaOptions:
    """``KvcopyArenaConnector``'s settings: sizes in bytes, times in seconds."""

    arena_bytes: int = 1 << 30  # pinned staging memory per worker (P and D)
    arena_ttl_s: float = 60.0  # P keeps a staged span at most this long without D's notification
    stage_timeout_s: float = 10.0  # P: how long a request waits for arena space before it fails
    fetch_timeout_s: float = 30.0  # D: handshake + P's record + D's arena space, from the request's start
    pull_timeout_s: float = 30.0  # D: one READ's deadline (also bounded by what is left of P's TTL)
    arena_order: str = "token"  # or "head" (HND pages, P/D of different TP)
    copy_backend: str = "auto"
    key_env: Optional[str] = None  # environment variable holding the shared key (hex): side channel, records, notes
    checksum: bool = True  # page sums: P's pack into the record, D's scatter compared (docs/nixl.md, "Checksums")
    require_checksum: bool = False  # D: a pull whose pages cannot be compared fails its load (docs/vllm.md)
    layerwise: bool = False  # P: stage each layer's settled pages as the forward runs (docs/vllm.md, "Layer-wise")
    transfer_mode: str = "pull"  # D: "push": D reserves a span, P WRITEs into it (kvcopy.vllm.arena.push_recv)
    push_timeout_s: float = 60.0  # D, push: reservation -> KV ready, from the request's start (then recomputed)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "arena_bytes":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"arena_bytes must be a positive int, got {value!r}")
            elif f.name.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value <= 0:
                    raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
        if self.arena_order not in ORDERS:
            raise ValueError(f"arena_order must be one of {sorted(ORDERS)}, got {self.arena_order!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {list(TRANSFER_MODES)}, got {self.transfer_mode!r}")
        if not isinstance(self.copy_backend, str):
            raise ValueError(f"copy_backend must be a backend name, got {self.copy_backend!r}")
        for flag in ("checksum", "require_checksum", "layerwise"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.require_checksum and not self.checksum:
            raise ValueError("require_checksum needs checksum true")
        if self.arena_ttl_s < MIN_ARENA_TTL_S:
            raise ValueError(f"arena_ttl_s must be at least {MIN_ARENA_TTL_S:g} s (P serves a record until a "
                             f"margin of max(1 s, 10%) before its span expires), got {self.arena_ttl_s!r}")
        if self.key_env is not None and (not isinstance(self.key_env, str) or not self.key_env):
            raise ValueError(f"key_env must name an environment variable, got {self.key_env!r}")

    def key(self) -> Optional[bytes]:
        """The shared key from ``key_env`` (hex), or None."""
        if self.key_env is None:
            return None
        text = os.environ.get(self.key_env)
        if not text:
            raise ValueError(f"{PREFIX}.key_env names {self.key_env!r}, which is not set")
        try:
            return bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"environment variable {self.key_env!r} must hold the key in hex") from None


def _keys(options_type) -> Tuple[str, ...]:
    return tuple(f.name for f in fields(options_type))


MIRROR_SURFACE = Surface(_keys(MirrorOptions), MirrorOptions)
ARENA_SURFACE = Surface(_keys(ArenaOptions), ArenaOptions)
OFFLOAD_SURFACE = Surface(_keys(OffloadOptions), OffloadOptions)
