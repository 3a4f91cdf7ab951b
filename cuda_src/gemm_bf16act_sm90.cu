// gemm_bf16act_sm90: gemm_bf16act's contract (pydflash/ops/gemm_bf16act.py: Y = round_bf16(X)
// . W^T, K-split partials or the silu_mul epilogue) on Hopper's warpgroup MMA (wgmma), which
// reads both operands from shared memory: no ldmatrix traffic and no fragment registers, the
// limit of the mma.sync tiles (gemm_bf16act.cu) at 64..1024 rows.
//
// Compiled for sm_90a only (pydflash.kernels: Family(arch_specific=True); wgmma does not exist
// on other targets, where the entries trap and pydflash never launches them).
//
// A block: 2 warpgroups (256 threads) own 128 rows of X (64 each) by 128 rows of W; K in 64-wide
// tiles (128-byte shared rows) through a WG_STAGES-deep cp.async ring. The tiles are stored in
// the canonical 128-byte-swizzled K-major layout (16-byte chunk c of row r at chunk c ^ (r & 7),
// each tile 1024-byte aligned), described to wgmma by a shared-memory descriptor (start >> 4,
// stride between 8-row groups 1024 bytes, swizzle mode 128B); the k-step s of a tile starts 32 *
// s bytes in. Per tile each warpgroup issues four wgmma.m64n128k16 (f32 += bf16 . bf16) and
// waits for them before the barrier that lets the ring overwrite the stage. cp.async lands in
// the generic proxy and wgmma reads through the async proxy: each thread fences
// (fence.proxy.async) after its copies land, before the barrier.
// Accumulators: warp w of a warpgroup holds its rows 16w.., as the mma.m16n8 C fragment per
// n-tile of 8: d[4j + 0, 1] = (row g, columns 8j + 2t, + 1), d[4j + 2, 3] = row g + 8.
//
// Preconditions (the launcher's): K % 32 == 0, W and Xb 16-byte aligned, N % 16 == 0 for
// silu_mul. Grid: x = M tiles, y = N tiles, z = K splits; dynamic shared memory
// WG_STAGES * 32 KiB + 1 KiB (the 1024-byte alignment of the ring).
#include "common.cuh"

PYDFLASH_REQUIRE(WG_STAGES);

#define WG_BM 128
#define WG_BN 128
#define WG_BK 64
#define WG_THREADS 256
#define WG_TILE_BYTES (128 * 128)  // 128 rows of 64 bf16
#define WG_STAGE_BYTES (2 * WG_TILE_BYTES)
#define WG_EPI_STORE 0
#define WG_EPI_SILU_MUL 1
#define WG_EPI_SILU_MUL_BF16 2  // silu_mul rounded to bf16: Y holds bf16 bits, ldy in elements

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ENABLED 1
#else
#define WG_ENABLED 0
#endif

