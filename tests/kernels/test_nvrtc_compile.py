"""CI, no GPU: every native/*.cu compiles with NVRTC for sm_80 and sm_90, and the compile cache
is keyed by source, architecture, options and instantiations. NVRTC needs no GPU; cuda-python,
NVRTC and the CUDA headers come from the `dev` extra."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from forge_service.backends.cuda.kernels import WRAPPERS, ci_programs
from forge_service.backends.cuda.nvrtc import NATIVE_DIR, Compiler, Program
from forge_service.errors import CudaError

ARCHS = ["sm_80", "sm_90"]
SOURCES = sorted(p.name for p in NATIVE_DIR.glob("*.cu"))
ELF_MAGIC = b"\x7fELF"  # a cubin is an ELF image


def test_every_source_has_one_wrapper():
    assert SOURCES, f"no kernel sources in {NATIVE_DIR}"
    assert sorted(w.SOURCE for w in WRAPPERS) == SOURCES


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles(source: str, arch: str, tmp_path: Path):
    program = next(p for p in ci_programs(arch) if p.source == source)
    module = Compiler(cache_dir=tmp_path).compile(program)
    assert module.image.startswith(ELF_MAGIC)
    assert set(module.symbols) == set(program.names)
    assert all(symbol.startswith("_Z") for symbol in module.symbols.values())  # mangled template instances


@pytest.fixture
def native_copy(tmp_path: Path) -> Path:
    native = tmp_path / "native"
    shutil.copytree(NATIVE_DIR, native)
    return native


def small_program(arch: str = "sm_90") -> Program:
    return Program("cache.cu", arch, ("forge::write_kv_kernel<float, 128>",))


def test_cache_key_follows_source_arch_options_and_names(native_copy: Path, tmp_path: Path):
    compiler = Compiler(cache_dir=tmp_path / "cache", native_dir=native_copy)
    program = small_program()
    key = compiler.key(program)
    assert compiler.key(program) == key
    assert compiler.key(replace(program, arch="sm_80")) != key
    assert compiler.key(replace(program, options=(*program.options, "-DFORGE_TEST=1"))) != key
    assert compiler.key(replace(program, names=("forge::write_kv_kernel<__half, 128>",))) != key
    source = native_copy / "cache.cu"
    source.write_text(source.read_text() + "\n// edited\n")
    assert compiler.key(program) != key
    header = native_copy / "common.cuh"
    edited_source_key = compiler.key(program)
    header.write_text(header.read_text() + "\n// edited\n")
    assert compiler.key(program) != edited_source_key


def test_compiled_module_is_reused_from_disk(native_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    first = Compiler(cache_dir=cache, native_dir=native_copy).compile(small_program())
    assert len(list(cache.glob("*.bin"))) == 1

    def no_nvrtc(self, program):
        raise AssertionError("compiled again despite the disk cache")

    monkeypatch.setattr(Compiler, "_compile", no_nvrtc)
    again = Compiler(cache_dir=cache, native_dir=native_copy).compile(small_program())
    assert again == first


def test_a_broken_source_fails_with_the_compiler_log(native_copy: Path, tmp_path: Path):
    source = native_copy / "cache.cu"
    source.write_text(source.read_text().replace("if (slot < 0) return;", "if (slot < 0) return"))
    with pytest.raises(CudaError, match=r"cache\.cu.*sm_90(.|\n)*error"):
        Compiler(cache_dir=tmp_path / "cache", native_dir=native_copy).compile(small_program())
    assert not list(tmp_path.rglob("*.bin"))  # nothing cached for a failed compile


def test_an_unknown_instantiation_fails(native_copy: Path, tmp_path: Path):
    program = Program("norm.cu", "sm_90", ("forge::rms_norm_kernel<float, double, 256>",))
    with pytest.raises(CudaError, match="norm.cu"):
        Compiler(cache_dir=None, native_dir=native_copy).compile(program)


def test_a_cache_that_cannot_be_written_leaves_the_compiled_module_usable(native_copy: Path, tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the cache directory would have to be made inside a file
    module = Compiler(cache_dir=blocked / "cache", native_dir=native_copy).compile(small_program())
    assert module.image.startswith(ELF_MAGIC)
    assert "cannot be cached" in caplog.text
