// Causal grouped-query attention backward through cuDNN's fused SDPA
// backward (cudnn-frontend's graph API, header-only, from the PyPI wheel
// nvidia-cudnn-frontend; cuDNN itself is the user's libcudnn.so.9, e.g. the
// one PyTorch installs). Built by `cargo xtask kernels` into
// kernels/out/liblrmoe_cudnn_attention.so, linked against libcudnn.so.9
// by its soname: crates/kernels opens libcudnn.so.9 by its full path first
// (`LRMOE_CUDNN` or a search), so the soname resolves to that copy, then
// this library. Where neither opens, the model keeps its own backward
// (kernels/dense.cu, kernels/lib/attention.cu).
//
// Layouts are lrmoe's head-major ones (as attention.cu's): q, o, dq, dout
// [n_seq, heads, seq, dh], k, v, dk, dv [n_seq, kv, seq, dh], query head
// hq reading key/value head hq / (heads / kv). The forward's row
// statistic comes in lrmoe's base 2 (lse2 = log2 Σ_{j ≤ i} exp(scale·q·k_j),
// scale = 1/√dh); cuDNN reads the natural-log one, so the call first
// writes lse2 · ln 2 into the front of its workspace.
//
// One graph per (device, shape), built on first use and kept for the
// process's life; one cuDNN handle per device. Calls are serialised by one lock (the graph's build
// and the launch; the work itself runs on the caller's stream).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include <cuda_runtime.h>
#include <cudnn_frontend.h>
#include <nvrtc.h>

namespace fe = cudnn_frontend;

namespace lrmoe_cudnn {

enum Uid : int64_t { Q = 1, K, V, O, DO, STATS, DQ, DK, DV };

struct Shape {
    int n_seq, heads, kv, seq, dh;
};

// Error text for the caller (a fixed buffer it owns).
void say(char *err, int len, const char *what, const std::string &detail) {
    if (err && len > 0) std::snprintf(err, (size_t)len, "%s: %s", what, detail.c_str());
}

bool shape_ok(const Shape &s, char *err, int len) {
    if (s.n_seq <= 0 || s.heads <= 0 || s.kv <= 0 || s.seq <= 0 || s.dh <= 0) {
        say(err, len, "cuDNN attention", "every dimension must be positive");
        return false;
    }
    if (s.heads % s.kv != 0) {
        say(err, len, "cuDNN attention", "heads must be a multiple of kv heads");
        return false;
    }
    if (s.dh % 8 != 0 || s.dh > 256) {
        say(err, len, "cuDNN attention", "head width must be a multiple of 8, at most 256");
        return false;
    }
    return true;
}

struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
};

// Kept for the life of the process, never destroyed: a graph's plans may
// release device memory, which must not happen after the CUDA context is
// gone at exit (or when the library is closed).
std::mutex &lock = *new std::mutex;
std::map<int, cudnnHandle_t> &handles = *new std::map<int, cudnnHandle_t>;  // by device
std::map<std::tuple<int, int, int, int, int, int>, Entry> &graphs =
    *new std::map<std::tuple<int, int, int, int, int, int>, Entry>;  // (device, shape)

std::shared_ptr<fe::graph::Tensor_attributes> head_major(fe::graph::Graph &g, const char *name, int64_t uid, int64_t b,
                                                         int64_t h, int64_t s, int64_t d) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({b, h, s, d})
                        .set_stride({h * s * d, s * d, d, 1}));
}

