"""cuda-python's driver and NVRTC modules, whichever release is installed, and the one error check."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from forge_service.errors import CudaError, DeviceUnavailable

INSTALL_HINT = "pip install 'forge[cuda]' (cuda-python and NVRTC)"


def bindings() -> tuple[ModuleType, ModuleType]:
    """(driver, nvrtc); raises DeviceUnavailable when cuda-python is not installed."""
    try:
        from cuda.bindings import driver, nvrtc  # cuda-python >= 12.6 (cuda-bindings)
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
            from cuda import nvrtc
        except ImportError as e:
            raise DeviceUnavailable(f"the CUDA backend needs cuda-python: {INSTALL_HINT}") from e
    return driver, nvrtc


def check(result: Any, call: str) -> Any:
    """cuda-python returns (status, *values): raise CudaError naming `call` unless the status is
    success; return the single value, a tuple of several, or None."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaError(f"{call} failed: {describe(status)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def describe(status: Any) -> str:
    """The enum name of a CUresult / nvrtcResult, with the driver's explanation when it has one."""
    name = getattr(status, "name", str(status))
    driver, _ = bindings()
    if isinstance(status, driver.CUresult):
        try:
            err, text = driver.cuGetErrorString(status)
        except RuntimeError:  # no driver library to ask (the failed call was not a driver call)
            return name
        if int(err) == 0 and text:
            return f"{name} ({text.decode() if isinstance(text, bytes) else text})"
    return name
