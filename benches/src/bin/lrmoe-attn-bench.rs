//! `lrmoe-attn-bench`: the device model's causal grouped-query attention —
//! scores materialised by grouped GEMMs (one group per sequence and
//! key/value head), the causal softmax kernels, the RoPE head layouts —
//! forward and forward + backward, at the shapes of qwen3-moe-mini and of
//! Qwen3-30B-A3B. Its peer, `benches/torch_attention.py` (PyTorch's fused
//! `scaled_dot_product_attention`), runs in the same device call: whether
//! a fused (flash) attention kernel would pay is read off the two.
//!
//! Prints one JSON line per shape: median device ms of the forward and of
//! forward + backward (10 runs after 3 warm-ups, CUDA events), and the
//! bytes of the materialised probabilities the forward keeps.

use kernels::cpu::{random_bf16, GemmVariant};
use kernels::gpu::{CudaSlice, Gpu};

/// One attention shape: sequences, sequence length, query heads, key/value
/// heads, head width.
struct Shape {
    name: &'static str,
    n_seq: usize,
    seq: usize,
    heads: usize,
    kv: usize,
    dh: usize,
}

struct Saved {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    p: CudaSlice<u16>,
}

fn main() -> anyhow::Result<()> {
    lrmoe_benches::init_process();
    let gpu = Gpu::open(0)?;
    let shapes = [
        Shape {
            name: "qwen3-moe-mini",
            n_seq: 32,
            seq: 512,
            heads: 8,
            kv: 2,
            dh: 64,
        },
        Shape {
            name: "qwen3-30b-a3b",
            n_seq: 8,
            seq: 2048,
            heads: 32,
            kv: 4,
            dh: 128,
        },
    ];
    for s in &shapes {
        let (n_seq, seq, h, kv, dh) = (s.n_seq, s.seq, s.heads, s.kv, s.dh);
        let n = n_seq * seq;
        let theta = 1.0e6f32;
        let scale = 1.0 / (dh as f32).sqrt();
        let qt = gpu.upload(&random_bf16(n * h * dh, 1))?;
        let kt = gpu.upload(&random_bf16(n * kv * dh, 2))?;
        let vt = gpu.upload(&random_bf16(n * kv * dh, 3))?;
        let dout = gpu.upload(&random_bf16(n * h * dh, 4))?;
        let groups = n_seq * kv;
        let rows = n_seq * h * seq;
        let att = gpu.even_offsets(groups, (h / kv) * seq)?;
        let forward = || -> anyhow::Result<(CudaSlice<u16>, Saved)> {
            let q = gpu.heads(&qt, (n_seq, seq, h, dh), theta, true)?;
            let k = gpu.heads(&kt, (n_seq, seq, kv, dh), theta, true)?;
            let v = gpu.heads(&vt, (n_seq, seq, kv, dh), 0.0, true)?;
            let sc = gpu.gemm_dev(GemmVariant::DataGrad, &att, groups, rows, &q, &k, seq, dh)?;
            let p = gpu.softmax_causal(&sc, rows, seq, scale)?;
            drop(sc);
            let c = gpu.gemm_dev(GemmVariant::Forward, &att, groups, rows, &p, &v, seq, dh)?;
            let out = gpu.heads(&c, (n_seq, seq, h, dh), 0.0, false)?;
            Ok((out, Saved { q, k, v, p }))
        };
        let backward = |sv: &Saved| -> anyhow::Result<()> {
            let dc = gpu.heads(&dout, (n_seq, seq, h, dh), 0.0, true)?;
            let dp = gpu.gemm_dev(
                GemmVariant::DataGrad,
                &att,
                groups,
                rows,
                &dc,
                &sv.v,
                seq,
                dh,
            )?;
            let dv = gpu.gemm_dev(
                GemmVariant::WeightGrad,
                &att,
                groups,
                rows,
                &sv.p,
                &dc,
                seq,
                dh,
            )?;
            let ds = gpu.softmax_causal_backward(&sv.p, &dp, rows, seq, scale)?;
            drop(dp);
            let dq = gpu.gemm_dev(
                GemmVariant::Forward,
                &att,
                groups,
                rows,
                &ds,
                &sv.k,
                seq,
                dh,
            )?;
            let dk = gpu.gemm_dev(
                GemmVariant::WeightGrad,
                &att,
                groups,
                rows,
                &ds,
                &sv.q,
                seq,
                dh,
            )?;
            gpu.heads(&dq, (n_seq, seq, h, dh), theta, false)?;
            gpu.heads(&dk, (n_seq, seq, kv, dh), theta, false)?;
            gpu.heads(&dv, (n_seq, seq, kv, dh), 0.0, false)?;
            Ok(())
        };
        let time = |both: bool| -> anyhow::Result<f64> {
            let mut ts = Vec::new();
            for i in 0..13 {
                let a = gpu.mark()?;
                let (_, sv) = forward()?;
                if both {
                    backward(&sv)?;
                }
                let b = gpu.mark()?;
                if i >= 3 {
                    ts.push(b.ms_since(&a)?);
                }
            }
            ts.sort_by(f64::total_cmp);
            Ok(ts[ts.len() / 2])
        };
        let (fwd, fwd_bwd) = (time(false)?, time(true)?);
        println!(
            "{}",
            serde_json::json!({
                "ours": s.name,
                "batch": n_seq, "seq": seq, "heads": h, "kv_heads": kv, "head_dim": dh,
                "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                "saved_probs_bytes": rows * seq * 2,
            })
        );
    }
    Ok(())
}
