"""kvcopy.native: finding the native libraries, and refusing stale ones."""
from pathlib import Path

from kvcopy import native


class _FakeLibrary:
    """Every function of the host library's C ABI (doing nothing), at ABI ``version``."""

    def __init__(self, version=None):
        for name in native.SIGNATURES["kvcopy_cpu"]:
            setattr(self, name, lambda *args: 0)
        self.kvcopy_cpu_entry_fields = lambda: native.ENTRY_FIELDS
        if version is None:
            del self.kvcopy_cpu_abi_version
        else:
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


def test_load_declares_every_signature_and_refuses_a_library_missing_one():
    lib = _FakeLibrary(native.ABI_VERSIONS["kvcopy_cpu"])
    path = Path("/nowhere/libkvcopy_cpu.so")
    assert native._checked(lib, "kvcopy_cpu", path) == (lib, None)
    restype, argtypes = native.SIGNATURES["kvcopy_cpu"]["kvcopy_plan_call"]
    assert (lib.kvcopy_plan_call.restype, lib.kvcopy_plan_call.argtypes) == (restype, argtypes)
    del lib.kvcopy_fold_page_sums
    got, why = native._checked(lib, "kvcopy_cpu", path)
    assert got is None and "kvcopy_fold_page_sums" in why and "rebuild" in why


def test_a_library_of_another_entry_width_is_refused():
    lib = _FakeLibrary(native.ABI_VERSIONS["kvcopy_cpu"])
    lib.kvcopy_cpu_entry_fields = lambda: native.ENTRY_FIELDS - 4
    got, why = native._checked(lib, "kvcopy_cpu", Path("/nowhere/libkvcopy_cpu.so"))
    assert got is None and f"{native.ENTRY_FIELDS - 4}-column" in why and "rebuild" in why
