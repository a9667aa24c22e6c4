"""Run-time compilation of native/*.cu with NVRTC, cached on disk by (source, architecture, options).

Kernels are C++ templates; a `Program` names the instantiations it needs as NVRTC name
expressions, and the compiled module maps each expression to its mangled symbol. Compiling
needs no GPU, which is what lets CI check that every source compiles.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forge_service.backends.cuda.driver import bindings, check
from forge_service.errors import CudaError, DeviceUnavailable

log = logging.getLogger("forge.cuda.nvrtc")

NATIVE_DIR = Path(__file__).resolve().parents[3] / "native"
CACHE_DIR = Path.home() / ".cache" / "forge" / "nvrtc"
DEFAULT_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")
# Headers the kernels include; a directory qualifies only when it holds all of them.
REQUIRED_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "crt/mma.h")
SYSTEM_INCLUDE_DIRS = (Path("/usr/local/cuda/include"), Path("/opt/cuda/include"))


@dataclass(frozen=True)
class Program:
    """One native source and the template instantiations to compile from it, for one GPU."""

    source: str  # file name under native/, e.g. "norm.cu"
    arch: str  # "sm_90" (a cubin) or "compute_90" (PTX, for GPUs newer than this NVRTC)
    names: tuple[str, ...]  # name expressions, e.g. "forge::rms_norm_kernel<float, __half, 256>"
    options: tuple[str, ...] = DEFAULT_OPTIONS


@dataclass(frozen=True)
class Module:
    """Compiled code (cubin, or PTX for compute_XX) and the mangled symbol of each name expression."""

    image: bytes
    symbols: dict[str, str]


class Compiler:
    """Compiles Programs with NVRTC; results are cached in memory and on disk."""

    def __init__(self, cache_dir: Path | None = CACHE_DIR, native_dir: Path = NATIVE_DIR) -> None:
        self.cache_dir = cache_dir
        self.native_dir = native_dir
        self._memory: dict[str, Module] = {}

    def key(self, program: Program) -> str:
        """Hash of everything that changes the output: the source and the shared headers, the
        architecture, the options, the instantiations and the NVRTC version."""
        headers = {p.name: p.read_text() for p in sorted(self.native_dir.glob("*.cuh"))}
        payload = {
            "source": self._read(program.source), "headers": headers, "arch": program.arch,
            "options": list(program.options), "names": list(program.names), "nvrtc": nvrtc_version(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def compile(self, program: Program) -> Module:
        key = self.key(program)
        module = self._memory.get(key) or self._load(key)
        if module is None:
            module = self._compile(program)
            self._store(key, module)
        self._memory[key] = module
        return module

    def _read(self, source: str) -> str:
        path = self.native_dir / source
        if not path.is_file():
            raise CudaError(f"no kernel source {path}")
        return path.read_text()

    def _compile(self, program: Program) -> Module:
        _, nvrtc = bindings()
        prog = check(nvrtc.nvrtcCreateProgram(self._read(program.source).encode(), program.source.encode(),
                                              0, [], []), "nvrtcCreateProgram")
        try:
            for name in program.names:
                check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), f"nvrtcAddNameExpression({name})")
            options = [*program.options, f"--gpu-architecture={program.arch}", f"-I{self.native_dir}",
                       *(f"-I{d}" for d in cuda_include_dirs())]
            status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
            if int(status) != 0:
                raise CudaError(f"NVRTC could not compile native/{program.source} for {program.arch}:\n"
                                f"{_log(nvrtc, prog)}")
            image = _image(nvrtc, prog, ptx=program.arch.startswith("compute_"))
            symbols = {name: _lowered(nvrtc, prog, name) for name in program.names}
        finally:
            check(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")
        return Module(image, symbols)

    def _paths(self, key: str) -> tuple[Path, Path]:
        assert self.cache_dir is not None
        return self.cache_dir / f"{key}.bin", self.cache_dir / f"{key}.json"

    def _load(self, key: str) -> Module | None:
        if self.cache_dir is None:
            return None
        image_path, symbols_path = self._paths(key)
        try:
            return Module(image_path.read_bytes(), json.loads(symbols_path.read_text()))
        except (OSError, ValueError):
            return None  # absent or half-written: compile again

    def _store(self, key: str, module: Module) -> None:
        if self.cache_dir is None:
            return
        image_path, symbols_path = self._paths(key)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(image_path, module.image)
            write_atomically(symbols_path, json.dumps(module.symbols).encode())
        except OSError as e:  # a cache: the module is compiled again next start
            log.warning("the compiled kernel cannot be cached in %s (%s)", self.cache_dir, e)


def nvrtc_version() -> tuple[int, int]:
    _, nvrtc = bindings()
    return check(nvrtc.nvrtcVersion(), "nvrtcVersion")


def supported_archs() -> list[int]:
    """Compute capabilities NVRTC can emit cubins for, e.g. [75, 80, ..., 90, 100]."""
    _, nvrtc = bindings()
    n = check(nvrtc.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
    return list(check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))[:n]


def target_arch(capability: tuple[int, int]) -> str:
    """sm_XY for a GPU this NVRTC knows; else PTX for the newest architecture it knows, which
    the driver compiles for the newer GPU."""
    cc = capability[0] * 10 + capability[1]
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}"
    older = [a for a in archs if a < cc]
    if not older:
        raise DeviceUnavailable(f"NVRTC {nvrtc_version()} cannot compile for compute capability {cc / 10:.1f}")
    return f"compute_{max(older)}"


def cuda_include_dirs() -> list[Path]:
    """The CUDA header directory for NVRTC: from the installed NVIDIA wheels (via
    cuda-pathfinder, else found under the `nvidia` namespace package) or a system CUDA."""
    for candidate in _header_candidates():
        if all((candidate / h).is_file() for h in REQUIRED_HEADERS):
            return [candidate]
    raise DeviceUnavailable(
        f"no CUDA headers ({', '.join(REQUIRED_HEADERS)}) found for NVRTC: "
        "pip install nvidia-cuda-runtime nvidia-cuda-crt, or install the CUDA toolkit")


def _header_candidates() -> list[Path]:
    found: list[Path] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        cudart = find_nvidia_header_directory("cudart")
        if cudart:
            found.append(Path(cudart))
    except (ImportError, RuntimeError):
        pass
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(p.parent for p in Path(root).glob("*/include/cuda_fp16.h"))
    return found + list(SYSTEM_INCLUDE_DIRS)


def _log(nvrtc, prog) -> str:
    size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = b" " * size
    check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\0 ").decode(errors="replace")


def _image(nvrtc, prog, ptx: bool) -> bytes:
    if ptx:
        get_size, get = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
    else:
        get_size, get = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
    size = check(get_size(prog), get_size.__name__)
    buf = b" " * size
    check(get(prog, buf), get.__name__)
    return buf


def _lowered(nvrtc, prog, name: str) -> str:
    symbol = check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), f"nvrtcGetLoweredName({name})")
    return symbol.decode() if isinstance(symbol, bytes) else str(symbol)


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file of its own, renamed over it: a reader sees the
    old file or the new, and processes writing the same path at once never take each other's file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
