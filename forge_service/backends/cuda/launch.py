"""Loading compiled kernels through the CUDA driver API and launching them on torch's stream.

Arguments are packed as ctypes values; tensors are passed by device pointer, so every wrapper
checks device, dtype, shape and alignment before it launches (a kernel cannot).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from forge_service.backends.cuda.driver import bindings, check
from forge_service.backends.cuda.nvrtc import Compiler, Program, target_arch
from forge_service.errors import CudaError, InvalidArgument

# C++ spelling of each dtype in name expressions.
CXX_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
DEFAULT_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def i32(v: int) -> ctypes.c_int:
    return ctypes.c_int(v)


def i64(v: int) -> ctypes.c_longlong:
    return ctypes.c_longlong(v)


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(v)


Arg = ctypes.c_void_p | ctypes.c_int | ctypes.c_longlong | ctypes.c_float


@dataclass
class Kernel:
    """One loaded kernel function."""

    name: str
    function: object  # CUfunction
    smem_opt_in: int = DEFAULT_SMEM_LIMIT

    def __call__(self, grid: Sequence[int], block: int, args: Sequence[Arg], smem: int = 0) -> None:
        driver, _ = bindings()
        if smem > self.smem_opt_in:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(self.function, attr, smem), f"cuFuncSetAttribute({self.name})")
            self.smem_opt_in = smem
        gx, gy, gz = (*grid, 1, 1)[:3]
        if gx == 0 or gy == 0 or gz == 0:
            return
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        check(driver.cuLaunchKernel(self.function, gx, gy, gz, block, 1, 1, smem, stream,
                                    ctypes.addressof(params), 0), f"launching {self.name}")


class Kernels:
    """Compiles (through the disk cache) and loads each kernel on first use, for one GPU."""

    def __init__(self, device: torch.device, compiler: Compiler | None = None) -> None:
        self.device = device
        self.compiler = compiler or Compiler()
        self.arch = target_arch(torch.cuda.get_device_capability(device))
        self._loaded: dict[tuple[str, str], Kernel] = {}
        self._modules: list[object] = []  # kept alive: unloading one frees its functions

    def get(self, source: str, name: str) -> Kernel:
        kernel = self._loaded.get((source, name))
        if kernel is None:
            kernel = self._load(source, name)
            self._loaded[(source, name)] = kernel
        return kernel

    def _load(self, source: str, name: str) -> Kernel:
        driver, _ = bindings()
        module = self.compiler.compile(Program(source, self.arch, (name,)))
        _ensure_context(self.device)
        handle = check(driver.cuModuleLoadData(module.image), f"cuModuleLoadData(native/{source})")
        self._modules.append(handle)
        function = check(driver.cuModuleGetFunction(handle, module.symbols[name].encode()),
                         f"cuModuleGetFunction({name})")
        return Kernel(name, function)


def _ensure_context(device: torch.device) -> None:
    """Make torch's primary context current on this thread (the driver API needs one)."""
    driver, _ = bindings()
    torch.cuda.init()
    if int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = check(driver.cuDeviceGet(index), "cuDeviceGet")
    context = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


# ---- argument checks shared by the wrappers -------------------------------------------------

def require(condition: bool, message: str) -> None:
    """Wrappers raise InvalidArgument for tensors a kernel cannot take (a caller's mistake)."""
    if not condition:
        raise InvalidArgument(message)


def check_tensor(t: torch.Tensor, name: str, dtypes: Sequence[torch.dtype], dim: int,
                 aligned: bool = True) -> None:
    """On a CUDA device, of one of `dtypes`, `dim`-dimensional, innermost stride 1, and (with
    `aligned`) its pointer and outer strides in whole 16-byte units, as vectorised access needs."""
    require(t.is_cuda, f"{name} must be a CUDA tensor, got one on {t.device}")
    require(t.dtype in dtypes, f"{name} must be one of {list(dtypes)}, got {t.dtype}")
    require(t.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    require(t.numel() == 0 or t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    if aligned:
        unit = 16 // t.element_size()
        require(t.data_ptr() % 16 == 0, f"{name} must start on a 16-byte boundary")
        require(all(s % unit == 0 for s in t.stride()[:-1]), f"{name}'s strides must be multiples of {unit}")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    """The paged K/V caches of one layer: contiguous [slots, Hkv, hd] of `dtype`, alike."""
    for cache, label in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        check_tensor(cache, label, (dtype,), 3)
        require(cache.is_contiguous() and cache.shape == k_cache.shape,
                f"{label} must be contiguous and shaped like k_cache {tuple(k_cache.shape)}")


def cxx(dtype: torch.dtype) -> str:
    if dtype not in CXX_TYPES:
        raise CudaError(f"no kernel instantiation for {dtype}")
    return CXX_TYPES[dtype]
