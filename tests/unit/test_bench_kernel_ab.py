"""bench/kernel_ab.py's builds: the native sources as they stand at a git revision or on disk."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.kernel_ab import ROOT, sources_at
from forge_service.backends import cpu_build


def _git_show(revision: str, path: Path) -> str:
    return subprocess.run(["git", "show", f"{revision}:{path.relative_to(ROOT)}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_a_revision_s_sources_are_its_native_files_and_the_worktree_s_those_on_disk(tmp_path: Path) -> None:
    at_head = sources_at("HEAD", tmp_path / "head")
    on_disk = sources_at("worktree", tmp_path / "disk")
    assert [p.relative_to(tmp_path / "disk") for p in on_disk] == [p.relative_to(ROOT) for p in cpu_build.SOURCES]
    assert [p.read_text() for p in on_disk] == [p.read_text() for p in cpu_build.SOURCES]
    # with the headers the sources include, beside them
    assert sorted(p.relative_to(tmp_path / "disk") for p in (tmp_path / "disk" / "native" / "cpu").glob("*.h")) \
        == [p.relative_to(ROOT) for p in cpu_build.headers()]
    committed = subprocess.run(["git", "ls-tree", "--name-only", "HEAD", "native/cpu/"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
    assert [str(p.relative_to(tmp_path / "head")) for p in at_head] == sorted(p for p in committed if p.endswith(".c"))
    written = sorted((tmp_path / "head" / "native" / "cpu").iterdir())
    assert [str(p.relative_to(tmp_path / "head")) for p in written] == sorted(
        p for p in committed if p.endswith((".c", ".h")))
    assert [p.read_text() for p in written] == [_git_show("HEAD", ROOT / p.relative_to(tmp_path / "head"))
                                                for p in written]
    with pytest.raises(subprocess.CalledProcessError):
        sources_at("no-such-revision", tmp_path / "none")
