// Dense transformer kernels of the device-resident model (built by `cargo
// xtask kernels` into kernels/out/dense.fatbin; loaded by crates/kernels
// with the `cuda` feature). Every kernel has a CPU twin in
// crates/kernels/src/dense.rs and a device test against it.
//
// Conventions: the residual stream, master weights, norms' 1/rms and
// gradients of embeddings and gains are f32; GEMM inputs and outputs are
// bf16 (raw uint16 bit patterns); all row-major. The GEMMs themselves are
// the grouped CUTLASS GEMM of liblrmoe_grouped_gemm.

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float bf(uint16_t u) { return __uint_as_float(static_cast<uint32_t>(u) << 16); }
__device__ __forceinline__ uint16_t to_bf(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load(const uint16_t* p, long long i) { return bf(p[i]); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// x[i, :] = table[tok[i], :] (f32 rows of d); add = 1: x[i, :] += it (a
// learned position embedding on top of the token embedding).
extern "C" __global__ void embed_fwd(const float* __restrict__ table, const uint32_t* __restrict__ tok,
                                     float* __restrict__ x, int n, int d, int add) {
    long long total = (long long)n * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d, c = i % d;
        float v = table[(long long)tok[r] * d + c];
        x[i] = add ? x[i] + v : v;
    }
}

// A batch from a corpus on the device: sequence b is corpus[starts[b] ..
// starts[b] + seq], its targets the next tokens.
extern "C" __global__ void batch_gather(const uint32_t* __restrict__ corpus, const uint32_t* __restrict__ starts,
                                        uint32_t* __restrict__ tok, uint32_t* __restrict__ tgt, int n_seq, int seq) {
    long long total = (long long)n_seq * seq;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long at = (long long)starts[i / seq] + i % seq;
        tok[i] = corpus[at];
        tgt[i] = corpus[at + 1];
    }
}

// dtable[tok[i], :] += dx[i, :] (atomic: tokens repeat).
extern "C" __global__ void embed_bwd(const float* __restrict__ dx, const uint32_t* __restrict__ tok,
                                     float* __restrict__ dtable, int n, int d) {
    long long total = (long long)n * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d, c = i % d;
        atomicAdd(dtable + (long long)tok[r] * d + c, dx[i]);
    }
}

// y = x / rms(x) ⊙ w per row of d (one warp per row), inv[row] = 1 / rms.
template <typename X>
__device__ void rmsnorm_fwd(const X* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ y,
                            float* __restrict__ inv, int rows, int d, float eps) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const X* xr = x + (long long)r * d;
        float s = 0.f;
        for (int i = lane; i < d; i += 32) {
            float v = load(xr, i);
            s = fmaf(v, v, s);
        }
        s = warp_sum(s);
        float iv = rsqrtf(s / d + eps);
        uint16_t* yr = y + (long long)r * d;
        for (int i = lane; i < d; i += 32) yr[i] = to_bf(load(xr, i) * iv * w[i]);
        if (lane == 0) inv[r] = iv;
    }
}
extern "C" __global__ void rmsnorm_fwd_f32(const float* x, const float* w, uint16_t* y, float* inv, int rows, int d,
                                           float eps) {
    rmsnorm_fwd(x, w, y, inv, rows, d, eps);
}
extern "C" __global__ void rmsnorm_fwd_bf16(const uint16_t* x, const float* w, uint16_t* y, float* inv, int rows,
                                            int d, float eps) {
    rmsnorm_fwd(x, w, y, inv, rows, d, eps);
}

