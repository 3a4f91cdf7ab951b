// Hopper's tensor memory accelerator (TMA) and mbarriers for the warp-specialised sm_90a tiles
// (gemm_bf16act_tma.cu, gemm_quant_tma.cu): the TensorMap kernel parameter, mbarrier init /
// arrive / expect-tx / parity wait, 2-D and 4-D box copies completing on a barrier, the producer
// of a stage ring. Compiled to nothing off sm_90a (WG_ENABLED, wgmma.cuh).
#pragma once
#include "wgmma.cuh"

// CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h is not on NVRTC's include path)
struct __align__(64) TensorMap {
    unsigned long long words[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
#if WG_ENABLED
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// The producer's arrival on a "full" barrier, announcing the bytes its copies will deliver.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
#if WG_ENABLED
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if WG_ENABLED
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if WG_ENABLED
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}

// One box of a 2-D tensor map (inner coordinate k, outer row) into shared memory at dst; the
// bytes complete a transaction of barrier bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, unsigned bar,
                                            int k, int row) {
#if WG_ENABLED
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(k), "r"(row)
        : "memory");
#endif
}

// The stage ring of a warp-specialised TMA tile: the dynamic shared memory aligned up to 1024
// bytes (the 128B swizzle's period), stage s at base + s * its bytes, and the mbarriers in
// `bars` (full[s], then empty[s]). tma_ring_init: thread `producer` initialises them (full:
// the producer's one expect_tx; empty: every one of `consumers` threads), then the block-wide
// barrier that every thread of the block must reach.
struct TmaRing {
    unsigned char* base;
    unsigned base_s, full0, empty0;  // shared-space addresses
    __device__ __forceinline__ unsigned full(int s) const { return full0 + 8 * s; }
    __device__ __forceinline__ unsigned empty(int s) const { return empty0 + 8 * s; }
};

template <int STAGES>
__device__ __forceinline__ TmaRing tma_ring_init(unsigned char* smem_raw,
                                                 unsigned long long (&bars)[2 * STAGES],
                                                 int producer, unsigned consumers) {
    TmaRing r;
    const unsigned raw = smem_addr(smem_raw);
    r.base = smem_raw + ((1024 - (raw & 1023)) & 1023);
    r.base_s = smem_addr(r.base);
    r.full0 = smem_addr(bars);
    r.empty0 = r.full0 + 8 * STAGES;
    if ((int)threadIdx.x == producer) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(r.full(s), 1);
            mbar_init(r.empty(s), consumers);
        }
#if WG_ENABLED
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }
    __syncthreads();
    return r;
}

// One box of a 4-D tensor map (coordinates innermost first) into shared memory at dst: a
// tiled weight layout's [tiles][chunks][rows][bytes] (gemm_quant_tma.cu).
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap* map, unsigned bar,
                                            int c0, int c1, int c2, int c3) {
#if WG_ENABLED
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2),
        "r"(c3)
        : "memory");
#endif
}

// The producer of a tile ring (one thread): for each k-tile kt, wait until the consumers have
// freed stage kt % STAGES, announce its stage_bytes on the stage's full barrier and let
// issue(kt, stage, full) start the copies that deliver them (stage: its shared address).
template <int STAGES, class Issue>
__device__ __forceinline__ void tma_produce(const TmaRing& ring, int nk, unsigned stage_bytes,
                                            Issue issue) {
    for (int kt = 0; kt < nk; ++kt) {
        const int s = kt % STAGES;
        if (kt >= STAGES) mbar_wait(ring.empty(s), ((kt / STAGES) + 1) & 1);
        const unsigned stage = ring.base_s + s * stage_bytes, full = ring.full(s);
        mbar_expect_tx(full, stage_bytes);
        issue(kt, stage, full);
    }
}
