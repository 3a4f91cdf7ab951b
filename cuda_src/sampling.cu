// Greedy token choice: row argmax (ties -> lowest index), one block per row.
#include "common.cuh"


__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
    // NaN never wins; equal values keep the lower index
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// out[r] = argmax_j x[r * ldx + j], j < n.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, long long ldx, int n,
                                       int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (long long)blockIdx.x * ldx;
    float bv = __int_as_float(0xff800000);
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) better(bv, bi, xr[j], j);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        better(bv, bi, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : __int_as_float(0xff800000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            better(bv, bi, ov, oi);
        }
        // all -inf/NaN row: index 0, like numpy's argmax of an all -inf row
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}
