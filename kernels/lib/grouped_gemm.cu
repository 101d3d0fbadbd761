// Variable-size grouped GEMM for the MoE layer on Hopper, bf16 in, f32
// accumulate, bf16 out, through CUTLASS 4.2's sm90 pointer-array grouped
// GEMM (TMA + wgmma, warp-specialized cooperative schedule; after example
// 57_hopper_grouped_gemm). Built by `cargo xtask kernels` into
// kernels/out/liblrmoe_gemm.so and loaded at run time by crates/kernels.
//
// Group sizes are read from device memory: a setup kernel turns the row
// offsets into per-group problem shapes, pointers and strides, and CUTLASS
// reads the shapes on the device (no host copy of the group sizes, no sync).
//
// Variants (E groups, offsets[E+1] over the routed rows, h = hidden, f = ffn):
//   0 forward : D[rows, f]  = A[rows, h] · B[e] (B: E × h × f)      per group (n_e, f, h)
//   1 dgrad   : D[rows, h]  = A[rows, f] · B[e]^T (B: E × h × f)    per group (n_e, h, f)
//   2 wgrad   : D[e] (h × f) = A[rows_e, h]^T · B[rows_e, f]        per group (h, f, n_e)

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Element = cutlass::bfloat16_t;
using Accum = float;
constexpr int Align = 8;
// The wider epilogue sub-tile (see below).
using Epi128x64 = Shape<_128, _64>;

// One concrete configuration per variant, at namespace scope (the host
// compiler rejects the builders' dependent types inside a class template).
#define LRMOE_GROUPED_GEMM(NAME, LAYOUT_A, LAYOUT_B, ELEMENT_C, EPI_TILE)                                              \
    namespace NAME##_cfg {                                                                                             \
    using LayoutA = LAYOUT_A;                                                                                          \
    using LayoutB = LAYOUT_B;                                                                                          \
    using LayoutD = cutlass::layout::RowMajor;                                                                         \
    using ElementC = ELEMENT_C;                                                                                        \
    using TileShape = Shape<_128, _256, _64>;                                                                          \
    using ClusterShape = Shape<_1, _1, _1>;                                                                            \
    using CollectiveEpilogue = cutlass::epilogue::collective::CollectiveBuilder<                                       \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EPI_TILE, Accum, Accum,          \
        ElementC, LayoutD*, Align, Element, LayoutD*, Align, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, \
        cutlass::epilogue::fusion::LinearCombination<Element, Accum, ElementC>>::CollectiveOp;                         \
    using CollectiveMainloop = cutlass::gemm::collective::CollectiveBuilder<                                           \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, Align, Element, LayoutB*, Align,       \
        Accum, TileShape, ClusterShape,                                                                                \
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                                            \
            sizeof(typename CollectiveEpilogue::SharedStorage))>,                                                      \
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;                                     \
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;          \
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;                                                  \
    using StrideA = typename Gemm::GemmKernel::InternalStrideA;                                                        \
    using StrideB = typename Gemm::GemmKernel::InternalStrideB;                                                        \
    using StrideD = typename Gemm::GemmKernel::InternalStrideD;                                                        \
    }                                                                                                                  \
    struct NAME {                                                                                                      \
        using Gemm = NAME##_cfg::Gemm;                                                                                 \
        using StrideA = NAME##_cfg::StrideA;                                                                           \
        using StrideB = NAME##_cfg::StrideB;                                                                           \
        using StrideD = NAME##_cfg::StrideD;                                                                           \
        using ElementC = NAME##_cfg::ElementC;                                                                         \
    };

