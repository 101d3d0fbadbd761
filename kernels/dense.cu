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
// learned position embedding on top of the token embedding). One warp per
// row; 16-byte loads and stores where d is a multiple of 4 and both
// buffers are 16-byte aligned.
extern "C" __global__ void embed_fwd(const float* __restrict__ table, const uint32_t* __restrict__ tok,
                                     float* __restrict__ x, int n, int d, int add) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    bool vec = (d & 3) == 0 && (((uintptr_t)table | (uintptr_t)x) & 15) == 0;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const float* src = table + (long long)tok[r] * d;
        float* dst = x + (long long)r * d;
        if (vec) {
            const float4* s4 = reinterpret_cast<const float4*>(src);
            float4* d4 = reinterpret_cast<float4*>(dst);
            for (int c = lane; c < (d >> 2); c += 32) {
                float4 t = s4[c];
                if (add) {
                    float4 o = d4[c];
                    t = make_float4(o.x + t.x, o.y + t.y, o.z + t.z, o.w + t.w);
                }
                d4[c] = t;
            }
        } else {
            for (int c = lane; c < d; c += 32) dst[c] = add ? dst[c] + src[c] : src[c];
        }
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

// Eight consecutive elements from 8 · c (16-byte aligned): f32 or bf16 to
// f32, and back (a bf16 store, or an f32 add).
__device__ __forceinline__ void load8(const float* p, long long c, float v[8]) {
    float4 a = reinterpret_cast<const float4*>(p)[2 * c], b = reinterpret_cast<const float4*>(p)[2 * c + 1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const uint16_t* p, long long c, float v[8]) {
    uint4 q = reinterpret_cast<const uint4*>(p)[c];
    uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; j++) v[2 * j] = __uint_as_float(u[j] << 16), v[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
}
__device__ __forceinline__ void put8(float* p, long long c, const float v[8]) {
    float4* q = reinterpret_cast<float4*>(p) + 2 * c;
    float4 a = q[0], b = q[1];
    q[0] = make_float4(a.x + v[0], a.y + v[1], a.z + v[2], a.w + v[3]);
    q[1] = make_float4(b.x + v[4], b.y + v[5], b.z + v[6], b.w + v[7]);
}
__device__ __forceinline__ void put8(uint16_t* p, long long c, const float v[8]) {
    uint4 q;
    q.x = (uint32_t)to_bf(v[0]) | ((uint32_t)to_bf(v[1]) << 16);
    q.y = (uint32_t)to_bf(v[2]) | ((uint32_t)to_bf(v[3]) << 16);
    q.z = (uint32_t)to_bf(v[4]) | ((uint32_t)to_bf(v[5]) << 16);
    q.w = (uint32_t)to_bf(v[6]) | ((uint32_t)to_bf(v[7]) << 16);
    reinterpret_cast<uint4*>(p)[c] = q;
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
// The same for wide rows (d a multiple of 256, x, w and y 16-byte aligned:
// the model's hidden width): each lane reads eight consecutive columns at
// a time in 16-byte loads.
template <typename X>
__device__ void rmsnorm_fwd_wide(const X* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ y,
                                 float* __restrict__ inv, int rows, int d, float eps) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5, chunks = d >> 8;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        long long row = (long long)r * (d >> 3);  // the row's first eight-column chunk
        float s = 0.f, v[8], wv[8];
        for (int k = 0; k < chunks; k++) {
            load8(x, row + k * 32 + lane, v);
#pragma unroll
            for (int j = 0; j < 8; j++) s = fmaf(v[j], v[j], s);
        }
        s = warp_sum(s);
        float iv = rsqrtf(s / d + eps);
        for (int k = 0; k < chunks; k++) {
            int c = k * 32 + lane;
            load8(x, row + c, v);
            load8(w, c, wv);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = v[j] * iv * wv[j];
            put8(y, row + c, v);
        }
        if (lane == 0) inv[r] = iv;
    }
}
// Whether rows of d take the wide kernels: d a multiple of 256 and every
// row buffer 16-byte aligned.
__device__ __forceinline__ bool wide_rows(int d, const void* a, const void* b, const void* c, const void* e) {
    return d % 256 == 0 && (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)e) & 15) == 0;
}
// Either of the two above, by the width and alignment.
template <typename X>
__device__ void rmsnorm_fwd_any(const X* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ y,
                                float* __restrict__ inv, int rows, int d, float eps) {
    if (wide_rows(d, x, w, y, y))
        rmsnorm_fwd_wide(x, w, y, inv, rows, d, eps);
    else
        rmsnorm_fwd(x, w, y, inv, rows, d, eps);
}
extern "C" __global__ void rmsnorm_fwd_f32(const float* x, const float* w, uint16_t* y, float* inv, int rows, int d,
                                           float eps) {
    rmsnorm_fwd_any(x, w, y, inv, rows, d, eps);
}
extern "C" __global__ void rmsnorm_fwd_bf16(const uint16_t* x, const float* w, uint16_t* y, float* inv, int rows,
                                            int d, float eps) {
    rmsnorm_fwd_any(x, w, y, inv, rows, d, eps);
}

// Backward of rmsnorm_fwd: dx = dy⊙w·inv − x·(Σ dy⊙w⊙x)·inv³/d per row;
// dw += Σ_rows dy⊙x·inv. One warp per row; each block sums its rows' dw in
// shared memory (d floats) and adds it to dw once. DX f32: added into dx
// (the residual stream's gradient); DX bf16: written.
//
// The rows of a warp (rmsnorm_bwd_rows): for widths of 32·CPL (CPL 2 to
// 16: the head norms' 64 and 128) each lane keeps its CPL columns' share
// of dw in registers over all its rows and adds it to shared memory once;
// for other widths (CPL = 0) every row's share goes to shared memory,
// where narrow rows would make a block's warps contend for the same few
// addresses. (CPL 32 and 64 spill registers.)
template <int CPL, typename X, typename DX>
__device__ void rmsnorm_bwd_rows(const X* __restrict__ x, const float* __restrict__ w,
                                 const float* __restrict__ inv, const uint16_t* __restrict__ dy, DX* __restrict__ dx,
                                 float* sdw, int rows, int d) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5;
    // Columns lane, lane + 32, … below d: CPL of them, or as many as fit.
    int cols = CPL > 0 ? CPL : (d - lane + 31) / 32;
    float acc[CPL > 0 ? CPL : 1];
#pragma unroll
    for (int k = 0; k < (CPL > 0 ? CPL : 1); k++) acc[k] = 0.f;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const X* xr = x + (long long)r * d;
        const uint16_t* gr = dy + (long long)r * d;
        float iv = inv[r];
        float dot = 0.f;
#pragma unroll(CPL > 0 ? CPL : 1)
        for (int k = 0; k < cols; k++) {
            int i = lane + 32 * k;
            dot = fmaf(bf(gr[i]) * w[i], load(xr, i), dot);
        }
        dot = warp_sum(dot);
        float c = dot * iv * iv * iv / d;
        DX* dr = dx + (long long)r * d;
#pragma unroll(CPL > 0 ? CPL : 1)
        for (int k = 0; k < cols; k++) {
            int i = lane + 32 * k;
            float g = bf(gr[i]), xv = load(xr, i);
            float v = g * w[i] * iv - xv * c;
            if constexpr (sizeof(DX) == 4) {
                dr[i] += v;
            } else {
                dr[i] = to_bf(v);
            }
            if constexpr (CPL > 0) {
                acc[k] = fmaf(g * xv, iv, acc[k]);
            } else {
                atomicAdd(&sdw[i], g * xv * iv);
            }
        }
    }
    if constexpr (CPL > 0) {
#pragma unroll
        for (int k = 0; k < CPL; k++) atomicAdd(&sdw[lane + 32 * k], acc[k]);
    }
}

