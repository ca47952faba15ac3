"""How many CPUs this process may run on: a container's, cgroup cpuset's or taskset's share, not
the host's hardware threads (a job given 16 of a host's 192 CPUs that sized its thread pools by
``os.cpu_count()`` would have ~100 threads contending for 16)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs of this process's affinity mask (``os.cpu_count()`` where the OS has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