// Epilogue tiles: the data gradient and the weight gradient store their
// output in 128 × 64 sub-tiles (CUTLASS's default is 128 × 32): twice the
// bytes in flight per TMA store. The weight gradient at small K spends much
// of each tile in its epilogue (E128, one H200, alternating in one call: at
// a quarter of the rows 0.310 → 0.290 ms, at all rows 0.773 → 0.752; the
// data gradient 0.72 → 0.71 at all rows, unchanged at a quarter; the
// forward unchanged either way, so it keeps the default). The plain weight
// gradient reads no C (void C alone changes nothing; it frees the shared
// memory the wider sub-tile needs); the weight gradient added onto a base
// keeps CUTLASS's default.
LRMOE_GROUPED_GEMM(Fwd, cutlass::layout::RowMajor, cutlass::layout::RowMajor, Element,
                   cutlass::epilogue::collective::EpilogueTileAuto)
LRMOE_GROUPED_GEMM(Dgrad, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Element, Epi128x64)
LRMOE_GROUPED_GEMM(Wgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, Epi128x64)
LRMOE_GROUPED_GEMM(WgradOnto, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Element,
                   cutlass::epilogue::collective::EpilogueTileAuto)

// Per-group arrays carved from the caller's workspace.
template <class G>
struct Arrays {
    typename ProblemShape::UnderlyingProblemShape* sizes;
    const Element** a;
    const Element** b;
    Element** d;
    typename G::StrideA* sa;
    typename G::StrideB* sb;
    typename G::StrideD* sd;
};

static size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

template <class G>
static size_t arrays_bytes(int groups) {
    size_t g = static_cast<size_t>(groups);
    return align256(g * sizeof(typename ProblemShape::UnderlyingProblemShape)) + 3 * align256(g * sizeof(void*)) +
           align256(g * sizeof(typename G::StrideA)) + align256(g * sizeof(typename G::StrideB)) +
           align256(g * sizeof(typename G::StrideD));
}

template <class G>
static Arrays<G> carve(char* ws, int groups) {
    size_t g = static_cast<size_t>(groups);
    Arrays<G> r;
    r.sizes = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(ws);
    ws += align256(g * sizeof(*r.sizes));
    r.a = reinterpret_cast<const Element**>(ws);
    ws += align256(g * sizeof(void*));
    r.b = reinterpret_cast<const Element**>(ws);
    ws += align256(g * sizeof(void*));
    r.d = reinterpret_cast<Element**>(ws);
    ws += align256(g * sizeof(void*));
    r.sa = reinterpret_cast<typename G::StrideA*>(ws);
    ws += align256(g * sizeof(typename G::StrideA));
    r.sb = reinterpret_cast<typename G::StrideB*>(ws);
    ws += align256(g * sizeof(typename G::StrideB));
    r.sd = reinterpret_cast<typename G::StrideD*>(ws);
    return r;
}

template <class G, int V>
__global__ void setup(Arrays<G> r, int groups, const int* __restrict__ offsets, const Element* a, const Element* b,
                      Element* d, int h, int f) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= groups) return;
    int lo = offsets[e];
    int n = offsets[e + 1] - lo;
    int m, nn, k;
    if (V == 0) {
        m = n; nn = f; k = h;
        r.a[e] = a + static_cast<size_t>(lo) * h;
        r.b[e] = b + static_cast<size_t>(e) * h * f;
        r.d[e] = d + static_cast<size_t>(lo) * f;
    } else if (V == 1) {
        m = n; nn = h; k = f;
        r.a[e] = a + static_cast<size_t>(lo) * f;
        r.b[e] = b + static_cast<size_t>(e) * h * f;
        r.d[e] = d + static_cast<size_t>(lo) * h;
    } else {
        m = h; nn = f; k = n;
        r.a[e] = a + static_cast<size_t>(lo) * h;
        r.b[e] = b + static_cast<size_t>(lo) * f;
        r.d[e] = d + static_cast<size_t>(e) * h * f;
    }
    r.sizes[e] = {m, nn, k};
    r.sa[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
    r.sb[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {nn, k, 1});
    r.sd[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, nn, 1});
}

