"""The serving process caps glibc's malloc arenas (see cap_malloc_arenas): threads share a few
heaps, so memory one thread frees is reused by the others instead of held as resident."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forge_service.config import malloc_arenas

ROOT = Path(__file__).resolve().parents[2]

# Eight threads allocate at once; then glibc's malloc_info lists one <heap> per arena.
COUNT_ARENAS = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    from forge_service.server import cap_malloc_arenas
    cap_malloc_arenas(None if sys.argv[1] == "none" else int(sys.argv[1]))
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    start, done = threading.Barrier(8), threading.Barrier(8)

    def allocate():
        start.wait()
        block = libc.malloc(4096)
        done.wait()
        libc.free(block)

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with tempfile.NamedTemporaryFile() as f:
        out = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, out)
        libc.fclose(out)
        print(open(f.name).read().count("<heap nr="))
""")


def _arenas(cap: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run = subprocess.run([sys.executable, "-c", COUNT_ARENAS, cap], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return int(run.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_info"), reason="glibc only")
def test_capped_threads_share_the_arenas_they_would_each_take():
    assert _arenas("none") > 2  # glibc's default: a new arena for each new allocating thread
    assert _arenas("2") == 2


def test_one_arena_per_usable_cpu_unless_the_environment_says():
    assert malloc_arenas({}) == len(os.sched_getaffinity(0))
    assert malloc_arenas({"MALLOC_ARENA_MAX": "4"}) is None  # glibc read it at start-up