// The rows of a warp for wide rows (wide_rows: the model's hidden width):
// each lane takes eight consecutive columns at a time in 16-byte loads (a
// row of 2048 is eight such chunks a lane). CH > 0 (d = 256 · CH): each
// lane keeps its 8 · CH columns' share of dw in registers over all its
// rows and adds it to shared memory once; CH = 0: every row's share goes
// to shared memory.
template <int CH, typename X, typename DX>
__device__ void rmsnorm_bwd_wide(const X* __restrict__ x, const float* __restrict__ w,
                                 const float* __restrict__ inv, const uint16_t* __restrict__ dy, DX* __restrict__ dx,
                                 float* sdw, int rows, int d) {
    int lane = threadIdx.x & 31;
    int warps = (gridDim.x * blockDim.x) >> 5, chunks = CH > 0 ? CH : d >> 8;
    float acc[CH > 0 ? CH : 1][8];
#pragma unroll
    for (int k = 0; k < (CH > 0 ? CH : 1); k++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[k][j] = 0.f;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        long long row = (long long)r * (d >> 3);  // the row's first eight-column chunk
        float iv = inv[r];
        float dot = 0.f;
#pragma unroll(CH > 0 ? CH : 1)
        for (int k = 0; k < chunks; k++) {
            int c = k * 32 + lane;
            float g[8], xv[8], wv[8];
            load8(dy, row + c, g);
            load8(x, row + c, xv);
            load8(w, c, wv);
#pragma unroll
            for (int j = 0; j < 8; j++) dot = fmaf(g[j] * wv[j], xv[j], dot);
        }
        dot = warp_sum(dot);
        float cc = dot * iv * iv * iv / d;
#pragma unroll(CH > 0 ? CH : 1)
        for (int k = 0; k < chunks; k++) {
            int c = k * 32 + lane;
            float g[8], xv[8], wv[8], v[8];
            load8(dy, row + c, g);
            load8(x, row + c, xv);
            load8(w, c, wv);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                v[j] = g[j] * wv[j] * iv - xv[j] * cc;
                if constexpr (CH > 0) {
                    acc[k][j] = fmaf(g[j] * xv[j], iv, acc[k][j]);
                } else {
                    atomicAdd(&sdw[8 * c + j], g[j] * xv[j] * iv);
                }
            }
            put8(dx, row + c, v);
        }
    }
    if constexpr (CH > 0) {
#pragma unroll
        for (int k = 0; k < CH; k++)
#pragma unroll
            for (int j = 0; j < 8; j++) atomicAdd(&sdw[8 * (k * 32 + lane) + j], acc[k][j]);
    }
}

