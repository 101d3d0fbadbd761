//! A small MoE transformer language model on the CPU, generic over `f32` and
//! `f64` (the latter for gradient checks).
//!
//! `tokens → embedding → N × [x + Attn(RMSNorm(x)); x + MoE(RMSNorm(x))] →
//! RMSNorm → LM head → cross-entropy`. Attention is causal multi-head with
//! no bias; the MoE layer is `layer`'s, with the LRMoE backward. Each rank
//! of a [`layer::Transport`] holds a full copy of the dense weights
//! (data parallel, gradients all-reduced) and runs the MoE layers with
//! expert parallelism over the same transport.

use kernels::cpu::{matmul, Op, Real};
use layer::transport::all_reduce_sum;
use layer::{BackwardStats, CallConfig, CallPlan, MoeConfig, MoeParams, Saved, Transport};
use quota::Placement;
use serde::{Deserialize, Serialize};

/// Errors of the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The configuration cannot work.
    #[error("bad model config: {0}")]
    Config(String),
    /// A token is outside the vocabulary, or a batch has the wrong shape.
    #[error("bad batch: {0}")]
    Batch(String),
    /// The loss or a gradient became NaN or infinite.
    #[error("non-finite {0}")]
    NonFinite(&'static str),
    /// The MoE layer failed.
    #[error(transparent)]
    Layer(#[from] layer::LayerError),
    /// A kernel rejected its inputs.
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] layer::TransportError),
}

/// Model shape.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Width.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads (`d_model` must divide evenly).
    pub n_heads: usize,
    /// Expert FFN width.
    pub ffn: usize,
    /// Experts per MoE layer.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise top-k routing weights.
    pub renormalize: bool,
    /// Longest sequence (rows of the learned position embedding).
    pub max_seq: usize,
}

impl ModelConfig {
    /// The MoE layer's configuration.
    pub fn moe(&self) -> MoeConfig {
        MoeConfig {
            hidden: self.d_model,
            ffn: self.ffn,
            n_experts: self.n_experts,
            top_k: self.top_k,
            renormalize: self.renormalize,
        }
    }

    /// Rejects shapes that cannot work.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.vocab == 0 || self.d_model == 0 || self.n_layers == 0 || self.n_heads == 0 {
            return Err(ModelError::Config(
                "vocab, d_model, n_layers and n_heads must be positive".into(),
            ));
        }
        if self.d_model % self.n_heads != 0 {
            return Err(ModelError::Config(format!(
                "d_model = {} is not divisible by n_heads = {}",
                self.d_model, self.n_heads
            )));
        }
        self.moe().validate()?;
        Ok(())
    }
}

/// One transformer block's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Block<T> {
    /// Pre-attention RMSNorm gain, `d`.
    pub norm1: Vec<T>,
    /// Query, key, value, output projections, `d × d` each.
    pub wq: Vec<T>,
    /// Key projection.
    pub wk: Vec<T>,
    /// Value projection.
    pub wv: Vec<T>,
    /// Output projection.
    pub wo: Vec<T>,
    /// Pre-MoE RMSNorm gain, `d`.
    pub norm2: Vec<T>,
    /// The MoE layer.
    pub moe: MoeParams<T>,
}

/// All weights of the model (or their gradients).
#[derive(Debug, Clone, PartialEq)]
pub struct Model<T> {
    /// Token embedding, `vocab × d`.
    pub embed: Vec<T>,
    /// Learned position embedding, `max_seq × d`.
    pub pos: Vec<T>,
    /// Blocks.
    pub blocks: Vec<Block<T>>,
    /// Final RMSNorm gain, `d`.
    pub norm_f: Vec<T>,
    /// LM head, `d × vocab`.
    pub head: Vec<T>,
}

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn fill<T: Real>(&mut self, v: &mut [T], scale: f64) {
        for x in v {
            *x = T::of((2.0 * self.uniform() - 1.0) * scale);
        }
    }
}

impl<T: Real> Model<T> {
    /// Zeros of the configured shapes.
    pub fn zeros(cfg: &ModelConfig) -> Self {
        let d = cfg.d_model;
        let z = |n: usize| vec![T::zero(); n];
        Self {
            embed: z(cfg.vocab * d),
            pos: z(cfg.max_seq * d),
            blocks: (0..cfg.n_layers)
                .map(|_| Block {
                    norm1: z(d),
                    wq: z(d * d),
                    wk: z(d * d),
                    wv: z(d * d),
                    wo: z(d * d),
                    norm2: z(d),
                    moe: MoeParams::zeros(&cfg.moe()),
                })
                .collect(),
            norm_f: z(d),
            head: z(d * cfg.vocab),
        }
    }

