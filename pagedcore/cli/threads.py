"""How many torch threads a command runs with: never more than the CPUs this process may use and that are free.

torch's default is one intra-op thread per core of the machine. That is too many in three common cases: a container
or ``taskset`` that lets the process use fewer CPUs than the machine has (``os.sched_getaffinity``), a cgroup CPU
quota (``docker --cpus 2``, Kubernetes limits: ``cpu.max``), and a machine other jobs keep busy. Each of torch's
parallel regions waits for its slowest thread, so a thread that has no CPU to run on stalls all of them: on this
project's 2-core machine under a load of ~10, ``pagedcore generate`` took 38 s with torch's 2 threads and 1.25 s with
one.

The default of ``pagedcore generate``, ``serve`` and ``bench``, when neither ``--threads`` nor ``OMP_NUM_THREADS``
says otherwise, is therefore the CPUs this process may use (affinity and quota), less the share of them other work
keeps busy (the 1-minute load average over the machine's CPUs), rounded, at least 1. The commands state the choice
in their start-up line. Plain Python: nothing here imports torch but :func:`apply_threads`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ThreadChoice", "apply_threads", "cgroup_cpu_limit", "choose_threads", "default_threads", "usable_cpus"]


@dataclass(frozen=True)
class ThreadChoice:
    """The torch threads a command runs with, and why.

    Attributes:
        threads: torch intra-op threads.
        source: ``"--threads"`` (asked for), ``"OMP_NUM_THREADS"`` (the environment) or ``"default"``.
        usable: the CPUs this process may use (affinity and cgroup quota).
        load: the 1-minute load average when the default was chosen (None where the system has none).
        cpus: the machine's CPUs (what the load average is spread over).

    Example:
        >>> ThreadChoice(1, "default", 2.0, 9.8, 2).describe()
        '1 torch thread (2 CPUs usable, load 9.8 on 2; --threads N to change)'
        >>> ThreadChoice(4, "--threads", 8.0, None, 8).describe()
        '4 torch threads (--threads)'
    """

    threads: int
    source: str
    usable: float
    load: float | None
    cpus: int

    def describe(self) -> str:
        """One phrase for a start-up line: the count and where it comes from."""
        count = f"{self.threads} torch thread{'s' if self.threads != 1 else ''}"
        if self.source != "default":
            return f"{count} ({self.source})"
        load = "" if self.load is None else f", load {self.load:.1f} on {self.cpus}"
        return f"{count} ({self.usable:g} CPUs usable{load}; --threads N to change)"


def cgroup_cpu_limit(
    root: str | os.PathLike[str] = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup"
) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` of v1; the smallest along the path to the root), or None without one.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "cpu.max").write_text("150000 100000")
        >>> cgroup_cpu_limit(root, membership="/nonexistent")
        1.5
        >>> _ = (root / "cpu.max").write_text("max 100000")
        >>> cgroup_cpu_limit(root, membership="/nonexistent") is None
        True
    """
    base = Path(root)
    limits = [q for folder in _cgroup_folders(base, membership) if (q := _quota(folder)) is not None]
    return min(limits) if limits else None


def _cgroup_folders(base: Path, membership: str) -> list[Path]:
    """The cgroup folders of this process and their parents (v2 and v1's cpu controller), deepest first."""
    paths: list[Path] = []
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        names = controllers.split(",")
        if controllers == "":
            top = base
        elif "cpu" in names:
            top = base / controllers if (base / controllers).is_dir() else base / "cpu"
        else:
            continue
        folder = top / path.strip("/")
        while True:
            paths.append(folder)
            if folder == top:
                break
            folder = folder.parent
    return paths or [base, base / "cpu"]


def _quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        v1_quota = int((folder / "cpu.cfs_quota_us").read_text())
        v1_period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return v1_quota / v1_period if v1_quota > 0 and v1_period > 0 else None


def usable_cpus() -> float:
    """The CPUs this process may use: those of its affinity mask, or fewer under a cgroup CPU quota.

    Example:
        >>> 0 < usable_cpus() <= (os.cpu_count() or 1)
        True
    """
    try:
        count: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return count if limit is None else max(min(count, limit), 1e-3)


def default_threads(usable: float, load: float | None, cpus: int) -> int:
    """Threads for ``usable`` CPUs when the machine's ``cpus`` CPUs carry a 1-minute ``load`` average: the usable
    CPUs less the busy share of them, rounded, at least 1 and at most the whole usable CPUs.

    Example:
        >>> default_threads(2, 0.1, 2), default_threads(2, 1.0, 2), default_threads(2, 9.8, 2)
        (2, 1, 1)
        >>> default_threads(4, 16.0, 64), default_threads(8, None, 8), default_threads(1.5, 0.0, 64)
        (3, 8, 1)
    """
    busy = 0.0 if load is None else min(1.0, max(0.0, load) / max(cpus, 1))
    free = usable * (1.0 - busy)
    return max(1, min(math.floor(usable + 1e-9), math.floor(free + 0.5)))


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The threads to run with: ``requested`` (``--threads``), else ``OMP_NUM_THREADS``, else
    :func:`default_threads` for this process and this moment's load.

    Example:
        >>> choose_threads(3)
        ThreadChoice(threads=3, source='--threads', usable=..., load=..., cpus=...)
        >>> choose_threads().threads >= 1
        True
    """
    usable, cpus = usable_cpus(), os.cpu_count() or 1
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    if requested is not None:
        return ThreadChoice(requested, "--threads", usable, load, cpus)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), "OMP_NUM_THREADS", usable, load, cpus)
    return ThreadChoice(default_threads(usable, load, cpus), "default", usable, load, cpus)


def apply_threads(requested: int | None = None) -> ThreadChoice:
    """:func:`choose_threads`, then ``torch.set_num_threads`` to it; returns the choice.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> apply_threads(1).threads, torch.get_num_threads()
        (1, 1)
        >>> torch.set_num_threads(before)
    """
    import torch

    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    return choice
