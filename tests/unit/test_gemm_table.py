"""The CUDA backend's GEMM autotune table on disk (no GPU needed): processes that tune the same GPU
model share one file, so a save keeps the rows other processes wrote, concurrent saves never take
each other's temporary file, and a table that cannot be written is a warning, not a failed start."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from forge_service.backends.cuda.gemm import Choice, TableFile


def choice(m: int, n: int = 576, k: int = 576) -> Choice:
    return Choice(m, n, k, "torch.bfloat16", "cublas", 0.01 * m)


def table(*choices: Choice) -> dict:
    return {(c.m, c.n, c.k, c.dtype): c for c in choices}


def test_a_save_keeps_the_rows_another_process_wrote(tmp_path: Path):
    path = tmp_path / "gemm" / "GPU.json"
    TableFile(path).save(table(choice(1), choice(2)))
    TableFile(path).save(table(choice(4), choice(2, k=1536)))  # a second engine, tuning other shapes
    assert set(TableFile(path).read()) == set(table(choice(1), choice(2), choice(4), choice(2, k=1536)))


def test_a_process_s_own_choice_replaces_the_one_on_disk(tmp_path: Path):
    path = tmp_path / "GPU.json"
    TableFile(path).save(table(choice(8)))
    retuned = Choice(8, 576, 576, "torch.bfloat16", "cutlass", 0.05, cutlass_ms=0.02)
    TableFile(path).save(table(retuned))
    assert TableFile(path).read()[(8, 576, 576, "torch.bfloat16")] == retuned


def test_concurrent_saves_never_fail_and_leave_a_readable_table(tmp_path: Path):
    path = tmp_path / "GPU.json"
    errors: list[BaseException] = []

    def tune(worker: int) -> None:
        own: dict = {}
        try:
            for m in range(40):
                own.update(table(choice(m + 1, n=64 * (worker + 1))))
                TableFile(path).save(own)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=tune, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = json.loads(path.read_text())
    assert len(rows) == len(TableFile(path).read()) >= 40
    assert list(path.parent.glob("*.tmp")) == []


def test_a_table_that_cannot_be_written_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = TableFile(blocked / "gemm" / "GPU.json")
    store.save(table(choice(1)))
    assert "cannot be written" in caplog.text
    assert store.read() == {}
