"""y = x @ w^T for the projections: CUTLASS (nvidia-cutlass's Python interface, compiled once and
cached by CUTLASS itself) or cuBLAS (torch), whichever a one-time autotune measured faster for
the shape. The table of choices is kept per GPU on disk and can be printed (bench/cuda_kernels.py).

CUTLASS is optional: when its package is missing or a kernel fails to build, to match cuBLAS, or
to be captured in a CUDA graph, the table says so and cuBLAS serves that shape.
"""
from __future__ import annotations

import importlib
import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from forge_service.backends.cuda.nvrtc import write_atomically

log = logging.getLogger("forge.cuda.gemm")

TABLE_DIR = Path.home() / ".cache" / "forge" / "gemm"
WARMUP, REPEATS = 3, 10


def bucket(m: int) -> int:
    """Row counts are tuned at the next power of two."""
    return 1 << max(0, (m - 1).bit_length())


@dataclass
class Choice:
    """One row of the autotune table."""

    m: int
    n: int
    k: int
    dtype: str
    winner: str  # "cutlass" | "cublas"
    cublas_ms: float
    cutlass_ms: float | None = None
    note: str = ""  # why CUTLASS lost or could not run


class CutlassGemm:
    """Plans of the CUTLASS Python interface, one per dtype (its JIT caches the kernels)."""

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self.reason = ""  # why the interface is unavailable, once looked for
        self._looked = False
        self._plans: dict[torch.dtype, object] = {}

    @property
    def module(self) -> ModuleType | None:
        if not self._looked:  # imported on first tuning: it is large, and optional
            self._module, self.reason = _cutlass_module()
            self._looked = True
        return self._module

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [M, K] row-major; w: [N, K] row-major, i.e. w^T column-major -> [M, N]
        assert self.module is not None
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        plan = self._plan(x.dtype)
        from forge_service.backends.cuda.driver import bindings

        stream = bindings()[0].CUstream(torch.cuda.current_stream().cuda_stream)
        plan.run(x, w.t(), out, out, alpha=1.0, beta=0.0, sync=False, stream=stream)
        return out

    def _plan(self, dtype: torch.dtype):
        if dtype not in self._plans:
            layout = self.module.LayoutType
            self._plans[dtype] = self.module.op.Gemm(
                element=dtype, element_accumulator=torch.float32, layout_A=layout.RowMajor,
                layout_B=layout.ColumnMajor, layout_C=layout.RowMajor)
        return self._plans[dtype]


def _cutlass_module() -> tuple[ModuleType | None, str]:
    """The CUTLASS Python interface: `cutlass_cppgen` (CUTLASS >= 4.2) or the older `cutlass`
    (the CuTe DSL also installs a `cutlass` module, without `op.Gemm`)."""
    reasons = []
    for name in ("cutlass_cppgen", "cutlass"):
        try:
            module = importlib.import_module(name)
        except Exception as e:  # a broken install raises anything at import: record it, use cuBLAS
            reasons.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if hasattr(getattr(module, "op", None), "Gemm"):
            return module, ""
        reasons.append(f"{name}: no op.Gemm")
    return None, "; ".join(reasons)


