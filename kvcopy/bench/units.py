"""Byte sizes and counts as ``kvcopy-bench`` prints and parses them (no torch here:
``--help`` must not wait for it)."""
from __future__ import annotations

import math


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"


def plural(n: int, noun: str) -> str:
    """``1 group``, ``2 groups``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def parse_size(text: str) -> int:
    """``"2K"``, ``"64KiB"``, ``"2M"``, ``"4096"`` -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = float(num) * mult
    except ValueError:
        raise ValueError(f"bad size {text!r} (e.g. 4096, 32K, 2M)") from None
    if value <= 0 or value != math.floor(value):
        raise ValueError(f"bad size {text!r} (e.g. 4096, 32K, 2M)")
    return int(value)