// WIDE: the kernels for widths that are multiples of 256 (their own
// entries, so that the wide rows' registers do not cost the head norms
// occupancy); rows that are not 16-byte aligned fall back to CPL = 0.
template <bool WIDE, typename X, typename DX>
__device__ void rmsnorm_bwd(const X* __restrict__ x, const float* __restrict__ w, const float* __restrict__ inv,
                            const uint16_t* __restrict__ dy, DX* __restrict__ dx, float* __restrict__ dw, int rows,
                            int d) {
    extern __shared__ float sdw[];
    for (int i = threadIdx.x; i < d; i += blockDim.x) sdw[i] = 0.f;
    __syncthreads();
    if constexpr (WIDE) {
        if (!wide_rows(d, x, w, dy, dx))
            rmsnorm_bwd_rows<0>(x, w, inv, dy, dx, sdw, rows, d);
        else if (d == 2048)
            rmsnorm_bwd_wide<8>(x, w, inv, dy, dx, sdw, rows, d);
        else if (d == 1024)
            rmsnorm_bwd_wide<4>(x, w, inv, dy, dx, sdw, rows, d);
        else
            rmsnorm_bwd_wide<0>(x, w, inv, dy, dx, sdw, rows, d);
    } else {
        switch (d) {
            case 64: rmsnorm_bwd_rows<2>(x, w, inv, dy, dx, sdw, rows, d); break;
            case 128: rmsnorm_bwd_rows<4>(x, w, inv, dy, dx, sdw, rows, d); break;
            case 256: rmsnorm_bwd_rows<8>(x, w, inv, dy, dx, sdw, rows, d); break;
            case 512: rmsnorm_bwd_rows<16>(x, w, inv, dy, dx, sdw, rows, d); break;
            default: rmsnorm_bwd_rows<0>(x, w, inv, dy, dx, sdw, rows, d);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(dw + i, sdw[i]);
}
extern "C" __global__ void rmsnorm_bwd_f32(const float* x, const float* w, const float* inv, const uint16_t* dy,
                                           float* dx, float* dw, int rows, int d) {
    rmsnorm_bwd<false>(x, w, inv, dy, dx, dw, rows, d);
}
extern "C" __global__ void rmsnorm_bwd_bf16(const uint16_t* x, const float* w, const float* inv, const uint16_t* dy,
                                            uint16_t* dx, float* dw, int rows, int d) {
    rmsnorm_bwd<false>(x, w, inv, dy, dx, dw, rows, d);
}
extern "C" __global__ void rmsnorm_bwd_wide_f32(const float* x, const float* w, const float* inv, const uint16_t* dy,
                                                float* dx, float* dw, int rows, int d) {
    rmsnorm_bwd<true>(x, w, inv, dy, dx, dw, rows, d);
}
extern "C" __global__ void rmsnorm_bwd_wide_bf16(const uint16_t* x, const float* w, const float* inv,
                                                 const uint16_t* dy, uint16_t* dx, float* dw, int rows, int d) {
    rmsnorm_bwd<true>(x, w, inv, dy, dx, dw, rows, d);
}

// Block-per-row RMSNorm for rows of d = 8 · blockDim.x (d a multiple of
// 256, at most 4096; rows 16-byte aligned): each thread holds eight
// consecutive columns of a row in registers, so every input is read from
// memory once (the warp-per-row kernels above read a row twice), and the
// gain stays in registers for the whole kernel. The row's sum goes through
// shared memory, double-buffered by row parity: one barrier a row.
__device__ __forceinline__ float block_row_sum(float v, float (*red)[32], int parity) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[parity][wid] = v;
    __syncthreads();
    float s = 0.f;
    for (int k = 0; k < nw; k++) s += red[parity][k];
    return s;
}
__device__ __forceinline__ void set8(float* p, long long c, const float v[8]) {
    float4* q = reinterpret_cast<float4*>(p) + 2 * c;
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Forward: y = x / rms(x) ⊙ w, inv[row] = 1 / rms; keep (may be null): x
// copied there in the same pass (the residual stream the backward reads).
template <typename X>
__device__ void rmsnorm_fwd_block(const X* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ y,
                                  float* __restrict__ inv, float* __restrict__ keep, int rows, int d, float eps) {
    __shared__ float red[2][32];
    int t = threadIdx.x, parity = 0;
    float wv[8], v[8], nv[8];
    load8(w, t, wv);
    if (blockIdx.x < rows) load8(x, (long long)blockIdx.x * blockDim.x + t, v);
    for (int r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
        long long c = (long long)r * blockDim.x + t;  // this thread's eight columns of row r
        // The block's next row in flight while this one is summed and written.
        if (r + gridDim.x < rows) load8(x, c + (long long)gridDim.x * blockDim.x, nv);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) s = fmaf(v[j], v[j], s);
        float iv = rsqrtf(block_row_sum(s, red, parity) / d + eps);
        if (keep) set8(keep, c, v);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = v[j] * iv * wv[j];
        put8(y, c, v);
        if (t == 0) inv[r] = iv;
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = nv[j];
    }
}
extern "C" __global__ void __launch_bounds__(512) rmsnorm_fwd_block_f32(const float* x, const float* w, uint16_t* y,
                                                                        float* inv, float* keep, int rows, int d,
                                                                        float eps) {
    rmsnorm_fwd_block(x, w, y, inv, keep, rows, d, eps);
}
extern "C" __global__ void __launch_bounds__(512) rmsnorm_fwd_block_bf16(const uint16_t* x, const float* w,
                                                                         uint16_t* y, float* inv, float* keep,
                                                                         int rows, int d, float eps) {
    rmsnorm_fwd_block(x, w, y, inv, static_cast<float*>(nullptr), rows, d, eps);
}

// Backward (as rmsnorm_bwd): each thread keeps its eight columns' share of
// dw in registers over all its block's rows and adds it to dw once.
template <typename X, typename DX>
__device__ void rmsnorm_bwd_block(const X* __restrict__ x, const float* __restrict__ w, const float* __restrict__ inv,
                                  const uint16_t* __restrict__ dy, DX* __restrict__ dx, float* __restrict__ dw,
                                  int rows, int d) {
    __shared__ float red[2][32];
    int t = threadIdx.x, parity = 0;
    float wv[8], acc[8], g[8], xv[8], ng[8], nx[8];
    load8(w, t, wv);
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.f;
    if (blockIdx.x < rows) {
        long long c = (long long)blockIdx.x * blockDim.x + t;
        load8(dy, c, g);
        load8(x, c, xv);
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
        long long c = (long long)r * blockDim.x + t;
        // The block's next row in flight while this one is reduced and
        // written.
        if (r + gridDim.x < rows) {
            long long cn = c + (long long)gridDim.x * blockDim.x;
            load8(dy, cn, ng);
            load8(x, cn, nx);
        }
        float iv = inv[r];
        float dot = 0.f, v[8];
        // f32: the gradient is added into dx, read before the barrier.
        if constexpr (sizeof(DX) == 4) load8(dx, c, v);
#pragma unroll
        for (int j = 0; j < 8; j++) dot = fmaf(g[j] * wv[j], xv[j], dot);
        float cc = block_row_sum(dot, red, parity) * iv * iv * iv / d;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float dj = g[j] * wv[j] * iv - xv[j] * cc;
            v[j] = sizeof(DX) == 4 ? v[j] + dj : dj;
            acc[j] = fmaf(g[j] * xv[j], iv, acc[j]);
            g[j] = ng[j];
            xv[j] = nx[j];
        }
        if constexpr (sizeof(DX) == 4) {
            set8(dx, c, v);
        } else {
            put8(dx, c, v);
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) atomicAdd(dw + 8 * t + j, acc[j]);
}
extern "C" __global__ void __launch_bounds__(512) rmsnorm_bwd_block_f32(const float* x, const float* w,
                                                                        const float* inv, const uint16_t* dy,
                                                                        float* dx, float* dw, int rows, int d) {
    rmsnorm_bwd_block(x, w, inv, dy, dx, dw, rows, d);
}
extern "C" __global__ void __launch_bounds__(512) rmsnorm_bwd_block_bf16(const uint16_t* x, const float* w,
                                                                         const float* inv, const uint16_t* dy,
                                                                         uint16_t* dx, float* dw, int rows, int d) {
    rmsnorm_bwd_block(x, w, inv, dy, dx, dw, rows, d);
}

// Token-major rows [n_seq·seq, heads·dh] ↔ head-major [n_seq, heads, seq,
// dh]. to_heads = 1: token → head layout, rotating by RoPE (base theta, 0 =
// no rotation; dimension j < dh/2 pairs with j + dh/2, angle pos·θ^(−2j/dh));
// to_heads = 0: head → token layout, rotating by the negative angle (the
// backward of the forward's rotation). One thread per (token, pair): the
// angle's sine and cosine once, then every head.
extern "C" __global__ void heads_bf16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, int n_seq,
                                      int seq, int heads, int dh, float theta, int to_heads) {
    int half = dh >> 1;
    long long total = (long long)n_seq * seq * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int j = (int)(i % half);
        long long tok = i / half;  // sequence · seq + position
        int pos = (int)(tok % seq);
        long long b = tok / seq;
        float s = 0.f, c = 1.f;
        if (theta > 0.f) {
            float freq = powf(theta, -2.f * (float)j / (float)dh);
            sincosf((float)pos * freq, &s, &c);
            if (!to_heads) s = -s;
        }
        for (int h = 0; h < heads; h++) {
            long long tix = tok * heads * dh + (long long)h * dh;
            long long hix = ((b * heads + h) * seq + pos) * dh;
            long long si = to_heads ? tix : hix, di = to_heads ? hix : tix;
            float x1 = bf(src[si + j]), x2 = bf(src[si + j + half]);
            if (theta > 0.f) {
                float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
                x1 = y1;
                x2 = y2;
            }
            dst[di + j] = to_bf(x1);
            dst[di + j + half] = to_bf(x2);
        }
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

// The fused cross-entropy over bf16 logits rows of v (a block per row):
// loss_sum += −log softmax(logits)[target] (f32 atomic), dlogits =
// (softmax − onehot) · inv_n as bf16, in two passes over each row: a
// running max-and-sum (the sum rescaled when the max grows), then the
// gradient. The row's 16-byte aligned middle moves as 8 bf16 per load and
// store; the elements before it (head) and after it (tail) one by one.
// Two kernels share these pieces: cross_entropy (many rows in flight)
// and cross_entropy_resident (one row a SM, below).

// The row's head length (elements before the first 16-byte boundary; the
// whole row when logits and gradient rows are not equally aligned), its
// aligned chunks of 8 and where its tail starts.
struct XentRow {
    int head, chunks, tail0;
};
__device__ __forceinline__ XentRow xent_row(const uint16_t* lr, const uint16_t* dr, int v) {
    int head = (int)(((16 - ((uintptr_t)lr & 15)) & 15) >> 1);
    if (head > v || (((uintptr_t)dr - (uintptr_t)lr) & 15) != 0) head = v;
    int chunks = (v - head) >> 3;
    return {head, chunks, head + (chunks << 3)};
}
// (m, s) += one logit: a rescale when it raises the max.
__device__ __forceinline__ void xent_eat(float x, float& m, float& s) {
    if (x > m) {
        s = s * __expf(m - x) + 1.f;
        m = x;
    } else if (!(x == -INFINITY && m == -INFINITY)) {
        s += __expf(x - m);  // NaN stays NaN: the loss reports it
    }
}
// (m, s) += (mo, so): two running max-and-sums merged.
__device__ __forceinline__ void xent_merge(float& m, float& s, float mo, float so) {
    float mm = fmaxf(m, mo);
    s = (m == -INFINITY ? 0.f : s * __expf(m - mm)) + (mo == -INFINITY ? 0.f : so * __expf(mo - mm));
    m = mm;
}
// The block's (m, s) from each thread's: over the warp, then over the
// warps; every thread returns with the block's. red_m, red_s: 32 floats
// each; bcast: 2. Ends with a barrier, so the caller may reuse them for
// its next row once every thread has passed its next reduction's start.
__device__ __forceinline__ void xent_block_merge(float& m, float& s, float* red_m, float* red_s, float* bcast) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        xent_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) {
        red_m[wid] = m;
        red_s[wid] = s;
    }
    __syncthreads();
    if (wid == 0) {
        m = lane < nw ? red_m[lane] : -INFINITY;
        s = lane < nw ? red_s[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            xent_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) {
            bcast[0] = m;
            bcast[1] = s;
        }
    }
    __syncthreads();
    m = bcast[0];
    s = bcast[1];
}
// The gradient of one logit at column j, and of eight packed in q from
// column j0.
struct XentGrad {
    float m, is, inv_n;
    int tg;
    __device__ __forceinline__ uint16_t operator()(float x, int j) const {
        return to_bf((__expf(x - m) * is - (j == tg ? 1.f : 0.f)) * inv_n);
    }
    __device__ __forceinline__ uint4 eight(uint4 q, int j0) const {
        uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            uint32_t lo = (*this)(__uint_as_float(w[t] << 16), j0 + 2 * t);
            uint32_t hi = (*this)(__uint_as_float(w[t] & 0xffff0000u), j0 + 2 * t + 1);
            w[t] = lo | (hi << 16);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

extern "C" __global__ void cross_entropy(const uint16_t* __restrict__ logits, const uint32_t* __restrict__ target,
                                         float* __restrict__ loss_sum, uint16_t* __restrict__ dlogits, int n, int v,
                                         float inv_n) {
    __shared__ float red_m[32], red_s[32], bcast[2];
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const uint16_t* lr = logits + (long long)r * v;
        uint16_t* dr = dlogits + (long long)r * v;
        XentRow row = xent_row(lr, dr, v);
        float m = -INFINITY, s = 0.f;
        for (int j = threadIdx.x; j < row.head; j += blockDim.x) xent_eat(bf(lr[j]), m, s);
        const uint4* lv = reinterpret_cast<const uint4*>(lr + row.head);
        for (int c = threadIdx.x; c < row.chunks; c += blockDim.x) {
            uint4 q = lv[c];
            uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                xent_eat(__uint_as_float(w[t] << 16), m, s);
                xent_eat(__uint_as_float(w[t] & 0xffff0000u), m, s);
            }
        }
        for (int j = row.tail0 + threadIdx.x; j < v; j += blockDim.x) xent_eat(bf(lr[j]), m, s);
        xent_block_merge(m, s, red_m, red_s, bcast);
        XentGrad grad{m, 1.f / s, inv_n, (int)target[r]};
        for (int j = threadIdx.x; j < row.head; j += blockDim.x) dr[j] = grad(bf(lr[j]), j);
        uint4* dv = reinterpret_cast<uint4*>(dr + row.head);
        for (int c = threadIdx.x; c < row.chunks; c += blockDim.x) dv[c] = grad.eight(lv[c], row.head + (c << 3));
        for (int j = row.tail0 + threadIdx.x; j < v; j += blockDim.x) dr[j] = grad(bf(lr[j]), j);
        if (threadIdx.x == 0) atomicAdd(loss_sum, logf(s) + m - bf(lr[grad.tg]));
        __syncthreads();
    }
}

