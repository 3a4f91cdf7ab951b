// gemm_quant_tma: Y[r, n] = sum_b d[n, b] * sum_{k in block b} Xb[r, k] * q[n, k] for q8_0 / q4_0
// weights (pydflash/ops/gemm_quant.py): context ingest's projection on Hopper, the quantized
// counterpart of gemm_bf16act_tma's hi/lo split (Xb = hi(x) or lo(x) rows of the bf16 scratch,
// the two partials the consumer adds). Each 32-wide K block (one GGML block) is multiplied
// afresh and scaled by its f16 d before it joins the f32 accumulator, as in gemm.cu, so the
// GGML values are used unchanged: the integer quants are exact bf16 MMA operands.
//
// Roles swapped against gemm_bf16act_tma (Y^T = W . Xb^T): the weights are wgmma's A operand,
// taken from registers (each thread turns its quants into bf16 pairs: a warp's 16 rows x 16 k
// as mma.m16n8k16's A fragment), and 128 rows of Xb are the B operand in shared memory (K-major,
// 128B swizzle, the layout gemm_bf16act_tma reads its weights in). A block: 128 weight rows
// (two consumer warpgroups of 64) x 128 rows of Xb, K tiles of 64 (two GGML blocks).
// - one producer thread streams each K tile's Xb box (128 x 64 bf16) and quant box (128 rows x
//   64 int8, or 32 bytes of q4_0 nibbles; swizzled across the row, qt_row_key) by
//   cp.async.bulk.tensor into a 4-deep ring (STAGES) on full / empty mbarriers (rows past the
//   ends zero-filled by the copy engine);
// - per GGML block a consumer warpgroup issues two wgmma.m64n128k16 into a fresh accumulator
//   (two of them, alternating) and, while the next block's MMAs run, adds d * the previous
//   block's sums to its accumulator (the scales of its thread's two rows read from global
//   memory beside the MMAs).
//
// Storage (pydflash/formats/tensor.py): q8_0 int8 [N, K]; q4_0 uint8 [N, K/2], per 32-block
// byte j = element j (low nibble) and element j + 16 (high nibble), value = nibble - 8; scales
// f16 bits [N, K/32] (row stride lds). The *_tiled entries read the same bytes in the decode
// linear's tiled layout (pydflash/formats/layout.py: [N / tr][K / 32][tr][a block's bytes],
// scales [N / tr][K / 32][tr], lds = the elements of a tile's scales), the same values in the
// same order: their results equal the row-major entries' bit for bit (QtLayout below). Y float32 [R, ldy]: row r of Xb -> row r of Y, columns n < N.
// Compiled for sm_90a only (Family(arch_specific=True)); elsewhere the entries trap.
// Grid: x = N tiles of 128, y = R tiles of 128. Block: 384 threads (warpgroups 0 and 1 the
// consumers, warpgroup 2 the producer, which hands them its registers by setmaxnreg: two
// block sums in flight and the accumulator take 192 a consumer thread). Dynamic shared
// memory: STAGES * (16 KiB + the quant tile) + 1 KiB (the ring's 1024-byte alignment).
#include "tma.cuh"

#define QT_CONSUMERS 256
#define QT_THREADS (QT_CONSUMERS + 128)  // + the producer warpgroup
#define QT_PRODUCER_REGS 40
#define QT_CONSUMER_REGS 232
#define QT_BN 128        // weight rows a block (two warpgroups of 64)
#define QT_BR 128        // Xb rows a block (wgmma's N)
#define QT_BK 64         // K a tile: two GGML blocks
#define QT_X_BYTES (QT_BR * 128)
#define QT_FMT_Q8_0 1
#define QT_FMT_Q4_0 2

// d (64 f32 of this thread) = A (64 x 16: this warp's 16 rows in registers, the A fragment of
// mma.m16n8k16) . B (128 x 16, descriptor b)^T, + d when `accumulate`
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const unsigned (&a)[4],
                                                    unsigned long long b, int accumulate) {
#if WG_ENABLED
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#else
    (void)d;
    (void)a;
    (void)b;
    (void)accumulate;
#endif
}

