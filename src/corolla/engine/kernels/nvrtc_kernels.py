"""CUDA C kernels compiled at run time with NVRTC and launched through the driver API (ctypes, no extension build,
no nvcc on the server: NVRTC ships with PyTorch's CUDA wheels). `NvrtcKernel(source, name, defines)` compiles
`source` for the current device's architecture (sm_XY, or sm_90a on compute capability 9.0) into a cubin once per
process and device, and `launch` puts it on PyTorch's current stream, so launches are captured by CUDA graphs like any
other kernel. Importing needs no GPU; compiling needs libnvrtc and libcuda (ctypes finds the ones PyTorch loaded).

Programmatic dependent launch (sm_90+): every launch allows the kernel's programs to start before the kernel ahead
of it in the stream has finished (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; kept as a programmatic edge
in a captured CUDA graph), once that kernel's programs have all released their dependents or ended. So each source
calls CUDA_HELPERS' `grid_release()` first (the next kernel may start: its programs wait before they read what this
one writes) and `grid_wait()` (the kernel ahead complete, its writes visible) before it reads anything another kernel
wrote or writes anything, in every program; before the wait only immutable inputs (weights, tables) are read. A
row GEMV's first weight loads and its setup then overlap the tail of the kernel ahead (docs/decisions/0047).
NvrtcKernel refuses a source without both calls. On older cards both are no-ops and launches are plain."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from pathlib import Path

import torch

# The CUDA helpers the quantized row GEMVs share (quant_int8_gemv, quant_tile_gemv), put before a kernel's own source:
# the programmatic launch's release and wait (every NVRTC kernel calls both, see above), 16-byte loads of the weight
# stream and of x, 4- and 16-byte copies into shared memory (cp.async), bf16 x into fp16 for the matrix units, RMSNorm's
# pairs (x's dtype: the kernel's -D X_BF16), x's staging in shared memory with the RMSNorm prologue (-D PRO: 1
# RMSNorm), the output dtype's loads (a residual) and rounding (-D OUT_BF16: bf16, else fp16), and the volatile
# loads of what the kernels ahead wrote (after grid_wait)
CUDA_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

// programmatic dependent launch: the next kernel in the stream may start its programs now (it waits before reading)
static __device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// programmatic dependent launch: wait until the kernel ahead has completed and its writes are visible (a no-op when
// it already had or the launch was plain)
static __device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// 16 bytes of a stream read once (weight codes): read-only path, not kept in L1
static __device__ __forceinline__ __attribute__((unused)) U4 ld_stream(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// ld_stream, the L2 fetching the 256 bytes around the 16 from DRAM: the INT8 row GEMV, whose other warps read the
// rest of those bytes next (2-4% faster on every Llama-3-8B projection of an H200; the NF4 tile GEMV no faster with
// it: docs/decisions/0069)
static __device__ __forceinline__ __attribute__((unused)) U4 ld_stream_256(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 4 bytes from global to shared memory without a register (cp.async; copy_async_wait completes this thread's): an
// immutable input read before grid_wait, used at the program's end (the INT8 row GEMV's row scales: docs/decisions/0055)
static __device__ __forceinline__ __attribute__((unused)) void copy_async4(float* dst, const float* src) {
  unsigned d;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

// 16 bytes of a weight stream from global to shared memory without a register (cp.async.cg: not kept in L1), the L2
// fetching the 256 bytes around them as ld_stream_256 does: a row GEMV's first chunks issued before grid_wait, where
// ptxas keeps them (it moved ld_stream_256 loads written there below the wait: docs/decisions/0114)
static __device__ __forceinline__ __attribute__((unused)) void copy_async16_256(U4* dst, const U4* src) {
  unsigned d;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

static __device__ __forceinline__ __attribute__((unused)) void copy_async_wait() {
  asm volatile("cp.async.wait_all;" ::: "memory");
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

// a value of the output's dtype that the kernel ahead wrote (a residual) -> fp32, read where it stands: a volatile
// load, kept after grid_wait() (a plain load through a const __restrict__ pointer was hoisted above the wait)
static __device__ __forceinline__ __attribute__((unused)) float load_written_out_type(const u16* p) {
  u16 h;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(h) : "l"(p) : "memory");
  return load_out_type(&h);
}

// an int64 the kernels ahead wrote (the routed experts' ids), read where it stands: a volatile load, kept after
// grid_wait() (ptxas moved a plain load through a const __restrict__ pointer above the wait)
static __device__ __forceinline__ __attribute__((unused)) long long load_written_i64(const long long* p) {
  long long v;
  asm volatile("ld.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// a pair of x's dtype (the kernel's -D X_BF16: bf16, else fp16) -> fp32 (the even value in .x)
static __device__ __forceinline__ __attribute__((unused)) float2 unpack_pair(u32 v) {
#if X_BF16
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
#else
  float lo, hi;
  asm("{.reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}" : "=f"(lo), "=f"(hi) : "r"(v));
  return make_float2(lo, hi);
#endif
}

// two fp32 values -> a pair of x's dtype, each rounded to nearest even (lo the even value)
static __device__ __forceinline__ __attribute__((unused)) u32 pack_pair(float lo, float hi) {
  u32 d;
#if X_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// RMSNorm's sum of squares over a pair of x's dtype, each square added in order
static __device__ __forceinline__ __attribute__((unused)) float sum_squares(float s, u32 v) {
  const float2 f = unpack_pair(v);
  return __fmaf_rn(f.y, f.y, __fmaf_rn(f.x, f.x, s));
}

// RMSNorm of a pair as triton_kernels.rms_norm rounds it: x times 1/rms rounded to the dtype, times the gain,
// rounded again
static __device__ __forceinline__ __attribute__((unused)) u32 norm_pair(u32 v, u32 w, float rstd) {
  const float2 f = unpack_pair(v), gw = unpack_pair(w);
  const float2 a = unpack_pair(pack_pair(__fmul_rn(f.x, rstd), __fmul_rn(f.y, rstd)));
  return pack_pair(__fmul_rn(a.x, gw.x), __fmul_rn(a.y, gw.y));
}

// a pair of x's dtype -> the matrix units' fp16 operand pair (bf16: times 2^-8, one rounding; fp16: as it is)
static __device__ __forceinline__ __attribute__((unused)) u32 x_operand(u32 v) {
#if X_BF16
  return bf16x2_to_f16x2(v);
#else
  return v;
#endif
}

// x's row `xg` (K values: K / 8 16-byte words) staged into shared memory `xs` as the matrix units' fp16 operand
// pairs, zeros from word K / 8 to `words` (whole units). PRO 1, RMSNorm with the gain `gain` first, rounded as
// triton_kernels.rms_norm rounds it: x and the gain (into `gs`, K / 8 words) staged as they are while x's squares are
// summed (each thread its words in order, the warp's lanes by a fixed butterfly, the warps in order through `red`
// [NT / 32]: every program forms the same 1/rms), then x normalized in place (each thread the words it stored)
// and converted as a plain x. Called by all NT threads of the program; the caller's barrier comes before xs is read.
// BATCH > 1: a thread's words loaded BATCH at a time before any is converted or stored (one L2 round trip per
// BATCH x NT words; one at a time, each word's load waits for the previous word's store: 4 round trips at the NF4
// tile GEMV's K = 14336 with 512 threads). BATCH 1 keeps the one-word loop: the batched one, even with one word a
// thread, changes how ptxas compiles the NF4 tile GEMV's main loop (0.1-0.3 us slower at K = 4096 on an H200,
// docs/decisions/0112). The same values and sums either way.
template <int NT, int BATCH = 1>
static __device__ __forceinline__ __attribute__((unused)) void stage_x(U4* xs, const U4* xg, int K, int words,
                                                                       const U4* gain, U4* gs, float* red,
                                                                       float eps) {
  const int tid = threadIdx.x;
#if PRO == 1
  float ss = 0.f;
  if (BATCH == 1) {
    for (int i = tid; i < words; i += NT) {
      U4 v = {0u, 0u, 0u, 0u};
      if (i < (K >> 3)) {
        v = ld_nc(xg + i);
        gs[i] = ld_nc(gain + i);
        ss = sum_squares(ss, v.x); ss = sum_squares(ss, v.y); ss = sum_squares(ss, v.z); ss = sum_squares(ss, v.w);
      }
      xs[i] = v;
    }
  } else {
    for (int i0 = tid; i0 < words; i0 += BATCH * NT) {
      U4 v[BATCH], w[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int i = i0 + j * NT;
        v[j] = U4{0u, 0u, 0u, 0u};
        if (i < (K >> 3)) {
          v[j] = ld_nc(xg + i);
          w[j] = ld_nc(gain + i);
        }
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {  // (in word order: the thread's sum as one word at a time forms it)
        const int i = i0 + j * NT;
        if (i < (K >> 3)) {
          gs[i] = w[j];
          ss = sum_squares(ss, v[j].x); ss = sum_squares(ss, v[j].y);
          ss = sum_squares(ss, v[j].z); ss = sum_squares(ss, v[j].w);
        }
        if (i < words) xs[i] = v[j];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  __syncthreads();
  ss = red[0];
  for (int w = 1; w < NT / 32; ++w) ss += red[w];
  const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
  for (int i = tid; i < (K >> 3); i += NT) {  // (the words this thread stored)
    U4 v = xs[i];
    const U4 w = gs[i];
    v.x = x_operand(norm_pair(v.x, w.x, rstd)); v.y = x_operand(norm_pair(v.y, w.y, rstd));
    v.z = x_operand(norm_pair(v.z, w.z, rstd)); v.w = x_operand(norm_pair(v.w, w.w, rstd));
    xs[i] = v;
  }
#else
  if (BATCH == 1) {
    for (int i = tid; i < words; i += NT) {
      U4 v = {0u, 0u, 0u, 0u};
      if (i < (K >> 3)) {
        v = ld_nc(xg + i);
        v.x = x_operand(v.x); v.y = x_operand(v.y); v.z = x_operand(v.z); v.w = x_operand(v.w);
      }
      xs[i] = v;
    }
  } else {
    for (int i0 = tid; i0 < words; i0 += BATCH * NT) {
      U4 v[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int i = i0 + j * NT;
        v[j] = U4{0u, 0u, 0u, 0u};
        if (i < (K >> 3)) v[j] = ld_nc(xg + i);
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int i = i0 + j * NT;
        if (i < (K >> 3)) {
          v[j].x = x_operand(v[j].x); v[j].y = x_operand(v[j].y);
          v[j].z = x_operand(v[j].z); v[j].w = x_operand(v[j].w);
        }
        if (i < words) xs[i] = v[j];
      }
    }
  }
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

// fp32 -> the output's dtype -> fp32 (a value as a GEMV stores it)
static __device__ __forceinline__ __attribute__((unused)) float rounded(float v) {
  const u16 h = to_out_type(v);
  return load_out_type(&h);
}

// silu(gate) * up as triton_kernels.silu_mul forms it from the stored gate and up (fp32, exp by ex2.approx, the
// quotient by div.full): the gated GEMVs' output before its rounding
static __device__ __forceinline__ __attribute__((unused)) float silu_times(float gt, float up) {
  float e, q;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(-gt, 1.44269504088896341f)));
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(gt), "f"(__fadd_rn(1.f, e)));
  return __fmul_rn(q, up);
}
"""


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id (an enum), padding to 8 bytes, a 64-byte value union (8-byte aligned)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("pad_value", ctypes.c_int),
                ("rest", ctypes.c_longlong * 7)]  # fmt: skip


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]  # fmt: skip


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


