"""Whether a process of this host is still running (a killed, unreaped one is not)."""

from __future__ import annotations

import os

__all__ = ["process_running"]


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this host exists and is not a zombie (killed, unreaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
