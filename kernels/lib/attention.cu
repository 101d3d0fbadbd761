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

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

#include "collective/fmha_fusion.hpp"
#include "device/device_universal.hpp"
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

__global__ void to_log2(float* x, long long n) {
    const float log2e = 1.4426950408889634f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= log2e;
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
    int blocks = (int)std::min<long long>((rows + 255) / 256, (long long)sm_count * 8);
    to_log2<<<blocks, 256, 0, stream>>>(lse2, rows);
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
}

}  // namespace lrmoe_attention

using namespace lrmoe_attention;

extern "C" {

// Whether this library takes the shape: head width 64 or 128, seq a
// positive multiple of 128 (the query tile; no partial tiles), kv a divisor
// of heads.
int lrmoe_flash_fwd_supports(int n_seq, int heads, int kv, int seq, int dh) {
    return n_seq > 0 && kv > 0 && heads % kv == 0 && seq > 0 && seq % 128 == 0 && (dh == 64 || dh == 128);
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
