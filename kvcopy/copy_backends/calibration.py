"""How ``auto`` picks a GPU backend, and the per-device table it reads.

The feature is the **mean descriptor size** of a call: the bytes of one contiguous
piece (a chunk of a merged run of adjacent pages, else a chunk of one page), i.e.
``total bytes / segments``. Copy engines pay per descriptor (H100: 4-7 GB/s at 4 KiB,
~52 GB/s at 64 KiB; published crossovers 28-34 KiB), the SM kernels do not.

Rule (:func:`pick`), for a direction and a mean descriptor size ``s``:

* with a calibration table for this device: the bucket nearest ``s`` (log scale);
  among the backends measured there and usable now, the fastest, where any backend
  within ``TIE`` (3%) of the fastest counts as fastest and ties go to ``ce`` (it
  leaves every SM to the model), then ``cuda``, then ``triton``;
* without one (the built-in default): ``ce`` from ``DEFAULT_CE_MIN_BYTES`` = 64 KiB
  up (safely above the published crossovers), the SM kernel below it (``cuda``, else
  ``triton``), ``torch`` when nothing else runs.

The table: ``kvcopy-bench calibrate`` (:mod:`kvcopy.bench.calibrate`) copies
scattered pages of each size from 2 KiB to 2 MiB in both directions with every GPU
backend, plus a contiguous pinned memcpy of the same bytes, and writes
``$XDG_CACHE_HOME/kvcopy/calibration.json`` (``~/.cache`` when unset), one entry per
device (name, compute capability, driver). ``KVCOPY_CALIBRATION`` names another file.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

DEFAULT_CE_MIN_BYTES = 64 * 1024
TIE = 0.03
PREFERENCE = ("ce", "cuda", "triton")  # tie-break order
SM_ORDER = ("cuda", "triton")
DEFAULT_SIZES = tuple(2048 << k for k in range(11))  # 2 KiB .. 2 MiB
FORMAT = 1


def table_path() -> Path:
    env = os.environ.get("KVCOPY_CALIBRATION")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcopy" / "calibration.json"


def device_key(device: int = 0) -> str:
    import torch

    props = torch.cuda.get_device_properties(device)
    driver = ""
    try:
        driver = str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") else ""
    except Exception:
        pass
    return f"{props.name}|sm_{props.major}{props.minor}|{driver or torch.version.cuda}"


_cache: Dict[str, Optional[dict]] = {}


def load_table(key: str) -> Optional[dict]:
    """The calibration entry for a device key, or None (read once per process)."""
    if key not in _cache:
        entry = None
        try:
            data = json.loads(table_path().read_text())
            if data.get("format") == FORMAT:
                entry = data.get("devices", {}).get(key)
        except (OSError, ValueError):
            entry = None
        _cache[key] = entry
    return _cache[key]


def pick(direction: str, desc_bytes: float, usable: Sequence[str], table: Optional[dict] = None) -> Optional[str]:
    """The backend for one call (see the module docstring); None if none is usable."""
    usable = [b for b in usable if b in PREFERENCE]
    if not usable:
        return None
    rows = (table or {}).get(direction) if table else None
    if rows:
        row = min(rows, key=lambda r: abs(math.log2(max(r["bytes"], 1)) - math.log2(max(desc_bytes, 1))))
        measured = {b: g for b, g in row["gbps"].items() if b in usable and g}
        if measured:
            best = max(measured.values())
            for b in PREFERENCE:
                if b in measured and measured[b] >= best * (1 - TIE):
                    return b
    if desc_bytes >= DEFAULT_CE_MIN_BYTES and "ce" in usable:
        return "ce"
    for b in SM_ORDER:
        if b in usable:
            return b
    return usable[0]


def save(key: str, measured: dict, path: Optional[Path] = None) -> Path:
    path = path or table_path()
    data: Dict[str, Any] = {"format": FORMAT, "devices": {}}
    try:
        old = json.loads(path.read_text())
        if old.get("format") == FORMAT:
            data = old
    except (OSError, ValueError):
        pass
    measured = dict(measured, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    data["devices"][key] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    _cache.pop(key, None)
    return path
