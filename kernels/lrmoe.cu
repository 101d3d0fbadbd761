// lrmoe CUDA kernels (built by `cargo xtask kernels`; loaded by crates/kernels
// with the `cuda` feature). Every kernel has a CPU twin in
// crates/kernels/src/cpu.rs and a device test against it.
//
// bf16 tensors travel as raw uint16 bit patterns; all row-major.

#include <cuda_bf16.h>
#include <stdint.h>

#include "limits.cuh"  // DROPPED, LRMOE_MAX_TOP_K, LRMOE_MAX_BLOCK_THREADS

__device__ __forceinline__ float bf16_sq_sum8(uint4 u) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&u);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(p[i]);
        s = fmaf(f.x, f.x, s);
        s = fmaf(f.y, f.y, s);
    }
    return s;
}

__device__ __forceinline__ float bf16_dot8(uint4 u, uint4 w) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&u);
    const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&w);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 a = __bfloat1622float2(p[i]);
        float2 b = __bfloat1622float2(q[i]);
        s = fmaf(a.x, b.x, s);
        s = fmaf(a.y, b.y, s);
    }
    return s;
}

// Dot product of two bf16 rows of `d` elements, by one warp (every lane
// gets the sum). 16-byte loads, two pairs in flight per lane, where both
// rows are 16-byte aligned and `d` is a multiple of 8; scalar otherwise.
__device__ __forceinline__ float row_dot(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b, int d,
                                         int lane);

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float row_dot(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b, int d,
                                         int lane) {
    float acc = 0.f;
    if (((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0 && (d & 7) == 0) {
        const uint4* u = reinterpret_cast<const uint4*>(a);
        const uint4* w = reinterpret_cast<const uint4*>(b);
        int nv = d >> 3;
        int i = lane;
        for (; i + 32 < nv; i += 64) {
            uint4 u0 = __ldg(u + i), w0 = __ldg(w + i), u1 = __ldg(u + i + 32), w1 = __ldg(w + i + 32);
            acc += bf16_dot8(u0, w0) + bf16_dot8(u1, w1);
        }
        for (; i < nv; i += 32) acc += bf16_dot8(__ldg(u + i), __ldg(w + i));
    } else {
        for (int i = lane; i < d; i += 32)
            acc = fmaf(__uint_as_float(static_cast<uint32_t>(a[i]) << 16),
                       __uint_as_float(static_cast<uint32_t>(b[i]) << 16), acc);
    }
    return warp_sum(acc);
}

// Sum of squares of one bf16 row of `d` elements, by one warp. Rows whose
// start is 16-byte aligned and whose width is a multiple of 8 take 16-byte
// loads, four in flight per lane; others fall back to scalar loads.
__device__ __forceinline__ float row_sq_norm(const uint16_t* __restrict__ row, int d, int lane) {
    float acc = 0.f;
    if ((reinterpret_cast<uintptr_t>(row) & 15) == 0 && (d & 7) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(row);
        int nv = d >> 3;
        int i = lane;
        for (; i + 96 < nv; i += 128) {
            uint4 a = __ldg(v + i), b = __ldg(v + i + 32), c = __ldg(v + i + 64), e = __ldg(v + i + 96);
            acc += bf16_sq_sum8(a) + bf16_sq_sum8(b) + bf16_sq_sum8(c) + bf16_sq_sum8(e);
        }
        for (; i < nv; i += 32) acc += bf16_sq_sum8(__ldg(v + i));
    } else {
        for (int i = lane; i < d; i += 32) {
            float x = __uint_as_float(static_cast<uint32_t>(__ldg(row + i)) << 16);
            acc = fmaf(x, x, acc);
        }
    }
    return warp_sum(acc);
}

// LRM scores: out[i] = gate[i]^2 * ||delta_i||^2 * ||h_i||^2.
//   h:     device, [n, d_in]  bf16 bits
//   delta: device, [n, d_out] bf16 bits
//   gate:  device, [n] f32
//   out:   device, [n] f32
// One warp per row, grid-stride over rows.
extern "C" __global__ void lrm_scores_bf16(const uint16_t* __restrict__ h, const uint16_t* __restrict__ delta,
                                           const float* __restrict__ gate, float* __restrict__ out, int n,
                                           int d_in, int d_out) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = warp; r < n; r += n_warps) {
        float sh = row_sq_norm(h + static_cast<size_t>(r) * d_in, d_in, lane);
        float sd = row_sq_norm(delta + static_cast<size_t>(r) * d_out, d_out, lane);
        if (lane == 0) {
            float g = gate[r];
            out[r] = g * g * sd * sh;
        }
    }
}

