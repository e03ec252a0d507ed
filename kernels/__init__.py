"""kvcopy.kernels: device code.

``block_copy.cuh`` is the item body shared by the CUDA kernel and the ``cpu`` backend
(raw pointers, no torch); the Triton kernels are Python modules of this package.
:func:`include_dir` gives the folder of the headers for NVRTC or a build.
"""
from pathlib import Path


def include_dir() -> Path:
    """Folder holding the ``.cuh`` headers."""
    return Path(__file__).resolve().parent