// The handle for the current device and the graph for `s` on it, built on
// first use; false (with the reason in err) when cuDNN refuses. Holds `lock`.
bool prepare(const Shape &s, cudnnHandle_t *handle, Entry **entry, char *err, int len) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        say(err, len, "cuDNN attention", "no current CUDA device");
        return false;
    }
    auto h = handles.find(dev);
    if (h == handles.end()) {
        cudnnHandle_t made = nullptr;
        cudnnStatus_t st = cudnnCreate(&made);
        if (st != CUDNN_STATUS_SUCCESS) {
            say(err, len, "cudnnCreate", cudnnGetErrorString(st));
            return false;
        }
        h = handles.emplace(dev, made).first;
    }
    *handle = h->second;
    auto key = std::make_tuple(dev, s.n_seq, s.heads, s.kv, s.seq, s.dh);
    auto found = graphs.find(key);
    if (found != graphs.end()) {
        *entry = &found->second;
        return true;
    }
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    int64_t b = s.n_seq, hq = s.heads, hk = s.kv, n = s.seq, d = s.dh;
    auto q = head_major(*g, "q", Q, b, hq, n, d);
    auto k = head_major(*g, "k", K, b, hk, n, d);
    auto v = head_major(*g, "v", V, b, hk, n, d);
    auto o = head_major(*g, "o", O, b, hq, n, d);
    auto dout = head_major(*g, "dout", DO, b, hq, n, d);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(STATS)
                               .set_dim({b, hq, n, 1})
                               .set_stride({hq * n, n, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes()
                     .set_name("lrmoe_sdpa_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(1.0f / std::sqrt((float)s.dh));
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, attrs);
    dq->set_output(true).set_uid(DQ).set_dim({b, hq, n, d}).set_stride({hq * n * d, n * d, d, 1});
    dk->set_output(true).set_uid(DK).set_dim({b, hk, n, d}).set_stride({hk * n * d, n * d, d, 1});
    dv->set_output(true).set_uid(DV).set_dim({b, hk, n, d}).set_stride({hk * n * d, n * d, d, 1});
    auto step = [&](fe::error_t e, const char *what) {
        if (e.is_bad()) say(err, len, what, e.get_message());
        return e.is_good();
    };
    if (!step(g->validate(), "cuDNN validate") || !step(g->build_operation_graph(*handle), "cuDNN operation graph") ||
        !step(g->create_execution_plans({fe::HeurMode_t::A}), "cuDNN execution plans") ||
        !step(g->check_support(*handle), "cuDNN support") ||
        !step(g->build_plans(*handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "cuDNN plans"))
        return false;
    Entry e;
    e.graph = g;
    if (!step(g->get_workspace_size(e.workspace), "cuDNN workspace")) return false;
    *entry = &graphs.emplace(key, e).first->second;
    return true;
}

size_t stats_bytes(const Shape &s) {
    // Rounded up to 256 bytes so cuDNN's workspace after it stays aligned.
    size_t n = (size_t)s.n_seq * s.heads * s.seq * sizeof(float);
    return (n + 255) / 256 * 256;
}

// y = a·x over n floats.
__global__ void scale_f32(const float *x, float *y, float a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = a * x[i];
}

// Runs f(handle, plan, shape) under the lock once the shape's plan is
// built (or found): 0 when f returns true, else 1 with the reason in err.
template <class F> int with_plan(const Shape &s, char *err, int err_len, F f) {
    if (!shape_ok(s, err, err_len)) return 1;
    try {
        std::lock_guard<std::mutex> g(lock);
        cudnnHandle_t h;
        Entry *e;
        if (!prepare(s, &h, &e, err, err_len)) return 1;
        return f(h, e, s) ? 0 : 1;
    } catch (const std::exception &x) {
        say(err, err_len, "cuDNN attention", x.what());
        return 1;
    }
}

}  // namespace lrmoe_cudnn

using namespace lrmoe_cudnn;

extern "C" {

// cudnn-frontend's experimental engines (Blackwell's, compiled at run time)
// call NVRTC; this backward never reaches them. Weak definitions keep the
// library free of a dependency on libnvrtc: a loaded NVRTC's own
// definitions take precedence, and without one these report an error.
__attribute__((weak)) nvrtcResult nvrtcCreateProgram(nvrtcProgram *, const char *, const char *, int,
                                                     const char *const *, const char *const *) {
    return NVRTC_ERROR_INTERNAL_ERROR;
}
__attribute__((weak)) nvrtcResult nvrtcDestroyProgram(nvrtcProgram *) { return NVRTC_ERROR_INTERNAL_ERROR; }
__attribute__((weak)) nvrtcResult nvrtcCompileProgram(nvrtcProgram, int, const char *const *) {
    return NVRTC_ERROR_INTERNAL_ERROR;
}
__attribute__((weak)) nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, size_t *) { return NVRTC_ERROR_INTERNAL_ERROR; }
__attribute__((weak)) nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char *) { return NVRTC_ERROR_INTERNAL_ERROR; }
__attribute__((weak)) nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, size_t *) { return NVRTC_ERROR_INTERNAL_ERROR; }
__attribute__((weak)) nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char *) { return NVRTC_ERROR_INTERNAL_ERROR; }