// Copies one row of `width` u16 elements, by one warp.
__device__ __forceinline__ void copy_row(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int width,
                                         int lane) {
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0 && (width & 7) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        int nv = width >> 3;
        int i = lane;
        // Four 16-byte loads in flight per lane before the stores (a
        // 2048-wide row is 8 per lane: two rounds).
        for (; i + 96 < nv; i += 128) {
            uint4 a = __ldg(s + i), b = __ldg(s + i + 32), c = __ldg(s + i + 64), e = __ldg(s + i + 96);
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i + 32 < nv; i += 64) {
            uint4 a = __ldg(s + i), b = __ldg(s + i + 32);
            d[i] = a;
            d[i + 32] = b;
        }
        for (; i < nv; i += 32) d[i] = __ldg(s + i);
    } else {
        for (int i = lane; i < width; i += 32) dst[i] = __ldg(src + i);
    }
}

// Pack (gather): out[j] = src[idx[j]] row by row.
//   src: device, [n_src, width] u16 (bf16 bits)
//   idx: device, [n_out] u32, each < n_src
//   out: device, [n_out, width] u16
extern "C" __global__ void gather_rows_u16(const uint16_t* __restrict__ src, const uint32_t* __restrict__ idx,
                                           uint16_t* __restrict__ out, int n_out, int width) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int j = warp; j < n_out; j += n_warps) {
        copy_row(src + static_cast<size_t>(idx[j]) * width, out + static_cast<size_t>(j) * width, width, lane);
    }
}

// Unpack (scatter back): out[i] = packed[inverse[i]], or zeros where
// inverse[i] == DROPPED.
//   packed:  device, [n_packed, width] u16
//   inverse: device, [n] u32
//   out:     device, [n, width] u16
extern "C" __global__ void unpack_rows_u16(const uint16_t* __restrict__ packed, const uint32_t* __restrict__ inverse,
                                           uint16_t* __restrict__ out, int n, int width) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int i = warp; i < n; i += n_warps) {
        uint32_t p = inverse[i];
        uint16_t* dst = out + static_cast<size_t>(i) * width;
        if (p == DROPPED) {
            if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && (width & 7) == 0) {
                uint4* d = reinterpret_cast<uint4*>(dst);
                for (int k = lane; k < (width >> 3); k += 32) d[k] = make_uint4(0, 0, 0, 0);
            } else {
                for (int k = lane; k < width; k += 32) dst[k] = 0;
            }
        } else {
            copy_row(packed + static_cast<size_t>(p) * width, dst, width, lane);
        }
    }
}

// Per-expert top-q selection.
//   scores:  device, [n_pairs] f32, grouped by expert (finite, >= 0)
//   ids:     device, [n_pairs] u32, ties go to the smaller id
//   offsets: device, [n_experts + 1] u32, expert e owns [offsets[e], offsets[e+1])
//   quotas:  device, [n_experts] u32
//   kept:    device, [n_pairs] u8 (1 kept, 0 dropped)
//   error:   device, [1] u32, set to 1 if a score is NaN or infinite
// One block per expert. The q-th best pair is found by a radix select over
// the 64-bit key (score bits << 32 | ~id), 8 bits per pass, whose order is
// the tie rule itself, so exactly min(q, n) pairs are kept. It stops as soon
// as the bucket holding the threshold is kept whole (at most eight passes).
__device__ __forceinline__ unsigned long long select_key(float s, uint32_t id) {
    // Non-negative floats order like their bit patterns; -0.0 maps to +0.0.
    uint32_t b = __float_as_uint(s) & 0x7fffffffu;
    return (static_cast<unsigned long long>(b) << 32) | static_cast<unsigned long long>(~id);
}