// The A fragments as operands of an empty asm: their conversions stay before wgmma.fence (the
// fence orders register writes before the wgmma that reads them; the conversions themselves
// are not volatile and could otherwise sink past it).
__device__ __forceinline__ void qt_fence_a(unsigned (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// The swizzle of u8_rows' copy (64-byte q8_0 rows / 32-byte q4_0 rows; the stage's quant tile
// 1024-byte aligned): byte L of the tile lands at L ^ (((L >> 7) & (span / 16 - 1)) << 4), its
// 16-byte chunk XORed with bits of its 128-byte line. For a row `row` that key depends on the
// row alone (and is the same for rows ra and ra + 8): qt_row_key(row) is XORed into the chunk
// offsets of the row's bytes. Swizzled, the 8 rows g of a warp's fragment loads meet 8 bank
// groups (unswizzled, q8_0 rows 64 bytes apart put 4 rows on each bank).
template <int FMT>
__device__ __forceinline__ int qt_row_key(int row) {
    return FMT == QT_FMT_Q8_0 ? ((row >> 1) & 3) << 4 : ((row >> 2) & 1) << 4;
}

// Where a stage's quant tile holds row `row` of the block (its bytes of GGML block `half` of the
// K tile at row_off + half * BLOCK_STEP, 16-byte chunks XORed with key):
// - row-major weights (u8_rows' 2-D box): [128 rows][ROW bytes], the two blocks side by side in
//   a row (BLOCK_STEP 0, their offsets inside the XOR), swizzled by qt_row_key;
// - the tiled layout (pydflash.formats.layout, tiles of tr = QT_TILE_ROWS_<format> rows, the
//   decode linear's; u8_tiles' 4-D box): [128 / tr tiles][2 blocks][tr rows][RB bytes], RB a
//   GGML block's bytes of a row (32 q8_0, 16 q4_0), BLOCK_STEP = tr * RB. q8_0's box is
//   swizzled over 32 bytes (bit 4 of an offset XORed with bit 7: row bit 2, tr * 32 being a
//   multiple of 256); q4_0's 16-byte rows are not (a fragment's 8 rows meet 8 bank groups).
template <int FMT, bool TILED>
struct QtLayout {
    static constexpr int RB = FMT == QT_FMT_Q8_0 ? 32 : 16;  // a GGML block's bytes of a row
    static constexpr int ROW = TILED ? RB : 2 * RB;            // bytes from one row to the next
    static constexpr int BLOCK = TILED ? 0 : RB;               // block 1's offset inside a row
    static constexpr int TILE_ROWS = FMT == QT_FMT_Q8_0 ? QT_TILE_ROWS_Q8 : QT_TILE_ROWS_Q4;
    // whole tiles in a block, and a fragment's rows ra, ra + 8 (ra % 16 < 8) in one tile
    static_assert(QT_BN % TILE_ROWS == 0 && TILE_ROWS % 16 == 0, "whole tiles of 16 k rows");
    static constexpr int BLOCK_STEP = TILED ? TILE_ROWS * RB : 0;  // block 1's offset
    static __device__ __forceinline__ int row_off(int row) {
        constexpr int TR = TILE_ROWS;
        return TILED ? (row / TR) * (2 * TR * RB) + (row % TR) * RB : row * ROW;
    }
    static __device__ __forceinline__ int key(int row) {
        if (!TILED) return qt_row_key<FMT>(row);
        return FMT == QT_FMT_Q8_0 ? ((row >> 2) & 1) << 4 : 0;
    }
};

// This thread's A fragments of the tile's GGML block `half` from the quant tile: a0 of k16 step
// 2 half, a1 of step 2 half + 1. Rows ra = g and ra + 8 of its warp's 16; registers 0, 1 hold
// k = 2t, 2t + 1 of the step and 2, 3 hold k = 2t + 8, 2t + 9 (mma.m16n8k16's A). Each pair is
// one 16-bit load, decoded by common.cuh's q8_pair / q4_pair: q8_0 bytes k, k + 1; q4_0 bytes 2t
// (+ 8) and the next of the block, whose low nibbles are elements 2t, 2t + 1 (a0) and high
// nibbles 2t + 16, 2t + 17 (a1).
// row_a = the quant tile + L::row_off(ra) + 2t (row ra's bytes from 2t), key = L::key(ra) (the
// same for rows ra and ra + 8).
template <int FMT, bool TILED>
__device__ __forceinline__ void qt_a_pair(unsigned (&a0)[4], unsigned (&a1)[4],
                                          const unsigned char* row_a, int key, int half) {
    using L = QtLayout<FMT, TILED>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: k 2t, 2t + 1; h = 1: k 2t + 8, 2t + 9
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {  // rows ra, ra + 8
            const unsigned char* p = row_a + 8 * rr * L::ROW + 8 * h + half * L::BLOCK_STEP;
            constexpr int BLOCK = L::BLOCK;
            if (FMT == QT_FMT_Q8_0) {  // chunks 2 half (a0) and 2 half + 1 (a1) of the row
                const unsigned u0 = *reinterpret_cast<const unsigned short*>(p + ((BLOCK * half) ^ key));
                const unsigned u1 =
                    *reinterpret_cast<const unsigned short*>(p + ((BLOCK * half + 16) ^ key));
                a0[2 * h + rr] = q8_pair(u0, 0);
                a1[2 * h + rr] = q8_pair(u1, 0);
            } else {  // chunk `half` of the row
                const unsigned u = *reinterpret_cast<const unsigned short*>(p + ((BLOCK * half) ^ key));
                const unsigned spread = __byte_perm(u, 0u, 0x4140);  // byte 1 -> byte 2
                a0[2 * h + rr] = q4_pair(spread & 0x000F000Fu);
                a1[2 * h + rr] = q4_pair((spread >> 4) & 0x000F000Fu);
            }
        }
    }
}

template <int FMT, bool TILED, int STAGES>
__device__ __forceinline__ void quant_tiles(const TensorMap* wmap, const TensorMap* xmap,
                                            const f16_bits* scales, long long lds, float* Y,
                                            long long ldy, int R, int N, int K) {
#if WG_ENABLED
    constexpr int W_BYTES = QT_BN * (FMT == QT_FMT_Q8_0 ? QT_BK : QT_BK / 2);
    constexpr int STAGE_BYTES = QT_X_BYTES + W_BYTES;
    static_assert(STAGE_BYTES % 1024 == 0, "every stage's Xb tile 1024-byte aligned");
    extern __shared__ __align__(1024) unsigned char qt_smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[s], then empty[s]
    const int tid = threadIdx.x;
    constexpr int tr = TILED ? QtLayout<FMT, true>::TILE_ROWS : 1;  // row-major: tiles of a row
    const int n0 = blockIdx.x * QT_BN, r0 = blockIdx.y * QT_BR;
    const int nk = K / QT_BK;  // K % 64 == 0 (the launcher's check)

    const TmaRing ring = tma_ring_init<STAGES>(qt_smem_raw, bars, QT_CONSUMERS, QT_CONSUMERS);

    if (tid >= QT_CONSUMERS) {  // the producer warpgroup: one thread issues every copy
        wg_setmaxnreg_dec<QT_PRODUCER_REGS>();
        if (tid == QT_CONSUMERS)
            tma_produce<STAGES>(ring, nk, STAGE_BYTES, [&](int kt, unsigned stage, unsigned full) {
                tma_load_2d(stage, xmap, full, kt * QT_BK, r0);
                if (TILED)  // (byte, row of a tile, block, tile): 2 blocks of 128 / tr tiles
                    tma_load_4d(stage + QT_X_BYTES, wmap, full, 0, 0, 2 * kt, n0 / tr);
                else
                    tma_load_2d(stage + QT_X_BYTES, wmap, full, kt * 2 * QtLayout<FMT, false>::RB, n0);
            });
        return;
    }

    wg_setmaxnreg_inc<QT_CONSUMER_REGS>();  // the two block sums and acc: 192 of them
    const int cw = tid >> 7;  // the consumer warpgroup: weight rows 64 cw..
    const int lane = tid & 31, wq = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int ra = cw * 64 + wq * 16 + g;  // this thread's rows ra and ra + 8 of the block
    using L = QtLayout<FMT, TILED>;
    const int row_off = L::row_off(ra) + 2 * t;
    const int key = L::key(ra);
    const int na = n0 + ra, nb = na + 8;
    // scale (n, c) at (n / tr) * lds + n % tr + c * tr: row-major planes are tr = 1
    auto scale_row = [&](int n) { return scales + (long long)(n / tr) * lds + n % tr; };
    const f16_bits* sa = scale_row(min(na, N - 1));
    // tiled: row nb is 8 rows on in na's tile (the pointer is read only when nb < N), so one
    // pointer and immediate offsets serve both (a register the q8_0 tile would otherwise spill)
    const f16_bits* sb = TILED ? sa + 8 : scale_row(min(nb, N - 1));
    float acc[64], b0[64], b1[64];  // the sums; a tile's first and second GGML block's MMAs
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = b0[i] = b1[i] = 0.f;  // written before they are read

    // one GGML block's two MMAs (block `half` of stage s) into a fresh blk, as one group
    auto issue = [&](int s, int half, float(&blk)[64]) {
        const unsigned char* xs = ring.base + s * STAGE_BYTES;
        const unsigned long long b = wg_desc(xs);
        unsigned a0[4], a1[4];
        qt_a_pair<FMT, TILED>(a0, a1, xs + QT_X_BYTES + row_off, key, half);
        qt_fence_a(a0);
        qt_fence_a(a1);
        wg_fence_operands(blk);
        wg_fence();
        wgmma_rs_m64n128k16(blk, a0, b + 2 * (2 * half), 0);
        wgmma_rs_m64n128k16(blk, a1, b + 2 * (2 * half + 1), 1);
        wg_commit();
    };
    // acc += d * a finished block's sums (rows na: da, nb: db), in block order
    auto add_scaled = [&](float(&blk)[64], float da, float db) {
        wg_fence_operands(blk);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = fmaf((i & 2) ? db : da, blk[i], acc[i]);
    };

    // Software-pipelined by one GGML block, two K tiles a step: each block's MMAs run while
    // the block before it is scaled into acc, but for the step's last (waited for with
    // nothing behind it). ptxas keeps the wgmmas asynchronous only where every wait's group
    // is one issued in the same step: a block in flight across the loop's back edge, or a
    // wgmma under a branch, makes it serialise them all (C7514 / C7518).
    auto block_d = [&](int c, float& da, float& db) {  // GGML block c's d of rows na, nb
        da = na < N ? f16_to_f32(sa[(long long)c * tr]) : 0.f;
        db = nb < N ? f16_to_f32(sb[(long long)c * tr]) : 0.f;
    };
    auto full = [&](int kt) { mbar_wait(ring.full(kt % STAGES), (kt / STAGES) & 1); };
    int kt = 0;
    for (; kt + 2 <= nk; kt += 2) {
        const int s0 = kt % STAGES, s1 = (kt + 1) % STAGES;
        float d[8];  // da, db of blocks 2 kt .. 2 kt + 3
#pragma unroll
        for (int j = 0; j < 4; ++j) block_d(2 * kt + j, d[2 * j], d[2 * j + 1]);
        full(kt);
        issue(s0, 0, b0);
        issue(s0, 1, b1);
        wg_wait<1>();
        add_scaled(b0, d[0], d[1]);
        full(kt + 1);
        issue(s1, 0, b0);
        wg_wait<1>();
        mbar_arrive(ring.empty(s0));  // both of tile kt's blocks are done with its stage
        add_scaled(b1, d[2], d[3]);
        issue(s1, 1, b1);
        wg_wait<1>();
        add_scaled(b0, d[4], d[5]);
        wg_wait<0>();
        mbar_arrive(ring.empty(s1));
        add_scaled(b1, d[6], d[7]);
    }
    if (kt < nk) {  // an odd count of K tiles: the last alone
        const int s0 = kt % STAGES;
        float d[4];
        block_d(2 * kt, d[0], d[1]);
        block_d(2 * kt + 1, d[2], d[3]);
        full(kt);
        issue(s0, 0, b0);
        issue(s0, 1, b1);
        wg_wait<1>();
        add_scaled(b0, d[0], d[1]);
        wg_wait<0>();
        mbar_arrive(ring.empty(s0));
        add_scaled(b1, d[2], d[3]);
    }

    // acc[4j + 0, 1] = (weight row na, Xb rows r0 + 8j + 2t, + 1); acc[4j + 2, 3]: row nb
#pragma unroll
    for (int j = 0; j < QT_BR / 8; ++j) {
        const int r = r0 + 8 * j + 2 * t;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = (e & 2) ? nb : na, row = r + (e & 1);
            if (n < N && row < R) Y[(long long)row * ldy + n] = acc[4 * j + e];
        }
    }
#else
    __trap();  // sm_90a only: pydflash launches these on sm_90 alone
#endif
}

#define QT_ENTRY(name, FMT, TILED, STAGES)                                                    \
    extern "C" __global__ void __launch_bounds__(QT_THREADS, 1)                               \
        name(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, \
             const f16_bits* scales, long long lds, float* Y, long long ldy, int R, int N,   \
             int K) {                                                                        \
        quant_tiles<FMT, TILED, STAGES>(&wmap, &xmap, scales, lds, Y, ldy, R, N, K);         \
    }
QT_ENTRY(gemm_quant_q8_0_tma, QT_FMT_Q8_0, false, 4)
QT_ENTRY(gemm_quant_q4_0_tma, QT_FMT_Q4_0, false, 4)
QT_ENTRY(gemm_quant_q8_0_tiled_tma, QT_FMT_Q8_0, true, 4)  // weights in the tiled layout
QT_ENTRY(gemm_quant_q4_0_tiled_tma, QT_FMT_Q4_0, true, 4)
