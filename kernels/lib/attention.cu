// Causal grouped-query attention forward on Hopper through CUTLASS 4.2's
// FMHA (examples/88_hopper_fmha, shipped in the nvidia-cutlass wheel: TMA
// loads, wgmma, warp-specialized consumers; FlashAttention-3's schedule).
// bf16 in and out, f32 accumulation and statistics. Built by `cargo xtask
// kernels` into kernels/out/liblrmoe_attention.so and loaded at run time by
// crates/kernels; the mma.sync kernels of kernels/dense.cu stay the twin
// path (and the backward's) for shapes this one does not take.
//
// Layouts are lrmoe's head-major ones: q, o [n_seq, heads, seq, dh], k, v
// [n_seq, kv, seq, dh], query head hq reading key/value head hq / g with
// g = heads / kv. With q's heads split as (kv, g), the batch mode of the
// CUTLASS problem is (sequence, kv head) — one linear index of stride
// g·seq·dh in q and seq·dh in k — and the head mode is g, of stride seq·dh
// in q and 0 in k and v: grouped-query attention without copying k or v.
//
// The row statistic is written as lrmoe's backward reads it, in base 2:
// lse2 = log2 Σ_{j ≤ i} exp(scale·q·k_j), scale = 1/√dh (CUTLASS writes the
// natural-log value; a second small kernel multiplies by log2 e).

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

#include "collective/fmha_fusion.hpp"
#include "device/device_universal.hpp"
#include "device/fmha_device_bwd.hpp"
#include "kernel/fmha_kernel_builder.hpp"

using namespace cute;
using namespace cutlass::fmha::kernel;
using namespace cutlass::fmha::collective;

namespace lrmoe_attention {

using Element = cutlass::bfloat16_t;
using ProblemShape = cute::tuple<int, int, int, int, int>;  // B H Q K D
using StrideQ = cute::tuple<int, _1, cute::tuple<int, int>>;  // Q D (B H)
using StrideK = cute::tuple<int, _1, cute::tuple<int, int>>;  // K D (B H)
using StrideV = cute::tuple<int, _1, cute::tuple<int, int>>;  // K D (B H)
using StrideO = cute::tuple<int, _1, cute::tuple<int, int>>;  // Q D (B H)
using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;      // Q (B H)

template <class Tile, class Schedule>
using Op = cutlass::device::Universal<typename FmhaBuilder<Element, float, float, Tile, StrideQ, StrideK, StrideV,
                                                           CausalFusion, Schedule>::Kernel>;

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
// The example's tiles for these head widths.
using Fwd128Coop = Op<Shape<_128, _128, _128>, Coop>;
using Fwd128Pingpong = Op<Shape<_128, _128, _128>, Pingpong>;
using Fwd64Coop = Op<Shape<_128, _64, _64>, Coop>;
using Fwd64Pingpong = Op<Shape<_128, _64, _64>, Pingpong>;

// y = a·x over n floats (x and y may be the same).
__global__ void scale_f32(const float* x, float* y, float a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = a * x[i];
}

int blocks_for(long long n, int sm_count) { return (int)std::max<long long>(1, std::min<long long>((n + 255) / 256, (long long)sm_count * 8)); }

// dst[b][s][:] = Σ_{j < g} src[b][j][s][:] (bf16, f32 sums rounded once):
// the per-query-head key/value gradients of a group summed into their
// shared head; rows of `row` elements, eight at a time.
__global__ void sum_groups_bf16(const uint16_t* __restrict__ src, uint16_t* __restrict__ dst, long long heads_kv,
                                int g, long long row_elems) {
    long long vecs = heads_kv * row_elems / 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < vecs; i += (long long)gridDim.x * blockDim.x) {
        long long e = i * 8, b = e / row_elems, r = e % row_elems;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < g; ++j) {
            uint4 w = *reinterpret_cast<const uint4*>(src + (b * g + j) * row_elems + r);
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                acc[2 * t] += __uint_as_float(ws[t] << 16);
                acc[2 * t + 1] += __uint_as_float(ws[t] & 0xffff0000u);
            }
        }
        uint32_t out[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * t], acc[2 * t + 1]);
            out[t] = *reinterpret_cast<uint32_t*>(&h);
        }
        *reinterpret_cast<uint4*>(dst + e) = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