    /// Seeded initialisation (uniform `±1/√fan_in`, unit norm gains).
    pub fn init(cfg: &ModelConfig, seed: u64) -> Self {
        let mut m = Self::zeros(cfg);
        let mut rng = Rng(seed ^ 0xD1B5_4A32_D192_ED03);
        let d = cfg.d_model;
        let s = 1.0 / (d as f64).sqrt();
        rng.fill(&mut m.embed, 1.0);
        rng.fill(&mut m.pos, 0.1);
        for (i, b) in m.blocks.iter_mut().enumerate() {
            b.norm1.fill(T::one());
            b.norm2.fill(T::one());
            for w in [&mut b.wq, &mut b.wk, &mut b.wv] {
                rng.fill(w, s);
            }
            // Residual branches start small so early training is stable.
            rng.fill(&mut b.wo, s / (2.0 * cfg.n_layers as f64).sqrt());
            b.moe = MoeParams::init(&cfg.moe(), seed.wrapping_add(1000 + i as u64));
        }
        m.norm_f.fill(T::one());
        rng.fill(&mut m.head, s);
        m
    }

    /// Every tensor with a stable name, in a fixed order.
    pub fn tensors(&self) -> Vec<(String, &Vec<T>)> {
        let mut v = vec![
            ("embed".to_string(), &self.embed),
            ("pos".to_string(), &self.pos),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            for (n, t) in [
                ("norm1", &b.norm1),
                ("wq", &b.wq),
                ("wk", &b.wk),
                ("wv", &b.wv),
                ("wo", &b.wo),
                ("norm2", &b.norm2),
            ] {
                v.push((format!("blocks.{i}.{n}"), t));
            }
            for (n, t) in b.moe.tensors() {
                v.push((format!("blocks.{i}.moe.{n}"), t));
            }
        }
        v.push(("norm_f".to_string(), &self.norm_f));
        v.push(("head".to_string(), &self.head));
        v
    }

    /// Every tensor with its name, mutably, in the order of [`Self::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<(String, &mut Vec<T>)> {
        let mut v = vec![
            ("embed".to_string(), &mut self.embed),
            ("pos".to_string(), &mut self.pos),
        ];
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (n, t) in [
                ("norm1", &mut b.norm1),
                ("wq", &mut b.wq),
                ("wk", &mut b.wk),
                ("wv", &mut b.wv),
                ("wo", &mut b.wo),
                ("norm2", &mut b.norm2),
            ] {
                v.push((format!("blocks.{i}.{n}"), t));
            }
            for (n, t) in b.moe.tensors_mut() {
                v.push((format!("blocks.{i}.moe.{n}"), t));
            }
        }
        v.push(("norm_f".to_string(), &mut self.norm_f));
        v.push(("head".to_string(), &mut self.head));
        v
    }

    /// Number of scalar parameters.
    pub fn n_params(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.len()).sum()
    }
}

const RMS_EPS: f64 = 1e-6;

/// `y = x / rms(x) ⊙ w` per row; returns `1 / rms` per row.
fn rmsnorm<T: Real>(x: &[T], w: &[T], y: &mut [T]) -> Vec<T> {
    let d = w.len();
    x.chunks_exact(d)
        .zip(y.chunks_exact_mut(d))
        .map(|(xr, yr)| {
            let ms = xr.iter().map(|&v| v * v).sum::<T>() / T::of(d as f64);
            let inv = T::one() / (ms + T::of(RMS_EPS)).sqrt();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * inv * g;
            }
            inv
        })
        .collect()
}

/// Backward of [`rmsnorm`]: adds into `dx` and `dw`.
fn rmsnorm_backward<T: Real>(x: &[T], w: &[T], inv: &[T], dy: &[T], dx: &mut [T], dw: &mut [T]) {
    let d = w.len();
    for (r, ((xr, dyr), dxr)) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
        .enumerate()
    {
        let s = inv[r];
        let dot: T = xr
            .iter()
            .zip(dyr)
            .zip(w)
            .map(|((&xv, &g), &wv)| g * wv * xv)
            .sum();
        let c = dot * s * s * s / T::of(d as f64);
        for i in 0..d {
            dw[i] += dyr[i] * xr[i] * s;
            dxr[i] += dyr[i] * w[i] * s - xr[i] * c;
        }
    }
}