// The cross-entropy for rows that the L2 cache might hold between their
// two passes (the LM head's 151 936 words: 297 KiB of bf16 a row). A
// block takes one row at a time, so the rows in flight are the grid's
// blocks; each thread keeps UNROLL 16-byte loads in flight so that few
// blocks still fill the memory pipeline. The running max-and-sum moves by
// chunks of 8 (one rescale when a chunk raises the max). HINT: the first
// pass's loads ask L2 to keep the lines (evict_last), the second pass's
// loads and the gradient's stores to let them go first (evict_first).
// Measured (docs/benchmarks.md): the second read does not come from L2 to
// any useful degree, but with the hints one block of 1024 a SM takes 0.96×
// cross_entropy's time.
__device__ __forceinline__ unsigned long long l2_policy(bool keep) {
    unsigned long long p;
    if (keep)
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    else
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
template <bool HINT>
__device__ __forceinline__ uint4 ld16(const uint4* a, unsigned long long pol) {
    uint4 r;
    if constexpr (HINT) {
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                     : "l"(a), "l"(pol));
    } else {
        r = *a;
    }
    return r;
}
template <bool HINT>
__device__ __forceinline__ void st16(uint4* a, uint4 v, unsigned long long pol) {
    if constexpr (HINT) {
        asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(a), "r"(v.x), "r"(v.y),
                     "r"(v.z), "r"(v.w), "l"(pol)
                     : "memory");
    } else {
        *a = v;
    }
}
// (m, s) += the eight bf16 logits of q: one rescale when they raise the max.
__device__ __forceinline__ void xent_eat8(uint4 q, float& m, float& s) {
    uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float x[8];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        x[2 * t] = __uint_as_float(w[t] << 16);
        x[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
    float cm = x[0];
#pragma unroll
    for (int j = 1; j < 8; ++j) cm = fmaxf(cm, x[j]);
    if (cm > m) {
        s = m == -INFINITY ? 0.f : s * __expf(m - cm);
        m = cm;
    }
    // −∞ (a masked word) adds nothing, even while every logit so far is
    // −∞; NaN stays NaN: the loss reports it.
#pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j] == -INFINITY ? 0.f : __expf(x[j] - m);
}
template <bool HINT, int UNROLL>
__device__ void cross_entropy_resident(const uint16_t* __restrict__ logits, const uint32_t* __restrict__ target,
                                       float* __restrict__ loss_sum, uint16_t* __restrict__ dlogits, int n, int v,
                                       float inv_n) {
    __shared__ float red_m[32], red_s[32], bcast[2];
    int nt = blockDim.x;
    unsigned long long keep = 0, drop = 0;
    if constexpr (HINT) {
        keep = l2_policy(true);
        drop = l2_policy(false);
    }
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const uint16_t* lr = logits + (long long)r * v;
        uint16_t* dr = dlogits + (long long)r * v;
        XentRow row = xent_row(lr, dr, v);
        float m = -INFINITY, s = 0.f;
        for (int j = threadIdx.x; j < row.head; j += nt) xent_eat(bf(lr[j]), m, s);
        const uint4* lv = reinterpret_cast<const uint4*>(lr + row.head);
        int c = threadIdx.x;
        for (; c + (UNROLL - 1) * nt < row.chunks; c += UNROLL * nt) {
            uint4 q[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) q[u] = ld16<HINT>(lv + c + u * nt, keep);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) xent_eat8(q[u], m, s);
        }
        for (; c < row.chunks; c += nt) xent_eat8(ld16<HINT>(lv + c, keep), m, s);
        for (int j = row.tail0 + threadIdx.x; j < v; j += nt) xent_eat(bf(lr[j]), m, s);
        xent_block_merge(m, s, red_m, red_s, bcast);
        XentGrad grad{m, 1.f / s, inv_n, (int)target[r]};
        for (int j = threadIdx.x; j < row.head; j += nt) dr[j] = grad(bf(lr[j]), j);
        uint4* dv = reinterpret_cast<uint4*>(dr + row.head);
        c = threadIdx.x;
        for (; c + (UNROLL - 1) * nt < row.chunks; c += UNROLL * nt) {
            uint4 q[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) q[u] = ld16<HINT>(lv + c + u * nt, drop);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                st16<HINT>(dv + c + u * nt, grad.eight(q[u], row.head + ((c + u * nt) << 3)), drop);
        }
        for (; c < row.chunks; c += nt) st16<HINT>(dv + c, grad.eight(ld16<HINT>(lv + c, drop), row.head + (c << 3)), drop);
        for (int j = row.tail0 + threadIdx.x; j < v; j += nt) dr[j] = grad(bf(lr[j]), j);
        if (threadIdx.x == 0) atomicAdd(loss_sum, logf(s) + m - bf(lr[grad.tg]));
        __syncthreads();
    }
}
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_l2(const uint16_t* logits, const uint32_t* target,
                                                                    float* loss_sum, uint16_t* dlogits, int n,
                                                                    int v, float inv_n) {
    cross_entropy_resident<false, 4>(logits, target, loss_sum, dlogits, n, v, inv_n);
}
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_l2_hint(const uint16_t* logits,
                                                                         const uint32_t* target, float* loss_sum,
                                                                         uint16_t* dlogits, int n, int v,
                                                                         float inv_n) {
    cross_entropy_resident<true, 4>(logits, target, loss_sum, dlogits, n, v, inv_n);
}

// Elements 4i .. 4i + 3 of an f32 or bf16 array, read through the
// read-only data path (`ld.global.nc`: the array is not written while the
// kernel runs).
__device__ __forceinline__ void load4(const float* g, long long i, float out[4]) {
    float4 q = __ldg(reinterpret_cast<const float4*>(g) + i);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
}
__device__ __forceinline__ void load4(const uint16_t* g, long long i, float out[4]) {
    uint2 q = __ldg(reinterpret_cast<const uint2*>(g) + i);
    out[0] = __uint_as_float(q.x << 16), out[1] = __uint_as_float(q.x & 0xffff0000u);
    out[2] = __uint_as_float(q.y << 16), out[3] = __uint_as_float(q.y & 0xffff0000u);
}
// Elements 4i .. 4i + 3 of a bf16 array: a, b, c, d rounded.
__device__ __forceinline__ void store4_bf(uint16_t* out, long long i, float a, float b, float c, float d) {
    uint2 w;
    w.x = (uint32_t)to_bf(a) | ((uint32_t)to_bf(b) << 16);
    w.y = (uint32_t)to_bf(c) | ((uint32_t)to_bf(d) << 16);
    reinterpret_cast<uint2*>(out)[i] = w;
}