// Backward of rmsnorm_fwd: dx = dy⊙w·inv − x·(Σ dy⊙w⊙x)·inv³/d per row;
// dw += Σ_rows dy⊙x·inv. One warp per row; each block sums its rows' dw in
// shared memory (d floats) and adds it to dw once. DX f32: added into dx
// (the residual stream's gradient); DX bf16: written.
template <typename X, typename DX>
__device__ void rmsnorm_bwd(const X* __restrict__ x, const float* __restrict__ w, const float* __restrict__ inv,
                            const uint16_t* __restrict__ dy, DX* __restrict__ dx, float* __restrict__ dw, int rows,
                            int d) {
    extern __shared__ float sdw[];
    for (int i = threadIdx.x; i < d; i += blockDim.x) sdw[i] = 0.f;
    __syncthreads();
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const X* xr = x + (long long)r * d;
        const uint16_t* gr = dy + (long long)r * d;
        float iv = inv[r];
        float dot = 0.f;
        for (int i = lane; i < d; i += 32) dot = fmaf(bf(gr[i]) * w[i], load(xr, i), dot);
        dot = warp_sum(dot);
        float c = dot * iv * iv * iv / d;
        DX* dr = dx + (long long)r * d;
        for (int i = lane; i < d; i += 32) {
            float g = bf(gr[i]), xv = load(xr, i);
            float v = g * w[i] * iv - xv * c;
            if constexpr (sizeof(DX) == 4) {
                dr[i] += v;
            } else {
                dr[i] = to_bf(v);
            }
            atomicAdd(&sdw[i], g * xv * iv);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(dw + i, sdw[i]);
}
extern "C" __global__ void rmsnorm_bwd_f32(const float* x, const float* w, const float* inv, const uint16_t* dy,
                                           float* dx, float* dw, int rows, int d) {
    rmsnorm_bwd(x, w, inv, dy, dx, dw, rows, d);
}
extern "C" __global__ void rmsnorm_bwd_bf16(const uint16_t* x, const float* w, const float* inv, const uint16_t* dy,
                                            uint16_t* dx, float* dw, int rows, int d) {
    rmsnorm_bwd(x, w, inv, dy, dx, dw, rows, d);
}

// Token-major rows [n_seq·seq, heads·dh] ↔ head-major [n_seq, heads, seq,
// dh]. to_heads = 1: token → head layout, rotating by RoPE (base theta, 0 =
// no rotation; dimension j < dh/2 pairs with j + dh/2, angle pos·θ^(−2j/dh));
// to_heads = 0: head → token layout, rotating by the negative angle (the
// backward of the forward's rotation). One thread per (row, head, pair).
extern "C" __global__ void heads_bf16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int n_seq,
                                      int seq, int heads, int dh, float theta, int to_heads) {
    int half = dh >> 1;
    long long total = (long long)n_seq * seq * heads * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int j = (int)(i % half);
        long long t = i / half;
        int h = (int)(t % heads);
        long long tok = t / heads;  // sequence · seq + position
        int pos = (int)(tok % seq);
        long long b = tok / seq;
        long long tix = tok * heads * dh + (long long)h * dh;
        long long hix = ((b * heads + h) * seq + pos) * dh;
        long long si = to_heads ? tix : hix, di = to_heads ? hix : tix;
        float x1 = bf(src[si + j]), x2 = bf(src[si + j + half]);
        if (theta > 0.f) {
            float freq = powf(theta, -2.f * (float)j / (float)dh);
            float s, c;
            sincosf((float)pos * freq, &s, &c);
            if (!to_heads) s = -s;
            float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
            x1 = y1;
            x2 = y2;
        }
        dst[di + j] = to_bf(x1);
        dst[di + j + half] = to_bf(x2);
    }
}

// Causal softmax of scores rows (bf16, rows of seq; row r is position
// r % seq): p[j] = exp(scale·s[j] − max) / Σ for j ≤ pos, 0 after. One warp
// per row.
extern "C" __global__ void softmax_causal_fwd(const uint16_t* __restrict__ s, uint16_t* __restrict__ p, int rows,
                                              int seq, float scale) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        int pos = r % seq;
        const uint16_t* sr = s + (long long)r * seq;
        uint16_t* pr = p + (long long)r * seq;
        float m = -INFINITY;
        for (int j = lane; j <= pos; j += 32) m = fmaxf(m, scale * bf(sr[j]));
        m = warp_max(m);
        float sum = 0.f;
        for (int j = lane; j <= pos; j += 32) sum += __expf(scale * bf(sr[j]) - m);
        sum = warp_sum(sum);
        float is = 1.f / sum;
        for (int j = lane; j < seq; j += 32) pr[j] = j <= pos ? to_bf(__expf(scale * bf(sr[j]) - m) * is) : 0;
    }
}

// ds = scale · p ⊙ (dp − Σ_j p·dp) per row (masked entries have p = 0).
extern "C" __global__ void softmax_causal_bwd(const uint16_t* __restrict__ p, const uint16_t* __restrict__ dp,
                                              uint16_t* __restrict__ ds, int rows, int seq, float scale) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        int pos = r % seq;
        const uint16_t* pr = p + (long long)r * seq;
        const uint16_t* gr = dp + (long long)r * seq;
        uint16_t* dr = ds + (long long)r * seq;
        float dot = 0.f;
        for (int j = lane; j <= pos; j += 32) dot = fmaf(bf(pr[j]), bf(gr[j]), dot);
        dot = warp_sum(dot);
        for (int j = lane; j < seq; j += 32) dr[j] = j <= pos ? to_bf(scale * bf(pr[j]) * (bf(gr[j]) - dot)) : 0;
    }
}

