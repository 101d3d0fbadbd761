//! `lrmoe-gpu-bench`: the CUDA kernels against the device's copy bandwidth
//! and the PyTorch peers, measured in the same call on the GPU machine.
//!
//! Usage: `lrmoe-gpu-bench [anchors.json]` where the optional file holds the
//! JSON object printed on the `SINGLE` line of `torch_anchors.py`, run in the
//! same device call. `LRMOE_GPU_TABLES` (e.g. `layer`) picks tables by
//! name: `kernels` (copy, row kernels, GEMMs), `layer`, `select`,
//! `router`, `wgrad` (the E128 weight gradient alone, to profile),
//! `wgrad-groups` (the same work in fewer, larger groups), `adamw` (the
//! fused AdamW against HBM's bandwidth, the copy and PyTorch's fused
//! AdamW, with `benches/torch_adamw.py`'s output as the anchors file),
//! `xent` (the fused cross-entropy's launches at the LM head's shape,
//! against HBM's bandwidth and the copy), `rows` (the embedding's forward
//! and the RMSNorm forward and backward at the A3B shape's rows, against
//! HBM's bandwidth and the copy); the first four by default.

use kernels::gpu::{Gpu, Timing};

fn anchor(anchors: &serde_json::Value, key: &str) -> Option<f64> {
    anchors.get(key).and_then(serde_json::Value::as_f64)
}

/// The anchors' skewed group sizes: Zipf(0.8) shares of `rows` over `e`
/// groups (the first takes the rounding remainder).
fn zipf_counts(e: usize, rows: u32) -> Vec<u32> {
    let w: Vec<f64> = (1..=e).map(|i| (i as f64).powf(-0.8)).collect();
    let total: f64 = w.iter().sum();
    let mut counts: Vec<u32> = w
        .iter()
        .map(|x| (x / total * f64::from(rows)).floor() as u32)
        .collect();
    counts[0] += rows - counts.iter().sum::<u32>();
    counts
}

/// The grouped GEMM's three variants and their table names.
const GEMM_VARIANTS: [(kernels::cpu::GemmVariant, &str); 3] = [
    (kernels::cpu::GemmVariant::Forward, "fwd"),
    (kernels::cpu::GemmVariant::DataGrad, "dgrad"),
    (kernels::cpu::GemmVariant::WeightGrad, "wgrad"),
];