/// Per-block activations kept for the backward.
struct BlockCache<T> {
    x_in: Vec<T>,
    inv1: Vec<T>,
    a: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    probs: Vec<T>,
    attn: Vec<T>,
    x_mid: Vec<T>,
    inv2: Vec<T>,
    moe: MoeState<T>,
}

/// The MoE layer's saved state: the host executor's, or the device
/// executor's.
enum MoeState<T> {
    Cpu(Saved<T>),
    Device(crate::device_moe::DeviceSavedHost),
}

impl<T> MoeState<T> {
    fn plan(&self) -> &CallPlan {
        match self {
            Self::Cpu(s) => &s.plan,
            Self::Device(g) => &g.plan,
        }
    }
    /// The layer's auxiliary load-balancing loss on this rank (the GPU
    /// layers refuse a nonzero coefficient).
    fn aux_loss(&self) -> f64 {
        match self {
            Self::Cpu(s) => s.aux_loss(),
            Self::Device(s) => s.aux_loss(),
        }
    }
}

/// Activations of one forward, for [`backward`].
pub struct Cache<T> {
    tokens: Vec<u32>,
    targets: Vec<u32>,
    blocks: Vec<BlockCache<T>>,
    x_final: Vec<T>,
    inv_f: Vec<T>,
    hf: Vec<T>,
    probs: Vec<T>,
    /// Wall time spent in the MoE layers' forwards, seconds.
    pub moe_seconds: f64,
    /// The MoE layers' auxiliary balancing losses on this rank, summed (0
    /// unless configured). Not part of the returned language-model loss;
    /// the backward's gradients are those of the loss plus this term.
    pub aux_loss: f64,
}

impl<T> Cache<T> {
    /// The controller's plan of each block's MoE call (routing, quotas,
    /// replicas).
    pub fn moe_plans(&self) -> impl Iterator<Item = &CallPlan> {
        self.blocks.iter().map(|b| b.moe.plan())
    }
}

/// How the MoE layers run in one step.
#[derive(Debug, Clone)]
pub struct MoeRun<'a> {
    /// Expert placement (owners).
    pub placement: &'a Placement,
    /// Backward planning.
    pub backward: &'a CallConfig,
    /// Run the MoE layers through the device executor on this rank's GPU
    /// (one GPU: EP = 1; launched ranks: NCCL) instead of the host one.
    pub device: Option<crate::device_moe::DeviceRun<'a>>,
    /// Each layer's auxiliary-loss-free balancing bias
    /// (`CallConfig::expert_bias`); empty: none.
    pub expert_bias: &'a [Vec<f64>],
}

/// Rearranges `[n, h·dh]` (token-major) into `[h, n, dh]` per sequence.
fn split_heads<T: Real>(x: &[T], seq: usize, heads: usize, dh: usize, out: &mut [T]) {
    let d = heads * dh;
    let n_seq = x.len() / (seq * d);
    for b in 0..n_seq {
        for t in 0..seq {
            for hh in 0..heads {
                let src = &x[(b * seq + t) * d + hh * dh..(b * seq + t) * d + (hh + 1) * dh];
                let dst = ((b * heads + hh) * seq + t) * dh;
                out[dst..dst + dh].copy_from_slice(src);
            }
        }
    }
}

/// Inverse of [`split_heads`].
fn merge_heads<T: Real>(x: &[T], seq: usize, heads: usize, dh: usize, out: &mut [T]) {
    let d = heads * dh;
    let n_seq = out.len() / (seq * d);
    for b in 0..n_seq {
        for t in 0..seq {
            for hh in 0..heads {
                let src = ((b * heads + hh) * seq + t) * dh;
                out[(b * seq + t) * d + hh * dh..(b * seq + t) * d + (hh + 1) * dh]
                    .copy_from_slice(&x[src..src + dh]);
            }
        }
    }
}

