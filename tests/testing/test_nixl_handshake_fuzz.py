"""The handshake fuzzer (kvcopy.testing.nixl.handshake_fuzz) in CI: each group of batches in a
subprocess, so a crash (v2: SIGSEGV in UCX on a flipped bit) or a hang (v2: a negative
tokens_per_page made plan_pull loop) fails the test instead of killing pytest."""
import json
import os
import subprocess
import sys

import pytest

from kvcopy.nixl import nixl_available

pytestmark = pytest.mark.skipif(nixl_available() is not None, reason="needs NIXL")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# about 5,600 variants in all: ~2,500 truncations, ~1,900 bit flips, 600 random, 390
# wrong types, 200 key variants, 48 oversized counts
GROUPS = ["random,truncations", "flips,keys", "counts,types"]


@pytest.mark.parametrize("batches", GROUPS)
def test_bad_handshakes_are_refused_with_value_or_type_errors(batches):
    env = dict(os.environ, UCX_NET_DEVICES="lo", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "kvcopy.testing.nixl.handshake_fuzz", "--batch", batches],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode in (0, 1), f"the fuzzer died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert [r["batch"] for r in reports] == batches.split(",")
    for r in reports:
        assert r["unexpected"] == [] and r["after"] == [], r
        assert r["outcomes"].get("refused", 0) >= r["variants"] - 2, r
        assert r["variants"] >= 40
    assert proc.returncode == 0