def nvrtc_library() -> ctypes.CDLL:
    """libnvrtc, loaded once (RuntimeError "NVRTC not found" where there is none): compiling needs no GPU."""
    return _lib("nvrtc")


def _check_cu(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _lib("cuda").cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({(name.value or b'?').decode()})")


def arch_option(device: torch.device) -> str:
    """NVRTC's --gpu-architecture for `device`: its own SASS (sm_90a on Hopper, for its arch-specific instructions)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"--gpu-architecture=sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def programmatic_launches(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents of the kernel ahead (CUDA sm_90+: its programs
    may start once the kernel ahead's have all released them; each waits before it reads that one's output). The
    NVRTC GEMVs and the decode step's RoPE and paged attention (triton_kernels) launch so where it holds."""
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def compile_cubin(source: str, name: str, options: list[str]) -> tuple[bytes, str]:
    """`source` compiled by NVRTC with `options` -> (the cubin, NVRTC's log: ptxas's resource report with
    `--ptxas-options=-v`); RuntimeError with the log when it fails. Needs no GPU (libnvrtc only)."""
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
        return cubin.raw, log.value.decode(errors="replace")
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


def launch_config(
    grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int, programmatic: bool
) -> tuple[_LaunchConfig, _LaunchAttribute]:
    """cuLaunchKernelEx's config (and the attribute it points to, to be kept alive with it): `programmatic`, the
    programmatic stream serialization attribute (the kernel may start before the one ahead of it ends)."""
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(
        grid[0], grid[1], grid[2], threads, 1, 1, shared_bytes, ctypes.c_void_p(stream),
        ctypes.pointer(attr), int(programmatic),
    )  # fmt: skip
    return config, attr


class NvrtcKernel:
    """One `extern "C" __global__` function of `source`, compiled with `-D` `defines` (name -> int) per device on
    first use. Arguments are passed as ctypes values (c_void_p for pointers, c_int, c_float, c_longlong). ValueError
    for a source that does not call both `grid_release()` and `grid_wait()` (every launch is programmatic)."""

    def __init__(self, source: str, name: str, defines: dict[str, int]) -> None:
        for call in ("grid_release();", "grid_wait();"):
            if call not in source:
                raise ValueError(f"{name}: an NVRTC kernel's source must call {call} (programmatic launch)")
        self.source = source
        self.name = name
        self.defines = dict(defines)
        self._functions: dict[int, ctypes.c_void_p] = {}
        self._modules: list[ctypes.c_void_p] = []  # kept loaded for the process's life
        self._shared_limit: dict[int, int] = {}  # device index -> the dynamic shared bytes a launch may take now
        self._shared_max: dict[int, int] = {}  # device index -> the most a program may opt in to (sm_90: 227 KiB)

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
                cubin, _ = compile_cubin(self.source, self.name, options)
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
                props = torch.cuda.get_device_properties(dev)
                self._shared_max[index] = props.shared_memory_per_block_optin  # type: ignore[attr-defined]  # (stubs)
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
        """Lets `fn` take `shared_bytes` of dynamic shared memory a program; ValueError (before any CUDA call, so
        nothing is left failed on the context and a tuner skips the config) past what the device allows."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if shared_bytes > self._shared_max[index]:
            raise ValueError(
                f"{self.name} {self.defines}: {shared_bytes} bytes of shared memory a program, more than the "
                f"{self._shared_max[index]} this device allows"
            )
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
        """Launches on PyTorch's current stream of `device` (captured when that stream captures a graph), as a
        programmatic dependent launch on sm_90+."""
        fn = self.function(device)
        self._allow_shared(device, fn, shared_bytes)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = torch.cuda.current_stream(device).cuda_stream
        config, _attr = launch_config(grid, threads, shared_bytes, stream, programmatic_launches(device))
        _check_cu(
            _lib("cuda").cuLaunchKernelEx(ctypes.byref(config), fn, params, None), f"cuLaunchKernelEx({self.name})"
        )