// byte offset of 16-byte chunk c (0..7) of row r in a 128-byte-row tile: the 128B swizzle
__device__ __forceinline__ int wg_at(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Shared-memory matrix descriptor of a K-major, 128B-swizzled tile at `smem` (1024-aligned).
__device__ __forceinline__ unsigned long long wg_desc(const unsigned char* smem) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    unsigned long long d = (unsigned long long)((addr & 0x3FFFF) >> 4);  // start address
    d |= 1ULL << 16;                                                     // leading offset (unused)
    d |= (unsigned long long)(1024 >> 4) << 32;                          // 8-row group stride
    d |= 1ULL << 62;                                                     // 128-byte swizzle
    return d;
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
__device__ __forceinline__ void wg_wait_all() {
#if WG_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// The accumulators as operands of an empty asm: the compiler may not move their reads or
// writes across it (wgmma writes them asynchronously, behind its wait).
__device__ __forceinline__ void wg_fence_operands(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
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

// k-tile kt of the split (32-chunks c0 + 2 kt, + 1) of X rows m0.. and W rows n0.. into a stage:
// 128 rows x 8 chunks of each operand, four of each per thread; rows past M or N and 32-chunks
// at or past c_end zero-filled.
__device__ __forceinline__ void wg_load(unsigned char* stage, const bf16_bits* Xb,
                                        const bf16_bits* W, int M, int N, int K, int m0, int n0,
                                        int c0, int c_end, int kt, int tid) {
    const int k0 = (c0 + 2 * kt) * 32;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = tid + i * WG_THREADS, r = c >> 3, q = c & 7;
        const int k = k0 + q * 8;
        const bool kin = k < c_end * 32;
        const bool ok_x = m0 + r < M && kin, ok_w = n0 + r < N && kin;
        cp_async16(stage + wg_at(r, q), ok_x ? Xb + (long long)(m0 + r) * K + k : Xb, ok_x);
        cp_async16(stage + WG_TILE_BYTES + wg_at(r, q), ok_w ? W + (long long)(n0 + r) * K + k : W,
                   ok_w);
    }
}

template <int EPI>
__device__ __forceinline__ void wg_tiles(const bf16_bits* __restrict__ W,
                                         const bf16_bits* __restrict__ Xb, float* __restrict__ Y,
                                         long long ldy, int M, int N, int K, int chunks_per_split,
                                         long long split_stride) {
#if WG_ENABLED
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    // the ring starts at the first 1024-byte boundary (the launcher adds 1 KiB)
    const unsigned base = (unsigned)__cvta_generic_to_shared(wg_smem_raw);
    unsigned char* ring = wg_smem_raw + ((1024 - (base & 1023)) & 1023);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wg = warp >> 2, wq = warp & 3;
    const int m0 = blockIdx.x * WG_BM, n0 = blockIdx.y * WG_BN;
    const int c0 = blockIdx.z * chunks_per_split;
    const int c_end = min(K / 32, c0 + chunks_per_split);
    const int nk = max(0, (c_end - c0 + 1) / 2);
    Y += blockIdx.z * split_stride;

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; ++s) {
        if (s < nk) wg_load(ring + s * WG_STAGE_BYTES, Xb, W, M, N, K, m0, n0, c0, c_end, s, tid);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<WG_STAGES - 2>();  // this thread's copies of tile kt have landed
        fence_proxy_async();             // ... and are visible to wgmma's async proxy
        __syncthreads();  // everyone's have; every warpgroup is done with tile kt - 1
        const int next = kt + WG_STAGES - 1;
        if (next < nk)
            wg_load(ring + (next % WG_STAGES) * WG_STAGE_BYTES, Xb, W, M, N, K, m0, n0, c0, c_end,
                    next, tid);
        cp_async_commit();
        const unsigned char* xs = ring + (kt % WG_STAGES) * WG_STAGE_BYTES;
        const unsigned long long a = wg_desc(xs + wg * 64 * 128);  // this warpgroup's 64 rows
        const unsigned long long b = wg_desc(xs + WG_TILE_BYTES);
        wg_fence_operands(d);
        wg_fence();
#pragma unroll
        for (int s = 0; s < WG_BK / 16; ++s) wgmma_m64n128k16(d, a + 2 * s, b + 2 * s);  // +32 B
        wg_commit();
        wg_wait_all();  // the stage is read before the next barrier lets the ring refill it
        wg_fence_operands(d);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + wg * 64 + wq * 16 + h * 8 + g;
        if (row >= M) continue;
        float* yrow = Y + (long long)row * ldy;
        if (EPI == WG_EPI_SILU_MUL || EPI == WG_EPI_SILU_MUL_BF16) {
#pragma unroll
            for (int p = 0; p < 8; ++p) {
                const int gate_row = n0 + p * 16;  // the group's first gate row
                if (gate_row >= N) continue;
                const int col = gate_row / 2 + 2 * t;
                const float y0 = silu(d[8 * p + 2 * h]) * d[8 * p + 4 + 2 * h];
                const float y1 = silu(d[8 * p + 2 * h + 1]) * d[8 * p + 4 + 2 * h + 1];
                if (EPI == WG_EPI_SILU_MUL_BF16) {  // the down projection's rounded input
                    bf16_bits* brow = reinterpret_cast<bf16_bits*>(Y) + (long long)row * ldy;
                    *reinterpret_cast<unsigned*>(brow + col) = pack_bf16x2(y0, y1);
                } else {
                    yrow[col] = y0;
                    yrow[col + 1] = y1;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int col = n0 + j * 8 + 2 * t;
                if (col < N) yrow[col] = d[4 * j + 2 * h];
                if (col + 1 < N) yrow[col + 1] = d[4 * j + 2 * h + 1];
            }
        }
    }
#else
    __trap();  // sm_90a only: pydflash launches these on sm_90 alone
#endif
}

#define WG_ENTRY(name, EPI)                                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS)                                   \
        name(const bf16_bits* W, const bf16_bits* Xb, float* Y, long long ldy, int M, int N,   \
             int K, int chunks_per_split, long long split_stride) {                            \
        wg_tiles<EPI>(W, Xb, Y, ldy, M, N, K, chunks_per_split, split_stride);                 \
    }
WG_ENTRY(gemm_bf16act_store_wgmma, WG_EPI_STORE)
WG_ENTRY(gemm_bf16act_silu_mul_wgmma, WG_EPI_SILU_MUL)
WG_ENTRY(gemm_bf16act_silu_mul_bf16_wgmma, WG_EPI_SILU_MUL_BF16)
