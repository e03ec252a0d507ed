"""``KvcopyNixlConnector``: vLLM 0.33's NIXL connector with kvcopy's host-buffer sync.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcopyNixlConnector",
        "kv_connector_module_path": "kvcopy.vllm", "kv_role": "kv_producer",
        "kv_buffer_device": "cpu"}'

Everything of vLLM's pull connector (scheduler, handshake, NIXL registration and
transfers, heartbeats, failure handling) is vLLM's own code; only the two host-buffer
copies of its worker change (``kv_buffer_device="cpu"`` on a GPU), and D asks for P's
handshake again when vLLM's single 5 s wait runs out (``KvcopyNixlWorker._nixl_handshake``):

* ``save_kv_to_host`` (P) and ``sync_recved_kv_to_device`` (D) in vLLM 0.33 flatten
  every transfer group's ids into one list and copy every host buffer at all of them.
  With several KV cache groups (overlaid from byte 0: one device byte belongs to a
  layer of each group) or KV-sharing layers (whose host buffers NIXL never fills),
  D's h2d lets unfilled host pages overwrite received KV: vLLM's fix for this (a
  per-group copy) regressed when its transfers moved to per-region geometry.
* Here one :class:`~kvcopy.core.copier.BlockCopier` is built when the KV caches are
  registered, from vLLM's own ``device_kv_caches``, ``host_xfer_buffers`` and
  ``kv_cache_config.transfer_groups``: each transfer group copies its own layers at its
  own blocks, KV-sharing layers (no transfer group, never registered with NIXL) are
  never copied. Each request-sync is one masked call for all groups (one backend
  launch), each group's ids in its device view's unit (``local_physical_block_ids``):
  kernel pages for attention groups, logical blocks for Mamba/GDN state groups
  (:mod:`kvcopy.vllm.groups`).

Models whose groups overlay one another with different page shapes are copied too:
different KV heads per group (pages padded to the largest), a doubled block size that
unifies page sizes, pages packed side by side in block-outermost rows, and attention +
GDN hybrids (``MambaSpec`` state ``[NB, 1, 1, state bytes]`` int8 views whose stride is
the padded page, next to attention kernel pages). The copier proves at registration
that these views alias only within one block of the pool and checks per call that no
block is named by two groups (:func:`kvcopy.core.aliasing.shared_rows`). vLLM's host buffer
for a padded state layer is smaller than the NIXL region vLLM registers for it (NIXL
refuses the descriptors); the worker allocates the buffer with the padded stride
(:func:`kvcopy.vllm.groups.state_host_buffers`) before vLLM registers it, and says so
in its registration line. vLLM needs ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` for Mamba NIXL
transfers.

Layout: vLLM's caches are ``[B, H, N, C]`` views of one int8 allocation (any of its
six layouts); the host buffers are contiguous ``[B, H, N, C]`` (or, for LBNHC, an HND
view of ``(B, N, H, C)``; padded state: the page as block stride), one per layer name.
The copier validates both once; a layer whose pages it cannot place raises at
registration, never mid-request.

Pageable host buffers are pinned once by the copier's GPU backends (see
:mod:`kvcopy.copy_backends.pinning`). vLLM's copies are synchronous (``.cpu()``, pageable
``.to()``); so are these: after the call the stream is synchronized, because P's host
pages are read by a remote NIXL READ as soon as the request is reported saved.

The arena connector (``KvcopyArenaConnector``: vLLM's scheduler, kvcopy's own
transport; no host mirror, one READ descriptor per request) lives in
:mod:`kvcopy.vllm.arena.connector`; :mod:`kvcopy.vllm` exports both, so both connectors share
``kv_connector_module_path="kvcopy.vllm"``.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

import torch
import zmq  # a vLLM dependency

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from ..core.copier import BlockCopier
from .checks import MIRROR, check_config
from .config import MIRROR_SURFACE, MirrorOptions, from_transfer_config
from .groups import (
    kernel_block_ids, kv_sharing_layers, pages_per_block, state_host_buffers, transfer_layer_groups,
)

# Under vLLM's logger tree, so the registration line shows in vLLM's own log output.
logger = init_logger("vllm.kvcopy")

__all__ = ["KvcopyNixlConnector", "KvcopyNixlScheduler", "KvcopyNixlWorker"]


class KvcopyNixlWorker(NixlPullConnectorWorker):
    """vLLM's pull worker; host-buffer copies through one masked :class:`BlockCopier`."""

    # Built by register_kv_caches when vLLM uses host buffers. Until then (or without
    # host buffers) the copy methods are vLLM's own, through its copy op.
    kvcopy_copier: Optional[BlockCopier] = None
    # Layers whose host buffer vLLM allocated smaller than the NIXL region it registers
    # for them (padded Mamba/GDN state pages), replaced by kvcopy: name -> page stride.
    kvcopy_state_buffers: Dict[str, int] = {}

    # How long D asks P's side channel for its handshake before the request is recomputed
    # (vLLM gives up after one 5 s wait: see _nixl_handshake).
    kvcopy_handshake_wait_s = 30.0

    def __init__(self, vllm_config, engine_id, kv_cache_config, options: Optional[MirrorOptions] = None):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # None where vLLM's own connector builds this class in place of its worker (the tests'
        # vllm_substitute): its config is then read here, once
        if options is None:
            options = from_transfer_config(vllm_config.kv_transfer_config, MIRROR_SURFACE)
        # host_buffer_on_cpu: vLLM turned host buffers off for the CPU platform; turn them on
        self.kvcopy_options = options
        self.kvcopy_forced_host_buffer = _forced_host_buffer(vllm_config, options)
        if self.kvcopy_forced_host_buffer:
            self.use_host_buffer = True

    def _nixl_handshake(self, host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        """vLLM's handshake, asked again until :attr:`kvcopy_handshake_wait_s` has passed.

        vLLM waits once, 5 s, for P's answer, then fails every request waiting on that P
        (recomputed). P's answer comes from a thread of P's engine-core process, which spins
        while P holds requests for D; on a busy 2-core host (two CPU engines, tests/engine)
        that thread answered after up to 8.4 s, and a whole batch was recomputed. Asked
        again only when the failed attempt registered no rank of P (it timed out before
        the first answer), so nothing is added twice."""
        deadline = time.monotonic() + self.kvcopy_handshake_wait_s
        while True:
            before = dict(self.kv_caches_base_addr.get(expected_engine_id, {}))  # ranks registered
            start = time.monotonic()
            try:
                return super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs)
            except zmq.Again:
                if time.monotonic() >= deadline or self.kv_caches_base_addr.get(expected_engine_id, {}) != before:
                    raise
                logger.warning("kvcopy: P %s at %s:%s did not answer the NIXL handshake in %.1f s; asking again "
                               "(until %.0f s)", expected_engine_id, host, port, time.monotonic() - start,
                               self.kvcopy_handshake_wait_s)

    def set_host_xfer_buffer_ops(self, copy_operation) -> None:
        """vLLM's: keeps the op only off the CPU platform; with ``host_buffer_on_cpu`` on
        the CPU it is kept too, since vLLM's connector saves only when an op is set (the
        copies themselves are the copier's)."""
        if self.kvcopy_forced_host_buffer:
            self.copy_blocks = copy_operation
            return
        super().set_host_xfer_buffer_ops(copy_operation)

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        if self.use_host_buffer:
            self._build_copier()

    def initialize_host_xfer_buffer(self, kv_caches) -> None:
        """vLLM's host buffers, with each padded Mamba/GDN state layer's buffer replaced
        by one whose block stride is the page its NIXL region uses (see
        :func:`kvcopy.vllm.groups.state_host_buffers`); vLLM registers what this leaves."""
        super().initialize_host_xfer_buffer(kv_caches)
        fixed = state_host_buffers(self.kv_cache_config, kv_caches, self.host_xfer_buffers)
        self.host_xfer_buffers.update(fixed)
        self.kvcopy_state_buffers = {n: t.stride(0) * t.element_size() for n, t in fixed.items()}

    def _build_copier(self) -> None:
        groups = transfer_layer_groups(
            self.kv_cache_config, self.host_xfer_buffers, kv_sharing_layers(self.vllm_config)
        )
        try:
            copier = BlockCopier(self.device_kv_caches, self.host_xfer_buffers, groups,
                                 options=self.kvcopy_options)
        except ValueError as exc:
            raise ValueError(
                f"KvcopyNixlConnector: cannot build the host-buffer copier for kv cache layout "
                f"{self.kv_cache_layout} (host {self.host_buffer_kv_cache_layout}): {exc}"
            ) from exc
        if self.kvcopy_copier is not None:
            self.kvcopy_copier.close()
        self.kvcopy_copier = copier
        self._pages_per_block = pages_per_block(self.kv_cache_config, self._physical_blocks_per_logical_kv_block)
        copied = sum(len(g) for g in groups)
        skipped = sorted(set(self.host_xfer_buffers) - {n for g in groups for n in g})
        logger.info(
            "kvcopy: host-buffer sync through backend %s (d2h %s, h2d %s): %d transfer groups, "
            "%d layers copied%s%s",
            copier.copy_backend, copier.copy_backends()["to_host"], copier.copy_backends()["to_device"],
            len(groups), copied,
            f", {len(skipped)} KV-sharing layers never copied" if skipped else "",
            self._state_buffers_note(),
        )

    def _state_buffers_note(self) -> str:
        if not self.kvcopy_state_buffers:
            return ""
        strides = sorted(set(self.kvcopy_state_buffers.values()))
        return (f"; {len(self.kvcopy_state_buffers)} Mamba/GDN state host buffers allocated by kvcopy with "
                f"the padded page stride {', '.join(map(str, strides))} bytes that their NIXL regions span "
                "(vLLM's are unpadded: NIXL would refuse the regions)")

    def _group_ids(self, ids: Sequence[Sequence[int]]) -> Optional[Sequence[Sequence[int]]]:
        """Per-group ids in each group's view unit, without vLLM's null block and without
        repeats, or None when the request moves nothing (vLLM signals a full prefix hit
        with an empty list). The null block (logical block 0: the first
        ``pages_per_block`` ids of a group) holds no request's KV; a Mamba/GDN group lists
        it at every position but its running state's, which the copier would refuse as an
        id written twice in one call (vLLM's copy just copies it again). A repeated id is
        the same source and destination on both sides: copying it once is the same."""
        out = []
        for g, per_block in zip(ids, self._pages_per_block):
            seen: set = set()
            row = []
            for b in g:
                if b >= per_block and b not in seen:
                    seen.add(b)
                    row.append(b)
            out.append(row)
        if not any(out):
            return None
        return out

    def _wait(self) -> None:
        # vLLM's op is synchronous; keep that contract (see module docstring). Allowed
        # under vLLM's sync debugger, as its own copies are.
        dev = next(iter(self.device_kv_caches.values())).device
        if dev.type == "cuda":
            with gpu_sync_allowed():
                torch.cuda.current_stream(dev).synchronize()

    def save_kv_to_host(self, metadata) -> None:
        """P: device -> host buffers, one masked call per request for all groups."""
        if self.kvcopy_copier is None:
            return super().save_kv_to_host(metadata)
        copied = False
        for _req_id, meta in metadata.reqs_to_save.items():
            meta.local_physical_block_ids = kernel_block_ids(meta.local_block_ids, self._pages_per_block)
            ids = self._group_ids(meta.local_physical_block_ids)
            if ids is not None:
                self.kvcopy_copier.to_host(ids)
                copied = True
        if copied:
            self._wait()

    def sync_recved_kv_to_device(self, req_id, meta) -> None:
        """D: host buffers -> device, each group's layers at that group's blocks only."""
        if self.kvcopy_copier is None:
            return super().sync_recved_kv_to_device(req_id, meta)
        ids = self._group_ids(meta.local_physical_block_ids)
        if ids is not None:
            self.kvcopy_copier.to_device(ids)
            self._wait()

    def shutdown(self) -> None:
        copier = getattr(self, "kvcopy_copier", None)
        if copier is not None:
            copier.close()
            self.kvcopy_copier = None
        super().shutdown()


