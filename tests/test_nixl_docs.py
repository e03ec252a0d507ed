"""docs/nixl.md's P/D example runs as written on the CPU and prints the plan it shows."""
import contextlib
import io
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "nixl.md"


def test_pd_example_runs_and_prints_the_documented_plan():
    text = DOC.read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    shown = re.search(r"```\n(PullPlan from .*?)```", text, re.S).group(1)
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(DOC), "exec"), ns)
    assert shown in out.getvalue()
    # the example's own checks ran; and D's KV changed where the plan says, zero at page 25
    d_kv, p_kv = ns["d_kv"], ns["p_kv"]
    assert torch.equal(d_kv["attn.0"][20:25].view(torch.int16), p_kv["attn.0"][4:9].view(torch.int16))
    assert not d_kv["attn.3"][25].view(torch.int16).any()  # allocated, not read: zeroed
    assert (d_kv["attn.3"][26] == 1).all()  # not in the request: untouched
    assert ns["P"]._closed and ns["D"]._closed


def test_arena_example_runs():
    text = DOC.read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'buffer="arena"' in b)
    ns: dict = {}
    exec(compile(example, str(DOC), "exec"), ns)
    assert ns["P"]._closed and ns["D"]._closed and ns["record"].num_tokens == 40
