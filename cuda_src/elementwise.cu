// Elementwise and row-gather kernels. Sizes are element counts; grid-stride loops.
#include "common.cuh"

__device__ __forceinline__ long long gtid() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long gstride() { return (long long)gridDim.x * blockDim.x; }

extern "C" __global__ void add_f32(const float* a, const float* b, float* out, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) out[i] = a[i] + b[i];
}

// out = silu(gate) * up, computed like the fused linear epilogue.
extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out,
                                        long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
        out[i] = silu(gate[i]) * up[i];
    }
}

// out[r, o] = silu(g) * u of a gate_up projection written as n_split partials split_stride
// floats apart (a batched round's hi / lo products from gemm_quant_tma.cu), rows of 2 * n_ff
// with gate and up rows interleaved in groups of 8 (pydflash/draft/weights.py): g at column
// 16 * (o / 8) + o % 8, u eight columns on; the partials added in split order, then
// silu_mul_f32's arithmetic.
extern "C" __global__ void silu_mul_split_f32(const float* part, long long split_stride,
                                              int n_split, long long rows, long long n_ff,
                                              float* out) {
    const long long n = rows * n_ff;
    for (long long i = gtid(); i < n; i += gstride()) {
        const long long r = i / n_ff, o = i - r * n_ff;
        const float* row = part + r * 2 * n_ff + (o >> 3) * 16 + (o & 7);
        float g = row[0], u = row[8];
        for (int s = 1; s < n_split; ++s) {
            g += row[s * split_stride];
            u += row[s * split_stride + 8];
        }
        out[i] = silu(g) * u;
    }
}

// A caller's input in another dtype -> the float32 / int32 the kernels read, in one pass:
// bf16 bits (exact: the bits widened), f16 (exact), int64 ids (values outside [0, 2^31) become
// -1: an id no table holds, never a wrapped valid one).
extern "C" __global__ void bf16_to_f32(const bf16_bits* src, float* dst, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) dst[i] = bf16_to_f32(src[i]);
}

extern "C" __global__ void f16_to_f32(const unsigned short* src, float* dst, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(src[i]));
        dst[i] = f;
    }
}

extern "C" __global__ void i64_to_i32(const long long* src, int* dst, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const long long v = src[i];
        dst[i] = (v >= 0 && v <= 0x7fffffffll) ? (int)v : -1;
    }
}

// x [rows, n] += row [n] (broadcast over rows).
extern "C" __global__ void add_row_inplace_f32(float* x, const float* row, long long rows,
                                               long long n) {
    for (long long i = gtid(); i < rows * n; i += gstride()) x[i] += row[i % n];
}

// out[r, :] = f32(table[ids[r], :]) for a bf16 table [n_rows_table, cols] (row stride ld).
// An id outside [0, n_rows_table) writes a row of NaN rather than reading out of bounds.
extern "C" __global__ void gather_rows_bf16(const bf16_bits* table, long long ld,
                                            long long n_rows_table, const int* ids, float* out,
                                            long long ldo, int n_ids, long long cols) {
    for (long long i = gtid(); i < (long long)n_ids * cols; i += gstride()) {
        const long long r = i / cols, c = i % cols;
        const int id = ids[r];
        out[r * ldo + c] = (id >= 0 && id < n_rows_table)
                               ? bf16_to_f32(table[(long long)id * ld + c])
                               : __int_as_float(0x7fc00000);
    }
}

// Same for an f32 table.
extern "C" __global__ void gather_rows_f32(const float* table, long long ld, long long n_rows_table,
                                           const int* ids, float* out, long long ldo, int n_ids,
                                           long long cols) {
    for (long long i = gtid(); i < (long long)n_ids * cols; i += gstride()) {
        const long long r = i / cols, c = i % cols;
        const int id = ids[r];
        out[r * ldo + c] = (id >= 0 && id < n_rows_table) ? table[(long long)id * ld + c]
                                                          : __int_as_float(0x7fc00000);
    }
}

// The round's block positions into the KV position table: pos[*len + i] = block_pos[i].
// *len is read on the device (see qkv_post), so a captured round stays valid as len grows.
extern "C" __global__ void scatter_block_pos(int* pos, const int* len, const int* block_pos,
                                             int b, const int* seq_slot, long long slot_kpos,
                                             long long seq_state) {
    // grid y = the batch's sequences: sequence y's len / block positions at y * seq_state, its
    // positions row in cache slot seq_slot[y] (y when null) slot_kpos ints apart
    const long long seq = blockIdx.y;
    const long long slot = seq_slot != nullptr ? (long long)seq_slot[seq] : seq;
    if (slot < 0) return;  // a bucket's padding sequence
    pos += slot * slot_kpos;
    len += seq * seq_state;
    block_pos += seq * seq_state;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < b) pos[*len + i] = block_pos[i];
}

// A round's block embeddings from the target's table [n_rows_table, cols] (row stride ld), read
// on the device: out[0] = table[*last] * *scale, out[1..b-1] = table[mask_id] * *scale (f32
// products). An id outside the table gives a NaN row, never an out-of-bounds read.
template <typename T>
__device__ __forceinline__ float table_value(const T* table, long long at);
template <>
__device__ __forceinline__ float table_value<bf16_bits>(const bf16_bits* table, long long at) {
    return bf16_to_f32(table[at]);
}
template <>
__device__ __forceinline__ float table_value<float>(const float* table, long long at) {
    return table[at];
}

template <typename T>
__device__ __forceinline__ void block_embed(const T* table, long long ld, long long n_rows_table,
                                            const int* last, int mask_id, const float* scale,
                                            float* out, int b, long long cols,
                                            const float* mask_rows, int n_mask_rows) {
    const float s = *scale;
    const int first = *last;
    for (long long i = gtid(); i < (long long)b * cols; i += gstride()) {
        const long long r = i / cols, c = i % cols;
        if (r > 0 && n_mask_rows > 0) {  // learned MASK rows: one for every slot, or one a slot
            out[i] = mask_rows[(n_mask_rows == 1 ? 0 : r - 1) * cols + c] * s;
            continue;
        }
        const long long id = r == 0 ? first : mask_id;
        out[i] = (id >= 0 && id < n_rows_table) ? table_value<T>(table, id * ld + c) * s
                                                : __int_as_float(0x7fc00000);
    }
}

extern "C" __global__ void block_embed_bf16(const bf16_bits* table, long long ld,
                                            long long n_rows_table, const int* last, int mask_id,
                                            const float* scale, float* out, int b, long long cols,
                                            const float* mask_rows, int n_mask_rows) {
    block_embed<bf16_bits>(table, ld, n_rows_table, last, mask_id, scale, out, b, cols, mask_rows,
                           n_mask_rows);
}

extern "C" __global__ void block_embed_f32(const float* table, long long ld, long long n_rows_table,
                                           const int* last, int mask_id, const float* scale,
                                           float* out, int b, long long cols,
                                           const float* mask_rows, int n_mask_rows) {
    block_embed<float>(table, ld, n_rows_table, last, mask_id, scale, out, b, cols, mask_rows,
                       n_mask_rows);
}
