"""The wire frame of everything a peer sends kvcopy: lengths, parts, a digest, an optional HMAC.

Layout (all integers little-endian), for a frame of ``k`` parts::

    magic            12 bytes, one per kind of payload (handshake, staged-request record)
    u32              version (one per kind; anything else is refused, never guessed)
    u32              flags: bit 0 set = an HMAC follows the digest
    u64 x k          the length of each part
    parts            the bytes of each part, in order
    32 bytes         SHA-256 of every byte before it
    [32 bytes]       HMAC-SHA256 (shared key) of every byte before it, if flag bit 0

:meth:`Framing.unframe` checks, in this order and before anything proportional to a
declared length is allocated or read: the magic, the size of the fixed prefix, the
version, the flags, each declared length against its limit, the total against the
payload's own length (exactly: truncated or extended payloads are refused), the digest,
then the HMAC. The digest catches accidental corruption (a bit flip, a truncation, bytes
appended) anywhere in the payload; it authenticates nothing, since anyone can recompute
it. The HMAC authenticates: without the key no one makes a frame a keyed reader accepts.
A reader without a key refuses a keyed frame (accepting it would hide that the two
sides are configured differently); a reader with a key refuses an unkeyed one.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

_FLAG_HMAC = 1
DIGEST_BYTES = 32  # SHA-256 and HMAC-SHA256
MIN_KEY_BYTES = 16


def check_key(key) -> Optional[bytes]:
    """A shared HMAC key: None, or bytes of at least :data:`MIN_KEY_BYTES`."""
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes (a shared secret), got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


@dataclass(frozen=True)
class Framing:
    """One kind of framed payload: its magic, version, part limits and the words its
    errors use (``what``: "handshake metadata"; ``kind``: "handshake")."""

    magic: bytes
    version: int
    limits: Tuple[Tuple[int, int], ...]  # per part: (least, most) bytes
    what: str
    kind: str

    @property
    def _prefix(self) -> struct.Struct:
        return struct.Struct("<II" + "Q" * len(self.limits))

    def frame(self, parts: Sequence[bytes], key: Optional[bytes] = None) -> bytes:
        """The frame of ``parts`` (see the module docstring); with ``key``, its HMAC too.
        Parts are not checked against the limits: a test may frame oversized ones."""
        key = check_key(key)
        parts = [bytes(p) for p in parts]
        flags = _FLAG_HMAC if key is not None else 0
        data = self.magic + self._prefix.pack(self.version, flags, *map(len, parts)) + b"".join(parts)
        data += hashlib.sha256(data).digest()
        if key is not None:
            data += hmac.new(key, data, hashlib.sha256).digest()
        return data

    def unframe(self, data, key: Optional[bytes] = None) -> List[bytes]:
        """The parts of a frame from a peer, every check of the module docstring passed;
        ``ValueError`` (``TypeError`` for a payload that is not bytes) saying what is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{self.what} must be bytes, got {type(data).__name__}")
        key = check_key(key)
        data = bytes(data)
        prefix = self._prefix
        fixed = len(self.magic) + prefix.size
        if not data.startswith(self.magic):
            raise ValueError(f"not kvcopy {self.what} (bad magic)")
        if len(data) < fixed:
            raise ValueError(f"{self.what} truncated before its header ({len(data)} bytes)")
        version, flags, *lengths = prefix.unpack_from(data, len(self.magic))
        if version != self.version:
            raise ValueError(f"{self.kind} version {version} is not supported (this kvcopy speaks {self.version})")
        if flags & ~_FLAG_HMAC:
            raise ValueError(f"{self.kind} flags {flags:#x}: unknown bits")
        if any(not lo <= n <= hi for n, (lo, hi) in zip(lengths, self.limits)):
            raise ValueError(f"{self.what} declares parts of {lengths} bytes (limits: "
                             f"{', '.join(f'{lo} to {hi}' for lo, hi in self.limits)})")
        keyed = bool(flags & _FLAG_HMAC)
        expected = fixed + sum(lengths) + DIGEST_BYTES * (2 if keyed else 1)
        if len(data) != expected:
            how = "truncated" if len(data) < expected else "followed by extra bytes"
            raise ValueError(f"{self.what} {how}: its lengths make {expected} bytes, got {len(data)}")
        signed = len(data) - (DIGEST_BYTES if keyed else 0)
        digest_at = signed - DIGEST_BYTES
        if not hmac.compare_digest(hashlib.sha256(data[:digest_at]).digest(), data[digest_at:signed]):
            raise ValueError(f"{self.what} corrupted: its SHA-256 digest does not match")
        if keyed and key is None:
            raise ValueError(f"{self.what} is authenticated with a shared key and this manager has "
                             "none: pass the same key= to both managers")
        if key is not None:
            if not keyed:
                raise ValueError(f"{self.what} is not authenticated: this manager requires a shared key")
            if not hmac.compare_digest(hmac.new(key, data[:signed], hashlib.sha256).digest(), data[signed:]):
                raise ValueError(f"{self.what} not authenticated: its HMAC does not match this "
                                 "manager's key (a different key, or tampered bytes)")
        out, at = [], fixed
        for n in lengths:
            out.append(data[at:at + n])
            at += n
        return out