extern "C" __global__ void select_top_q(const float* __restrict__ scores, const uint32_t* __restrict__ ids,
                                        const uint32_t* __restrict__ offsets, const uint32_t* __restrict__ quotas,
                                        uint8_t* __restrict__ kept, uint32_t* __restrict__ error) {
    __shared__ uint32_t hist[256];
    __shared__ unsigned long long prefix;
    __shared__ uint32_t remaining;
    __shared__ int done;
    int e = blockIdx.x;
    uint32_t lo = offsets[e], hi = offsets[e + 1];
    uint32_t n = hi - lo;
    uint32_t q = min(quotas[e], n);
    for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float s = scores[i];
        if (!isfinite(s) || s < 0.f) atomicOr(error, 1u);
    }
    if (q == 0 || q == n) {
        for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x) kept[i] = q == n ? 1 : 0;
        return;
    }
    if (threadIdx.x == 0) {
        prefix = 0ull;
        remaining = q;
        done = 0;
    }
    unsigned long long mask = 0ull;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        unsigned long long p = prefix;
        for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            unsigned long long k = select_key(scores[i], ids[i]);
            if ((k & mask) == p) atomicAdd(&hist[(k >> shift) & 255ull], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t need = remaining, above = 0;
            int b = 255;
            for (; b > 0; --b) {
                if (above + hist[b] >= need) break;
                above += hist[b];
            }
            remaining = need - above;
            prefix = p | (static_cast<unsigned long long>(b) << shift);
            // Every key left in the threshold's bucket is kept: the kept
            // keys are then exactly those whose digits so far are at least
            // the prefix's, and the lower digits cannot change the set
            // (usually after two passes rather than eight).
            done = hist[b] == need - above;
        }
        mask |= 255ull << shift;
        __syncthreads();
        if (done) break;
    }
    unsigned long long t = prefix;
    for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        kept[i] = (select_key(scores[i], ids[i]) & mask) >= t ? 1 : 0;
}

__device__ __forceinline__ float bf(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
__device__ __forceinline__ uint16_t to_bf(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float sigmoidf(float a) { return 1.f / (1.f + expf(-a)); }

// SwiGLU forward: h = silu(a) * b, element-wise, f32 math, bf16 (RNE) out.
//   a, b, h: device, [n] bf16 bits
// Each thread handles 8 consecutive elements with 16-byte accesses when the
// three pointers are 16-byte aligned; a scalar loop covers the rest.
__device__ __forceinline__ uint16_t swiglu1(uint16_t a, uint16_t b) {
    float x = bf(a);
    return to_bf(x * sigmoidf(x) * bf(b));
}

extern "C" __global__ void swiglu_fwd_bf16(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
                                           uint16_t* __restrict__ h, long long n) {
    long long tid = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
    long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    bool aligned = ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(h)) & 15) == 0;
    long long n_vec = aligned ? n / 8 : 0;
    for (long long v = tid; v < n_vec; v += stride) {
        uint4 ua = __ldg(reinterpret_cast<const uint4*>(a) + v), ub = __ldg(reinterpret_cast<const uint4*>(b) + v);
        const uint16_t* pa = reinterpret_cast<const uint16_t*>(&ua);
        const uint16_t* pb = reinterpret_cast<const uint16_t*>(&ub);
        uint4 uh;
        uint16_t* ph = reinterpret_cast<uint16_t*>(&uh);
#pragma unroll
        for (int j = 0; j < 8; ++j) ph[j] = swiglu1(pa[j], pb[j]);
        reinterpret_cast<uint4*>(h)[v] = uh;
    }
    for (long long i = n_vec * 8 + tid; i < n; i += stride) h[i] = swiglu1(a[i], b[i]);
}

// SwiGLU backward: da = dh * b * silu'(a), db = dh * silu(a).
//   a, b, dh, da, db: device, [n] bf16 bits
extern "C" __global__ void swiglu_bwd_bf16(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
                                           const uint16_t* __restrict__ dh, uint16_t* __restrict__ da,
                                           uint16_t* __restrict__ db, long long n) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        float x = bf(a[i]), y = bf(b[i]), g = bf(dh[i]);
        float s = sigmoidf(x);
        da[i] = to_bf(g * y * s * (1.f + x * (1.f - s)));
        db[i] = to_bf(g * x * s);
    }
}

