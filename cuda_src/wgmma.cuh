// Hopper warpgroup MMA (wgmma) helpers shared by the sm_90a GEMM tiles (gemm_bf16act_sm90.cu,
// gemm_bf16act_tma.cu): shared-memory descriptors of 128B-swizzled K-major tiles, the fences and
// group waits, and the m64n128k16 bf16 MMA with f32 accumulators.
// WG_ENABLED is 1 only when compiling for sm_90a (wgmma exists nowhere else); elsewhere the
// helpers compile to nothing and the entries trap.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ENABLED 1
#else
#define WG_ENABLED 0
#endif

// byte offset of 16-byte chunk c (0..7) of row r in a 128-byte-row tile: the 128B swizzle
__device__ __forceinline__ int wg_at(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Shared-memory matrix descriptor of a K-major tile of ROW_BYTES-byte rows swizzled across
// them (128: chunk c of row r at c ^ (r & 7), the tile 1024-aligned; 64: at c ^ ((r >> 1) & 3),
// 512-aligned): 8-row groups 8 * ROW_BYTES apart.
template <int ROW_BYTES>
__device__ __forceinline__ unsigned long long wg_desc_rows(const unsigned char* smem) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "the 128B or 64B swizzle");
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    unsigned long long d = (unsigned long long)((addr & 0x3FFFF) >> 4);  // start address
    d |= 1ULL << 16;                                                     // leading offset (unused)
    d |= (unsigned long long)(8 * ROW_BYTES >> 4) << 32;                 // 8-row group stride
    d |= (ROW_BYTES == 128 ? 1ULL : 2ULL) << 62;                         // swizzle mode
    return d;
}
// the 128B-swizzled tiles of 64 bf16 a row; the 64B-swizzled ones of 32 (tiled weights)
__device__ __forceinline__ unsigned long long wg_desc(const unsigned char* smem) {
    return wg_desc_rows<128>(smem);
}
__device__ __forceinline__ unsigned long long wg_desc_64b(const unsigned char* smem) {
    return wg_desc_rows<64>(smem);
}

__device__ __forceinline__ void wg_fence() {
#if WG_ENABLED
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if WG_ENABLED
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed MMA groups are still in flight.
template <int N>
__device__ __forceinline__ void wg_wait() {
#if WG_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void wg_wait_all() { wg_wait<0>(); }
// The accumulators as operands of an empty asm: the compiler may not move their reads or
// writes across it (wgmma writes them asynchronously, behind its wait).
template <int R>
__device__ __forceinline__ void wg_fence_operands(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A warpgroup gives back registers (dec) or takes them (inc) to N a thread: every thread of
// the warpgroup executes it (warp-specialised tiles: the producer's few for the consumers'
// accumulators; N a multiple of 8 in [24, 256], the block's total within the launch's)
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_dec() {
#if WG_ENABLED
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_inc() {
#if WG_ENABLED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void fence_proxy_async() {
#if WG_ENABLED
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d (64 f32 of this thread) += A (64 x 16, descriptor a) . B (128 x 16, descriptor b)^T
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long a,
                                                 unsigned long long b) {
#if WG_ENABLED
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.eq.u32 p, 1, 1;\n"  // scale-d: D += A . B
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b));
#else
    (void)d;
    (void)a;
    (void)b;
#endif
}
