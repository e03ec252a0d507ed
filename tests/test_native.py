"""kvcopy.native: finding the native libraries, and refusing stale ones."""
from pathlib import Path

from kvcopy import native


class _FakeLibrary:
    def __init__(self, version=None):
        if version is not None:
            self.kvcopy_cpu_abi_version = lambda: version


def test_a_library_built_from_other_sources_is_refused():
    """A library whose C signatures differ from what the Python code passes would be
    called with the wrong arguments: refused, with a reason that says to rebuild."""
    path = Path("/nowhere/libkvcopy_cpu.so")
    want = native.ABI_VERSIONS["kvcopy_cpu"]
    lib = _FakeLibrary(want)
    assert native._checked(lib, "kvcopy_cpu", path) == (lib, None)
    for stale in (_FakeLibrary(want - 1), _FakeLibrary(want + 1), _FakeLibrary()):
        got, why = native._checked(stale, "kvcopy_cpu", path)
        assert got is None and "rebuild" in why and str(path) in why


def test_the_built_libraries_load_with_their_abi_version():
    lib, why = native.load("kvcopy_cpu")
    if lib is None:  # not built here: the reason says so, never an import error
        assert why
        return
    assert lib.kvcopy_cpu_abi_version() == native.ABI_VERSIONS["kvcopy_cpu"]
    assert native.find("kvcopy_cpu") is not None