// Router: softmax over E logits, top-k (ties to the lower expert), optional
// renormalisation of the k weights. One warp per token.
//   logits: device, [t, e] f32
//   probs:  device, [t, e] f32
//   idx:    device, [t, k] u32 (descending probability)
//   gates:  device, [t, k] f32
// Softmax and top-k of each row of logits. `sel_bias` (nullable, one per
// expert) is added to the probabilities for the choice only (DeepSeek-V3's
// auxiliary-loss-free balancing bias); the gates are the unbiased
// probabilities of the chosen experts.
extern "C" __global__ void router_topk(const float* __restrict__ logits, const float* __restrict__ sel_bias,
                                       float* __restrict__ probs, uint32_t* __restrict__ idx,
                                       float* __restrict__ gates, int t, int e, int k, int renormalize) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = warp; r < t; r += n_warps) {
        const float* l = logits + static_cast<size_t>(r) * e;
        float* p = probs + static_cast<size_t>(r) * e;
        float m = -INFINITY;
        for (int i = lane; i < e; i += 32) m = fmaxf(m, l[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float s = 0.f;
        for (int i = lane; i < e; i += 32) s += expf(l[i] - m);
        s = warp_sum(s);
        for (int i = lane; i < e; i += 32) p[i] = expf(l[i] - m) / s;
        __syncwarp();
        float total = 0.f;
        uint32_t prev_i = 0xffffffffu;
        float prev_v = INFINITY;
        for (int j = 0; j < k; ++j) {
            // Best (value, index) strictly after (prev_v, prev_i) in the order
            // "higher value, then lower index".
            // A NaN key (a NaN input row) ranks as -inf, so every row picks
            // k valid experts (its gates stay NaN: the backward's scores
            // refuse them); -inf start: a bias below -1 still ranks.
            float bv = -INFINITY;
            uint32_t bi = 0xffffffffu;
            for (int i = lane; i < e; i += 32) {
                float v = sel_bias ? p[i] + sel_bias[i] : p[i];
                if (v != v) v = -INFINITY;
                bool after = v < prev_v || (v == prev_v && static_cast<uint32_t>(i) > prev_i);
                bool better = v > bv || (v == bv && static_cast<uint32_t>(i) < bi);
                if (after && better) {
                    bv = v;
                    bi = i;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            float g = p[bi];
            if (lane == 0) {
                idx[static_cast<size_t>(r) * k + j] = bi;
                gates[static_cast<size_t>(r) * k + j] = g;
            }
            total += g;
            prev_v = bv;
            prev_i = bi;
        }
        if (renormalize && lane == 0) {
            for (int j = 0; j < k; ++j) gates[static_cast<size_t>(r) * k + j] /= total;
        }
    }
}

// Combine: y[t] = sum_j gate[t, j] * o[row[t, j]], f32 accumulation, bf16
// out; rows equal to DROPPED contribute nothing. One warp per token; no
// atomics, so the result is deterministic.
//   o:     device, [n_rows, h] bf16 bits (expert outputs, any order)
//   row:   device, [t, k] u32 (row of o for each pair, or DROPPED)
//   gates: device, [t, k] f32, or null for all-ones (a plain scatter-add)
//   base:  device, [t, h] bf16 bits added in f32 before the one rounding, or
//          null (so a scatter-add onto another gradient is one pass)
//   y:     device, [t, h] bf16 bits
extern "C" __global__ void combine_bf16(const uint16_t* __restrict__ o, const uint32_t* __restrict__ row,
                                        const float* __restrict__ gates, const uint16_t* __restrict__ base,
                                        uint16_t* __restrict__ y, int t, int h, int k) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    // 16-byte path: each lane owns 8 consecutive columns per step.
    bool vec = (h & 7) == 0 &&
               ((reinterpret_cast<uintptr_t>(o) | reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(base)) &
                15) == 0;
    for (int r = warp; r < t; r += n_warps) {
        const uint32_t* rr = row + static_cast<size_t>(r) * k;
        const float* gg = gates ? gates + static_cast<size_t>(r) * k : nullptr;
        if (vec) {
            // The loop bounds are warp-uniform (the shuffles below need the
            // whole warp); lanes past h only skip their loads and stores.
            for (int c0 = 0; c0 < h; c0 += 256) {
                int c = c0 + lane * 8;
                bool act = c < h;
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                if (base && act) {
                    uint4 u = __ldg(reinterpret_cast<const uint4*>(base + static_cast<size_t>(r) * h + c));
                    const uint16_t* p = reinterpret_cast<const uint16_t*>(&u);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = bf(p[q]);
                }
                // Lane l holds pair j0 + l; the pair rows that are not
                // DROPPED are visited in order, four loads in flight per lane
                // (a backward that keeps few pairs per token would otherwise
                // wait on one row at a time). The sum's order is pair order.
                for (int j0 = 0; j0 < k; j0 += 32) {
                    int j = j0 + lane;
                    uint32_t my_src = j < k ? rr[j] : DROPPED;
                    float my_g = (gg && j < k) ? gg[j] : 1.f;
                    unsigned m = __ballot_sync(0xffffffffu, my_src != DROPPED);
                    while (m) {
                        uint32_t s[4];
                        float g4[4];
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            int l = m ? __ffs(m) - 1 : 0;
                            s[q] = m ? __shfl_sync(0xffffffffu, my_src, l) : DROPPED;
                            g4[q] = __shfl_sync(0xffffffffu, my_g, l);
                            m &= m - 1;
                        }
                        uint4 u[4];
#pragma unroll
                        for (int q = 0; q < 4; ++q)
                            if (act && s[q] != DROPPED)
                                u[q] = __ldg(reinterpret_cast<const uint4*>(o + static_cast<size_t>(s[q]) * h + c));
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            if (act && s[q] != DROPPED) {
                                const uint16_t* p = reinterpret_cast<const uint16_t*>(&u[q]);
#pragma unroll
                                for (int e = 0; e < 8; ++e) acc[e] = fmaf(g4[q], bf(p[e]), acc[e]);
                            }
                        }
                    }
                }
                if (act) {
                    uint4 out;
                    uint16_t* po = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
                    for (int q = 0; q < 8; ++q) po[q] = to_bf(acc[q]);
                    *reinterpret_cast<uint4*>(y + static_cast<size_t>(r) * h + c) = out;
                }
            }
        } else {
            for (int c = lane; c < h; c += 32) {
                float acc = base ? bf(base[static_cast<size_t>(r) * h + c]) : 0.f;
                for (int j = 0; j < k; ++j) {
                    uint32_t src = rr[j];
                    if (src != DROPPED) acc = fmaf(gg ? gg[j] : 1.f, bf(o[static_cast<size_t>(src) * h + c]), acc);
                }
                y[static_cast<size_t>(r) * h + c] = to_bf(acc);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Routing and LRMoE backward helpers for the single-GPU layer.

// Block-wide exclusive scan of one u32 per thread (blockDim.x <= LRMOE_MAX_BLOCK_THREADS).
__device__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* total) {
    __shared__ uint32_t warp_sums[LRMOE_MAX_BLOCK_THREADS / 32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    uint32_t x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[wid] = x;
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) >> 5;
        uint32_t s = lane < nw ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            uint32_t y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < nw) warp_sums[lane] = s;
    }
    __syncthreads();
    uint32_t before = (wid > 0 ? warp_sums[wid - 1] : 0) + x - v;
    *total = warp_sums[((blockDim.x + 31) >> 5) - 1];
    __syncthreads();
    return before;
}

// Stable grouping of pairs by expert (one block per expert, in pair order):
//   expert: device, [n] u32 (expert of each pair; DROPPED = not grouped)
//   keep:   device, [n] u8 or null (only pairs with keep[p] != 0 are grouped)
//   base:   device, [E] u32, first output slot of each expert
//   dst:    device, [n] u32, output slot of each pair (DROPPED if not grouped)
//   src:    device, [sum] u32, pair of each output slot
//   seg:    device, [E + 1] u32 or null: when the input is already grouped by
//           expert, block e scans only [seg[e], seg[e+1]) instead of all n
extern "C" __global__ void group_by_expert(const uint32_t* __restrict__ expert, const uint8_t* __restrict__ keep,
                                           const uint32_t* __restrict__ base, uint32_t* __restrict__ dst,
                                           uint32_t* __restrict__ src, int n, const uint32_t* __restrict__ seg) {
    uint32_t e = blockIdx.x;
    uint32_t next = base[e];
    int lo = seg ? static_cast<int>(seg[e]) : 0;
    int hi = seg ? static_cast<int>(seg[e + 1]) : n;
    for (int start = lo; start < hi; start += blockDim.x) {
        int p = start + threadIdx.x;
        bool mine = p < hi && expert[p] == e && (keep == nullptr || keep[p] != 0);
        uint32_t total;
        uint32_t rank = block_exclusive_scan(mine ? 1u : 0u, &total);
        if (mine) {
            dst[p] = next + rank;
            src[next + rank] = p;
        }
        next += total;
    }
}

// Rows per key: counts[b] += #{p : key[p] == b && (keep == null || keep[p] != 0)}
// for b < groups (other keys are not counted; counts zeroed by the caller).
// Grid-stride over the rows; each block counts into shared bins (global ones
// when `shared_bins` is 0: too many groups for shared memory), lanes with the
// same key add once per warp (sorted keys, as expert-major rows have, would
// otherwise serialise 32 atomics on one bin), and each block adds its bins
// into counts. Integer adds: the result does not depend on the order.
extern "C" __global__ void key_counts(const uint32_t* __restrict__ key, const uint8_t* __restrict__ keep,
                                      uint32_t* __restrict__ counts, int n, int groups, int shared_bins) {
    extern __shared__ uint32_t bins[];
    uint32_t* to = shared_bins ? bins : counts;
    if (shared_bins) {
        for (int b = threadIdx.x; b < groups; b += blockDim.x) bins[b] = 0;
        __syncthreads();
    }
    int lane = threadIdx.x & 31;
    // The loop bound is warp-uniform, so every lane takes part in the match.
    for (int base = blockIdx.x * blockDim.x; base < n; base += gridDim.x * blockDim.x) {
        int p = base + threadIdx.x;
        uint32_t k = p < n ? key[p] : 0xFFFFFFFFu;
        bool counted = p < n && k < static_cast<uint32_t>(groups) && (keep == nullptr || keep[p] != 0);
        uint32_t tag = counted ? k : 0xFFFFFFFFu;
        unsigned peers = __match_any_sync(0xFFFFFFFFu, tag);
        if (counted && lane == __ffs(peers) - 1) atomicAdd(&to[k], static_cast<uint32_t>(__popc(peers)));
    }
    if (shared_bins) {
        __syncthreads();
        for (int b = threadIdx.x; b < groups; b += blockDim.x)
            if (bins[b]) atomicAdd(&counts[b], bins[b]);
    }
}

// Runs expanded: out[dst + i] = src + i * step for each [dst, src, n] triple
// of `runs` (ascending dst, tiling 0..len; checked on the host). One thread
// per entry finds its run by binary search over the runs' starts.
extern "C" __global__ void expand_runs(const uint32_t* __restrict__ runs, int n_runs, uint32_t step,
                                       uint32_t* __restrict__ out, int len) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < len; j += gridDim.x * blockDim.x) {
        int lo = 0, hi = n_runs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (runs[3 * mid] <= static_cast<uint32_t>(j)) lo = mid;
            else hi = mid - 1;
        }
        out[j] = runs[3 * lo + 1] + (static_cast<uint32_t>(j) - runs[3 * lo]) * step;
    }
}

