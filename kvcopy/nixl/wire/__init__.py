"""Untrusted bytes in and out, each checked before it reaches NIXL or memory: the frame and
its digest (:mod:`.framing`), typed JSON reading (:mod:`.schema`), the handshake
(:mod:`.handshake`; a region's part of it, :mod:`.region_record`), the staged-request
record (:mod:`.record`), notifications (:mod:`.notices`)."""
