"""The vLLM version ``kvcopy.vllm`` is written against, checked once, when the package is
imported: without vLLM 0.33.x, ``import kvcopy.vllm`` (or any of its modules) raises
``ImportError`` naming the version it needs, before any vLLM module is touched."""
from __future__ import annotations

SUPPORTED_VLLM = "0.33"


def require_vllm() -> str:
    """vLLM's version string; ``ImportError`` when vLLM is missing or not 0.33.x."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"kvcopy.vllm needs vLLM {SUPPORTED_VLLM}.x (pip install 'vllm=={SUPPORTED_VLLM}.0'); "
            f"vLLM is not importable: {exc}"
        ) from exc
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0].rsplit(".", 1)[0] != SUPPORTED_VLLM:
        raise ImportError(f"kvcopy.vllm needs vLLM {SUPPORTED_VLLM}.x, found vLLM {version}")
    return version


VLLM_VERSION = require_vllm()
