"""vLLM's host-buffer sync overwrote received KV in hybrid models; here, end to end, it
does not: a hybrid model's KV goes P device -> P host -> (transfer) -> D host -> D
device and D holds P's bytes at every group's blocks, nothing else changed.

Device KV tensors are shared by one layer of each group (as vLLM allocates hybrid
models); host buffers are per layer (as vLLM's host-buffer path allocates them); two
KV-sharing layers point at other layers' device tensors and have host buffers that no
transfer ever fills. The negative control runs vLLM's coalesced sync (every layer at
all groups' ids, as vLLM does since it coalesced host-buffer copies across groups)
through the same check and must fail: the check can see the bug.
"""
import pytest
import torch

import kvcopy
from kvcopy.core.layout import as_words
from kvcopy.testing.reference import reference_copy

NUM_GROUPS, LAYERS_PER_GROUP, NB, SHAPE = 3, 2, 40, (4, 2, 16)  # (BS, H, D)
P_IDS = [[3, 4, 5, 17], [9, 30], [11, 12, 38]]
D_IDS = [[0, 1, 2, 7], [20, 21], [33, 8, 9]]


def _model(seed, fill=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    groups = [[f"model.layers.{k * NUM_GROUPS + gi}.attn" for k in range(LAYERS_PER_GROUP)]
              for gi in range(NUM_GROUPS)]
    dev, host = {}, {}
    for k in range(LAYERS_PER_GROUP):
        shared = torch.randint(0, 256, (2, NB) + SHAPE, dtype=torch.uint8, generator=g) if fill is None \
            else torch.full((2, NB) + SHAPE, fill, dtype=torch.uint8)
        for gi in range(NUM_GROUPS):
            dev[groups[gi][k]] = shared.view(torch.bfloat16)
    for name in list(dev):
        host[name] = torch.full_like(dev[name], 0)
    # KV-sharing layers: read layer 0's / layer 1's KV, own a host buffer, in no group.
    for j, target in enumerate((groups[0][0], groups[1][1])):
        name = f"model.layers.{NUM_GROUPS * LAYERS_PER_GROUP + j}.attn"
        dev[name] = dev[target]
        host[name] = torch.randint(0, 256, (2, NB) + SHAPE, dtype=torch.uint8, generator=g).view(torch.bfloat16)
    return dev, host, groups


def _transfer(p_host, d_host, groups):
    """What NIXL does: each group's layers' host pages, at that group's blocks only."""
    for gi, layers in enumerate(groups):
        for name in layers:
            reference_copy(p_host[name], d_host[name], P_IDS[gi], D_IDS[gi], block_dim=1)


def _run(d_sync):
    """P saves, NIXL's part is replayed, ``d_sync`` moves D's host buffers to its
    device caches; returns the D layers whose device bytes differ from the contract."""
    p_dev, p_host, groups = _model(seed=1)
    kvcopy.BlockCopier(p_dev, p_host, groups, copy_backend="cpu").to_host(P_IDS)
    d_dev, d_host, _ = _model(seed=2, fill=0xA5)
    # Expected D device bytes, one array per storage (aliased names share it).
    expected = {t.data_ptr(): as_words(t).clone() for t in d_dev.values()}
    for gi, layers in enumerate(groups):
        for name in layers:
            expected[d_dev[name].data_ptr()][:, D_IDS[gi]] = as_words(p_dev[name])[:, P_IDS[gi]]
    _transfer(p_host, d_host, groups)
    d_sync(d_dev, d_host, groups)
    return [n for n, t in d_dev.items() if not torch.equal(as_words(t), expected[t.data_ptr()])]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_d_holds_p_kv_at_every_groups_blocks(backend):
    def sync(dev, host, groups):
        kvcopy.BlockCopier(dev, host, groups, copy_backend=backend).to_device(D_IDS)

    assert _run(sync) == []


def test_negative_control_coalesced_sync_is_caught():
    """vLLM's coalesced sync: every layer (KV-sharing ones too) at all groups' ids."""
    all_ids = [i for ids in D_IDS for i in ids]

    def coalesced(dev, host, groups):
        for name in dev:
            reference_copy(host[name], dev[name], all_ids, all_ids, block_dim=1)

    bad = _run(coalesced)
    assert bad, "the check did not see unfilled host pages overwrite received KV"


def test_negative_control_per_group_all_layers_is_caught():
    """vLLM's per-group sync before it coalesced groups: every layer at each group's blocks."""
    def every_layer(dev, host, groups):
        for ids in D_IDS:
            for name in dev:
                reference_copy(host[name], dev[name], ids, ids, block_dim=1)

    assert _run(every_layer)