// Byte gather: out[j] = src[idx[j]].
extern "C" __global__ void gather_u8(const uint8_t* __restrict__ src, const uint32_t* __restrict__ idx,
                                     uint8_t* __restrict__ out, int n) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) out[j] = src[idx[j]];
}

// Gather with a per-pair scale: out[j] = scale[pair[j]] * src[pair[j] / div]
// (bf16; scale may be null for 1.0).
//   src:  device, [rows, width] bf16 bits
//   pair: device, [n_out] u32
extern "C" __global__ void gather_scaled_u16(const uint16_t* __restrict__ src, const uint32_t* __restrict__ pair,
                                             int div, const float* __restrict__ scale, uint16_t* __restrict__ out,
                                             int n_out, int width) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int j = warp; j < n_out; j += n_warps) {
        uint32_t p = pair[j];
        const uint16_t* s = src + static_cast<size_t>(p / div) * width;
        uint16_t* d = out + static_cast<size_t>(j) * width;
        float g = scale ? scale[p] : 1.f;
        for (int c = lane; c < width; c += 32) d[c] = to_bf(g * bf(s[c]));
    }
}

// out[j] = src[idx[j]] for 32-bit values; DROPPED indices give DROPPED.
extern "C" __global__ void gather_32(const uint32_t* __restrict__ src, const uint32_t* __restrict__ idx,
                                     uint32_t* __restrict__ out, int n) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        uint32_t i = idx[j];
        out[j] = i == DROPPED ? DROPPED : src[i];
    }
}

