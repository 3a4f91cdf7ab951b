// linear_v3 over a tiled weight layout: cuda_src/linear_v3.cuh's template with Tiled3 as its
// weight source instead of RowMajor3, the store / add / silu_mul entries (linear3t_<format>_
// <epilogue>[_nt1]). Launcher: pydflash/linear/decode_v3.py (a GpuTensor with tile_rows); the
// layout: pydflash/formats/layout.py; the same -D constants as linear_v3.cu (a decode_v3.Config's).
//
// The layout (ROWS = 16 * MT rows a warp, RB a row's bytes of one 32-chunk, C = K / 32):
//   weights [ceil(N / ROWS) row tiles][C chunks][ROWS rows][RB bytes]: what one ring stage
//           holds, in the stage's own order, is one contiguous run (the lanes' 16-byte copies
//           cover 512 consecutive bytes per instruction, the slices of a block neighbouring
//           runs);
//   scales  [row tiles][C][ROWS] f16: a stage's scales are one run of 2 * ROWS bytes, copied by
//           the first ROWS / 8 lanes as 16-byte pieces (the row-major layout moves a 4-byte
//           word per row and reads half of it).
// Rows past N are zero in both (a tile is always whole), so every copy exists; their outputs
// are never stored. The arithmetic, the plan and the results are linear_v3's bit for bit: only
// the addresses the ring is filled from differ.
#include "linear_v3.cuh"

template <int FMT, int MT>
struct Tiled3 {
    using G = Ring3<FMT, MT, 1>;
    static constexpr int SCALE_STEP = 1;                  // a stage's scales: one f16 a row
    static constexpr int SCALE_PIECES = G::ROWS * 2 / 16;  // 16-byte pieces of them (4 .. 16)
    const unsigned char* wsrc;
    const unsigned char* ssrc;
    bool copies_scales;

    __device__ __forceinline__ Tiled3(const unsigned char* W, const f16_bits* scales,
                                      long long row0, int lane, int g, int c_begin, int N,
                                      int K) {
        const long long first = (row0 / G::ROWS) * (long long)(K >> 5) + c_begin;  // its stage
        wsrc = W + first * G::W_BYTES + lane * 16;
        ssrc = reinterpret_cast<const unsigned char*>(scales) + first * (G::ROWS * 2) + lane * 16;
        copies_scales = G::QUANT && lane < SCALE_PIECES;
    }
    __device__ __forceinline__ bool whole() const { return true; }  // padded tiles

    __device__ __forceinline__ void issue(unsigned w_dst, unsigned s_dst, unsigned off, bool,
                                          int inner) {
#pragma unroll
        for (int u = 0; u < G::WG; ++u) cp_async16_w(w_dst + off + u * 512, wsrc + u * 512);
        if constexpr (G::QUANT) {
            if (copies_scales) cp_async16_w(s_dst + off, ssrc);
        }
        wsrc += (long long)inner * G::W_BYTES;
        ssrc += (long long)inner * (G::ROWS * 2);
    }
    static __device__ __forceinline__ unsigned s_lane(int lane) { return lane * 16; }
    __device__ __forceinline__ int scale_byte(int) const { return 0; }
};

LIN3_ALL(linear3t_, bf16, FMT_BF16, LIN3_MT_BF16, LIN3_STAGES_BF16, Tiled3)
LIN3_ALL(linear3t_, q8_0, FMT_Q8_0, LIN3_MT_Q8, LIN3_STAGES_Q8, Tiled3)
LIN3_ALL(linear3t_, q4_0, FMT_Q4_0, LIN3_MT_Q4, LIN3_STAGES_Q4, Tiled3)