fn main() -> anyhow::Result<()> {
    lrmoe_benches::init_process();
    let anchors: serde_json::Value = match std::env::args().nth(1) {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(&p)?)?,
        None => serde_json::Value::Null,
    };
    let gpu = Gpu::open(0)?;
    let tables =
        std::env::var("LRMOE_GPU_TABLES").unwrap_or_else(|_| "kernels,layer,select,router".into());
    let table = |name: &str| tables.split(',').any(|t| t.trim() == name);
    if table("kernels") {
        let copy = gpu.bench_copy(2 << 30)?;
        println!(
            "copy (device to device, 2 GiB): {:.3} ms, {:.0} GB/s read+write",
            copy.ms,
            copy.gbps()
        );
        if let Some(t) = anchor(&anchors, "copy_GBps_rw") {
            println!("torch copy_ (same run): {t:.0} GB/s read+write");
        }
        // Rows that are only written (an unpack's dropped rows) move at the
        // device's write-only rate: with the kept rows at copy speed, an
        // unpack that drops half its rows can reach at most this share of
        // the copy's bandwidth.
        let zero = gpu.bench_memset(1 << 30)?;
        let bound = 1.5 / (1.0 + 0.5 * copy.gbps() / zero.gbps());
        println!(
            "zero fill (memset, 1 GiB, write only): {:.0} GB/s = {:.2}× copy; unpack with 50% dropped rows is bounded by {bound:.2}× copy",
            zero.gbps(),
            zero.gbps() / copy.gbps()
        );
        println!();
        println!("| kernel | shape | median ms | GB/s | / copy | torch peer GB/s | / torch |");
        println!("|---|---|---|---|---|---|---|");
        for (key, n, d_in, d_out) in [
            (
                "E128_H2048_F768_rows131072",
                131072usize,
                768usize,
                2048usize,
            ),
            ("E64_H4096_F1536_rows131072", 131072, 1536, 4096),
        ] {
            let t = gpu.bench_scores(n, d_in, d_out)?;
            let peer = anchor(&anchors, &format!("rownorm_{key}_GBps"));
            println!(
                "| LRM scores (bf16 in, f32 out; bytes read) | {n} × ({d_in} + {d_out}) | {:.3} | {:.0} | {:.2} | {} | {} |",
                t.ms,
                t.gbps(),
                t.gbps() / copy.gbps(),
                peer.map_or("-".into(), |p| format!("{p:.0} (row norms of one {n} × {d_out} matrix)")),
                peer.map_or("-".into(), |p| format!("{:.2}", t.gbps() / p)),
            );
        }
        for (key, n, width) in [
            ("E128_H2048_F768_rows131072", 131072usize, 2048usize),
            ("E64_H4096_F1536_rows131072", 131072, 4096),
        ] {
            let peer = anchor(&anchors, &format!("gather_{key}_GBps_rw"));
            let t = gpu.bench_gather(n, width)?;
            println!(
                "| pack (row gather, random permutation; read+write) | {n} × {width} | {:.3} | {:.0} | {:.2} | {} | {} |",
                t.ms,
                t.gbps(),
                t.gbps() / copy.gbps(),
                peer.map_or("-".into(), |p| format!("{p:.0} (index_select)")),
                peer.map_or("-".into(), |p| format!("{:.2}", t.gbps() / p)),
            );
            for dropped in [0usize, 50] {
                let t = gpu.bench_unpack(n, width, dropped)?;
                println!(
                    "| unpack (row scatter, {dropped}% dropped rows zero-filled; read+write) | {n} × {width} | {:.3} | {:.0} | {:.2} | {} | {} |",
                    t.ms,
                    t.gbps(),
                    t.gbps() / copy.gbps(),
                    peer.map_or("-".into(), |p| format!("{p:.0} (index_select)")),
                    peer.map_or("-".into(), |p| format!("{:.2}", t.gbps() / p)),
                );
            }
        }
        let t = gpu.bench_swiglu(131072 * 768)?;
        println!(
            "| SwiGLU forward (bf16; read a, b + write h) | 131072 × 768 | {:.3} | {:.0} | {:.2} | - | - |",
            t.ms,
            t.gbps(),
            t.gbps() / copy.gbps()
        );
        let t = gpu.bench_combine(16384, 2048, 8)?;
        println!(
            "| combine (weighted sum of top-8 rows; read + write) | 16384 tokens × 8 × 2048 | {:.3} | {:.0} | {:.2} | - | - |",
            t.ms,
            t.gbps(),
            t.gbps() / copy.gbps()
        );
        println!();
        println!("| grouped GEMM (bf16, f32 acc) | shape | median ms | TFLOP/s | torch._grouped_mm TFLOP/s | / torch |");
        println!("|---|---|---|---|---|---|");
        for (key, e, h, f) in [
            ("E128_H2048_F768_rows131072", 128usize, 2048usize, 768usize),
            ("E64_H4096_F1536_rows131072", 64, 4096, 1536),
        ] {
            let counts = zipf_counts(e, 131072);
            for (variant, name) in GEMM_VARIANTS {
                let (t, tflops) = gpu.bench_grouped_gemm(variant, &counts, h, f)?;
                let peer = anchor(&anchors, &format!("grouped_mm_{name}_{key}_tflops"));
                println!(
                    "| {name} | {e} experts, hidden {h}, ffn {f}, 131072 rows | {:.3} | {tflops:.0} | {} | {} |",
                    t.ms,
                    peer.map_or("-".into(), |p| format!("{p:.0}")),
                    peer.map_or("-".into(), |p| format!("{:.2}", tflops / p)),
                );
            }
            // The GEMMs at r = 0.25: a quarter of each group's rows (the
            // weight gradient: K of the product, the same h × f outputs).
            let quarter: Vec<u32> = counts.iter().map(|c| c / 4).collect();
            let rows: u32 = quarter.iter().sum();
            for (variant, name) in GEMM_VARIANTS {
                let (t, tflops) = gpu.bench_grouped_gemm(variant, &quarter, h, f)?;
                println!(
                    "| {name}, ¼ rows | {e} experts, hidden {h}, ffn {f}, {rows} rows | {:.3} | {tflops:.0} | - | - |",
                    t.ms
                );
            }
        }
        println!();
    }
    if table("layer") {
        println!("MoE layer on one GPU (EP = 1, bf16), 16384 tokens, top-8, renormalised; random router (PyTorch's peer skews its router with a bias).");
        println!();
        println!("| shape | ours fwd ms | torch fwd ms | fwd speed-up | retention | ours bwd ms | bwd(r) / bwd(1) | target r + 0.1 | torch bwd ms | bwd speed-up | fwd+bwd peak MiB (reserved / in buffers) | kept pairs |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        for (key, e, h, f) in [
            ("E128_H2048_F768_rows131072", 128usize, 2048usize, 768usize),
            ("E64_H4096_F1536_rows131072", 64, 4096, 1536),
        ] {
            let cfg = layer::MoeConfig {
                hidden: h,
                ffn: f,
                n_experts: e,
                top_k: 8,
                renormalize: true,
            };
            let rs = [1.0, 0.75, 0.5, 0.25];
            // The same retentions with the quotas trimmed to whole GEMM
            // tiles, as device training runs them (`moe.tile_trim`).
            let planners: Vec<layer::DevicePlanner> = lrmoe_benches::ratio_planners(&cfg, &rs)
                .into_iter()
                .chain(
                    lrmoe_benches::ratio_planners(&cfg, &rs[1..])
                        .into_iter()
                        .map(|p| p.tile_aligned(layer::TileAlign::DEVICE)),
                )
                .collect();
            let labelled: Vec<(f64, &layer::DevicePlanner)> = rs
                .iter()
                .chain(&rs[1..])
                .copied()
                .zip(planners.iter())
                .collect();
            let rows = layer::device::bench(
                &gpu,
                layer::device::DeviceComm::Local,
                &cfg,
                16384,
                &labelled,
                0.0,
                10,
            )?;
            let fwd = rows[0].forward_ms;
            let tf = anchor(&anchors, &format!("moe_layer_{key}_fwd_ms"));
            let tb = anchor(&anchors, &format!("moe_layer_{key}_bwd_ms"));
            let full = rows[0].backward_ms;
            for (i, r) in rows.iter().enumerate() {
                let label = if i >= rs.len() {
                    format!("{} tile-trimmed", r.retention)
                } else {
                    r.retention.to_string()
                };
                println!(
                    "| E{e} H{h} F{f} | {fwd:.2} | {} | {} | {label} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0} / {:.0} | {} |",
                    tf.map_or("-".into(), |v| format!("{v:.2}")),
                    tf.map_or("-".into(), |v| format!("{:.2}", v / fwd)),
                    r.backward_ms,
                    r.backward_ms / full,
                    r.retention + 0.1,
                    tb.map_or("-".into(), |v| format!("{v:.2}")),
                    tb.map_or("-".into(), |v| format!("{:.2}", v / r.backward_ms)),
                    r.peak_bytes as f64 / (1 << 20) as f64,
                    r.peak_used_bytes as f64 / (1 << 20) as f64,
                    r.kept_total
                );
            }
        }
    }
    if table("wgrad") {
        // Only the E128 weight gradient, at a quarter of the rows and at all
        // rows (Zipf(0.8) counts as above): a short run to profile.
        let counts = zipf_counts(128, 131072);
        let quarter: Vec<u32> = counts.iter().map(|c| c / 4).collect();
        for (name, c) in [("¼ rows", &quarter), ("all rows", &counts)] {
            let (t, tflops) =
                gpu.bench_grouped_gemm(kernels::cpu::GemmVariant::WeightGrad, c, 2048, 768)?;
            println!(
                "wgrad E128 H2048 F768, {name}: {:.3} ms, {tflops:.0} TFLOP/s",
                t.ms
            );
        }
    }
    if table("wgrad-groups") {
        // The same weight-gradient work (E·h·f outputs, K rows per group)
        // cut into fewer, larger groups: 48, 192 and 768 output tiles per
        // group. A CTA's next tile is 132 tiles on, so with small groups
        // nearly every tile starts a new group.
        for k in [256u32, 1024] {
            for (e, h, f) in [
                (128usize, 2048usize, 768usize),
                (32, 4096, 1536),
                (8, 8192, 3072),
            ] {
                let counts = vec![k; e];
                let (t, tflops) =
                    gpu.bench_grouped_gemm(kernels::cpu::GemmVariant::WeightGrad, &counts, h, f)?;
                println!(
                    "wgrad {e} groups × {h} × {f}, K = {k}: {:.3} ms, {tflops:.0} TFLOP/s",
                    t.ms
                );
            }
        }
    }
    if table("adamw") {
        adamw_table(&gpu, &anchors)?;
    }
    if table("xent") {
        xent_table(&gpu)?;
    }
    if table("rows") {
        rows_table(&gpu)?;
    }
    if table("select") {
        let t = gpu.bench_select(128, 131072)?;
        println!();
        println!(
            "Top-q selection, 128 experts × 131072 pairs (Zipf 0.8 counts, half of each expert kept): median {:.1} µs (target ≤ 100 µs)",
            t.ms * 1e3
        );
    }
    if table("router") {
        for (h, e) in [(2048, 128), (4096, 64)] {
            println!();
            println!("The router backward's parts, 16384 tokens, top-8, E{e} H{h} (median ms):");
            println!();
            println!("| part | ms |\n|---|---|");
            for (name, ms) in gpu.bench_router_backward(16384, h, e, 8)? {
                println!("| {name} | {ms:.3} |");
            }
        }
    }
    Ok(())
}

