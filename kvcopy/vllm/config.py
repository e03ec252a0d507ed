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

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple

from ..checks import integer
from ..core.options import CopyOptions
from ..nixl.modes.side_stream import LAYERWISE_CTAS, MAX_LAYERWISE_CTAS
from ..nixl.options import ManagerOptions
from ..offload import OffloadOptions

PREFIX = "kv_connector_extra_config['kvcopy']"
TRANSFER_MODES = ("pull", "push")  # D's choice; P serves both
# The shortest arena TTL the connector takes: P's side channel stops serving a record a
# margin of max(1 s, 10% of the TTL) before its span expires, so below 2 s nothing would
# be served for long enough to be read.
MIN_ARENA_TTL_S = 2.0
ARENA_PULL_TIMEOUT_S = 30.0  # the arena's default READ deadline (a TransferManager's is none)
# P's least bytes per chunk WRITE of a layer-wise push: a WRITE's fixed cost on UCX loopback
# is 13% of 1 MiB, over 25% below 256 KiB (kvcopy.vllm.arena.push_chunks)
PUSH_CHUNK_BYTES = 1 << 20


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
class MirrorOptions(CopyOptions):
    """``KvcopyNixlConnector``'s settings: how its copier copies (``copy_backend``,
    ``max_ctas``; the layout is vLLM's) and this."""

    # On vLLM's CPU platform, stage through host buffers all the same. vLLM turns host
    # buffers off on a CPU worker (NIXL reads the KV in place), so there the mirror
    # connector is vLLM's connector and kvcopy's copier never runs. With this flag on a CPU
    # worker and kv_buffer_device="cpu", the connector runs the path a GPU worker with host
    # buffers runs, step for step, with kvcopy's cpu backend in place of a GPU one and no
    # stream synchronized: for testing and measuring that path without a GPU. On a GPU
    # worker it changes nothing.
    host_buffer_on_cpu: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.host_buffer_on_cpu, bool):
            raise TypeError(f"host_buffer_on_cpu must be true or false, got {self.host_buffer_on_cpu!r}")


def _mirror(checksum: bool = False, **keys) -> MirrorOptions:
    """The mirror's ``checksum`` key takes only false, and is no field: its bytes travel by
    vLLM's own NIXL transfers and handshake, which carry no page sums, so nothing could
    compare them end to end; true is refused rather than ignored."""
    if not isinstance(checksum, bool):
        raise TypeError(f"checksum must be true or false, got {checksum!r}")
    if checksum:
        raise ValueError("checksum=true needs kvcopy's transport; KvcopyNixlConnector moves KV with vLLM's own "
                         "NIXL transfers, which carry no page sums to compare. Use KvcopyArenaConnector (page "
                         "sums on by default) or set checksum to false")
    return MirrorOptions(**keys)


