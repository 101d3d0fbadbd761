//! `lrmoe-attn-bench`: the device model's causal grouped-query attention
//! (`Gpu::attention_forward` / `attention_backward`: the fused kernels or
//! scores materialised by grouped GEMMs, one group per sequence and
//! key/value head, as `LRMOE_ATTENTION` picks; the RoPE head layouts
//! included), forward and forward + backward, at the shapes of
//! qwen3-moe-mini and of Qwen3-30B-A3B. Its peer,
//! `benches/torch_attention.py` (PyTorch's fused
//! `scaled_dot_product_attention`), runs in the same device call
//! (`benches/attention-device.sh` runs both paths and the peer).
//!
//! Prints one JSON line per shape: median device ms of the forward and of
//! forward + backward (10 runs after 3 warm-ups, CUDA events), the same
//! for the fused kernels alone (`kernels_*`: no RoPE or layout passes), the
//! path taken, the bytes of probabilities the forward keeps (0 when
//! fused), and each forward kernel alone where it takes the shape
//! (`forward_kernels_ms`: the `mma.sync` kernel and CUTLASS's two
//! schedules, `LRMOE_ATTENTION_FWD`), and the default forward with each
//! backward that takes the shape (`fwd_bwd_kernels_ms`: the `mma.sync`
//! kernels with the stored dS, CUTLASS's, cuDNN's; `LRMOE_ATTENTION_DQ`).

use kernels::cpu::random_bf16;
use kernels::gpu::{AttnDq, AttnFwd, AttnShape, Gpu};

fn main() -> anyhow::Result<()> {
    lrmoe_benches::init_process();
    let gpu = Gpu::open(0)?;
    let cudnn = match gpu.cudnn_attention() {
        Ok((path, version)) => serde_json::json!({"version": version, "path": path}),
        Err(e) => serde_json::json!({"error": e.to_string()}),
    };
    let shape = |n_seq, seq, heads, kv_heads, head_dim| AttnShape {
        n_seq,
        seq,
        heads,
        kv_heads,
        head_dim,
        theta: 1.0e6,
    };
    for (name, shape) in [
        ("qwen3-moe-mini", shape(32, 512, 8, 2, 64)),
        ("qwen3-30b-a3b", shape(8, 2048, 32, 4, 128)),
    ] {
        let (n_seq, seq, h, kv, dh) = (
            shape.n_seq,
            shape.seq,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
        );
        let n = n_seq * seq;
        let qt = gpu.upload(&random_bf16(n * h * dh, 1))?;
        let kt = gpu.upload(&random_bf16(n * kv * dh, 2))?;
        let vt = gpu.upload(&random_bf16(n * kv * dh, 3))?;
        let dout = gpu.upload(&random_bf16(n * h * dh, 4))?;
        let att = gpu.even_offsets(shape.groups(), shape.rows_each())?;
        let rows = n_seq * h * seq;
        let whole = |both: bool| -> anyhow::Result<()> {
            let (_, sv) = gpu.attention_forward(shape, &att, (&qt, &kt, &vt))?;
            if both {
                gpu.attention_backward(shape, &att, &sv, &dout)?;
            }
            Ok(())
        };
        // The fused kernels alone (head-major inputs as they are, no RoPE
        // or layout passes).
        let dims = (n_seq, seq, h, kv, dh);
        let kernels_only = |both: bool| -> anyhow::Result<()> {
            let (o, lse2) = gpu.flash_attention_forward(dims, &qt, &kt, &vt)?;
            if both {
                gpu.flash_attention_backward(dims, (&qt, &kt, &vt), (&o, &lse2), &dout)?;
            }
            Ok(())
        };
        let (fwd, fwd_bwd) = (
            median_ms(&gpu, || whole(false))?,
            median_ms(&gpu, || whole(true))?,
        );
        let (kfwd, kfwd_bwd) = (
            median_ms(&gpu, || kernels_only(false))?,
            median_ms(&gpu, || kernels_only(true))?,
        );
        // Each forward kernel alone where it takes the shape.
        let mut by_kernel = serde_json::Map::new();
        for (label, kernel) in [
            ("mma", AttnFwd::Mma),
            ("cooperative", AttnFwd::Cooperative),
            ("pingpong", AttnFwd::Pingpong),
        ] {
            if gpu.flash_forward_takes(kernel, dims) {
                let ms = median_ms(&gpu, || {
                    gpu.flash_attention_forward_with(dims, &qt, &kt, &vt, kernel)?;
                    Ok(())
                })?;
                by_kernel.insert(label.into(), ms.into());
            }
        }
        // The default forward with each backward that takes the shape.
        let mut by_backward = serde_json::Map::new();
        let (o, lse2) = gpu.flash_attention_forward(dims, &qt, &kt, &vt)?;
        for (label, path) in [
            ("stored", AttnDq::Stored),
            ("cutlass", AttnDq::Cutlass),
            ("cudnn", AttnDq::Cudnn),
        ] {
            let run = || {
                gpu.flash_attention_backward_with(dims, (&qt, &kt, &vt), (&o, &lse2), &dout, path)
                    .map(|_| ())
            };
            if run().is_ok() {
                let ms = median_ms(&gpu, || {
                    gpu.flash_attention_forward(dims, &qt, &kt, &vt)?;
                    run()?;
                    Ok(())
                })?;
                by_backward.insert(label.into(), ms.into());
            }
        }
        let fused = gpu
            .attention_forward(shape, &att, (&qt, &kt, &vt))?
            .1
            .fused();
        println!(
            "{}",
            serde_json::json!({
                "ours": name,
                "batch": n_seq, "seq": seq, "heads": h, "kv_heads": kv, "head_dim": dh,
                "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                "kernels_fwd_ms": kfwd, "kernels_fwd_bwd_ms": kfwd_bwd,
                "forward_kernels_ms": by_kernel,
                "fwd_bwd_kernels_ms": by_backward,
                "cudnn": cudnn,
                "path": if fused { "fused" } else { "materialised" },
                "saved_probs_bytes": if fused { 0 } else { rows * seq * 2 },
            })
        );
    }
    Ok(())
}

/// Median device ms of `run` over 10 runs after 3 warm-ups (CUDA events).
fn median_ms(gpu: &Gpu, mut run: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut ts = Vec::new();
    for i in 0..13 {
        let a = gpu.mark()?;
        run()?;
        let b = gpu.mark()?;
        if i >= 3 {
            ts.push(b.ms_since(&a)?);
        }
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}