// cuDNN's version (e.g. 92801), or 0 if libcudnn is not reachable.
int lrmoe_cudnn_version() { return (int)cudnnGetVersion(); }

// The workspace `lrmoe_cudnn_bwd` needs for this shape on the current
// device, building (and keeping) the graph: 0 and *bytes set, or 1 with
// the reason in err (cuDNN does not take the shape, or is not usable).
int lrmoe_cudnn_bwd_workspace(int n_seq, int heads, int kv, int seq, int dh, size_t *bytes, char *err, int err_len) {
    return with_plan(Shape{n_seq, heads, kv, seq, dh}, err, err_len, [&](cudnnHandle_t, Entry *e, const Shape &s) {
        *bytes = stats_bytes(s) + (size_t)e->workspace;
        return true;
    });
}

// dq, dk, dv (bf16, head-major) of the causal attention whose forward gave
// o and lse2, on `stream`; `workspace` of at least the bytes
// `lrmoe_cudnn_bwd_workspace` gave for the shape. 0, or 1 with the reason.
int lrmoe_cudnn_bwd(int n_seq, int heads, int kv, int seq, int dh, const void *q, const void *k, const void *v,
                    const void *o, const float *lse2, const void *dout, void *dq, void *dk, void *dv, void *workspace,
                    size_t ws_bytes, void *stream, char *err, int err_len) {
    return with_plan(Shape{n_seq, heads, kv, seq, dh}, err, err_len, [&](cudnnHandle_t h, Entry *e, const Shape &s) {
        size_t lead = stats_bytes(s);
        if (ws_bytes < lead + (size_t)e->workspace) {
            say(err, err_len, "cuDNN attention", "workspace smaller than lrmoe_cudnn_bwd_workspace asked for");
            return false;
        }
        auto st = cudnnSetStream(h, (cudaStream_t)stream);
        if (st != CUDNN_STATUS_SUCCESS) {
            say(err, err_len, "cudnnSetStream", cudnnGetErrorString(st));
            return false;
        }
        long long rows = (long long)n_seq * heads * seq;
        float *stats = (float *)workspace;
        int blocks = (int)std::min<long long>((rows + 255) / 256, 1024);
        scale_f32<<<blocks, 256, 0, (cudaStream_t)stream>>>(lse2, stats, 0.69314718055994530942f, rows);
        cudaError_t ce = cudaGetLastError();
        if (ce != cudaSuccess) {
            say(err, err_len, "cuDNN attention statistics", cudaGetErrorString(ce));
            return false;
        }
        std::unordered_map<int64_t, void *> pack = {
            {Q, (void *)q},   {K, (void *)k},   {V, (void *)v},  {O, (void *)o},  {DO, (void *)dout},
            {STATS, stats},   {DQ, dq},         {DK, dk},        {DV, dv},
        };
        void *rest = e->workspace > 0 ? (void *)((char *)workspace + lead) : nullptr;
        auto r = e->graph->execute(h, pack, rest);
        if (r.is_bad()) {
            say(err, err_len, "cuDNN execute", r.get_message());
            return false;
        }
        return true;
    });
}

}  // extern "C"