/// Loss (mean cross-entropy over this rank's tokens, in nats) and cache.
/// `tokens` and `targets` are `n_seq × seq` row-major.
pub fn forward<T: Real, X: Transport>(
    comm: &X,
    cfg: &ModelConfig,
    model: &Model<T>,
    run: &MoeRun<'_>,
    tokens: &[u32],
    targets: &[u32],
    seq: usize,
) -> Result<(f64, Cache<T>), ModelError> {
    cfg.validate()?;
    let (d, v_n, heads) = (cfg.d_model, cfg.vocab, cfg.n_heads);
    let dh = d / heads;
    if seq == 0 || seq > cfg.max_seq || tokens.len() % seq != 0 || targets.len() != tokens.len() {
        return Err(ModelError::Batch(format!(
            "{} tokens and {} targets do not form sequences of {seq} (max_seq {})",
            tokens.len(),
            targets.len(),
            cfg.max_seq
        )));
    }
    if let Some(&t) = tokens.iter().chain(targets).find(|&&t| t as usize >= v_n) {
        return Err(ModelError::Batch(format!(
            "token {t} outside the vocabulary of {v_n}"
        )));
    }
    let n = tokens.len();
    let n_seq = n / seq;
    let mut x = vec![T::zero(); n * d];
    for (i, (row, &t)) in x.chunks_exact_mut(d).zip(tokens).enumerate() {
        let p = i % seq;
        for ((o, &e), &q) in row
            .iter_mut()
            .zip(&model.embed[t as usize * d..(t as usize + 1) * d])
            .zip(&model.pos[p * d..(p + 1) * d])
        {
            *o = e + q;
        }
    }
    let scale = T::of(1.0 / (dh as f64).sqrt());
    let mut blocks = Vec::with_capacity(cfg.n_layers);
    let mut moe_seconds = 0.0;
    for b in &model.blocks {
        let x_in = x.clone();
        let mut a = vec![T::zero(); n * d];
        let inv1 = rmsnorm(&x, &b.norm1, &mut a);
        let proj = |w: &[T]| -> Result<Vec<T>, ModelError> {
            let mut o = vec![T::zero(); n * d];
            matmul(&mut o, &a, Op::N, w, Op::N, (n, d, d), false)?;
            let mut s = vec![T::zero(); n * d];
            split_heads(&o, seq, heads, dh, &mut s);
            Ok(s)
        };
        let (q, k, v) = (proj(&b.wq)?, proj(&b.wk)?, proj(&b.wv)?);
        // Causal attention per (sequence, head).
        let mut probs = vec![T::zero(); n_seq * heads * seq * seq];
        let mut ctx = vec![T::zero(); n * d];
        for sh in 0..n_seq * heads {
            let qs = &q[sh * seq * dh..(sh + 1) * seq * dh];
            let ks = &k[sh * seq * dh..(sh + 1) * seq * dh];
            let vs = &v[sh * seq * dh..(sh + 1) * seq * dh];
            let p = &mut probs[sh * seq * seq..(sh + 1) * seq * seq];
            matmul(p, qs, Op::N, ks, Op::T, (seq, dh, seq), false)?;
            for (i, row) in p.chunks_exact_mut(seq).enumerate() {
                let mut max = T::neg_infinity();
                for (j, s) in row.iter_mut().enumerate() {
                    if j > i {
                        *s = T::neg_infinity();
                    } else {
                        *s *= scale;
                        max = max.max(*s);
                    }
                }
                let mut sum = T::zero();
                for s in row.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                for s in row.iter_mut() {
                    *s = *s / sum;
                }
            }
            matmul(
                &mut ctx[sh * seq * dh..(sh + 1) * seq * dh],
                p,
                Op::N,
                vs,
                Op::N,
                (seq, seq, dh),
                false,
            )?;
        }
        let mut attn = vec![T::zero(); n * d];
        merge_heads(&ctx, seq, heads, dh, &mut attn);
        matmul(&mut x, &attn, Op::N, &b.wo, Op::N, (n, d, d), true)?;
        let x_mid = x.clone();
        let mut m = vec![T::zero(); n * d];
        let inv2 = rmsnorm(&x, &b.norm2, &mut m);
        let clock = std::time::Instant::now();
        let biased;
        let call = match run.expert_bias.get(blocks.len()) {
            Some(b) if !b.is_empty() => {
                biased = layer::CallConfig {
                    expert_bias: b.clone(),
                    ..run.backward.clone()
                };
                &biased
            }
            _ => run.backward,
        };
        let (y, moe) = match run.device {
            Some(dev) => {
                if dev.comm.world_size() != comm.world_size() {
                    return Err(ModelError::Config(format!(
                        "the device executor spans {} ranks, the model {}",
                        dev.comm.world_size(),
                        comm.world_size()
                    )));
                }
                let (y, s) = crate::device_moe::forward(dev, &cfg.moe(), call, &b.moe, &m)?;
                (y, MoeState::Device(s))
            }
            None => {
                let (y, s) = layer::forward(comm, &cfg.moe(), call, &b.moe, run.placement, &m)?;
                (y, MoeState::Cpu(s))
            }
        };
        moe_seconds += clock.elapsed().as_secs_f64();
        for (xv, yv) in x.iter_mut().zip(&y) {
            *xv += *yv;
        }
        blocks.push(BlockCache {
            x_in,
            inv1,
            a,
            q,
            k,
            v,
            probs,
            attn,
            x_mid,
            inv2,
            moe,
        });
    }
    let mut hf = vec![T::zero(); n * d];
    let inv_f = rmsnorm(&x, &model.norm_f, &mut hf);
    let mut probs = vec![T::zero(); n * v_n];
    matmul(
        &mut probs,
        &hf,
        Op::N,
        &model.head,
        Op::N,
        (n, d, v_n),
        false,
    )?;
    let mut loss = 0.0f64;
    for (row, &t) in probs.chunks_exact_mut(v_n).zip(targets) {
        let max = row.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
        let mut sum = T::zero();
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        for s in row.iter_mut() {
            *s = *s / sum;
        }
        loss -= row[t as usize].wide().max(1e-300).ln();
    }
    let loss = loss / n as f64;
    let aux_loss = blocks.iter().map(|b| b.moe.aux_loss()).sum::<f64>();
    if !loss.is_finite() || !aux_loss.is_finite() {
        return Err(ModelError::NonFinite("loss"));
    }
    Ok((
        loss,
        Cache {
            tokens: tokens.to_vec(),
            targets: targets.to_vec(),
            blocks,
            x_final: x,
            inv_f,
            hf,
            probs,
            moe_seconds,
            aux_loss,
        },
    ))
}