template <class G>
static typename G::Gemm::Arguments arguments(Arrays<G> r, int groups, int sm_count, float beta) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename G::Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion{};
    fusion.alpha = 1.f;
    fusion.beta = beta;
    decltype(args.epilogue.ptr_C) c = nullptr;
    if constexpr (!std::is_void_v<typename G::ElementC>) c = const_cast<const Element**>(r.d);
    args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                       {groups, r.sizes, nullptr},
                                       {r.a, r.sa, r.b, r.sb},
                                       {fusion, c, r.sd, r.d, r.sd},
                                       hw};
    return args;
}

template <class G>
static size_t workspace_bytes(int groups, int sm_count) {
    Arrays<G> r = carve<G>(nullptr, groups);
    return arrays_bytes<G>(groups) + align256(G::Gemm::get_workspace_size(arguments<G>(r, groups, sm_count, 0.f)));
}

template <class G, int V>
static int run(int groups, const int* offsets, const void* a, const void* b, void* d, float beta, int h, int f,
               int sm_count, void* workspace, size_t ws_bytes, cudaStream_t stream) {
    if (groups <= 0) return 0;
    if (ws_bytes < workspace_bytes<G>(groups, sm_count)) return 1;
    char* ws = static_cast<char*>(workspace);
    Arrays<G> r = carve<G>(ws, groups);
    setup<G, V><<<(groups + 127) / 128, 128, 0, stream>>>(r, groups, offsets, static_cast<const Element*>(a),
                                                           static_cast<const Element*>(b), static_cast<Element*>(d), h,
                                                           f);
    if (cudaGetLastError() != cudaSuccess) return 2;
    auto args = arguments<G>(r, groups, sm_count, beta);
    typename G::Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
    if (gemm.initialize(args, ws + arrays_bytes<G>(groups), stream) != cutlass::Status::kSuccess) return 4;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
    if (cudaGetLastError() != cudaSuccess) return 6;
    return 0;
}

extern "C" {

// Bytes of device workspace a call of `variant` over `groups` groups needs.
size_t lrmoe_grouped_gemm_workspace(int variant, int groups, int sm_count) {
    if (groups <= 0) return 0;
    switch (variant) {
        case 0: return workspace_bytes<Fwd>(groups, sm_count);
        case 1: return workspace_bytes<Dgrad>(groups, sm_count);
        case 2: return std::max(workspace_bytes<Wgrad>(groups, sm_count), workspace_bytes<WgradOnto>(groups, sm_count));
        default: return 0;
    }
}

// Runs `variant` on `stream`: D = A·B, or D = A·B + D (summed in f32, one
// rounding) when beta is 1 (beta is 0 or 1). Pointers are device pointers:
// offsets [groups+1] i32; a, b, d bf16 as in the header; workspace of at
// least lrmoe_grouped_gemm_workspace bytes. Returns 0, or a nonzero code:
// 1 workspace too small, 2 setup launch failed, 3 CUTLASS cannot implement
// (alignment: h and f must be multiples of 8), 4 initialize, 5 run, 6 launch
// error, 7 unknown variant.
int lrmoe_grouped_gemm(int variant, int groups, const int* offsets, const void* a, const void* b, void* d, float beta,
                       int h, int f, int sm_count, void* workspace, size_t ws_bytes, void* stream) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (variant) {
        case 0: return run<Fwd, 0>(groups, offsets, a, b, d, beta, h, f, sm_count, workspace, ws_bytes, s);
        case 1: return run<Dgrad, 1>(groups, offsets, a, b, d, beta, h, f, sm_count, workspace, ws_bytes, s);
        case 2:
            return beta == 0.f ? run<Wgrad, 2>(groups, offsets, a, b, d, beta, h, f, sm_count, workspace, ws_bytes, s)
                               : run<WgradOnto, 2>(groups, offsets, a, b, d, beta, h, f, sm_count, workspace, ws_bytes, s);
        default: return 7;
    }
}
}