// out = a + b (bf16, f32 math).
extern "C" __global__ void add_bf16(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
                                    uint16_t* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = to_bf(bf(a[i]) + bf(b[i]));
}

// bf16 -> f32.
extern "C" __global__ void bf16_to_f32(const uint16_t* __restrict__ a, float* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = bf(a[i]);
}

// Logits with a per-column bias (the hot-expert workload): out[i] = a[i] +
// bias[i % cols], f32.
//   a: [n] bf16 bits (rows × cols); bias: [cols] f32; out: [n] f32
extern "C" __global__ void bf16_to_f32_bias(const uint16_t* __restrict__ a, const float* __restrict__ bias,
                                            float* __restrict__ out, long long n, int cols) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = bf(a[i]) + bias[i % cols];
}

// Priority sampling keys (the device form of lrm_score's priority rule):
// rho[i] = sqrt(score[i]) / u(seed, id[i]) in f64, rounded to f32, with
// u in (0, 1] from the SplitMix64 finaliser of (seed, id) — the same u as
// lrm_score::uniform. Twin: kernels::cpu::priority_keys_reference.
__device__ __forceinline__ double uniform01(unsigned long long seed, unsigned long long id) {
    unsigned long long z = seed ^ (id * 0x9E3779B97F4A7C15ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>((z >> 11) + 1ull) / 9007199254740992.0;
}

extern "C" __global__ void priority_keys(const float* __restrict__ score, const uint32_t* __restrict__ id,
                                         unsigned long long seed, float* __restrict__ rho, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        rho[i] = static_cast<float>(sqrt(static_cast<double>(score[i])) / uniform01(seed, id[i]));
}

// Priority sampling weights, one block per expert segment [offsets[e],
// offsets[e+1]): tau = the key of the one row kept at quota q + 1 but not
// at q (0 when the expert keeps every row); kept rows get
// w = max(a, tau) / a with a = sqrt(score) (1 where a = 0), dropped rows 0.
// Twin: kernels::cpu::priority_weights_reference.
extern "C" __global__ void priority_weights(const float* __restrict__ rho, const float* __restrict__ score,
                                            const uint8_t* __restrict__ kept_q, const uint8_t* __restrict__ kept_q1,
                                            const uint32_t* __restrict__ offsets, float* __restrict__ w) {
    __shared__ float tau;
    uint32_t lo = offsets[blockIdx.x], hi = offsets[blockIdx.x + 1];
    if (threadIdx.x == 0) tau = 0.f;
    __syncthreads();
    for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        if (kept_q1[i] && !kept_q[i]) tau = rho[i];
    __syncthreads();
    double t = static_cast<double>(tau);
    for (uint32_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        double a = sqrt(static_cast<double>(score[i]));
        w[i] = kept_q[i] ? (a > 0.0 ? static_cast<float>(fmax(a, t) / a) : 1.f) : 0.f;
    }
}

// out = a * b (f32).
extern "C" __global__ void mul_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                                   int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] * b[i];
}

