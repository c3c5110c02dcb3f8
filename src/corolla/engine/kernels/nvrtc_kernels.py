"""CUDA C kernels compiled at run time with NVRTC and launched through the driver API (ctypes, no extension build,
no nvcc on the server: NVRTC ships with PyTorch's CUDA wheels). `NvrtcKernel(source, name, defines)` compiles
`source` for the current device's architecture (sm_XY, or sm_90a on compute capability 9.0) into a cubin once per
process and device, and `launch` puts it on PyTorch's current stream, so launches are captured by CUDA graphs like any
other kernel. Importing needs no GPU; compiling needs libnvrtc and libcuda (ctypes finds the ones PyTorch loaded)."""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import torch

# The CUDA helpers the quantized row GEMVs share (quant_int8_gemv, quant_tile_gemv), put before a kernel's own source:
# 16-byte loads of the weight stream and of x, bf16 x into fp16 for the matrix units, the output dtype's load and
# rounding (the kernel's -D OUT_BF16: bf16, else fp16)
CUDA_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

// 16 bytes of a stream read once (weight codes): read-only path, not kept in L1
static __device__ __forceinline__ __attribute__((unused)) U4 ld_stream(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16 read-only bytes every program reads (x)
static __device__ __forceinline__ __attribute__((unused)) U4 ld_nc(const U4* p) {
  U4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// a bf16 pair -> the fp16 pair of the values times 2^-8 (exact product, one rounding), the even value low: x as the
// matrix units' fp16 operand, in range (the sums times 2^8 afterwards, exact)
static __device__ __forceinline__ __attribute__((unused)) u32 bf16x2_to_f16x2(u32 v) {
  const float lo = __fmul_rn(__uint_as_float(v << 16), 0.00390625f);
  const float hi = __fmul_rn(__uint_as_float(v & 0xffff0000u), 0.00390625f);
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// a value of the output's dtype (a residual) -> fp32
static __device__ __forceinline__ __attribute__((unused)) float load_out_type(const u16* p) {
#if OUT_BF16
  return __uint_as_float(((u32)*p) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
  return f;
#endif
}

// fp32 -> the output's dtype, rounded to nearest even
static __device__ __forceinline__ __attribute__((unused)) u16 to_out_type(float v) {
  u16 h;
#if OUT_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}
"""

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def _lib(kind: str) -> ctypes.CDLL:
    """libcuda (the driver) or libnvrtc (of PyTorch's CUDA major version), loaded once."""
    if kind not in _LIBS:
        if kind == "cuda":
            _LIBS[kind] = ctypes.CDLL("libcuda.so.1")
        else:
            major = str(torch.version.cuda or "").split(".")[0]
            errors = []
            # by name (the loader's path, or the copy PyTorch loaded), else the one its nvidia-cuda-nvrtc wheel holds
            wheels = sorted(str(p) for d in sys.path for p in Path(d).glob(f"nvidia/*/lib/libnvrtc.so.{major}*"))
            for name in (f"libnvrtc.so.{major}", "libnvrtc.so", *wheels):
                try:
                    _LIBS[kind] = ctypes.CDLL(name)
                    break
                except OSError as e:
                    errors.append(str(e))
            else:
                raise RuntimeError(f"NVRTC not found: {'; '.join(errors)}")
    return _LIBS[kind]


def _check_cu(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _lib("cuda").cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({(name.value or b'?').decode()})")


def arch_option(device: torch.device) -> str:
    """NVRTC's --gpu-architecture for `device`: its own SASS (sm_90a on Hopper, for its arch-specific instructions)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"--gpu-architecture=sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def compile_cubin(source: str, name: str, options: list[str]) -> bytes:
    """`source` compiled by NVRTC with `options` -> the cubin; RuntimeError with NVRTC's log when it fails."""
    nvrtc = _lib("nvrtc")
    prog = ctypes.c_void_p()
    res = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
    if res:
        raise RuntimeError(f"nvrtcCreateProgram failed ({res})")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        res = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        if res:
            raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode(errors='replace')[:4000]}")
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if nvrtc.nvrtcGetCUBIN(prog, cubin):
            raise RuntimeError(f"nvrtcGetCUBIN failed for {name}")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _ensure_context(device: torch.device) -> None:
    # the driver calls act on the thread's current context: PyTorch's primary context of `device`
    torch.cuda.current_stream(device)  # (initializes the runtime, which makes the primary context current)
    ctx = ctypes.c_void_p()
    _check_cu(_lib("cuda").cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        torch.zeros(1, device=device)  # a runtime call binds the primary context to this thread
        torch.cuda.synchronize(device)


class NvrtcKernel:
    """One `extern "C" __global__` function of `source`, compiled with `-D` `defines` (name -> int) per device on
    first use. Arguments are passed as ctypes values (c_void_p for pointers, c_int, c_float, c_longlong)."""

    def __init__(self, source: str, name: str, defines: dict[str, int]) -> None:
        self.source = source
        self.name = name
        self.defines = dict(defines)
        self._functions: dict[int, ctypes.c_void_p] = {}
        self._modules: list[ctypes.c_void_p] = []  # kept loaded for the process's life
        self._shared_limit: dict[int, int] = {}

    def function(self, device: torch.device) -> ctypes.c_void_p:
        """The loaded function on `device` (compiled and loaded on the first call)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._functions.get(index)
        if fn is not None:
            return fn
        with _LOCK:
            if index not in self._functions:
                dev = torch.device("cuda", index)
                options = [arch_option(dev), "--std=c++17"]
                options += [f"-D{k}={v}" for k, v in self.defines.items()]
                cubin = compile_cubin(self.source, self.name, options)
                cuda = _lib("cuda")
                module, fn = ctypes.c_void_p(), ctypes.c_void_p()
                with torch.cuda.device(dev):  # into the primary context of `dev`
                    _ensure_context(dev)
                    _check_cu(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
                    name = self.name.encode()
                    _check_cu(cuda.cuModuleGetFunction(ctypes.byref(fn), module, name), "cuModuleGetFunction")
                self._modules.append(module)
                self._functions[index] = fn
                self._shared_limit[index] = 48 * 1024
        return self._functions[index]

    def blocks_per_sm(self, device: torch.device, threads: int, shared_bytes: int) -> int:
        """How many programs of `threads` threads and `shared_bytes` dynamic shared memory one multiprocessor holds."""
        fn = self.function(device)
        self._allow_shared(device, fn, shared_bytes)
        count = ctypes.c_int()
        _check_cu(
            _lib("cuda").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(count), fn, ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)
            ),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        return count.value

    def _allow_shared(self, device: torch.device, fn: ctypes.c_void_p, shared_bytes: int) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if shared_bytes > self._shared_limit[index]:
            _check_cu(
                _lib("cuda").cuFuncSetAttribute(
                    fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared_bytes)
                ),
                "cuFuncSetAttribute(max dynamic shared memory)",
            )
            self._shared_limit[index] = shared_bytes

    def launch(
        self, device: torch.device, grid: tuple[int, int, int], threads: int, shared_bytes: int, args: list
    ) -> None:
        """Launches on PyTorch's current stream of `device` (captured when that stream captures a graph)."""
        fn = self.function(device)
        self._allow_shared(device, fn, shared_bytes)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        _check_cu(
            _lib("cuda").cuLaunchKernel(
                fn, grid[0], grid[1], grid[2], threads, 1, 1, ctypes.c_uint(shared_bytes), stream, params, None
            ),
            f"cuLaunchKernel({self.name})",
        )
