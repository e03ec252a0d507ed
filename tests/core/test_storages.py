"""kvcopy.core.storages: the memory a BlockCopier was built on, checked at build and per call.

A copy's source and destination must not share a byte (refused at build); a storage
replaced or freed after build is refused at the next call, before any byte moves.
"""
import pytest
import torch

import kvcopy
from kvcopy.core.storages import StorageGuard, check_disjoint

CPU_BACKENDS = [b for b in ("torch", "cpu") if kvcopy.available_copy_backends()[b] is None]


def test_disjoint_sides_pass_and_a_shared_byte_is_named():
    pool = torch.zeros(64, dtype=torch.uint8)
    check_disjoint({"a": pool[:32]}, {"a": pool[32:]})  # adjacent: no shared byte
    check_disjoint({"a": pool[:16], "b": pool[:16]}, {"a": pool[16:32], "b": pool[48:]})  # one side may share
    with pytest.raises(ValueError, match=r"host buffer of layer 'b' and device cache of layer 'a' share bytes"):
        check_disjoint({"a": pool[:32]}, {"b": pool[31:40]})
    with pytest.raises(ValueError, match="share bytes"):
        check_disjoint({"a": pool[8:16]}, {"b": pool[:64:16]})  # strided over the device's bytes
    check_disjoint({"a": pool[:0]}, {"b": pool})  # an empty tensor has no bytes


def test_guard_sees_a_storage_moved_freed_or_regrown():
    a = torch.zeros(8, 4)
    b = torch.zeros(8, 4)
    view = a[2:]  # another view of a's storage: one watch per storage
    guard = StorageGuard({"a": a, "a2": view}, {"b": b})
    guard.check()
    assert len(guard._watched) == 2
    b.set_(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="storage of layer 'b' was replaced or freed after the BlockCopier"):
        guard.check()
    b2 = torch.zeros(8, 4)
    guard = StorageGuard({"b": b2})
    b2.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"layer 'b' .* now 0 bytes"):
        guard.check()


# ---------------------------------------------------------------- through the copier
def _one_layer(dev, host):
    return kvcopy.BlockCopier({"a": dev}, {"a": host}, [["a"]],
                              copy_backend="cpu" if "cpu" in CPU_BACKENDS else "torch")


def test_source_and_destination_overlap_is_refused_at_build():
    """One storage, the host view half a page past the device view (old code: accepted,
    and the cpu backend gave wrong bytes)."""
    pool = torch.zeros(2 * 8 * 16 * 8 + 64, dtype=torch.float16)
    page = 16 * 8
    dev = pool[: 8 * page].view(8, 16, 8)
    host = pool[page // 2 : page // 2 + 8 * page].view(8, 16, 8)
    with pytest.raises(ValueError, match="share bytes"):
        _one_layer(dev, host)
    with pytest.raises(ValueError, match="share bytes"):
        _one_layer(dev, dev)
    _one_layer(pool[: 8 * page].view(8, 16, 8), pool[8 * page : 16 * page].view(8, 16, 8)).close()  # adjacent: fine


@pytest.mark.parametrize("how", ["set_", "resize_(0)"])
@pytest.mark.parametrize("side", ["device", "host"])
def test_storage_replaced_or_freed_after_build_raises_at_the_call(side, how):
    """Old code wrote into the freed storage (SIGSEGV or silent corruption)."""
    dev = torch.randn(8, 16, 8).to(torch.float16)
    host = torch.zeros(8, 16, 8, dtype=torch.float16)
    copier = _one_layer(dev, host)
    copier.to_host([[1, 2]])
    target = dev if side == "device" else host
    if how == "set_":
        target.set_(torch.zeros(8, 16, 8, dtype=torch.float16))
    else:
        target.untyped_storage().resize_(0)
    other = host if side == "device" else dev
    before = other.clone()
    for call in (copier.to_host, copier.to_device):
        with pytest.raises(ValueError, match="replaced or freed after the BlockCopier was built"):
            call([[3, 4]])
    assert torch.equal(other.view(torch.int16), before.view(torch.int16))
    copier.plan("d2h", [[3]])  # validating ids touches no memory: still allowed
    copier.close()