// s, s2 += the squares of one 16-byte load's elements (the last argument
// picks the element type).
__device__ __forceinline__ void sq_acc(uint4 q, float& s, float& s2, const float*) {
    float a = __uint_as_float(q.x), b = __uint_as_float(q.y), c = __uint_as_float(q.z), d = __uint_as_float(q.w);
    s = fmaf(a, a, s);
    s2 = fmaf(b, b, s2);
    s = fmaf(c, c, s);
    s2 = fmaf(d, d, s2);
}
__device__ __forceinline__ void sq_acc(uint4 q, float& s, float& s2, const uint16_t*) {
    uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float lo = __uint_as_float(w[j] << 16), hi = __uint_as_float(w[j] & 0xffff0000u);
        s = fmaf(lo, lo, s);
        s2 = fmaf(hi, hi, s2);
    }
}
// out[0] += Σ x² (gradient norms; f32 or bf16 input): 16-byte loads (4 f32
// or 8 bf16 elements), two of them in flight a thread, where the buffer's
// alignment allows; the rest one by one. (Measured on the H200, 2²⁸
// elements: 89% (bf16) and 92% (f32) of HBM's bandwidth, 1.01× and 1.04×
// the device copy; one 4-element load a thread was 0.6% and 1.8% slower.)
template <typename G>
__device__ void sq_sum(const G* __restrict__ x, float* __restrict__ out, long long n) {
    constexpr int V = 16 / (int)sizeof(G);
    __shared__ float red[32];
    float s = 0.f, s2 = 0.f;
    long long stride = (long long)gridDim.x * blockDim.x, first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long nv = ((uintptr_t)x & 15) == 0 ? n / V : 0;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    long long i = first;
    for (; i + stride < nv; i += 2 * stride) {
        uint4 a = xv[i], b = xv[i + stride];
        sq_acc(a, s, s2, x);
        sq_acc(b, s, s2, x);
    }
    if (i < nv) sq_acc(xv[i], s, s2, x);
    for (long long j = nv * V + first; j < n; j += stride) {
        float v = load(x, j);
        s = fmaf(v, v, s);
    }
    s = warp_sum(s + s2);
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
__device__ __forceinline__ void adamw_one(float& p, float& m, float& v, float g, float lr, float b1, float b2,
                                          float eps, float wd, float bc1, float bc2) {
    m = b1 * m + (1.f - b1) * g;
    v = b2 * v + (1.f - b2) * g * g;
    p -= lr * ((m / bc1) / (sqrtf(v / bc2) + eps) + wd * p);
}
template <typename G>
__device__ void adamw(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, const G* __restrict__ g,
                      uint16_t* __restrict__ p16, long long n, float lr, float b1, float b2, float eps, float wd,
                      float bc1, float bc2, const float* __restrict__ norm_sq, float clip) {
    float norm = sqrtf(*norm_sq);
    float scale = (clip > 0.f && norm > clip) ? clip / norm : 1.f;
    long long stride = (long long)gridDim.x * blockDim.x, first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    // Four elements per thread and load where every buffer allows it (the
    // same arithmetic per element as one at a time), the rest one by one.
    bool wide = (((uintptr_t)p | (uintptr_t)m | (uintptr_t)v) & 15) == 0 && ((uintptr_t)g & (4 * sizeof(G) - 1)) == 0 &&
                ((uintptr_t)p16 & 7) == 0;
    long long n4 = wide ? n / 4 : 0;
    // (Measured on the H200, A3B shape: two vectors a thread in flight, or
    // streaming cache hints, made this 5% slower; one vector a thread it
    // moves 81% of HBM's bandwidth, 0.91× the device copy. Tiles through
    // the bulk-copy engine (cp.async.bulk, 1024–4096 parameters, 2–4 stages
    // a block) were 3–150% slower, 2026-12-05.)
    for (long long i = first; i < n4; i += stride) {
        float4 pq = reinterpret_cast<float4*>(p)[i], mq = reinterpret_cast<float4*>(m)[i],
               vq = reinterpret_cast<float4*>(v)[i];
        float gs[4];
        load4(g, i, gs);
        float pp[4] = {pq.x, pq.y, pq.z, pq.w}, mm[4] = {mq.x, mq.y, mq.z, mq.w}, vv[4] = {vq.x, vq.y, vq.z, vq.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) adamw_one(pp[t], mm[t], vv[t], gs[t] * scale, lr, b1, b2, eps, wd, bc1, bc2);
        reinterpret_cast<float4*>(p)[i] = make_float4(pp[0], pp[1], pp[2], pp[3]);
        reinterpret_cast<float4*>(m)[i] = make_float4(mm[0], mm[1], mm[2], mm[3]);
        reinterpret_cast<float4*>(v)[i] = make_float4(vv[0], vv[1], vv[2], vv[3]);
        if (p16) store4_bf(p16, i, pp[0], pp[1], pp[2], pp[3]);
    }
    for (long long i = n4 * 4 + first; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(pi, mi, vi, load(g, i) * scale, lr, b1, b2, eps, wd, bc1, bc2);
        m[i] = mi;
        v[i] = vi;
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

// AdamW's loads and stores with its arithmetic replaced by adds (p += g,
// m += g, v += g, the bf16 copy of p written; bf16 gradient), in the same
// grid-stride launch with the same vectors: what the update's access
// pattern alone reaches on this device, the ceiling against which
// `adamw_bf16`'s bandwidth is read (a probe for the benchmark; twin:
// `dense::adamw_streams_reference`).
extern "C" __global__ void adamw_streams_bf16(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                                              const uint16_t* __restrict__ g, uint16_t* __restrict__ p16,
                                              long long n) {
    long long stride = (long long)gridDim.x * blockDim.x, first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    bool wide = (((uintptr_t)p | (uintptr_t)m | (uintptr_t)v) & 15) == 0 && ((uintptr_t)g & 7) == 0 &&
                ((uintptr_t)p16 & 7) == 0;
    long long n4 = wide ? n / 4 : 0;
    for (long long i = first; i < n4; i += stride) {
        float4 pq = reinterpret_cast<float4*>(p)[i], mq = reinterpret_cast<float4*>(m)[i],
               vq = reinterpret_cast<float4*>(v)[i];
        float gs[4];
        load4(g, i, gs);
        pq = make_float4(pq.x + gs[0], pq.y + gs[1], pq.z + gs[2], pq.w + gs[3]);
        mq = make_float4(mq.x + gs[0], mq.y + gs[1], mq.z + gs[2], mq.w + gs[3]);
        vq = make_float4(vq.x + gs[0], vq.y + gs[1], vq.z + gs[2], vq.w + gs[3]);
        reinterpret_cast<float4*>(p)[i] = pq;
        reinterpret_cast<float4*>(m)[i] = mq;
        reinterpret_cast<float4*>(v)[i] = vq;
        store4_bf(p16, i, pq.x, pq.y, pq.z, pq.w);
    }
    for (long long i = n4 * 4 + first; i < n; i += stride) {
        float gi = load(g, i);
        p[i] += gi;
        m[i] += gi;
        v[i] += gi;
        p16[i] = to_bf(p[i]);
    }
}

// x += y (f32; gradients accumulated over micro-batches).
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// Many f32 sums in one launch, through device addresses (in-process ranks
// sharing one GPU read each other's buffers): part j writes dst[j][i] for
// i < len[j] from the k sources src[j*k .. j*k+k][i], in source order —
// from 0.0f (acc = 0; acc += s0; acc += s1; …: the order and bits of adding
// each source into a zeroed buffer) when from_zero, else from the first
// source (k = 1: an exact copy). A destination may be one of its own
// sources (each element is read before it is written, by one thread).
// One block per chunk of SUM_CHUNK elements; chunk_end[j] is the inclusive
// prefix sum of part j's chunks.
#define SUM_CHUNK 4096
extern "C" __global__ void sum_parts_f32(const unsigned long long* __restrict__ dst,
                                         const unsigned long long* __restrict__ src,
                                         const long long* __restrict__ len,
                                         const long long* __restrict__ chunk_end, int parts, int k,
                                         int from_zero) {
    const long long c = blockIdx.x;
    int lo = 0, hi = parts - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (chunk_end[mid] > c) hi = mid;
        else lo = mid + 1;
    }
    const long long base = (c - (lo ? chunk_end[lo - 1] : 0)) * SUM_CHUNK;
    const long long end = min(base + SUM_CHUNK, len[lo]);
    float* d = reinterpret_cast<float*>(dst[lo]);
    const unsigned long long* s = src + (long long)lo * k;
    for (long long i = base + threadIdx.x; i < end; i += blockDim.x) {
        float acc = from_zero ? 0.0f : reinterpret_cast<const float*>(s[0])[i];
        for (int p = from_zero ? 0 : 1; p < k; ++p) acc += reinterpret_cast<const float*>(s[p])[i];
        d[i] = acc;
    }
}

// y = bf16(x) (weights' working copies, the residual's input to a GEMM).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, uint16_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = to_bf(x[i]);
}

// ---------------------------------------------------------------------------
// Fused causal grouped-query attention (FlashAttention-2's algorithm: Dao,
// 2023) on bf16 tensor cores: mma.sync m16n8k16 (f32 accumulate) with
// operands loaded from shared memory by ldmatrix. Head-major inputs:
// q [n_seq, heads, seq, DH], k and v [n_seq, kv, seq, DH]; query head hq
// reads key/value head hq / (heads / kv). Scores are s = scale · q·k; the
// kernels work in base 2 (sl = scale · log2 e), so the forward's row
// statistic is lse2 = log2 Σ_{j ≤ i} 2^(sl·q·k_j) and the probabilities
// p = 2^(sl·q·k − lse2). The forward stores no seq × seq matrix (the
// backward stores dS for the call while it fits, AttnDq). Blocks of 64
// queries or keys, 4 warps of 16 rows each; rows past seq are zero-filled
// and never written. Only the diagonal block is masked: every other block
// a kernel visits lies wholly below the diagonal and inside the sequence.
// Twins: crate::dense::flash_attention_reference /
// flash_attention_backward_reference.
namespace fa {
constexpr int B = 64;  // queries or keys per block: 4 warps of 16 rows
// Shared-memory row strides, padded by 16 bytes so that the eight rows an
// ldmatrix reads fall in different banks.
template <int DH> constexpr int LT = DH + 8;   // bf16 tiles [B][DH]

// rows [row0, row0 + 64) of a [seq, DH] head into a padded smem tile, zero
// past seq.
template <int DH>
__device__ __forceinline__ void load_tile(uint16_t* dst, const uint16_t* src, int row0, int seq) {
    constexpr int V = DH / 8;  // 16-byte vectors per row
    for (int i = threadIdx.x; i < B * V; i += blockDim.x) {
        int r = i / V, c = i % V;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (row0 + r < seq) x = reinterpret_cast<const uint4*>(src + (long long)(row0 + r) * DH)[c];
        reinterpret_cast<uint4*>(dst + r * LT<DH>)[c] = x;
    }
}

// The same rows copied asynchronously (cp.async, 16 bytes each; rows past
// seq zero-filled by a source size of 0): the next tile loads while the
// current one is used. cp_async_wait<N> waits for all but the last N
// committed groups.
template <int DH>
__device__ __forceinline__ void load_tile_async(uint16_t* dst, const uint16_t* src, int row0, int seq) {
    constexpr int V = DH / 8;
    for (int i = threadIdx.x; i < B * V; i += blockDim.x) {
        int r = i / V, c = i % V;
        bool in = row0 + r < seq;
        const uint16_t* from = in ? src + (long long)(row0 + r) * DH + c * 8 : src;
        unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst + r * LT<DH> + c * 8));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(in ? 16 : 0));
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Register fragments of mma.sync m16n8k16 (lane l, g = l / 4, t = l % 4):
//   A (16 × 16, 4 × bf16x2): a0 row g, cols 2t, 2t+1; a1 row g+8; a2 row g,
//     cols 2t+8, 2t+9; a3 row g+8, cols 2t+8, 2t+9.
//   B (16 × 8, 2 × bf16x2): b0 rows 2t, 2t+1 of col g; b1 rows 2t+8, 2t+9.
//   C (16 × 8, 4 × f32): c0, c1 row g, cols 2t, 2t+1; c2, c3 row g+8.
// So two C tiles side by side (16 × 16) are an A fragment once packed to
// bf16: the probabilities feed the next product straight from registers.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// c0 and c1: output columns n0.. and n0 + 8.. from one ldmatrix of B
// (b[0..1] and b[2..3], as bt_at and b_at lay them out).
__device__ __forceinline__ void mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
    mma(c0, a, b[0], b[1]);
    mma(c1, a, b[2], b[3]);
}
__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const uint16_t* p) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], const uint16_t* p) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// Where lane `l` points ldmatrix in a row-major tile of stride L:
// the A fragment of rows r0.., cols k0..;
template <int L>
__device__ __forceinline__ int a_at(int lane, int r0, int k0) {
    return (r0 + (lane & 15)) * L + k0 + ((lane >> 4) << 3);
}
// the B fragments of output columns n0.. and n0 + 8.. (r[0..1], r[2..3])
// from a tile whose rows are those columns (B = tileᵀ: K in Q·Kᵀ);
template <int L>
__device__ __forceinline__ int bt_at(int lane, int n0, int k0) {
    return (n0 + (lane & 7) + ((lane >> 4) << 3)) * L + k0 + (((lane >> 3) & 1) << 3);
}
// the same from a tile whose rows are the reduction (B = tile: V in P·V),
// through ldmatrix.trans.
template <int L>
__device__ __forceinline__ int b_at(int lane, int k0, int n0) {
    return (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * L + n0 + ((lane >> 4) << 3);
}
// 2^x on the special-function unit (ex2.approx, flush-to-zero; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
// Two C tiles (16 × 16) packed into the A fragment of the next product.
__device__ __forceinline__ void to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack(c0[0], c0[1]);
    a[1] = pack(c0[2], c0[3]);
    a[2] = pack(c1[0], c1[1]);
    a[3] = pack(c1[2], c1[3]);
}