// The backward: FlashAttention-2's order in CUTLASS's Hopper FMHA (one CTA
// per key tile and query head; dQ summed in f32 by atomics, then
// converted). Its tiles, after the example's.
using Bwd128 = cutlass::fmha::device::FmhaBwd<Element, float, Shape<_64, _128, _128>, CausalFusion>;
using Bwd64 = cutlass::fmha::device::FmhaBwd<Element, float, Shape<_64, _128, _64>, CausalFusion>;

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// The workspace's pieces: the natural-log row statistic, Σ O·dO per row,
// dQ in f32, and (grouped heads) dK and dV per query head.
struct BwdSpace {
    size_t lse, sum_odo, dq, dk, dv, total;
};
BwdSpace bwd_space(int n_seq, int heads, int kv, int seq, int dh) {
    size_t rows = (size_t)n_seq * heads * seq;
    BwdSpace w;
    w.lse = 0;
    w.sum_odo = w.lse + align256(rows * 4);
    w.dq = w.sum_odo + align256(rows * 4);
    w.dk = w.dq + align256(rows * dh * 4);
    size_t per = heads == kv ? 0 : align256(rows * dh * 2);
    w.dv = w.dk + per;
    w.total = w.dv + per;
    return w;
}

template <class Operation>
int run_bwd(int n_seq, int heads, int kv, int seq, int dh, const void* q, const void* k, const void* v, const void* o,
            const float* lse2, const void* dout, void* dq, void* dk, void* dv, void* workspace, size_t ws_bytes,
            int sm_count, cudaStream_t stream) {
    int g = heads / kv;
    BwdSpace w = bwd_space(n_seq, heads, kv, seq, dh);
    if (ws_bytes < w.total) return 1;
    char* ws = static_cast<char*>(workspace);
    float* lse = reinterpret_cast<float*>(ws + w.lse);
    long long rows = (long long)n_seq * heads * seq;
    // CUTLASS's backward reads the natural-log statistic.
    scale_f32<<<blocks_for(rows, sm_count), 256, 0, stream>>>(lse2, lse, 0.6931471805599453f, rows);
    int sd = seq * dh;
    using S4 = cute::tuple<int, int, int, _1>;
    S4 sq{g * sd, sd, dh, _1{}};
    S4 skv{sd, 0, dh, _1{}};
    bool grouped = g > 1;
    S4 sdkv = grouped ? sq : S4{sd, sd, dh, _1{}};
    void* dk_to = grouped ? ws + w.dk : dk;
    void* dv_to = grouped ? ws + w.dv : dv;
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Operation::Arguments args{
        {n_seq * kv, g, seq, seq, dh},
        static_cast<const Element*>(q), sq,
        static_cast<const Element*>(k), skv,
        static_cast<const Element*>(v), skv,
        static_cast<const Element*>(o), sq,
        lse, cute::tuple<int, int, _1>{g * seq, seq, _1{}},
        static_cast<const Element*>(dout), sq,
        static_cast<Element*>(dq), sq,
        static_cast<Element*>(dk_to), sdkv,
        static_cast<Element*>(dv_to), sdkv,
        hw};
    if (Operation::can_implement(args) != cutlass::Status::kSuccess) return 3;
    Operation op;
    if (op.initialize_split(args, ws + w.dq, ws + w.sum_odo, stream) != cutlass::Status::kSuccess) return 4;
    if (op.run(stream) != cutlass::Status::kSuccess) return 5;
    if (grouped) {
        long long hk = (long long)n_seq * kv;
        sum_groups_bf16<<<blocks_for(hk * sd / 8, sm_count), 256, 0, stream>>>(
            reinterpret_cast<const uint16_t*>(ws + w.dk), static_cast<uint16_t*>(dk), hk, g, sd);
        sum_groups_bf16<<<blocks_for(hk * sd / 8, sm_count), 256, 0, stream>>>(
            reinterpret_cast<const uint16_t*>(ws + w.dv), static_cast<uint16_t*>(dv), hk, g, sd);
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

template <class Operation>
int run(int n_seq, int heads, int kv, int seq, int dh, const void* q, const void* k, const void* v, void* o,
        float* lse2, int sm_count, cudaStream_t stream) {
    int g = heads / kv;
    ProblemShape shape{n_seq * kv, g, seq, seq, dh};
    int sd = seq * dh;
    StrideQ sq{dh, _1{}, make_tuple(g * sd, sd)};
    StrideK sk{dh, _1{}, make_tuple(sd, 0)};
    StrideV sv{dh, _1{}, make_tuple(sd, 0)};
    StrideO so{dh, _1{}, make_tuple(g * sd, sd)};
    StrideLSE sl{_1{}, make_tuple(g * seq, seq)};
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Operation::Arguments args{shape,
                                       {static_cast<const Element*>(q), sq, static_cast<const Element*>(k), sk,
                                        static_cast<const Element*>(v), sv},
                                       {static_cast<Element*>(o), so, lse2, sl},
                                       hw};
    if (Operation::get_workspace_size(args) != 0) return 1;
    if (Operation::can_implement(args) != cutlass::Status::kSuccess) return 3;
    // The shared-memory limit once per configuration (thread-safe); the
    // parameters (TMA descriptors) per call, on this thread's stack, so
    // in-process ranks may call from several threads.
    static const bool ready = [] {
        int smem = Operation::Kernel::SharedStorageSize;
        return smem < (48 << 10) ||
               cudaFuncSetAttribute(cutlass::device_kernel<typename Operation::Kernel>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess;
    }();
    if (!ready) return 4;
    auto params = Operation::Kernel::to_underlying_arguments(args, nullptr);
    if (Operation::run(params, stream) != cutlass::Status::kSuccess) return 5;
    long long rows = (long long)n_seq * heads * seq;
    scale_f32<<<blocks_for(rows, sm_count), 256, 0, stream>>>(lse2, lse2, 1.4426950408889634f, rows);
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

}  // namespace lrmoe_attention

using namespace lrmoe_attention;

extern "C" {

// Whether this library takes the shape: head width 64 or 128, seq a
// positive multiple of 128 (the query tile; no partial tiles), kv a divisor
// of heads, and fewer than 2^31 elements in q (CUTLASS's strides and
// offsets here are 32-bit).
int lrmoe_flash_fwd_supports(int n_seq, int heads, int kv, int seq, int dh) {
    return n_seq > 0 && kv > 0 && heads % kv == 0 && seq > 0 && seq % 128 == 0 && (dh == 64 || dh == 128) &&
           (long long)n_seq * heads * seq * dh < (1LL << 31);
}

// The forward on `stream` (device pointers, layouts as in the header);
// schedule 0: cooperative, 1: ping-pong. Returns 0, or a nonzero code: 1
// workspace needed, 2 shape not supported, 3 CUTLASS cannot implement, 4
// initialize, 5 run, 6 launch error.
int lrmoe_flash_fwd(int schedule, int n_seq, int heads, int kv, int seq, int dh, const void* q, const void* k,
                    const void* v, void* o, float* lse2, int sm_count, void* stream) {
    if (!lrmoe_flash_fwd_supports(n_seq, heads, kv, seq, dh)) return 2;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dh == 128)
        return schedule == 1 ? run<Fwd128Pingpong>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, sm_count, s)
                             : run<Fwd128Coop>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, sm_count, s);
    return schedule == 1 ? run<Fwd64Pingpong>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, sm_count, s)
                         : run<Fwd64Coop>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, sm_count, s);
}
}

