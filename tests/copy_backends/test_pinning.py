"""kvcopy.copy_backends.pinning: page-locking pageable host buffers in place (cudaHostRegister)."""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from kvcopy.copy_backends import pinning


def test_no_cuda_is_a_no_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = torch.zeros(1024, dtype=torch.uint8)
    with pinning.pin_host_tensors([t, t[10:], t.view(32, 32).t()]) as p:
        assert p.registered == 0 and p.registered_bytes == 0 and p.already_pinned == 0
    p.release()  # idempotent
    assert pinning.host_pointer_usable() is True


def test_release_is_idempotent_and_empty_input():
    p = pinning.pin_host_tensors([])
    assert p.registered == 0
    p.release()
    p.release()


@pytest.mark.gpu
def test_pins_each_pageable_storage_once_and_unpins(monkeypatch, caplog):
    monkeypatch.setattr(pinning, "_logged", False)
    a = torch.zeros(4, 1 << 16, dtype=torch.uint8)
    b = torch.zeros(1 << 20, dtype=torch.bfloat16)
    already = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(16, device="cuda")
    assert not a.is_pinned() and not b.is_pinned()
    with caplog.at_level(logging.DEBUG, logger="kvcopy.copy_backends.pinning"):
        p = pinning.pin_host_tensors([a, a[1:], a.t(), b, b.view(2, -1), already, dev])
    assert p.registered >= 1 and p.already_pinned >= 1  # page spans; the pinned tensor left alone
    assert p.registered_bytes == a.numel() + 2 * b.numel()
    assert a.is_pinned() and a[3:].is_pinned() and b.is_pinned()
    infos = [r for r in caplog.records if r.name == "kvcopy.copy_backends.pinning" and r.levelno == logging.INFO]
    assert len(infos) == 1 and "cudaHostRegister" in infos[0].getMessage()
    # a second pinning of the same buffers (another copier) shares kvcopy's registration
    # and logs nothing at INFO; the memory stays pinned until the last holder releases
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvcopy.copy_backends.pinning"):
        q = pinning.pin_host_tensors([a, b])
    assert q.registered == p.registered
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    p.release()
    assert a.is_pinned() and b.is_pinned()  # q still holds them
    q.release()
    assert not a.is_pinned() and not b.is_pinned() and already.is_pinned()
    p.release()
    q.release()


@pytest.mark.gpu
def test_garbage_collected_pinning_unpins():
    a = torch.zeros(1 << 20, dtype=torch.uint8)
    p = pinning.pin_host_tensors([a])
    assert p.registered == 1 and a.is_pinned()
    del p
    gc.collect()
    assert not a.is_pinned()


@pytest.mark.gpu
def test_kernel_reads_registered_memory():
    """A registered pageable buffer is usable by a device copy and by kernels."""
    a = torch.arange(1 << 20, dtype=torch.int32)
    with pinning.pin_host_tensors([a]):
        d = a.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), a)
    assert pinning.host_pointer_usable(torch.cuda.current_device()) in (True, False)


# ---------------------------------------------------------------------------------
# The registration bookkeeping, with a fake CUDA runtime (runs anywhere).

class FakeRuntime:
    """Page-granular cudaHostRegister: fails with 712 on pages already registered."""

    def __init__(self, foreign=()):
        self.pages = {}  # page -> owner start
        self.foreign = set(foreign)  # pinned by someone else
        self.calls = []

    def register(self, addr, n):
        pages = range(addr // 4096, (addr + n) // 4096)
        if any(p in self.pages or p in self.foreign for p in pages):
            return 712
        self.calls.append(("register", addr, n))
        for p in pages:
            self.pages[p] = addr
        return 0

    def unregister(self, addr):
        self.calls.append(("unregister", addr))
        for p in [p for p, a in self.pages.items() if a == addr]:
            del self.pages[p]

    def is_pinned(self, addr):
        return addr // 4096 in self.pages or addr // 4096 in self.foreign


def test_page_spans_merge_small_neighbours():
    # three small tensors: two share a page, one is adjacent, one is far away
    assert pinning.page_spans([(100, 50), (300, 4000), (8192, 10), (40960, 4096)], page=4096) == [
        (0, 12288), (40960, 45056)]


def test_registry_shares_spans_and_unregisters_with_the_last_holder():
    rt = FakeRuntime()
    reg = pinning.Registry(rt.register, rt.unregister, rt.is_pinned)
    a, _ = reg.acquire([(0, 8192)])
    b, _ = reg.acquire([(4096, 16384)])  # overlaps a's span: shares it, registers the rest
    assert reg.spans() == {0: (8192, 2), 8192: (16384, 1)}
    assert rt.calls == [("register", 0, 8192), ("register", 8192, 8192)]
    reg.release(a)
    assert 1 in rt.pages and 0 in rt.pages  # b still holds the first span
    reg.release(b)
    assert reg.spans() == {} and rt.pages == {}
    reg.release(b)  # nothing left to drop


def test_registry_leaves_foreign_pinned_memory_alone_and_cleans_up_on_failure():
    rt = FakeRuntime(foreign={2})
    reg = pinning.Registry(rt.register, rt.unregister, rt.is_pinned)
    held, foreign = reg.acquire([(8192, 12288)])
    assert foreign == 1 and held == [] and rt.calls == []
    # a span whose registration fails half-way: what was registered is undone
    rt.foreign = {5}
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        reg.acquire([(0, 8192), (16384, 24576)])  # page 5 foreign but page 4 not: 712
    assert reg.spans() == {} and rt.pages == {}