/// The embedding's forward and the RMSNorm forward and backward at the
/// A3B shape's rows (16 384 tokens of 2 048, the Qwen3 vocabulary):
/// median device ms against the bytes each must move at the nominal HBM
/// rate ([`hbm`]) and the device copy's rate (issue 31's dense parts).
fn rows_table(gpu: &Gpu) -> anyhow::Result<()> {
    let (n, d, v) = (16384usize, 2048usize, 151_936usize);
    let copy = gpu.bench_copy(2 << 30)?;
    let hbm = hbm(gpu);
    println!();
    println!(
        "Dense rows, {n} × {d} (vocabulary {v}); device copy {:.0} GB/s; limit at {}:",
        copy.gbps(),
        hbm.label
    );
    println!();
    println!("| kernel | median ms | GB/s | ÷ copy's rate | ms ÷ limit |");
    println!("|---|---|---|---|---|");
    for (name, t) in gpu.bench_rows(n, d, v)? {
        println!(
            "| {name} | {:.4} | {:.0} | {:.3} | {:.3} |",
            t.ms,
            t.gbps(),
            t.gbps() / copy.gbps(),
            t.ms / (t.bytes / 1e6 / hbm.gbps)
        );
    }
    Ok(())
}

/// The fused cross-entropy at the LM head's shape (16 384 rows of the
/// Qwen3 vocabulary, 151 936 words) with each launch: median device ms
/// against the least HBM must move (logits read once, gradient written
/// once), the copy's rate and the streamed launch; the loss and the first
/// 64 rows' gradient against the streamed launch's (the same sums in
/// another order: bf16 rounding may differ by an ulp).
fn xent_table(gpu: &Gpu) -> anyhow::Result<()> {
    use kernels::gpu::XentLaunch;
    let (n, v) = (16384usize, 151_936usize);
    let copy = gpu.bench_copy(2 << 30)?;
    let hbm = hbm(gpu);
    let mut launches = vec![(
        "streamed (256 threads, ≤ 32 blocks a SM)".to_string(),
        XentLaunch::Streamed,
    )];
    for l2_hints in [false, true] {
        for (threads, blocks_per_sm) in [(1024, 1), (512, 2), (1024, 2)] {
            launches.push((
                format!(
                    "resident, {threads} threads × {blocks_per_sm} a SM{}",
                    if l2_hints { ", L2 hints" } else { "" }
                ),
                XentLaunch::Resident {
                    threads,
                    blocks_per_sm,
                    l2_hints,
                },
            ));
        }
    }
    println!();
    println!(
        "Cross-entropy, {n} × {v} bf16 logits; the least HBM must move: {:.2} GB (limit {:.3} ms at {}); device copy {:.0} GB/s:",
        4.0 * (n * v) as f64 / 1e9,
        4.0 * (n * v) as f64 / 1e6 / hbm.gbps,
        hbm.label,
        copy.gbps()
    );
    println!();
    println!("| launch | median ms | ÷ limit | ÷ streamed | loss − streamed's (relative) | first 64 rows: most |Δ| |");
    println!("|---|---|---|---|---|---|");
    let mut base: Option<(f64, f32, Vec<u16>)> = None;
    for (name, how) in launches {
        let (t, loss, rows) = gpu.bench_cross_entropy((n, v), how, 64)?;
        let limit = t.bytes / 1e6 / hbm.gbps;
        let (ratio, dl, dg) = match &base {
            None => ("1.000".to_string(), "—".to_string(), "—".to_string()),
            Some((ms, l0, r0)) => {
                let most = rows
                    .iter()
                    .zip(r0)
                    .map(|(&a, &b)| {
                        (kernels::cpu::bf16_bits_to_f32(a) - kernels::cpu::bf16_bits_to_f32(b))
                            .abs()
                    })
                    .fold(0f32, f32::max);
                (
                    format!("{:.3}", t.ms / ms),
                    format!("{:.1e}", (loss - l0) / l0.abs().max(1e-30)),
                    format!("{most:.1e}"),
                )
            }
        };
        println!(
            "| {name} | {:.3} | {:.2} | {ratio} | {dl} | {dg} |",
            t.ms,
            t.ms / limit
        );
        if base.is_none() {
            base = Some((t.ms, loss, rows));
        }
    }
    Ok(())
}