// x += y (f32 residual += bf16 branch output).
extern "C" __global__ void add_into_f32(float* __restrict__ x, const uint16_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bf(y[i]);
}

// Fused cross-entropy over bf16 logits rows of v (one block per row):
// loss_sum += −log softmax(logits)[target] (f32 atomic), dlogits =
// (softmax − onehot) · inv_n as bf16.
extern "C" __global__ void cross_entropy(const uint16_t* __restrict__ logits, const uint32_t* __restrict__ target,
                                         float* __restrict__ loss_sum, uint16_t* __restrict__ dlogits, int n, int v,
                                         float inv_n) {
    __shared__ float red[32];
    __shared__ float bcast;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const uint16_t* lr = logits + (long long)r * v;
        float m = -INFINITY;
        for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, bf(lr[j]));
        m = warp_max(m);
        if (lane == 0) red[wid] = m;
        __syncthreads();
        if (wid == 0) {
            float t = lane < nw ? red[lane] : -INFINITY;
            t = warp_max(t);
            if (lane == 0) bcast = t;
        }
        __syncthreads();
        m = bcast;
        __syncthreads();
        float s = 0.f;
        for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(bf(lr[j]) - m);
        s = warp_sum(s);
        if (lane == 0) red[wid] = s;
        __syncthreads();
        if (wid == 0) {
            float t = lane < nw ? red[lane] : 0.f;
            t = warp_sum(t);
            if (lane == 0) bcast = t;
        }
        __syncthreads();
        s = bcast;
        uint32_t tg = target[r];
        float is = 1.f / s;
        uint16_t* dr = dlogits + (long long)r * v;
        for (int j = threadIdx.x; j < v; j += blockDim.x) {
            float pj = __expf(bf(lr[j]) - m) * is;
            dr[j] = to_bf((pj - (j == (int)tg ? 1.f : 0.f)) * inv_n);
        }
        if (threadIdx.x == 0) atomicAdd(loss_sum, logf(s) + m - bf(lr[tg]));
        __syncthreads();
    }
}

// out[0] += Σ x² (gradient norms; f32 or bf16 input).
template <typename G>
__device__ void sq_sum(const G* __restrict__ x, float* __restrict__ out, long long n) {
    __shared__ float red[32];
    float s = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = load(x, i);
        s = fmaf(v, v, s);
    }
    s = warp_sum(s);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) red[wid] = s;
    __syncthreads();
    if (wid == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) atomicAdd(out, t);
    }
}
extern "C" __global__ void sq_sum_f32(const float* x, float* out, long long n) { sq_sum(x, out, n); }
extern "C" __global__ void sq_sum_bf16(const uint16_t* x, float* out, long long n) { sq_sum(x, out, n); }

// One AdamW update (the host optimizer's formula, f32): the gradient is
// scaled by clip / ‖g‖ when clip > 0 and ‖g‖ = sqrt(*norm_sq) exceeds it;
// m, v updated; p −= lr·(m̂ / (sqrt(v̂) + eps) + wd·p); the bf16 copy of p
// written when given.
template <typename G>
__device__ void adamw(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, const G* __restrict__ g,
                      uint16_t* __restrict__ p16, long long n, float lr, float b1, float b2, float eps, float wd,
                      float bc1, float bc2, const float* __restrict__ norm_sq, float clip) {
    float norm = sqrtf(*norm_sq);
    float scale = (clip > 0.f && norm > clip) ? clip / norm : 1.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float gi = load(g, i) * scale;
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = p[i];
        pi -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * pi);
        p[i] = pi;
        if (p16) p16[i] = to_bf(pi);
    }
}
extern "C" __global__ void adamw_f32(float* p, float* m, float* v, const float* g, uint16_t* p16, long long n,
                                     float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                                     const float* norm_sq, float clip) {
    adamw(p, m, v, g, p16, n, lr, b1, b2, eps, wd, bc1, bc2, norm_sq, clip);
}
extern "C" __global__ void adamw_bf16(float* p, float* m, float* v, const uint16_t* g, uint16_t* p16, long long n,
                                      float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                                      const float* norm_sq, float clip) {
    adamw(p, m, v, g, p16, n, lr, b1, b2, eps, wd, bc1, bc2, norm_sq, clip);
}

// x += y (f32; gradients accumulated over micro-batches).
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// y = bf16(x) (weights' working copies, the residual's input to a GEMM).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, uint16_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = to_bf(x[i]);
}
