"""Notifications between managers, and with a shared key the tag that authenticates them.

A notification is NIXL's ``send_notif``: bytes delivered to an agent under the name the
sending agent gave itself, unauthenticated. In arena mode P frees a staged span once its
readers said they are done, so without a key anyone who reaches P's NIXL agent can free
spans (docs/nixl.md, "Trust model"). With the managers' shared key, every notification a
manager sends carries :data:`TAG_BYTES` more at its end::

    tag = HMAC-SHA256(key, b"kvcopy-notify\\0" + sender + b"\\0" + receiver + b"\\0"
                           + receiver's generation + b"\\0" + message)

``sender`` and ``receiver`` are the two agents' names, ``generation`` the receiver's
registration generation (from its handshake). The receiver checks the tag against the
name NIXL delivered the message under, its own name and generation, strips it, and drops
a message whose tag does not match (:func:`untag`; counted in the manager's
``stats()["notifications_refused"]``). So a notification is accepted only from a holder
of the key, for this registration of this receiver; replayed to the same receiver it
says again what it said (a reader already counted counts once), replayed anywhere else
it is refused. A key holder can still say what it likes (docs/nixl.md, "Trust model").

:class:`Mailbox` is one manager's side of it: what it sends, tagged, and what it takes,
checked, with the messages ``save`` read early kept for the next caller.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Callable, Dict, List, Mapping, Optional, Tuple

TAG_BYTES = 32
_DOMAIN = b"kvcopy-notify\0"


def tag(key: bytes, sender: str, receiver: str, generation: str, message: bytes) -> bytes:
    """The tag ``sender`` appends to ``message`` for ``receiver`` (registration ``generation``)."""
    text = b"\0".join((sender.encode(), receiver.encode(), generation.encode(), bytes(message)))
    return hmac.new(key, _DOMAIN + text, hashlib.sha256).digest()


def tagged(key: Optional[bytes], sender: str, receiver: str, generation: str, message: bytes) -> bytes:
    """``message`` as sent: with ``key``, the tag appended; without, as it is."""
    if key is None:
        return bytes(message)
    return bytes(message) + tag(key, sender, receiver, generation, message)


def untag(key: Optional[bytes], receiver: str, generation: str, new: Mapping[str, List[bytes]]
          ) -> Tuple[Dict[str, List[bytes]], int]:
    """The messages of ``new`` (NIXL's, by sender) whose tags match, tags stripped, and
    how many were dropped. Without a key every message is kept as it came."""
    if key is None:
        return {k: list(v) for k, v in new.items()}, 0
    out: Dict[str, List[bytes]] = {}
    refused = 0
    for sender, msgs in new.items():
        for m in msgs:
            m = bytes(m)
            body, got = m[:-TAG_BYTES], m[-TAG_BYTES:]
            if len(m) < TAG_BYTES or not hmac.compare_digest(got, tag(key, sender, receiver, generation, body)):
                refused += 1
                continue
            out.setdefault(sender, []).append(body)
    return out, refused


class Mailbox:
    """One manager's notifications over its NIXL agent (``send_notification``,
    ``notifications``), with its shared key (or None) and its name."""

    def __init__(self, agent, key: Optional[bytes], name: str):
        self._agent, self._key, self._name = agent, key, name
        self._kept: Dict[str, List[bytes]] = {}  # taken with keep=True: the next take hands them out
        self.refused = 0  # messages whose tag did not match (dropped)

    def send(self, peer: str, generation: str, message: bytes) -> None:
        """``message`` to ``peer`` (its registration ``generation``), tagged with the key."""
        self._agent.send_notification(peer, tagged(self._key, self._name, peer, generation, message))

    def take(self, generation: str, on_new: Callable[[Mapping[str, List[bytes]]], None], keep: bool = False
             ) -> Dict[str, List[bytes]]:
        """New messages by sender (with a key: tags checked against this manager's
        ``generation`` and stripped), first shown to ``on_new``; with ``keep`` held for
        the next call instead of returned."""
        new, refused = untag(self._key, self._name, generation, self._agent.notifications())
        self.refused += refused
        on_new(new)
        if keep:
            for k, v in new.items():
                self._kept.setdefault(k, []).extend(v)
            return {}
        out, self._kept = self._kept, {}
        for k, v in new.items():
            out.setdefault(k, []).extend(v)
        return out
