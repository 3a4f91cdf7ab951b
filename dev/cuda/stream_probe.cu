// Read bandwidth of a weight-streaming access pattern alone (no arithmetic): the diagnostic
// behind tools/bench_stream.py. The decode linears (linear_v3.cu) read a row-major [N, K]
// weight as tiles of `rows` rows x `run_bytes` bytes: a warp's ring stage is one such tile, so
// each row of it is a short run at a stride of a whole weight row. This kernel reads the same
// tiles in the same order, either from that row-major layout (tiled == 0) or from a layout
// where each tile is one contiguous block of rows * run_bytes bytes (tiled == 1: what a
// load-time re-layout for the MMA fragments would give), and nothing else, so the two times
// measure what the layout costs the memory system.
//
// Work split as linear_v3's: warp (g, s) of g = row group (`rows` rows), s = slice of
// `slices`, reads runs s, s + slices, s + 2 * slices, ... of its rows; a block's warps are
// consecutive slices of one row group (they read neighbouring runs of the same rows at once).
// Bytes in flight do not depend on the tile: a lane loads PROBE_BATCH 16-byte granules at a
// time (PROBE_BATCH / granules-a-lane-a-tile tiles of the warp's sequence), two batches ahead
// (8 KiB a warp), so small and large tiles compare at the same depth. The granules are folded
// into one word, written to sink[warp] so the loads stay.
#include "common.cuh"

#define PROBE_BATCH 8  // granules a lane loads a batch; a tile is at most 8 * 32 * 16 bytes

__device__ __forceinline__ uint4 probe_load(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

extern "C" __global__ void stream_tiles(const unsigned char* __restrict__ w, long long row_bytes,
                                        int n_groups, int rows, int run_bytes, int slices,
                                        int tiled, unsigned* sink) {
    const int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= n_groups * slices) return;
    const int g = warp / slices, s = warp % slices;
    const int n_runs = (int)(row_bytes / run_bytes);  // tiles of the row group
    const int gpr = run_bytes / 16;                    // granules per row of a tile
    const int per_lane = rows * gpr / 32;              // granules a lane loads per tile
    const int per_batch = PROBE_BATCH / per_lane;      // tiles a batch
    const int my_tiles = (n_runs - s + slices - 1) / slices;
    const long long tile_step = tiled ? (long long)rows * run_bytes : run_bytes;
    const unsigned char* group = w + (long long)g * rows * row_bytes;
    // granule j of a batch: tile j / per_lane of it, granule lane + 32 * (j % per_lane) of the
    // tile, at in_tile[j] from the tile's start (the divisions once, not per batch)
    long long in_tile[PROBE_BATCH];
    int tile_of[PROBE_BATCH];
#pragma unroll
    for (int j = 0; j < PROBE_BATCH; ++j) {
        const int q = lane + 32 * (j % per_lane);
        tile_of[j] = j / per_lane;
        in_tile[j] = tiled ? 16LL * q : (long long)(q / gpr) * row_bytes + 16LL * (q % gpr);
    }
    auto load_batch = [&](uint4* dst, int b) {
#pragma unroll
        for (int j = 0; j < PROBE_BATCH; ++j) {
            const int t = b * per_batch + tile_of[j];  // the warp's t-th tile: run s + t * slices
            dst[j] = make_uint4(0, 0, 0, 0);
            if (t < my_tiles)
                dst[j] = probe_load(group + (long long)(s + t * slices) * tile_step + in_tile[j]);
        }
    };
    const int n_batches = (my_tiles + per_batch - 1) / per_batch;
    unsigned acc = 0;
    uint4 cur[PROBE_BATCH], nxt[PROBE_BATCH];
    if (n_batches > 0) load_batch(cur, 0);
    for (int b = 0; b < n_batches; ++b) {
        if (b + 1 < n_batches) load_batch(nxt, b + 1);
#pragma unroll
        for (int j = 0; j < PROBE_BATCH; ++j) {
            acc ^= cur[j].x ^ cur[j].y ^ cur[j].z ^ cur[j].w;
            cur[j] = nxt[j];
        }
    }
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if (lane == 0) sink[warp] = acc;
}