// A warp's 16 × DH accumulator (DH / 8 C tiles) to bf16 rows row0 + g and
// row0 + g + 8 of out (those below seq), scaled by mul0 and mul1.
template <int DH>
__device__ __forceinline__ void store_acc(const float (*acc)[4], uint16_t* out, int row0, int seq, float mul0,
                                          float mul1) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = row0 + g + 8 * h;
        float mul = h ? mul1 : mul0;
        if (row < seq)
#pragma unroll
            for (int n = 0; n < DH / 8; n++)
                *reinterpret_cast<uint32_t*>(out + (long long)row * DH + n * 8 + 2 * t) =
                    pack(acc[n][2 * h] * mul, acc[n][2 * h + 1] * mul);
    }
}

// The key/value head that query head bh (sequence · heads + head) reads:
// its index among n_seq · kv.
__device__ __forceinline__ long long kv_head(int bh, int heads, int kv) {
    return (long long)(bh / heads) * kv + (bh % heads) / (heads / kv);
}
// The two-stage K/V pipeline of the forward and dQ kernels over key
// blocks (tiles: 2 stages × {K, V} × [B][L]). kv_issue starts copying
// block j into its stage; kv_tile issues block j + 1 when j < last, waits
// for block j and returns its K (its V follows at + B·L).
template <int DH>
__device__ __forceinline__ void kv_issue(uint16_t* tiles, const uint16_t* K, const uint16_t* V, int j, int seq) {
    constexpr int L = LT<DH>;
    uint16_t* dst = tiles + (j & 1) * 2 * B * L;
    load_tile_async<DH>(dst, K, j * B, seq);
    load_tile_async<DH>(dst + B * L, V, j * B, seq);
    cp_async_commit();
}
template <int DH>
__device__ __forceinline__ const uint16_t* kv_tile(uint16_t* tiles, const uint16_t* K, const uint16_t* V, int j,
                                                   int last, int seq) {
    if (j < last) {
        kv_issue<DH>(tiles, K, V, j + 1, seq);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
    return tiles + (j & 1) * 2 * B * LT<DH>;
}
// The stored dS of one (sequence, query head): one 64 × 64 tile per
// (query block qb, key block kb ≤ qb), at qb·(qb + 1)/2 + kb; a tile is
// 512 16-byte words, [key slice w][query chunk nq][lane]: the A fragment
// of dSᵀ's 16 × 16 block (keys 16w.., queries 16nq..) that lane holds.
__device__ __forceinline__ long long ds_tiles(int seq) {
    long long nb = (seq + B - 1) / B;
    return nb * (nb + 1) / 2;
}
// An 8 × 8 bf16 matrix transposed across the warp (each lane's 32-bit
// fragment: row lane / 4, columns 2·(lane % 4) and + 1).
__device__ __forceinline__ uint32_t movt(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
// dQ += dS·K for one 16-key chunk n of a K tile: dsf is the A fragment of
// the warp's 16 queries × those keys.
template <int DH>
__device__ __forceinline__ void dq_add(float (*dqa)[4], const uint32_t (&dsf)[4], const uint16_t* Ks, int lane,
                                       int n) {
#pragma unroll
    for (int dp = 0; dp < DH / 16; dp++) {
        uint32_t bf[4];
        ldsm_t(bf, Ks + b_at<LT<DH>>(lane, n * 16, dp * 16));
        mma2(dqa[2 * dp], dqa[2 * dp + 1], dsf, bf);
    }
}
}  // namespace fa

// Forward: each warp keeps its 16 rows' Q fragments, scores, bf16
// probabilities and output accumulator in registers; K and V tiles go
// through shared memory, the next pair loading while this one is used.
// The longest query blocks (the last) start first.
template <int DH>
__device__ void flash_fwd(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                          const uint16_t* __restrict__ v, uint16_t* __restrict__ o, float* __restrict__ lse2,
                          int seq, int heads, int kv, float sl) {
    using namespace fa;
    constexpr int L = LT<DH>;
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);  // 2 stages × {K, V} × [B][L]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
    const uint16_t* K = k + kv_head(bh, heads, kv) * seq * DH;
    const uint16_t* Vg = v + kv_head(bh, heads, kv) * seq * DH;
    int row0 = qb * B + warp * 16;
    load_tile<DH>(tiles, q + (long long)bh * seq * DH, qb * B, seq);
    __syncthreads();
    uint32_t qf[DH / 16][4];
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++) ldsm(qf[kk], tiles + a_at<L>(lane, warp * 16, kk * 16));
    __syncthreads();
    kv_issue<DH>(tiles, K, Vg, 0, seq);
    float oacc[DH / 8][4];