/// What [`backward`] returns.
pub struct Gradients<T> {
    /// Gradients of every weight, summed over ranks.
    pub grads: Model<T>,
    /// Each MoE layer's backward figures on this rank, in layer order.
    pub moe_stats: Vec<BackwardStats>,
    /// Wall time spent in the MoE layers' backwards, seconds.
    pub moe_seconds: f64,
}

/// Gradients of the mean loss over *all* ranks' tokens (each rank holds the
/// same number), summed over ranks so every rank gets the same result; and
/// each MoE layer's backward figures for this rank.
pub fn backward<T: Real, X: Transport>(
    comm: &X,
    cfg: &ModelConfig,
    model: &Model<T>,
    run: &MoeRun<'_>,
    cache: &Cache<T>,
    seq: usize,
) -> Result<Gradients<T>, ModelError> {
    let (d, v_n, heads) = (cfg.d_model, cfg.vocab, cfg.n_heads);
    let dh = d / heads;
    let n = cache.tokens.len();
    let n_seq = n / seq;
    let world = comm.world_size() as f64;
    let mut g = Model::<T>::zeros(cfg);
    // d loss / d logits = (p − onehot) / (n · world).
    let inv_n = T::of(1.0 / (n as f64 * world));
    let mut dlogits = cache.probs.clone();
    for (row, &t) in dlogits.chunks_exact_mut(v_n).zip(&cache.targets) {
        row[t as usize] -= T::one();
        row.iter_mut().for_each(|v| *v *= inv_n);
    }
    matmul(
        &mut g.head,
        &cache.hf,
        Op::T,
        &dlogits,
        Op::N,
        (d, n, v_n),
        false,
    )?;
    let mut dhf = vec![T::zero(); n * d];
    matmul(
        &mut dhf,
        &dlogits,
        Op::N,
        &model.head,
        Op::T,
        (n, v_n, d),
        false,
    )?;
    let mut dx = vec![T::zero(); n * d];
    rmsnorm_backward(
        &cache.x_final,
        &model.norm_f,
        &cache.inv_f,
        &dhf,
        &mut dx,
        &mut g.norm_f,
    );

    let mut stats = Vec::with_capacity(cfg.n_layers);
    let mut moe_seconds = 0.0;
    let scale = T::of(1.0 / (dh as f64).sqrt());
    for (li, (b, c)) in model.blocks.iter().zip(&cache.blocks).enumerate().rev() {
        let gb = &mut g.blocks[li];
        // MoE branch: x = x_mid + moe(norm2(x_mid)).
        let clock = std::time::Instant::now();
        let (dm, moe_grads, st) = match (&c.moe, run.device) {
            (MoeState::Cpu(s), _) => {
                layer::backward(comm, &cfg.moe(), run.backward, &b.moe, s, &dx)?
            }
            (MoeState::Device(s), Some(dev)) => {
                crate::device_moe::backward(dev, comm, &cfg.moe(), s, &dx)?
            }
            (MoeState::Device(_), None) => {
                return Err(ModelError::Config(
                    "a device forward needs the device for its backward".into(),
                ))
            }
        };
        moe_seconds += clock.elapsed().as_secs_f64();
        gb.moe = moe_grads;
        stats.push(st);
        rmsnorm_backward(&c.x_mid, &b.norm2, &c.inv2, &dm, &mut dx, &mut gb.norm2);
        // Attention branch: x_mid = x_in + attn(norm1(x_in)) · Wo.
        matmul(&mut gb.wo, &c.attn, Op::T, &dx, Op::N, (d, n, d), false)?;
        let mut dattn = vec![T::zero(); n * d];
        matmul(&mut dattn, &dx, Op::N, &b.wo, Op::T, (n, d, d), false)?;
        let mut dctx = vec![T::zero(); n * d];
        split_heads(&dattn, seq, heads, dh, &mut dctx);
        let mut dq = vec![T::zero(); n * d];
        let mut dk = vec![T::zero(); n * d];
        let mut dv = vec![T::zero(); n * d];
        let mut dp = vec![T::zero(); seq * seq];
        for sh in 0..n_seq * heads {
            let r = sh * seq * dh..(sh + 1) * seq * dh;
            let p = &c.probs[sh * seq * seq..(sh + 1) * seq * seq];
            matmul(
                &mut dv[r.clone()],
                p,
                Op::T,
                &dctx[r.clone()],
                Op::N,
                (seq, seq, dh),
                false,
            )?;
            matmul(
                &mut dp,
                &dctx[r.clone()],
                Op::N,
                &c.v[r.clone()],
                Op::T,
                (seq, dh, seq),
                false,
            )?;
            // dS = P ⊙ (dP − rowsum(dP ⊙ P)), times the 1/√dh scale.
            for (prow, dprow) in p.chunks_exact(seq).zip(dp.chunks_exact_mut(seq)) {
                let dot: T = prow.iter().zip(dprow.iter()).map(|(&a, &b)| a * b).sum();
                for (ds, &pv) in dprow.iter_mut().zip(prow) {
                    *ds = pv * (*ds - dot) * scale;
                }
            }
            matmul(
                &mut dq[r.clone()],
                &dp,
                Op::N,
                &c.k[r.clone()],
                Op::N,
                (seq, seq, dh),
                false,
            )?;
            matmul(
                &mut dk[r.clone()],
                &dp,
                Op::T,
                &c.q[r.clone()],
                Op::N,
                (seq, seq, dh),
                false,
            )?;
        }
        let mut da = vec![T::zero(); n * d];
        let mut merged = vec![T::zero(); n * d];
        for (dproj, w, gw) in [
            (&dq, &b.wq, &mut gb.wq),
            (&dk, &b.wk, &mut gb.wk),
            (&dv, &b.wv, &mut gb.wv),
        ] {
            merge_heads(dproj, seq, heads, dh, &mut merged);
            matmul(gw, &c.a, Op::T, &merged, Op::N, (d, n, d), false)?;
            matmul(&mut da, &merged, Op::N, w, Op::T, (n, d, d), true)?;
        }
        rmsnorm_backward(&c.x_in, &b.norm1, &c.inv1, &da, &mut dx, &mut gb.norm1);
    }
    for (i, (row, &t)) in dx.chunks_exact(d).zip(&cache.tokens).enumerate() {
        for (gv, &v) in g.embed[t as usize * d..(t as usize + 1) * d]
            .iter_mut()
            .zip(row)
        {
            *gv += v;
        }
        let p = i % seq;
        for (gv, &v) in g.pos[p * d..(p + 1) * d].iter_mut().zip(row) {
            *gv += v;
        }
    }
    stats.reverse();
    // Dense weights are data parallel: sum every rank's contribution. The
    // MoE layers already summed theirs.
    for (name, t) in g.tensors_mut() {
        if !name.contains(".moe.") {
            all_reduce_sum(comm, t)?;
        }
    }
    if g.tensors()
        .iter()
        .any(|(_, t)| t.iter().any(|v| !v.is_finite()))
    {
        return Err(ModelError::NonFinite("gradient"));
    }
    Ok(Gradients {
        grads: g,
        moe_stats: stats,
        moe_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use layer::run_local;
    use std::time::Duration;

    fn tiny() -> ModelConfig {
        ModelConfig {
            vocab: 7,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            ffn: 6,
            n_experts: 4,
            top_k: 2,
            renormalize: true,
            max_seq: 8,
        }
    }

    fn loss_and_grads(
        cfg: &ModelConfig,
        model: &Model<f64>,
        tokens: &[u32],
        targets: &[u32],
        seq: usize,
        ranks: usize,
    ) -> (f64, Model<f64>) {
        let call = CallConfig::default();
        loss_and_grads_with(cfg, model, tokens, targets, seq, ranks, &call)
    }

    fn loss_and_grads_with(
        cfg: &ModelConfig,
        model: &Model<f64>,
        tokens: &[u32],
        targets: &[u32],
        seq: usize,
        ranks: usize,
        bwd: &CallConfig,
    ) -> (f64, Model<f64>) {
        let placement = Placement {
            owner: (0..cfg.n_experts).map(|e| e % ranks).collect(),
            replicas: vec![],
        };
        let run = MoeRun {
            placement: &placement,
            backward: bwd,
            device: None,
            expert_bias: &[],
        };
        let per = tokens.len() / ranks;
        let res: Vec<Result<_, ModelError>> = run_local(ranks, Duration::from_secs(60), |t| {
            let r = t.rank();
            let (l, c) = forward(
                t,
                cfg,
                model,
                &run,
                &tokens[r * per..(r + 1) * per],
                &targets[r * per..(r + 1) * per],
                seq,
            )?;
            let g = backward(t, cfg, model, &run, &c, seq)?;
            // The objective the gradients belong to.
            Ok((l + c.aux_loss, g.grads))
        });
        let mut total = 0.0;
        let mut grads = None;
        for r in res {
            let (l, g) = r.unwrap();
            total += l / ranks as f64;
            grads = Some(g);
        }
        (total, grads.unwrap())
    }

    /// Central finite differences of the objective against the analytic
    /// gradient at three entries of every tensor whose name `check` takes.
    #[allow(clippy::too_many_arguments)]
    fn assert_fd(
        cfg: &ModelConfig,
        model: &Model<f64>,
        tokens: &[u32],
        targets: &[u32],
        seq: usize,
        ranks: usize,
        call: &CallConfig,
        check: &dyn Fn(&str) -> bool,
    ) {
        let (_, grads) = loss_and_grads_with(cfg, model, tokens, targets, seq, ranks, call);
        let eps = 1e-6;
        let objective =
            |m: &Model<f64>| loss_and_grads_with(cfg, m, tokens, targets, seq, ranks, call).0;
        let names: Vec<String> = model.tensors().iter().map(|(n, _)| n.clone()).collect();
        for (ti, name) in names.iter().enumerate().filter(|(_, n)| check(n)) {
            let len = model.tensors()[ti].1.len();
            for idx in [0, len / 2, len - 1] {
                let mut plus = model.clone();
                plus.tensors_mut()[ti].1[idx] += eps;
                let mut minus = model.clone();
                minus.tensors_mut()[ti].1[idx] -= eps;
                let fd = (objective(&plus) - objective(&minus)) / (2.0 * eps);
                let an = grads.tensors()[ti].1[idx];
                assert!(
                    (fd - an).abs() <= 1e-6 * (1.0 + fd.abs()),
                    "{name}[{idx}] ({ranks} ranks): analytic {an}, numeric {fd}"
                );
            }
        }
    }

    #[test]
    fn gradients_with_the_auxiliary_balancing_loss_match_finite_differences() {
        let cfg = tiny();
        let model = Model::<f64>::init(&cfg, 4);
        let tokens: Vec<u32> = (0..20).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..20).map(|i| (i * 5 % 7 + 1) as u32 % 7).collect();
        let call = CallConfig {
            aux_loss_coeff: 0.5,
            ..CallConfig::default()
        };
        for ranks in [1, 2] {
            let (l, _) = loss_and_grads_with(&cfg, &model, &tokens, &targets, 5, ranks, &call);
            let (l0, _) = loss_and_grads(&cfg, &model, &tokens, &targets, 5, ranks);
            assert!(l > l0, "the auxiliary loss is part of the objective");
            let routing = |n: &str| n.contains("router") || n.contains("norm2");
            assert_fd(&cfg, &model, &tokens, &targets, 5, ranks, &call, &routing);
        }
    }

    #[test]
    fn gradients_match_central_finite_differences() {
        let cfg = tiny();
        let model = Model::<f64>::init(&cfg, 3);
        let tokens: Vec<u32> = (0..10).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..10).map(|i| (i * 5 % 7 + 1) as u32 % 7).collect();
        let call = CallConfig::default();
        assert_fd(&cfg, &model, &tokens, &targets, 5, 1, &call, &|_| true);
    }

    #[test]
    fn two_ranks_equal_one_rank() {
        let cfg = tiny();
        let model = Model::<f64>::init(&cfg, 5);
        let tokens: Vec<u32> = (0..24).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..24).map(|i| (i * 2 % 7) as u32).collect();
        let (l1, g1) = loss_and_grads(&cfg, &model, &tokens, &targets, 6, 1);
        let (l2, g2) = loss_and_grads(&cfg, &model, &tokens, &targets, 6, 2);
        assert!((l1 - l2).abs() < 1e-12);
        for ((name, a), (_, b)) in g1.tensors().into_iter().zip(g2.tensors()) {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-12 * (1.0 + x.abs()), "{name}");
            }
        }
    }

    #[test]
    fn bf16_grouped_experts_train_like_the_cpu_experts() {
        // The expert backend `--device cuda` uses with several ranks, here
        // through the kernels' CPU twins: same loss and gradients within
        // bf16 tolerance, replicas included.
        let cfg = ModelConfig {
            d_model: 16,
            ffn: 8,
            ..tiny()
        };
        let model = Model::<f64>::init(&cfg, 9);
        let tokens: Vec<u32> = (0..48).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..48).map(|i| (i * 2 % 7) as u32).collect();
        let cpu = CallConfig {
            replica_slots_per_rank: 1,
            ..CallConfig::default()
        };
        let twins = CallConfig {
            experts: layer::ExpertBackend::Bf16(std::sync::Arc::new(kernels::grouped::CpuTwins)),
            ..cpu.clone()
        };
        let (l1, g1) = loss_and_grads_with(&cfg, &model, &tokens, &targets, 6, 2, &cpu);
        let (l2, g2) = loss_and_grads_with(&cfg, &model, &tokens, &targets, 6, 2, &twins);
        assert!((l1 - l2).abs() <= 1e-2 * l1.abs(), "loss {l1} vs {l2}");
        for ((name, a), (_, b)) in g1.tensors().into_iter().zip(g2.tensors()) {
            let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
            let den: f64 = a.iter().map(|x| x * x).sum();
            let rel = (num / den.max(1e-300)).sqrt();
            assert!(rel <= 5e-2, "{name}: relative error {rel}");
        }
    }

    #[test]
    fn bad_batches_are_errors() {
        let cfg = tiny();
        let model = Model::<f32>::init(&cfg, 1);
        let placement = Placement {
            owner: vec![0; 4],
            replicas: vec![],
        };
        let bwd = CallConfig::default();
        let run = MoeRun {
            placement: &placement,
            backward: &bwd,
            device: None,
            expert_bias: &[],
        };
        let res: Vec<Result<(), ModelError>> = run_local(1, Duration::from_secs(5), |t| {
            forward(t, &cfg, &model, &run, &[9, 1], &[1, 1], 2).map(|_| ())
        });
        assert!(matches!(res[0], Err(ModelError::Batch(_))));
        let bad = ModelConfig { n_heads: 3, ..cfg };
        assert!(matches!(bad.validate(), Err(ModelError::Config(_))));
        let bad = ModelConfig { top_k: 9, ..cfg };
        assert!(bad.validate().is_err());
    }
}