class GemmTuner:
    """Picks CUTLASS or cuBLAS per (row bucket, N, K, dtype) on first use and remembers it."""

    def __init__(self, device: torch.device, table_dir: Path | None = TABLE_DIR, use_cutlass: bool = True) -> None:
        self.device = device
        self.cutlass = CutlassGemm() if use_cutlass else None
        name = torch.cuda.get_device_name(device).replace(" ", "_")
        self.store = None if table_dir is None else TableFile(table_dir / f"{name}.json")
        self.table: dict[tuple[int, int, int, str], Choice] = {} if self.store is None else self.store.read()

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [M, K], w: [N, K] -> [M, N]
        key = (bucket(x.shape[0]), w.shape[0], w.shape[1], str(x.dtype))
        choice = self.table.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                return F.linear(x, w)  # tuning synchronises; graphs are warmed up first, so rare
            choice = self._tune(key, w)
        usable = self.cutlass is not None and self.cutlass.module is not None
        if choice.winner == "cutlass" and usable and x.is_contiguous() and w.is_contiguous():
            return self.cutlass(x, w)
        return F.linear(x, w)

    def rows(self) -> list[dict]:
        return table_rows(self.table)

    def _tune(self, key: tuple[int, int, int, str], w: torch.Tensor) -> Choice:
        m, n, k, dtype = key
        x = torch.randn(m, k, dtype=w.dtype, device=self.device)  # the bucket's rows, against the real weight
        choice = Choice(m, n, k, dtype, "cublas", time_ms(lambda: F.linear(x, w)))
        if w.dtype == torch.float32:
            choice.note = "float32 stays on cuBLAS (CUTLASS would compute in TF32)"
        elif self.cutlass is None or self.cutlass.module is None:
            choice.note = "CUTLASS not used" if self.cutlass is None else f"CUTLASS unavailable: {self.cutlass.reason}"
        else:
            self._try_cutlass(choice, x, w)
        log.info("gemm %dx%dx%d %s: %s (cuBLAS %.3f ms, CUTLASS %s) %s", m, n, k, dtype, choice.winner,
                 choice.cublas_ms, "-" if choice.cutlass_ms is None else f"{choice.cutlass_ms:.3f} ms", choice.note)
        self.table[key] = choice
        if self.store is not None:
            self.store.save(self.table)
        return choice

    def _try_cutlass(self, choice: Choice, x: torch.Tensor, w: torch.Tensor) -> None:
        try:
            got, want = self.cutlass(x, w), F.linear(x, w)
            torch.cuda.synchronize(self.device)
            err = (got.float() - want.float()).abs().max().item()
            if not err <= 2e-2 * want.float().abs().max().item():
                choice.note = f"CUTLASS result differs from cuBLAS by {err:.3g}"
                return
            choice.cutlass_ms = time_ms(lambda: self.cutlass(x, w))
            _capture_once(lambda: self.cutlass(x, w))
        except Exception as e:  # JIT build, launch or capture failures: record why, keep cuBLAS
            choice.note = f"CUTLASS failed: {type(e).__name__}: {str(e)[:200]}"
            return
        if choice.cutlass_ms < choice.cublas_ms:
            choice.winner = "cutlass"


class TableFile:
    """The autotune table on disk, shared by every process on the host that tunes the same GPU model
    (engines of one node, test workers): each save merges the rows already there, so no process's
    choices are lost to another's, and replaces the file atomically. It is a cache: a table that
    cannot be read is empty, and one that cannot be written is logged and left (tuning happens again)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[tuple[int, int, int, str], Choice]:
        try:
            rows = [Choice(**r) for r in json.loads(self.path.read_text())]
        except (OSError, ValueError, TypeError):
            return {}
        return {(c.m, c.n, c.k, c.dtype): c for c in rows}

    def save(self, table: dict[tuple[int, int, int, str], Choice]) -> None:
        rows = table_rows({**self.read(), **table})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(rows, indent=1).encode())
        except OSError as e:
            log.warning("the GEMM autotune table cannot be written to %s (%s); shapes are tuned again next start",
                        self.path, e)


def table_rows(table: dict[tuple[int, int, int, str], Choice]) -> list[dict]:
    """The table's choices as plain rows, by shape."""
    return [asdict(c) for c in sorted(table.values(), key=lambda c: (c.n, c.k, c.m))]


def time_ms(fn: Callable[[], object], warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median milliseconds of `fn` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _capture_once(fn: Callable[[], object]) -> None:
    """Raise unless `fn` can be captured in a CUDA graph (decode steps are replayed from graphs)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # first use outside the capture, as torch recommends
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