#pragma unroll
    for (int n = 0; n < DH / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) oacc[n][i] = 0.f;
    int qpos[2] = {row0 + g, row0 + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int j = 0; j <= qb; j++) {
        const uint16_t* Ks = kv_tile<DH>(tiles, K, Vg, j, qb, seq);
        const uint16_t* Vs = Ks + B * L;
        float s[B / 8][4];
#pragma unroll
        for (int n = 0; n < B / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[n][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DH / 16; kk++)
#pragma unroll
            for (int np = 0; np < B / 16; np++) {
                uint32_t bf[4];
                ldsm(bf, Ks + bt_at<L>(lane, np * 16, kk * 16));
                mma2(s[2 * np], s[2 * np + 1], qf[kk], bf);
            }
        float mx[2] = {-INFINITY, -INFINITY};
        bool diag = j == qb;
#pragma unroll
        for (int n = 0; n < B / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = i >> 1, key = j * B + n * 8 + 2 * t + (i & 1);
                if (diag && (key > qpos[r] || key >= seq)) s[n][i] = -INFINITY;
                mx[r] = fmaxf(mx[r], s[n][i]);
            }
        // Scores stay unscaled (sl > 0 keeps the maximum's place): each
        // probability is one FFMA and one ex2.
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float mn = fmaxf(m[r], mx[r] * sl);
            base[r] = mn == -INFINITY ? 0.f : mn;
            alpha[r] = ex2(m[r] - base[r]);
            l[r] *= alpha[r];
            m[r] = mn;
        }
#pragma unroll
        for (int n = 0; n < B / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float p = ex2(fmaf(s[n][i], sl, -base[i >> 1]));
                l[i >> 1] += p;
                s[n][i] = p;
            }
#pragma unroll
        for (int n = 0; n < DH / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) oacc[n][i] *= alpha[i >> 1];
#pragma unroll
        for (int kk = 0; kk < B / 16; kk++) {
            uint32_t pf[4];
            to_a(pf, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < DH / 16; dp++) {
                uint32_t bf[4];
                ldsm_t(bf, Vs + b_at<L>(lane, kk * 16, dp * 16));
                mma2(oacc[2 * dp], oacc[2 * dp + 1], pf, bf);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    store_acc<DH>(oacc, o + (long long)bh * seq * DH, row0, seq, 1.f / l[0], 1.f / l[1]);
    if (t == 0)
        for (int r = 0; r < 2; r++)
            if (qpos[r] < seq) lse2[(long long)bh * seq + qpos[r]] = m[r] + log2f(l[r]);
}

// D[row] = Σ_d dO[row, d] · O[row, d] (head-major rows), one warp per row.
extern "C" __global__ void flash_bwd_dot(const uint16_t* __restrict__ dout, const uint16_t* __restrict__ out,
                                         float* __restrict__ d, long long rows, int dh) {
    int lane = threadIdx.x & 31;
    long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        float s = 0.f;
        for (int c = lane; c < dh; c += 32) s = fmaf(bf(dout[r * dh + c]), bf(out[r * dh + c]), s);
        s = warp_sum(s);
        if (lane == 0) d[r] = s;
    }
}

// dK, dV for one block of 64 keys of one (sequence, kv head): every query
// block at or after it, every query head of the group; each warp owns 16
// keys. It works on the transposed products (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ), so
// Pᵀ and dSᵀ are A operands straight from the accumulators' registers; dK
// and dV stay in registers (no atomics).
template <int DH>
__device__ void flash_bwd_kv(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                             const uint16_t* __restrict__ v, const uint16_t* __restrict__ dout,
                             const float* __restrict__ lse2, const float* __restrict__ dd, uint16_t* __restrict__ dk,
                             uint16_t* __restrict__ dv, uint4* __restrict__ ds, int seq, int heads, int kv, float sl,
                             float scale) {
    using namespace fa;
    constexpr int L = LT<DH>;
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t* Ks = reinterpret_cast<uint16_t*>(smem);  // [B][L]
    uint16_t* Vs = Ks + B * L;
    uint16_t* QG = Vs + B * L;                           // 2 stages × {Q, dO} × [B][L]
    float* LD = reinterpret_cast<float*>(QG + 4 * B * L);  // 2 stages × {lse2, D} × [B]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int kb = blockIdx.x, bk = blockIdx.y, b = bk / kv, hk = bk % kv, group = heads / kv;
    load_tile<DH>(Ks, k + (long long)bk * seq * DH, kb * B, seq);
    load_tile<DH>(Vs, v + (long long)bk * seq * DH, kb * B, seq);
    float dka[DH / 8][4], dva[DH / 8][4];
#pragma unroll
    for (int n = 0; n < DH / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dka[n][i] = dva[n][i] = 0.f;
    int key0 = kb * B + warp * 16;
    int key[2] = {key0 + g, key0 + g + 8};
    // Every (query head of the group, query block at or after this key
    // block) in turn; the next one's tiles load while this one computes.
    int per_head = (seq + B - 1) / B - kb, total = group * per_head;
    auto issue = [&](int it, int st) {
        long long bh = (long long)b * heads + hk * group + it / per_head;
        int qb = kb + it % per_head;
        uint16_t* dst = QG + st * 2 * B * L;
        load_tile_async<DH>(dst, q + bh * seq * DH, qb * B, seq);
        load_tile_async<DH>(dst + B * L, dout + bh * seq * DH, qb * B, seq);
        cp_async_commit();
        for (int i = threadIdx.x; i < B; i += blockDim.x) {
            int r = qb * B + i;
            LD[st * 2 * B + i] = r < seq ? lse2[bh * seq + r] : 0.f;
            LD[st * 2 * B + B + i] = r < seq ? dd[bh * seq + r] : 0.f;
        }
    };
    issue(0, 0);
    for (int it = 0; it < total; it++) {
        int stage = it & 1, qb = kb + it % per_head;
        if (it + 1 < total) {
            issue(it + 1, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t* Qs = QG + stage * 2 * B * L;
        const uint16_t* Gs = Qs + B * L;
        const float* Ls = LD + stage * 2 * B;
        const float* Ds = Ls + B;
        bool diag = qb == kb;
        // Sᵀ and dPᵀ for the warp's 16 keys and all 64 queries: one K and
        // one V fragment per slice of the head dimension serve four query
        // chunks (sixteen independent chains of mma).
        float sa[B / 8][4] = {}, ga[B / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < DH / 16; kk++) {
            uint32_t ak[4], av[4];
            ldsm(ak, Ks + a_at<L>(lane, warp * 16, kk * 16));
            ldsm(av, Vs + a_at<L>(lane, warp * 16, kk * 16));
#pragma unroll
            for (int nq = 0; nq < B / 16; nq++) {
                uint32_t bf[4];
                ldsm(bf, Qs + bt_at<L>(lane, nq * 16, kk * 16));
                mma2(sa[2 * nq], sa[2 * nq + 1], ak, bf);
                ldsm(bf, Gs + bt_at<L>(lane, nq * 16, kk * 16));
                mma2(ga[2 * nq], ga[2 * nq + 1], av, bf);
            }
        }
        // Pᵀ and dSᵀ in place.
#pragma unroll
        for (int n = 0; n < B / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int c = n * 8 + 2 * t + (i & 1);
                float p = ex2(fmaf(sa[n][i], sl, -Ls[c]));
                if (diag && (key[i >> 1] > qb * B + c || key[i >> 1] >= seq || qb * B + c >= seq)) p = 0.f;
                sa[n][i] = p;
                ga[n][i] = p * (ga[n][i] - Ds[c]) * scale;
            }
        // dV += Pᵀ dO and dK += dSᵀ Q, one 16-query chunk at a time; with
        // ds, each dSᵀ fragment (bf16, as the products use it) is also
        // stored for flash_bwd_q_ds.
        uint4* dst = nullptr;
        if (ds != nullptr) {
            long long bh = (long long)b * heads + hk * group + it / per_head;
            dst = ds + (bh * ds_tiles(seq) + (long long)qb * (qb + 1) / 2 + kb) * 512 + warp * 128 + lane;
        }
#pragma unroll
        for (int nq = 0; nq < B / 16; nq++) {
            uint32_t pt[4], st[4];
            to_a(pt, sa[2 * nq], sa[2 * nq + 1]);
            to_a(st, ga[2 * nq], ga[2 * nq + 1]);
            if (dst != nullptr) dst[nq * 32] = make_uint4(st[0], st[1], st[2], st[3]);
#pragma unroll
            for (int dp = 0; dp < DH / 16; dp++) {
                uint32_t bf[4];
                ldsm_t(bf, Gs + b_at<L>(lane, nq * 16, dp * 16));
                mma2(dva[2 * dp], dva[2 * dp + 1], pt, bf);
                ldsm_t(bf, Qs + b_at<L>(lane, nq * 16, dp * 16));
                mma2(dka[2 * dp], dka[2 * dp + 1], st, bf);
            }
        }
        __syncthreads();
    }
    store_acc<DH>(dka, dk + (long long)bk * seq * DH, key0, seq, 1.f, 1.f);
    store_acc<DH>(dva, dv + (long long)bk * seq * DH, key0, seq, 1.f, 1.f);
}

// dQ for one block of 64 queries of one (sequence, head): every key block
// at or before it; each warp owns 16 queries, their Q and dO fragments,
// scores, dP and dS in registers. The longest query blocks start first.
template <int DH>
__device__ void flash_bwd_q(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                            const uint16_t* __restrict__ v, const uint16_t* __restrict__ dout,
                            const float* __restrict__ lse2, const float* __restrict__ dd, uint16_t* __restrict__ dq,
                            int seq, int heads, int kv, float sl, float scale) {
    using namespace fa;
    constexpr int L = LT<DH>;
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);  // 2 stages × {K, V} × [B][L]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
    const uint16_t* K = k + kv_head(bh, heads, kv) * seq * DH;
    const uint16_t* Vg = v + kv_head(bh, heads, kv) * seq * DH;
    int row0 = qb * B + warp * 16;
    load_tile<DH>(tiles, q + (long long)bh * seq * DH, qb * B, seq);
    load_tile<DH>(tiles + B * L, dout + (long long)bh * seq * DH, qb * B, seq);
    __syncthreads();
    uint32_t qf[DH / 16][4], gf[DH / 16][4];
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++) {
        ldsm(qf[kk], tiles + a_at<L>(lane, warp * 16, kk * 16));
        ldsm(gf[kk], tiles + B * L + a_at<L>(lane, warp * 16, kk * 16));
    }
    __syncthreads();
    kv_issue<DH>(tiles, K, Vg, 0, seq);
    float dqa[DH / 8][4];
#pragma unroll
    for (int n = 0; n < DH / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dqa[n][i] = 0.f;
    int qpos[2] = {row0 + g, row0 + g + 8};
    float ls[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ls[r] = qpos[r] < seq ? lse2[(long long)bh * seq + qpos[r]] : 0.f;
        dr[r] = qpos[r] < seq ? dd[(long long)bh * seq + qpos[r]] : 0.f;
    }
    for (int j = 0; j <= qb; j++) {
        const uint16_t* Ks = kv_tile<DH>(tiles, K, Vg, j, qb, seq);
        const uint16_t* Vs = Ks + B * L;
        bool diag = j == qb;
        // One 16-key chunk at a time: S and dP, then dS into dQ += dS K.
#pragma unroll
        for (int n = 0; n < B / 16; n++) {
            float sa[2][4] = {}, ga[2][4] = {};
#pragma unroll
            for (int kk = 0; kk < DH / 16; kk++) {
                uint32_t bf[4];
                ldsm(bf, Ks + bt_at<L>(lane, n * 16, kk * 16));
                mma2(sa[0], sa[1], qf[kk], bf);
                ldsm(bf, Vs + bt_at<L>(lane, n * 16, kk * 16));
                mma2(ga[0], ga[1], gf[kk], bf);
            }
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int r = i >> 1, key = j * B + n * 16 + h * 8 + 2 * t + (i & 1);
                    float p = ex2(fmaf(sa[h][i], sl, -ls[r]));
                    if (diag && (key > qpos[r] || key >= seq || qpos[r] >= seq)) p = 0.f;
                    ga[h][i] = p * (ga[h][i] - dr[r]) * scale;
                }
            uint32_t dsf[4];
            to_a(dsf, ga[0], ga[1]);
            dq_add<DH>(dqa, dsf, Ks, lane, n);
        }
        __syncthreads();
    }
    store_acc<DH>(dqa, dq + (long long)bh * seq * DH, row0, seq, 1.f, 1.f);
}

// dQ from the dS tiles flash_bwd_kv stored: for one block of 64 queries of
// one (sequence, head), dQ = Σ_{key blocks ≤ it} dS · K, no recomputation
// (one product instead of three). Each warp owns 16 queries; it reads the
// dSᵀ fragments of its query chunk and transposes them in registers
// (movmatrix: the A fragment of dS). K tiles go through shared memory, the
// next loading while this one is used. The longest query blocks first.
template <int DH>
__device__ void flash_bwd_q_ds(const uint16_t* __restrict__ k, const uint4* __restrict__ ds, uint16_t* __restrict__ dq,
                               int seq, int heads, int kv) {
    using namespace fa;
    constexpr int L = LT<DH>;
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);  // 2 stages × K [B][L]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
    const uint16_t* K = k + kv_head(bh, heads, kv) * seq * DH;
    const uint4* tile = ds + ((long long)bh * ds_tiles(seq) + (long long)qb * (qb + 1) / 2) * 512 + warp * 32 + lane;
    int row0 = qb * B + warp * 16;
    load_tile_async<DH>(tiles, K, 0, seq);
    cp_async_commit();
    float dqa[DH / 8][4];
#pragma unroll
    for (int n = 0; n < DH / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dqa[n][i] = 0.f;
    for (int j = 0; j <= qb; j++) {
        uint4 x[B / 16];
#pragma unroll
        for (int n = 0; n < B / 16; n++) x[n] = tile[(long long)j * 512 + n * 128];
        if (j < qb) {
            load_tile_async<DH>(tiles + ((j + 1) & 1) * B * L, K, (j + 1) * B, seq);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t* Ks = tiles + (j & 1) * B * L;
#pragma unroll
        for (int n = 0; n < B / 16; n++) {
            // dSᵀ's fragment (keys × queries) → dS's (queries × keys): the
            // off-diagonal 8 × 8 quarters swap places.
            uint32_t dsf[4] = {movt(x[n].x), movt(x[n].z), movt(x[n].y), movt(x[n].w)};
            dq_add<DH>(dqa, dsf, Ks, lane, n);
        }
        __syncthreads();
    }
    store_acc<DH>(dqa, dq + (long long)bh * seq * DH, row0, seq, 1.f, 1.f);
}

#define LRMOE_FLASH(DH)                                                                                                \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_fwd_##DH(                                                  \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o, float* lse2, int seq, int heads,         \
        int kv, float sl) {                                                                                            \
        flash_fwd<DH>(q, k, v, o, lse2, seq, heads, kv, sl);                                                           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) flash_bwd_kv_##DH(                                               \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse2,             \
        const float* dd, uint16_t* dk, uint16_t* dv, uint4* ds, int seq, int heads, int kv, float sl, float scale) {   \
        flash_bwd_kv<DH>(q, k, v, dout, lse2, dd, dk, dv, ds, seq, heads, kv, sl, scale);                              \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_bwd_q_##DH(                                                \
        const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse2,             \
        const float* dd, uint16_t* dq, int seq, int heads, int kv, float sl, float scale) {                           \
        flash_bwd_q<DH>(q, k, v, dout, lse2, dd, dq, seq, heads, kv, sl, scale);                                       \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_bwd_q_ds_##DH(const uint16_t* k, const uint4* ds,         \
                                                                            uint16_t* dq, int seq, int heads, int kv) { \
        flash_bwd_q_ds<DH>(k, ds, dq, seq, heads, kv);                                                                 \
    }
LRMOE_FLASH(16)
LRMOE_FLASH(32)
LRMOE_FLASH(64)
LRMOE_FLASH(128)