def _forced_host_buffer(vllm_config, options: MirrorOptions) -> bool:
    """``host_buffer_on_cpu`` applies: vLLM's CPU platform with ``kv_buffer_device="cpu"``."""
    from vllm.platforms import current_platform

    return (options.host_buffer_on_cpu and current_platform.device_type == "cpu"
            and vllm_config.kv_transfer_config.kv_buffer_device == "cpu")


class KvcopyNixlScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler; with ``host_buffer_on_cpu`` (:class:`~kvcopy.vllm.config.MirrorOptions`)
    on a CPU worker it sends P's saves as it does for a GPU worker with host buffers."""

    def __init__(self, vllm_config, engine_id, kv_cache_config, options: MirrorOptions):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        if _forced_host_buffer(vllm_config, options):
            self.use_host_buffer = True


class KvcopyNixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull) with :class:`KvcopyNixlWorker` as its worker
    (its settings: :class:`~kvcopy.vllm.config.MirrorOptions`)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        options = from_transfer_config(vllm_config.kv_transfer_config, MIRROR_SURFACE)
        check_config(vllm_config, MIRROR, kv_cache_config)  # vLLM's checks keyed on "NixlConnector"
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvcopyNixlScheduler(vllm_config, self.engine_id, kv_cache_config, options)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvcopyNixlWorker(vllm_config, self.engine_id, kv_cache_config, options)
        else:
            raise ValueError(f"unsupported KVConnectorRole: {role}")

