"""glibc's malloc tuned at start-up by ``pagedcore generate``, ``serve`` and ``bench`` where ``PAGEDCORE_MALLOC=tuned``
asks (``pagedcore/cli/malloc.py``, issue 33.2): glibc's defaults otherwise, what the environment chose stands, and the
tuning makes a freed block of megabytes come back without page faults (glibc's defaults unmap it and fault in fresh
zeroed pages on the next allocation)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pagedcore.cli.malloc import MallocChoice, tune_malloc

ROOT = Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a 64 MiB block allocated, written, freed, then again: the page faults of the second time
SECOND_FAULTS = """
import ctypes, resource, sys
from pagedcore.cli.malloc import tune_malloc
print(tune_malloc({"PAGEDCORE_MALLOC": sys.argv[1]}).tuned)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 64 << 20
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    before = faults()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
print(faults() - before)
"""


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({}, "default"),  # glibc's defaults unless asked: the settings cost decode steps ~4%
        ({"PAGEDCORE_MALLOC": "default"}, "default"),
        ({"PAGEDCORE_MALLOC": "tuned", "MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),  # not a MALLOC_*_ variable
        ({"PAGEDCORE_MALLOC": "tuned", "MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"PAGEDCORE_MALLOC": "tuned", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
        ({"PAGEDCORE_MALLOC": "fast"}, "PAGEDCORE_MALLOC='fast' is neither 'tuned' nor 'default'"),
    ],
)
def test_the_environments_choice_stands(env, reason):
    choice = tune_malloc(env, apply=False)
    if reason == "MALLOC_ARENA_MAX":
        assert choice.tuned is GLIBC
    else:
        assert choice == MallocChoice(False, reason)
        assert reason in choice.describe() or reason == "default"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_a_freed_block_comes_back_without_page_faults_when_tuned():
    """The mechanism the measured prefill gain rests on (scripts/allocator_bench.py): with glibc's defaults a 64 MiB
    block is a fresh mapping each time (16,384 faults of 4 KiB pages); tuned, the second one reuses the first's
    pages."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", SECOND_FAULTS]
    runs = {
        how: subprocess.run([*command, how], capture_output=True, text=True, env=env, check=True).stdout.split()
        for how in ("default", "tuned")
    }
    assert runs["default"][0] == "False" and runs["tuned"][0] == "True"
    assert int(runs["default"][1]) >= 16_000  # every page of the block faulted in again
    assert int(runs["tuned"][1]) < 100
