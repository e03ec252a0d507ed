"""The arena connector (``KvcopyArenaConnector``, :mod:`.connector`): vLLM's scheduler with
kvcopy's :class:`~kvcopy.nixl.TransferManager` in arena mode as the transport.

:mod:`.meta` the metadata and options both sides agree on; :mod:`.stage` P's staging and
records; :mod:`.pull` D's pulls; :mod:`.channel` P's side-channel listener and the messages;
:mod:`.record_client` D's client of it; :mod:`.stats` the counters vLLM reports.
"""