@dataclass(frozen=True)
class ArenaOptions:
    """``KvcopyArenaConnector``'s settings: its own, and its workers' ``TransferManager``
    options (``manager``: the keys ``arena_bytes``, ``arena_ttl_s``, ``pull_timeout_s``,
    ``arena_order``, ``copy_backend``, ``max_ctas``, ``checksum``, ``require_checksum``,
    ``nixl_thread_nice``, and ``key`` from ``key_env``; each checked by :class:`~kvcopy.nixl.options.ManagerOptions`).
    Times in seconds."""

    stage_timeout_s: float = 10.0  # P: how long a request waits for arena space before it fails
    fetch_timeout_s: float = 30.0  # D: handshake + P's record + D's arena space, from the request's start
    key_env: Optional[str] = None  # environment variable holding the shared key (hex): side channel, records, notes
    layerwise: bool = False  # P: stage each layer's settled pages as the forward runs (docs/vllm.md, "Layer-wise")
    transfer_mode: str = "pull"  # D: "push": D reserves a span, P WRITEs into it (kvcopy.vllm.arena.push_recv)
    push_timeout_s: float = 60.0  # D, push: reservation -> KV ready, from the request's start (then recomputed)
    push_chunk_bytes: int = PUSH_CHUNK_BYTES  # P, layer-wise push: least bytes per chunk WRITE (0: every run)
    # P, layer-wise on a GPU: CTAs of a layer's copy on the side stream (kvcopy.nixl.modes.side_stream, "Grid")
    layerwise_ctas: int = LAYERWISE_CTAS
    # pull_timeout_s: D's deadline of one READ (also bounded by what is left of P's TTL)
    manager: ManagerOptions = ManagerOptions(pull_timeout_s=ARENA_PULL_TIMEOUT_S)

    def __post_init__(self) -> None:
        for name in ("stage_timeout_s", "fetch_timeout_s", "push_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {list(TRANSFER_MODES)}, got {self.transfer_mode!r}")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be true or false, got {self.layerwise!r}")
        if isinstance(self.push_chunk_bytes, bool) or not isinstance(self.push_chunk_bytes, int) \
                or self.push_chunk_bytes < 0:
            raise ValueError(f"push_chunk_bytes must be a whole number of bytes (0 or more), "
                             f"got {self.push_chunk_bytes!r}")
        integer(self.layerwise_ctas, "layerwise_ctas", 1, MAX_LAYERWISE_CTAS)
        if self.key_env is not None and (not isinstance(self.key_env, str) or not self.key_env):
            raise ValueError(f"key_env must name an environment variable, got {self.key_env!r}")
        if not isinstance(self.manager, ManagerOptions):
            raise TypeError(f"manager must be a ManagerOptions, got {type(self.manager).__name__}")
        if self.manager.pull_timeout_s is None:  # a TransferManager's default; D's READs need a deadline
            raise ValueError("pull_timeout_s must be a positive number of seconds, got None")
        if self.manager.arena_ttl_s < MIN_ARENA_TTL_S:
            raise ValueError(f"arena_ttl_s must be at least {MIN_ARENA_TTL_S:g} s (P serves a record until a "
                             f"margin of max(1 s, 10%) before its span expires), got {self.manager.arena_ttl_s!r}")


MANAGER_KEYS = ("arena_bytes", "arena_ttl_s", "pull_timeout_s", "arena_order", "copy_backend", "max_ctas",
                "checksum", "require_checksum", "nixl_thread_nice")


def _key_from_env(key_env: Any) -> Optional[bytes]:
    """The shared key held (hex) by the environment variable ``key_env`` names, or None."""
    if not isinstance(key_env, str) or not key_env:
        return None  # none, or refused by ArenaOptions
    text = os.environ.get(key_env)
    if not text:
        raise ValueError(f"key_env names {key_env!r}, which is not set")
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"key_env: environment variable {key_env!r} must hold the key in hex") from None


def _arena(**keys) -> ArenaOptions:
    manager = {k: keys.pop(k) for k in MANAGER_KEYS if k in keys}
    manager.setdefault("pull_timeout_s", ARENA_PULL_TIMEOUT_S)
    options = ArenaOptions(**keys)  # key_env checked before it is read
    key = _key_from_env(options.key_env)
    options = dataclasses.replace(options, manager=ManagerOptions(key=key, **manager))
    # a chunk threshold no span can reach is a mistake when set (the default may exceed a small arena)
    if "push_chunk_bytes" in keys and options.push_chunk_bytes > options.manager.arena_bytes:
        raise ValueError(f"push_chunk_bytes must be at most arena_bytes ({options.manager.arena_bytes}: no span "
                         f"is larger), got {options.push_chunk_bytes}")
    return options


def _keys(options_type) -> Tuple[str, ...]:
    return tuple(f.name for f in fields(options_type))


MIRROR_SURFACE = Surface(("checksum", "copy_backend", "host_buffer_on_cpu", "max_ctas"), _mirror)
ARENA_SURFACE = Surface(tuple(f for f in _keys(ArenaOptions) if f != "manager") + MANAGER_KEYS, _arena)
OFFLOAD_SURFACE = Surface(("checksum", "copy_backend", "max_ctas"), OffloadOptions)