extern "C" {

// Bytes of device workspace lrmoe_flash_bwd needs for the shape (0 when
// the shape is not taken).
size_t lrmoe_flash_bwd_workspace(int n_seq, int heads, int kv, int seq, int dh) {
    if (!lrmoe_flash_fwd_supports(n_seq, heads, kv, seq, dh)) return 0;
    return bwd_space(n_seq, heads, kv, seq, dh).total;
}

// The backward on `stream` from q, k, v, the forward's o and lse2 (base 2,
// as lrmoe_flash_fwd writes it) and dout (layouts as in the header): dq,
// dk, dv (bf16). Returns 0, or a nonzero code: 1 workspace too small, 2
// shape not supported, 3 CUTLASS cannot implement, 4 initialize, 5 run, 6
// launch error.
int lrmoe_flash_bwd(int n_seq, int heads, int kv, int seq, int dh, const void* q, const void* k, const void* v,
                    const void* o, const float* lse2, const void* dout, void* dq, void* dk, void* dv, void* workspace,
                    size_t ws_bytes, int sm_count, void* stream) {
    if (!lrmoe_flash_fwd_supports(n_seq, heads, kv, seq, dh)) return 2;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dh == 128)
        return run_bwd<Bwd128>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, dout, dq, dk, dv, workspace, ws_bytes,
                               sm_count, s);
    return run_bwd<Bwd64>(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, dout, dq, dk, dv, workspace, ws_bytes,
                          sm_count, s);
}
}
