// DSpark Markov-head state math between the projections (the projections are linear.cu).
// One block; r = the head's rank. Matches pydflash.reference.ReferenceDraft.markov_bias.
#include "common.cuh"

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// gated: u = sigmoid(proj + bias) * e, proj = gate_proj([h ; e]) without its bias.
extern "C" __global__ void markov_gated(const float* proj, const float* bias, const float* e,
                                        float* u, int r) {
    for (int i = threadIdx.x; i < r; i += blockDim.x) u[i] = sigmoidf_(proj[i] + bias[i]) * e[i];
}

// rnn: (gate, cand, out) = split(proj + bias); s = sig(gate) s + (1 - sig(gate)) tanh(cand),
// written back into z[0:r] (the next step's input); u = tanh(out).
extern "C" __global__ void markov_rnn(const float* proj, const float* bias, float* z, float* u,
                                      int r) {
    for (int i = threadIdx.x; i < r; i += blockDim.x) {
        const float g = sigmoidf_(proj[i] + bias[i]);
        const float c = tanhf(proj[r + i] + bias[r + i]);
        z[i] = g * z[i] + (1.f - g) * c;
        u[i] = tanhf(proj[2 * r + i] + bias[2 * r + i]);
    }
}