// Router backward for one token per warp. dg[p] = dy[t] . o[row[p]] for
// each of its k pairs (o in grouped order), then through the optional
// renormalisation and the softmax: dlogits [t, e] as bf16.
//   dy: [t, h] bf16; o: [rows, h] bf16; row: [t*k] u32 (grouped row of each pair)
//   probs: [t, e] f32; idx: [t*k] u32; gates: [t*k] f32
// `aux_dp` (nullable, one per expert) is the auxiliary balancing loss's
// gradient with respect to every probability of every token, added before
// the softmax backward.
extern "C" __global__ void router_backward(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ o,
                                           const uint32_t* __restrict__ row, const float* __restrict__ probs,
                                           const uint32_t* __restrict__ idx, const float* __restrict__ gates,
                                           const float* __restrict__ aux_dp, uint16_t* __restrict__ dlogits,
                                           int t, int h, int e, int k, int renormalize) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    bool vec = ((reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(o)) & 15) == 0 && (h & 7) == 0;
    for (int r = warp; r < t; r += n_warps) {
        const float* p = probs + static_cast<size_t>(r) * e;
        const uint16_t* dyr = dy + static_cast<size_t>(r) * h;
        float dgv[LRMOE_MAX_TOP_K];  // k <= LRMOE_MAX_TOP_K (checked by the wrapper)
        // The k dot products <dy_r, o_pair> in one pass over dy_r: each
        // 16-byte chunk of dy_r is loaded once, beside the same chunk of up
        // to eight pair rows (eight loads in flight per lane).
        for (int j0 = 0; j0 < k; j0 += 8) {
            int m = min(8, k - j0);
            const uint16_t* src[8];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
                src[jj] = o + static_cast<size_t>(row[static_cast<size_t>(r) * k + j0 + min(jj, m - 1)]) * h;
            float acc[8];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) acc[jj] = 0.f;
            if (vec) {
                const uint4* u = reinterpret_cast<const uint4*>(dyr);
                int nv = h >> 3;
                for (int i = lane; i < nv; i += 32) {
                    uint4 a = __ldg(u + i);
                    uint4 w[8];
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj)
                        if (jj < m) w[jj] = __ldg(reinterpret_cast<const uint4*>(src[jj]) + i);
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj)
                        if (jj < m) acc[jj] += bf16_dot8(a, w[jj]);
                }
            } else {
                for (int i = lane; i < h; i += 32) {
                    float a = __uint_as_float(static_cast<uint32_t>(dyr[i]) << 16);
#pragma unroll
                    for (int jj = 0; jj < 8; ++jj)
                        if (jj < m) acc[jj] = fmaf(a, __uint_as_float(static_cast<uint32_t>(src[jj][i]) << 16), acc[jj]);
                }
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                float v = warp_sum(acc[jj]);
                if (jj < m) dgv[j0 + jj] = v;
            }
        }
        float dot_g = 0.f, s = 0.f;
        for (int j = 0; j < k; ++j) {
            dot_g += dgv[j] * gates[static_cast<size_t>(r) * k + j];
            s += p[idx[static_cast<size_t>(r) * k + j]];
        }
        // dp is nonzero only on the k selected experts (plus the auxiliary
        // loss's term on every expert).
        float dot_p = 0.f;
        for (int j = 0; j < k; ++j) {
            float dpj = renormalize ? (dgv[j] - dot_g) / s : dgv[j];
            dot_p += p[idx[static_cast<size_t>(r) * k + j]] * dpj;
        }
        if (aux_dp) {
            float a = 0.f;
            for (int i = lane; i < e; i += 32) a += p[i] * aux_dp[i];
            dot_p += warp_sum(a);
        }
        for (int i = lane; i < e; i += 32) {
            float dpi = aux_dp ? aux_dp[i] : 0.f;
            for (int j = 0; j < k; ++j)
                if (idx[static_cast<size_t>(r) * k + j] == static_cast<uint32_t>(i))
                    dpi += renormalize ? (dgv[j] - dot_g) / s : dgv[j];
            dlogits[static_cast<size_t>(r) * e + i] = to_bf(p[i] * (dpi - dot_p));
        }
    }
}

