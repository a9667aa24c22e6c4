"""The CUDA backend: NVRTC-compiled kernels from native/ launched with cuda-python on torch's
stream, CUTLASS/cuBLAS GEMMs chosen per shape, and CUDA graphs for decode steps.

Importing this package needs neither cuda-python nor a GPU; constructing `CudaBackend` needs both.
"""
