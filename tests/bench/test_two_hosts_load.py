"""A busy P for the two-host bench (kvcopy.bench.two_hosts_load): CPU lists, pinning that
later threads inherit, the load's threads and the rate they report."""
import json
import os
import subprocess
import sys
import threading

import pytest

from kvcopy.bench import two_hosts_load as load


class _Server:
    def __init__(self):
        self.scratch = {}


def test_cpu_lists_parse_and_bad_ones_are_refused():
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    assert load.parse_cpus(None) is None
    assert load.parse_cpus(str(last)) == [last]
    assert load.parse_cpus(f"{last},{first}") == sorted({first, last})
    assert load.parse_cpus(f"{first}-{last}") == [c for c in range(first, last + 1)]
    for bad in ("x", "", "1-", "-1", "1,,2", "1.5"):
        with pytest.raises(ValueError, match="such as"):
            load.parse_cpus(bad)
    with pytest.raises(ValueError, match="not all of them usable"):
        load.parse_cpus(str(max(allowed) + 4096))


def test_the_load_runs_its_threads_at_nice_0_and_stops():
    server = _Server()
    before = {t.ident for t in threading.enumerate()}
    load.load_start(server, 2)
    with pytest.raises(ValueError, match="already"):
        load.load_start(server, 1)
    listed = load.threads(server)
    names = [name for name, _, _ in listed]
    assert names.count("p-load-0") == names.count("p-load-1") == 1, names
    assert all(nice == os.getpriority(os.PRIO_PROCESS, 0) for name, nice, _ in listed if name.startswith("p-load"))
    rate = load.load_stop(server)
    assert rate > 0 and "load" not in server.scratch
    assert {t.ident for t in threading.enumerate()} == before  # joined


def test_pinning_covers_the_threads_already_there_and_those_started_later():
    """In a child process (pinning this one would pin the test run): every thread on
    the one CPU, the ones started before ``pin`` and after it."""
    cpu = max(os.sched_getaffinity(0))
    code = f"""
import json, threading
from kvcopy.bench import two_hosts_load as load
class S: scratch = {{}}
stop, named = threading.Event(), threading.Event()
def early_thread():
    load.name_thread("early"); named.set(); stop.wait()
early = threading.Thread(target=early_thread); early.start(); named.wait()
load.pin(S(), [{cpu}])
load.load_start(S, 1)
listed = load.threads(S)
load.load_stop(S); stop.set(); early.join()
print(json.dumps(listed))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"early", "p-load-0"} <= {name for name, _, _ in listed}, listed
    assert all(cpus == [cpu] for _, _, cpus in listed), listed
