"""Loading a peer's checked handshake into NIXL: its agent, under the name it claims, and
its descriptor list.

``TransferManager.add_peer`` checks everything it can first (:func:`~kvcopy.nixl.wire.handshake.decode`,
the limits, the layer pairing); :func:`load_peer` is what follows, where NIXL parses the
peer's agent metadata. The name in that metadata must be the handshake's (checked before
loading where the metadata shows it, and again after); a refusal after NIXL loaded the
agent releases it again (parked or unloaded, :mod:`kvcopy.nixl.agent`), never touching
an agent in use by another peer or this manager's own, so the name can be added later
with genuine metadata. An arena-mode peer is read at its staged spans, never at its KV:
no descriptor list is prepared for it.
"""
from __future__ import annotations

from typing import Container, Optional

import numpy as np

from .agent import Agent, NixlError, metadata_name
from .engine.info import EngineInfo


def load_peer(agent: Agent, remote: EngineInfo, descs: np.ndarray, own: str, in_use: Container[str]
              ) -> Optional[object]:
    """Load ``remote``'s agent into ``agent`` and prepare its descriptors ``descs``;
    returns the prepared list (None for an arena peer). Raises ``ValueError`` with
    nothing left loaded by this call. ``own``: this manager's agent name; ``in_use``:
    names of peers added already."""
    claimed = metadata_name(remote.agent_metadata)
    if claimed is not None and claimed != remote.name:
        raise ValueError(f"peer handshake names {remote.name!r} but its NIXL agent metadata is for {claimed!r}")
    try:
        name = agent.add_remote(remote.agent_metadata)
    except NixlError as exc:
        agent.unload_remote(remote.name)  # NIXL may keep what it loaded before failing
        raise ValueError(f"peer {remote.name!r}: {exc}") from None
    if name != remote.name:
        if name not in in_use and name != own:  # never touch a peer in use
            agent.release_remote(name)
        raise ValueError(f"peer handshake names {remote.name!r} but its NIXL agent is {name!r}")
    try:
        return None if remote.buffer == "arena" else agent.prep_remote(name, descs, remote.mem_type)
    except NixlError as exc:
        agent.release_remote(name)
        raise ValueError(f"peer {name!r}: its advertised regions are not what it registered: {exc}") from None