/// A device's nominal HBM bandwidth, GB/s, and how the tables name it.
struct Hbm {
    gbps: f64,
    label: String,
}

/// The nominal HBM bandwidth of the GPU the bench runs on, by its name
/// (H200: 4.8 TB/s; H100 SXM: 3.35; H100 PCIe: 2.0); another GPU is
/// taken as an H200, and the tables say so.
fn hbm(gpu: &Gpu) -> Hbm {
    let name = gpu.device_name().unwrap_or_default();
    let (tbps, what) = if name.contains("H200") {
        (4.8, "H200")
    } else if name.contains("H100") && name.contains("PCIe") {
        (2.0, "H100 PCIe")
    } else if name.contains("H100") {
        (3.35, "H100 SXM")
    } else {
        (4.8, "an H200's, the GPU unknown")
    };
    Hbm {
        gbps: tbps * 1e3,
        label: format!("{tbps} TB/s ({what} HBM)"),
    }
}

/// AdamW over 2²⁸ parameters (`Gpu::bench_adamw`: f32 masters and
/// moments, the bf16 copy written) with a bf16 and an f32 gradient: median
/// device ms, the bytes it must move (28 and 30 a parameter), and that rate
/// against the nominal HBM bandwidth ([`hbm`]), the device copy and PyTorch's fused AdamW
/// (`adamw_GBps` of the anchors: f32 gradient, no bf16 copy, 28 bytes).
fn adamw_table(gpu: &Gpu, anchors: &serde_json::Value) -> anyhow::Result<()> {
    let n = 1usize << 28;
    let copy = gpu.bench_copy(2 << 30)?;
    println!();
    println!(
        "AdamW, {n} parameters; device copy {:.0} GB/s:",
        copy.gbps()
    );
    println!();
    let hbm = hbm(gpu);
    println!(
        "| gradient | median ms | bytes/param | GB/s | of {} | / copy | / torch fused AdamW |",
        hbm.label
    );
    println!("|---|---|---|---|---|---|---|");
    let peer = anchor(anchors, "adamw_GBps");
    // One row: the rate against HBM, the copy and (for the update itself)
    // PyTorch's fused AdamW.
    let row = |what: &str, t: &Timing, against_peer: bool| {
        let gbps = t.gbps();
        let versus = match peer {
            Some(p) if against_peer => format!("{:.3} ({p:.0} GB/s)", gbps / p),
            _ => "-".into(),
        };
        println!(
            "| {what} | {:.3} | {} | {gbps:.0} | {:.1}% | {:.3} | {versus} |",
            t.ms,
            t.bytes / n as f64,
            gbps / hbm.gbps * 100.0,
            gbps / copy.gbps(),
        );
    };
    for bf16 in [true, false] {
        let t = gpu.bench_adamw(n, bf16)?;
        row(if bf16 { "bf16" } else { "f32" }, &t, true);
    }
    // The update's loads and stores with adds for its arithmetic: the
    // ceiling of its access pattern on this device, beside the copy's.
    let t = gpu.bench_adamw_streams(n)?;
    row(
        "its loads and stores alone (bf16 gradient, adds for the arithmetic)",
        &t,
        false,
    );
    println!();
    println!("The gradient norm's squared sum over {n} elements (the input read once):");
    println!();
    println!("| input | median ms | GB/s | of {} | / copy |", hbm.label);
    println!("|---|---|---|---|---|");
    for bf16 in [true, false] {
        let t = gpu.bench_sq_sum(n, bf16)?;
        println!(
            "| {} | {:.3} | {:.0} | {:.1}% | {:.3} |",
            if bf16 { "bf16" } else { "f32" },
            t.ms,
            t.gbps(),
            t.gbps() / hbm.gbps * 100.0,
            t.gbps() / copy.gbps(),
        );
    }
    Ok(())
}
