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
// Each lane loads its 16-byte granules of two tiles ahead (a tile's loads all in flight before
// the first is used) and folds them into one word, written to sink[warp] so the loads stay.
#include "common.cuh"

#define PROBE_MAX_G 8  // granules a lane loads per tile: rows * run_bytes <= 8 * 32 * 16 bytes

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
    const int n_runs = (int)(row_bytes / run_bytes);
    const int gpr = run_bytes / 16;              // granules per row of a tile
    const int per_lane = rows * gpr / 32;        // granules a lane loads per tile
    const long long tile_bytes = (long long)rows * run_bytes;
    const unsigned char* group = w + (long long)g * rows * row_bytes;
    // a granule's offset inside its tile (the divisions once, not per tile); a tile starts at
    // run * tile_bytes (tiled) or at run * run_bytes of the group's first row (row-major)
    long long in_tile[PROBE_MAX_G];
#pragma unroll
    for (int j = 0; j < PROBE_MAX_G; ++j) {
        const int q = lane + 32 * j;
        in_tile[j] = tiled ? 16LL * q : (long long)(q / gpr) * row_bytes + 16LL * (q % gpr);
    }
    const long long tile_step = tiled ? tile_bytes : run_bytes;
    unsigned acc = 0;
    uint4 cur[PROBE_MAX_G], nxt[PROBE_MAX_G];
    auto load_tile = [&](uint4* dst, int run) {
        const unsigned char* tile = group + (long long)run * tile_step;
#pragma unroll
        for (int j = 0; j < PROBE_MAX_G; ++j)
            if (j < per_lane) dst[j] = probe_load(tile + in_tile[j]);
    };
    int run = s;
    if (run < n_runs) load_tile(cur, run);
    for (; run < n_runs; run += slices) {
        if (run + slices < n_runs) load_tile(nxt, run + slices);
#pragma unroll
        for (int j = 0; j < PROBE_MAX_G; ++j) {
            if (j < per_lane) {
                acc ^= cur[j].x ^ cur[j].y ^ cur[j].z ^ cur[j].w;
                cur[j] = nxt[j];
            }
        }
    }
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if (lane == 0) sink[warp] = acc;
}
