"""The README's API example runs as written (on the CPU) and does what it says."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs_and_copies_each_group_at_its_blocks():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    dev, host = ns["device_caches"], ns["host_buffers"]
    g0, g1 = ns["layer_groups"]
    # group 0's layers at 3, 4, 5 (host 0 from the last call too), group 1's at 9
    for name in g0:
        assert torch.equal(host[name][:, [3, 4, 5]].view(torch.int16), dev[name][:, [3, 4, 5]].view(torch.int16))
        assert not host[name][:, 9].view(torch.int16).any()
    for name in g1:
        assert torch.equal(host[name][:, 9].view(torch.int16), dev[name][:, 9].view(torch.int16))
        assert not host[name][:, [3, 4, 5]].view(torch.int16).any()
    assert not host["model.layers.4.attn"].view(torch.int16).any()  # KV-sharing: untouched
    assert torch.equal(ns["packed"], ns["scattered"]) and ns["packed"].unique().numel() == 4  # one sum per page



def test_readme_stays_a_manual():
    """Under 200 lines; detail belongs in docs/*.md, history in CHANGELOG.md."""
    lines = README.read_text().splitlines()
    assert len(lines) < 200, len(lines)
