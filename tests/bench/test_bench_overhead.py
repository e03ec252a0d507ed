"""kvcopy-bench overhead: the per-call host cost with the launch stubbed, without a GPU."""
import json

import pytest

from kvcopy import native
from kvcopy.bench.cli import main


@pytest.mark.skipif(native.load("kvcopy_cpu")[0] is None, reason="CPU library not built")
def test_overhead_rows_are_labelled_stubbed(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["overhead", "--layers", "8", "--groups", "3", "--calls", "20", "--rounds", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "launch replaced by a no-op" in text
    res = json.loads(out.read_text())
    labels = [r["label"] for r in res["rows"]]
    assert labels[:2] == ["plan", "cuda stubbed"] and "triton stubbed" in labels
    assert all(r["median_us"] > 0 for r in res["rows"])
    assert res["layers"] == 8 and res["groups"] == 3 and res["clock"] == "wall"


@pytest.mark.skipif(native.load("kvcopy_cpu")[0] is None, reason="CPU library not built")
def test_overhead_on_the_thread_clock_says_so(tmp_path, capsys, monkeypatch):
    """--clock thread times by time.thread_time (the thread's CPU time), and says so."""
    from kvcopy.bench import overhead

    reads = []
    monkeypatch.setitem(overhead.CLOCKS, "thread", lambda: reads.append(1) or len(reads) * 1e-6)
    out = tmp_path / "o.json"
    assert main(["overhead", "--layers", "4", "--groups", "2", "--calls", "10", "--rounds", "2",
                 "--backends", "cuda", "--clock", "thread", "--json", str(out)]) == 0
    assert "thread clock" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["clock"] == "thread" and reads  # the rows came from that clock
    with pytest.raises(SystemExit):
        main(["overhead", "--clock", "process"])