// Column sums of a row-major [g, n] bf16 matrix in f32: out[c] = sum_r
// x[r, c], rows in order (deterministic). The router weight gradient's
// token groups (split over the reduction dimension) summed.
extern "C" __global__ void col_sum_bf16(const uint16_t* __restrict__ x, float* __restrict__ out, int g, int n) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n; c += gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int r = 0; r < g; ++r) s += __uint_as_float(static_cast<uint32_t>(x[static_cast<size_t>(r) * n + c]) << 16);
        out[c] = s;
    }
}

// Column means of a row-major [t, e] f32 matrix: out[c] = sum_r x[r, c] / t,
// one thread per column, rows in order (deterministic).
extern "C" __global__ void col_mean_f32(const float* __restrict__ x, float* __restrict__ out, int t, int e) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < e; c += gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int r = 0; r < t; ++r) s += x[static_cast<size_t>(r) * e + c];
        out[c] = t > 0 ? s / static_cast<float>(t) : 0.f;
    }
}

// Squared norm of each bf16 row: out[r] = ||x_r||^2 (f32). One warp per row.
extern "C" __global__ void row_sq_norms_bf16(const uint16_t* __restrict__ x, float* __restrict__ out, int n, int d) {
    int lane = threadIdx.x & 31;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int n_warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = warp; r < n; r += n_warps) {
        float s = row_sq_norm(x + static_cast<size_t>(r) * d, d, lane);
        if (lane == 0) out[r] = s;
    }
}

// LRM scores from precomputed norms, in grouped order:
// score[j] = g[p]^2 * dy_sq[p / k] * h_sq[j] with p = pair[j].
extern "C" __global__ void scores_from_norms(const float* __restrict__ gates, const float* __restrict__ dy_sq,
                                             const float* __restrict__ h_sq, const uint32_t* __restrict__ pair,
                                             float* __restrict__ out, int n, int k) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        uint32_t p = pair[j];
        float g = gates[p];
        out[j] = g * g * dy_sq[p / k] * h_sq[j];
    }
}

// out[i] = value.
extern "C" __global__ void fill_u32(uint32_t* __restrict__ out, uint32_t value, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = value;
}
