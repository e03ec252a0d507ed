"""kvcopy.copy_backends.gpu: which device a copy is on, and availability resolved once."""
from types import SimpleNamespace

import pytest
import torch

from kvcopy.copy_backends import gpu

CPU, META = torch.device("cpu"), torch.device("meta")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _tables(src, dst, tensors=()):
    return SimpleNamespace(src_device=src, dst_device=dst, src_tensors=list(tensors), dst_tensors=[])


@pytest.mark.parametrize("src,dst,want", [
    (GPU0, CPU, (0, None)),
    (CPU, GPU1, (1, None)),
    (GPU1, GPU1, (1, None)),
    (CPU, CPU, (None, "needs a CUDA tensor on one side")),
    (GPU0, GPU1, (None, "both sides on different GPUs")),
    (GPU0, META, (None, "unsupported device meta")),
])
def test_gpu_side(src, dst, want):
    index, why = gpu.gpu_side(_tables(src, dst))
    assert index == want[0]
    assert (why is None) if want[1] is None else (want[1] in why)


def test_tensors_on_another_gpu_than_the_tables_are_refused():
    other = SimpleNamespace(device=GPU1)
    index, why = gpu.gpu_side(_tables(GPU0, CPU, [other]))
    assert index is None and "tensors on several GPUs" in why


def test_availability_is_resolved_once_and_says_why():
    calls = []

    class Probe(gpu.GpuBackendBase):
        def _find(self):
            calls.append(1)
            return "library missing"

    b = Probe()
    first = b.unavailable_reason()
    assert b.unavailable_reason() == first and len(calls) <= 1
    if torch.cuda.is_available():
        assert first == "library missing" and calls == [1]
    else:  # no device: said first, and _find never asked
        assert "no CUDA device here" in first and "libkvcopy_cuda.so" in first and calls == []
    assert "needs a CUDA tensor" in b.unsupported_reason(_tables(CPU, CPU))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a device")
def test_no_device_names_the_build_too():
    why = gpu.cuda_unavailable()
    assert why.startswith("no CUDA device here (torch.cuda.is_available() is False); libkvcopy_cuda.so")


@pytest.mark.gpu
def test_device_info_and_getters():
    sms, usable = gpu.device_info(0)
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count and isinstance(usable, bool)
    assert gpu.current_device_getter()() == torch.cuda.current_device()
    assert gpu.raw_stream_getter()(0) == torch.cuda.current_stream(0).cuda_stream
    assert gpu.call_on_device(0, torch.cuda.current_device) == 0
