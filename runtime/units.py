"""Byte counts as people read them, for the messages of leases, fake GPUs and the monitor."""

from __future__ import annotations


def format_bytes(nbytes: int) -> str:
    """Human-readable size with binary units: '0 B', '512 B', '1.5 KiB', '3.2 GiB'."""
    if abs(nbytes) < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"
