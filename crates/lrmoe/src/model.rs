//! A small MoE transformer language model on the CPU, generic over `f32` and
//! `f64` (the latter for gradient checks).
//!
//! `tokens → embedding → N × [x + Attn(RMSNorm(x)); x + MoE(RMSNorm(x))] →
//! RMSNorm → LM head → cross-entropy`. Attention is causal, without bias,
//! grouped-query (`n_kv_heads` key/value heads shared by `n_heads / n_kv_heads`
//! query heads each), with an optional Qwen3 per-head RMSNorm of queries and
//! keys and either a learned position embedding or rotary position
//! embeddings (RoPE, rotate-half form: dimension `i < head_dim/2` pairs with
//! `i + head_dim/2`, angle `pos · θ^(−2i/head_dim)`, applied after the q/k
//! norm) — the Qwen3-MoE block when [`ModelConfig::rope_theta`] is set and
//! `qk_norm` is on. The MoE layer is `layer`'s, with the LRMoE backward. Each rank
//! of a [`layer::Transport`] holds a full copy of the dense weights
//! (data parallel, gradients all-reduced) and runs the MoE layers with
//! expert parallelism over the same transport.
//!
//! The block's and the pass's order is `crate::block`'s (written once for
//! this model and the device model); this file holds the CPU primitives.

use kernels::cpu::{matmul, Op};
use layer::transport::all_reduce_sum;
use layer::{BackwardStats, CallConfig, CallPlan, MoeConfig, MoeParams, Saved, Transport, Value};
use quota::Placement;
use serde::{Deserialize, Serialize};

use crate::block::{self, Norm, Pass, PassGrads, QkvGrads};

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
    /// Longest sequence (rows of the learned position embedding; with RoPE
    /// only a bound on the batch's sequence length).
    pub max_seq: usize,
    /// Key/value heads of grouped-query attention (must divide `n_heads`);
    /// `None`: `n_heads` (plain multi-head attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Width of one attention head; `None`: `d_model / n_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Rotary position embeddings with this base (Qwen3: 1e6) instead of the
    /// learned position embedding; `None`: learned positions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Qwen3's RMSNorm of every query and key head (one `head_dim` gain each
    /// for queries and keys per block), before the rotation.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// Epsilon of every RMSNorm; `None`: 1e-6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rms_eps: Option<f64>,
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

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Width of one attention head.
    pub fn head_width(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// RMSNorm epsilon.
    pub fn eps(&self) -> f64 {
        self.rms_eps.unwrap_or(1e-6)
    }

    /// A small model of the given vocabulary with the classic block
    /// (multi-head attention, learned positions; tests and examples).
    pub fn small(vocab: usize) -> Self {
        Self {
            vocab,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            ffn: 6,
            n_experts: 4,
            top_k: 2,
            renormalize: true,
            max_seq: 8,
            n_kv_heads: None,
            head_dim: None,
            rope_theta: None,
            qk_norm: false,
            rms_eps: None,
        }
    }

    /// Rejects shapes that cannot work.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.vocab == 0 || self.d_model == 0 || self.n_layers == 0 || self.n_heads == 0 {
            return bad("vocab, d_model, n_layers and n_heads must be positive".into());
        }
        if self.max_seq == 0 {
            return bad("max_seq must be positive".into());
        }
        match self.head_dim {
            None if self.d_model % self.n_heads != 0 => {
                return bad(format!(
                    "d_model = {} is not divisible by n_heads = {} (or set head_dim)",
                    self.d_model, self.n_heads
                ))
            }
            Some(0) => return bad("head_dim must be positive".into()),
            _ => {}
        }
        let kv = self.kv_heads();
        if kv == 0 || self.n_heads % kv != 0 {
            return bad(format!(
                "n_kv_heads = {kv} must be positive and divide n_heads = {}",
                self.n_heads
            ));
        }
        if let Some(t) = self.rope_theta {
            if !(t.is_finite() && t > 1.0) {
                return bad(format!("rope_theta = {t} must be finite and > 1"));
            }
            if self.head_width() % 2 != 0 {
                return bad(format!(
                    "RoPE needs an even head_dim, not {}",
                    self.head_width()
                ));
            }
        }
        let eps = self.eps();
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return bad(format!("rms_eps = {eps} must be in (0, 1)"));
        }
        if [self.n_heads, kv]
            .iter()
            .any(|h| h.checked_mul(self.head_width()).is_none())
        {
            return bad("heads × head_dim overflows".into());
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
    /// Query projection, `d × (n_heads · head_dim)`.
    pub wq: Vec<T>,
    /// Key projection, `d × (n_kv_heads · head_dim)`.
    pub wk: Vec<T>,
    /// Value projection, `d × (n_kv_heads · head_dim)`.
    pub wv: Vec<T>,
    /// Output projection, `(n_heads · head_dim) × d`.
    pub wo: Vec<T>,
    /// Query-head RMSNorm gain, `head_dim` (empty without `qk_norm`).
    pub q_norm: Vec<T>,
    /// Key-head RMSNorm gain, `head_dim` (empty without `qk_norm`).
    pub k_norm: Vec<T>,
    /// Pre-MoE RMSNorm gain, `d`.
    pub norm2: Vec<T>,
    /// The MoE layer.
    pub moe: MoeParams<T>,
}

/// All weights of the model (or their gradients). `Default` is a model
/// with no tensors (a placeholder where the weights live elsewhere).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Model<T> {
    /// Token embedding, `vocab × d`.
    pub embed: Vec<T>,
    /// Learned position embedding, `max_seq × d` (empty with RoPE).
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
    fn fill<T: Value>(&mut self, v: &mut [T], scale: f64) {
        for x in v {
            *x = T::of((2.0 * self.uniform() - 1.0) * scale);
        }
    }
}

impl<T: Value> Model<T> {
    /// Zeros of the configured shapes.
    pub fn zeros(cfg: &ModelConfig) -> Self {
        let d = cfg.d_model;
        let dh = cfg.head_width();
        let (qd, kd) = (cfg.n_heads * dh, cfg.kv_heads() * dh);
        let qk = if cfg.qk_norm { dh } else { 0 };
        let z = |n: usize| vec![T::zero(); n];
        Self {
            embed: z(cfg.vocab * d),
            pos: z(if cfg.rope_theta.is_some() {
                0
            } else {
                cfg.max_seq * d
            }),
            blocks: (0..cfg.n_layers)
                .map(|_| Block {
                    norm1: z(d),
                    wq: z(d * qd),
                    wk: z(d * kd),
                    wv: z(d * kd),
                    wo: z(qd * d),
                    q_norm: z(qk),
                    k_norm: z(qk),
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
            b.q_norm.fill(T::one());
            b.k_norm.fill(T::one());
            for w in [&mut b.wq, &mut b.wk, &mut b.wv] {
                rng.fill(w, s);
            }
            // Residual branches start small so early training is stable.
            let so = 1.0 / ((cfg.n_heads * cfg.head_width()) as f64).sqrt();
            rng.fill(&mut b.wo, so / (2.0 * cfg.n_layers as f64).sqrt());
            b.moe = MoeParams::init(&cfg.moe(), seed.wrapping_add(1000 + i as u64));
        }
        m.norm_f.fill(T::one());
        rng.fill(&mut m.head, s);
        m
    }

    /// Every tensor with a stable name, in a fixed order.
    pub fn tensors(&self) -> Vec<(String, &Vec<T>)> {
        let mut v = vec![("embed".to_string(), &self.embed)];
        if !self.pos.is_empty() {
            v.push(("pos".to_string(), &self.pos));
        }
        for (i, b) in self.blocks.iter().enumerate() {
            for (n, t) in [
                ("norm1", &b.norm1),
                ("wq", &b.wq),
                ("wk", &b.wk),
                ("wv", &b.wv),
                ("wo", &b.wo),
                ("q_norm", &b.q_norm),
                ("k_norm", &b.k_norm),
                ("norm2", &b.norm2),
            ]
            .into_iter()
            .filter(|(_, t)| !t.is_empty())
            {
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
        let mut v = vec![("embed".to_string(), &mut self.embed)];
        if !self.pos.is_empty() {
            v.push(("pos".to_string(), &mut self.pos));
        }
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (n, t) in [
                ("norm1", &mut b.norm1),
                ("wq", &mut b.wq),
                ("wk", &mut b.wk),
                ("wv", &mut b.wv),
                ("wo", &mut b.wo),
                ("q_norm", &mut b.q_norm),
                ("k_norm", &mut b.k_norm),
                ("norm2", &mut b.norm2),
            ]
            .into_iter()
            .filter(|(_, t)| !t.is_empty())
            {
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

/// `y = x / rms(x) ⊙ w` per row of `w.len()`; returns `1 / rms` per row.
fn rmsnorm<T: Value>(x: &[T], w: &[T], eps: f64, y: &mut [T]) -> Vec<T> {
    let d = w.len();
    x.chunks_exact(d)
        .zip(y.chunks_exact_mut(d))
        .map(|(xr, yr)| {
            let ms = xr.iter().map(|&v| v * v).sum::<T>() / T::of(d as f64);
            let inv = T::one() / (ms + T::of(eps)).sqrt();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * inv * g;
            }
            inv
        })
        .collect()
}

/// Backward of [`rmsnorm`]: adds into `dx` and `dw`.
fn rmsnorm_backward<T: Value>(x: &[T], w: &[T], inv: &[T], dy: &[T], dx: &mut [T], dw: &mut [T]) {
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

/// Activations of one forward, for [`backward`].
pub struct Cache<T: Value> {
    tokens: Vec<u32>,
    targets: Vec<u32>,
    pass: Pass<HostF<T>>,
    /// Wall time spent in the MoE layers' forwards, seconds.
    pub moe_seconds: f64,
    /// The MoE layers' auxiliary balancing losses on this rank, summed (0
    /// unless configured). Not part of the returned language-model loss;
    /// the backward's gradients are those of the loss plus this term.
    pub aux_loss: f64,
}

impl<T: Value> Cache<T> {
    /// The controller's plan of each block's MoE call (routing, quotas,
    /// replicas).
    pub fn moe_plans(&self) -> impl Iterator<Item = &CallPlan> {
        self.pass.blocks.iter().map(|b| &b.moe.plan)
    }
}

/// How the MoE layers run in one step.
#[derive(Debug, Clone)]
pub struct MoeRun<'a> {
    /// Expert placement (owners).
    pub placement: &'a Placement,
    /// Backward planning.
    pub backward: &'a CallConfig,
    /// Each layer's auxiliary-loss-free balancing bias
    /// (`CallConfig::expert_bias`); empty: none.
    pub expert_bias: &'a [Vec<f64>],
    /// Each layer's previous routed pairs per expert, the SYMI-like
    /// replicas' input (`CallConfig::replica_load`); empty: none (the
    /// trainer fills it in its SYMI-like mode only).
    pub replica_load: &'a [Vec<u64>],
}

/// A step's MoE run with `placement` and `backward` alone: no balancing
/// bias and no previous load for SYMI-like replicas.
pub fn plain_moe_run<'a>(placement: &'a Placement, backward: &'a CallConfig) -> MoeRun<'a> {
    MoeRun {
        placement,
        backward,
        expert_bias: &[],
        replica_load: &[],
    }
}

/// Layer `li`'s call when it differs from `run.backward`: with its
/// balancing bias, and with its previous load as the SYMI-like replicas'
/// input.
pub(crate) fn layer_call_of(run: &MoeRun<'_>, li: usize) -> Option<CallConfig> {
    let bias = run.expert_bias.get(li).filter(|b| !b.is_empty());
    let load = run.replica_load.get(li).filter(|l| !l.is_empty());
    if bias.is_none() && load.is_none() {
        return None;
    }
    Some(CallConfig {
        expert_bias: bias.cloned().unwrap_or_default(),
        replica_load: load.cloned(),
        ..run.backward.clone()
    })
}

/// Rearranges `[n, h·dh]` (token-major) into `[h, n, dh]` per sequence.
fn split_heads<T: Value>(x: &[T], seq: usize, heads: usize, dh: usize, out: &mut [T]) {
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

/// Rotates every head of the token-major rows `x` (`[n, width]`, `width` a
/// multiple of `dh`; token `i` at position `i % seq`) by RoPE with base
/// `theta`; `inverse` rotates by the negative angle (the transpose: the
/// backward of the rotation).
fn rope<T: Value>(x: &mut [T], seq: usize, width: usize, dh: usize, theta: f64, inverse: bool) {
    let half = dh / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let table: Vec<(T, T)> = (0..seq)
        .flat_map(|p| {
            (0..half).map(move |j| {
                let angle = p as f64 * theta.powf(-2.0 * j as f64 / dh as f64);
                (T::of(angle.cos()), T::of(sign * angle.sin()))
            })
        })
        .collect();
    for (i, row) in x.chunks_exact_mut(width).enumerate() {
        let cs = &table[(i % seq) * half..(i % seq + 1) * half];
        for head in row.chunks_exact_mut(dh) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                let (x1, x2) = (*a, *b);
                *a = x1 * c - x2 * s;
                *b = x2 * c + x1 * s;
            }
        }
    }
}

/// Inverse of [`split_heads`].
fn merge_heads<T: Value>(x: &[T], seq: usize, heads: usize, dh: usize, out: &mut [T]) {
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

/// The batch against the model: whole sequences of at most `max_seq`,
/// tokens and targets inside the vocabulary.
fn check_batch(
    cfg: &ModelConfig,
    tokens: &[u32],
    targets: &[u32],
    seq: usize,
) -> Result<(), ModelError> {
    let v_n = cfg.vocab;
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
    Ok(())
}

/// Token embeddings (plus learned positions, when the model has them).
fn embed<T: Value>(cfg: &ModelConfig, model: &Model<T>, tokens: &[u32], seq: usize) -> Vec<T> {
    let d = cfg.d_model;
    let mut x = vec![T::zero(); tokens.len() * d];
    for (i, (row, &t)) in x.chunks_exact_mut(d).zip(tokens).enumerate() {
        row.copy_from_slice(&model.embed[t as usize * d..(t as usize + 1) * d]);
        if !model.pos.is_empty() {
            let p = i % seq;
            for (o, &q) in row.iter_mut().zip(&model.pos[p * d..(p + 1) * d]) {
                *o += q;
            }
        }
    }
    x
}

/// What attention keeps for its backward (the CPU backend's).
pub(crate) struct AttnForward<T> {
    /// Query and key projections before their head norms, token-major, and
    /// the norms' `1 / rms` per head row (empty without `qk_norm`).
    q_raw: Vec<T>,
    k_raw: Vec<T>,
    q_inv: Vec<T>,
    k_inv: Vec<T>,
    /// Queries, keys and values as attention saw them (normed and rotated),
    /// `[sequence, head, position, head_dim]`.
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    probs: Vec<T>,
}

/// The projections of the normed rows `a`, the optional q/k norms and
/// RoPE, and causal grouped-query attention per (sequence, query head);
/// query head `j` reads key/value head `j / group`. What the backward
/// keeps, and the context rows (token-major, before the output
/// projection).
fn attention_forward<T: Value>(
    cfg: &ModelConfig,
    b: &Block<T>,
    a: &[T],
    seq: usize,
) -> Result<(AttnForward<T>, Vec<T>), ModelError> {
    let d = cfg.d_model;
    let (h, kv, dh) = (cfg.n_heads, cfg.kv_heads(), cfg.head_width());
    let (qd, kd, group) = (h * dh, kv * dh, h / kv);
    let eps = cfg.eps();
    let n = a.len() / d;
    let n_seq = n / seq;
    let scale = T::of(1.0 / (dh as f64).sqrt());
    let proj = |w: &[T], width: usize| -> Result<Vec<T>, ModelError> {
        let mut o = vec![T::zero(); n * width];
        matmul(&mut o, a, Op::N, w, Op::N, (n, d, width), false)?;
        Ok(o)
    };
    let (mut qt, mut kt, vt) = (proj(&b.wq, qd)?, proj(&b.wk, kd)?, proj(&b.wv, kd)?);
    let (mut q_raw, mut k_raw, mut q_inv, mut k_inv) = (vec![], vec![], vec![], vec![]);
    if cfg.qk_norm {
        q_raw = qt.clone();
        k_raw = kt.clone();
        q_inv = rmsnorm(&q_raw, &b.q_norm, eps, &mut qt);
        k_inv = rmsnorm(&k_raw, &b.k_norm, eps, &mut kt);
    }
    if let Some(theta) = cfg.rope_theta {
        rope(&mut qt, seq, qd, dh, theta, false);
        rope(&mut kt, seq, kd, dh, theta, false);
    }
    let by_head = |t: &[T], heads: usize| {
        let mut s = vec![T::zero(); t.len()];
        split_heads(t, seq, heads, dh, &mut s);
        s
    };
    let (q, k, v) = (by_head(&qt, h), by_head(&kt, kv), by_head(&vt, kv));
    let mut probs = vec![T::zero(); n_seq * h * seq * seq];
    let mut ctx = vec![T::zero(); n * qd];
    for sh in 0..n_seq * h {
        let ks_i = (sh / h) * kv + (sh % h) / group;
        let qs = &q[sh * seq * dh..(sh + 1) * seq * dh];
        let ks = &k[ks_i * seq * dh..(ks_i + 1) * seq * dh];
        let vs = &v[ks_i * seq * dh..(ks_i + 1) * seq * dh];
        let p = &mut probs[sh * seq * seq..(sh + 1) * seq * seq];
        matmul(p, qs, Op::N, ks, Op::T, (seq, dh, seq), false)?;
        causal_softmax(p, seq, scale);
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
    let mut attn = vec![T::zero(); n * qd];
    merge_heads(&ctx, seq, h, dh, &mut attn);
    let saved = AttnForward {
        q_raw,
        k_raw,
        q_inv,
        k_inv,
        q,
        k,
        v,
        probs,
    };
    Ok((saved, attn))
}

/// Scaled scores `p` (`seq × seq`, one head) to causal softmax rows, in
/// place: future positions get probability zero.
fn causal_softmax<T: Value>(p: &mut [T], seq: usize, scale: T) {
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
}

/// What the head keeps for its backward (the CPU backend's).
pub(crate) struct Top<T> {
    /// Mean cross-entropy of the targets, nats.
    loss: f64,
    x_final: Vec<T>,
    inv_f: Vec<T>,
    hf: Vec<T>,
    probs: Vec<T>,
}

/// Final norm, LM head and softmax probabilities; the mean cross-entropy
/// of `targets` in nats.
fn head_loss<T: Value>(
    cfg: &ModelConfig,
    model: &Model<T>,
    x: Vec<T>,
    targets: &[u32],
) -> Result<Top<T>, ModelError> {
    let (d, v_n) = (cfg.d_model, cfg.vocab);
    let n = targets.len();
    let mut hf = vec![T::zero(); n * d];
    let inv_f = rmsnorm(&x, &model.norm_f, cfg.eps(), &mut hf);
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
    Ok(Top {
        loss: loss / n as f64,
        x_final: x,
        inv_f,
        hf,
        probs,
    })
}

/// The CPU model's buffers (`T` slices), [`crate::block`]'s family.
pub(crate) struct HostF<T>(std::marker::PhantomData<T>);

impl<T: Value> block::Family for HostF<T> {
    type Stream = Vec<T>;
    type Rows = Vec<T>;
    type Inv = Vec<T>;
    type Attn = AttnForward<T>;
    type Moe = Saved<T>;
    type MoeGrads = MoeParams<T>;
    type Grad = Vec<T>;
    type Top = Top<T>;
}

/// One rank's pass on the CPU: [`crate::block`]'s host backend.
struct HostPass<'a, T: Value, X: Transport> {
    comm: &'a X,
    cfg: &'a ModelConfig,
    model: &'a Model<T>,
    run: &'a MoeRun<'a>,
    tokens: &'a [u32],
    targets: &'a [u32],
    seq: usize,
    /// Wall seconds in the MoE layers' calls so far.
    moe_seconds: std::cell::Cell<f64>,
}

impl<'a, T: Value, X: Transport> HostPass<'a, T, X> {
    /// Rank `comm`'s pass of `model` on `tokens → targets` (sequences of
    /// `seq`).
    fn new(
        (comm, cfg, model): (&'a X, &'a ModelConfig, &'a Model<T>),
        run: &'a MoeRun<'a>,
        (tokens, targets): (&'a [u32], &'a [u32]),
        seq: usize,
    ) -> Self {
        Self {
            comm,
            cfg,
            model,
            run,
            tokens,
            targets,
            seq,
            moe_seconds: 0.0.into(),
        }
    }

    fn gain(&self, li: usize, which: Norm) -> &[T] {
        let b = &self.model.blocks[li];
        match which {
            Norm::Attention => &b.norm1,
            Norm::Moe => &b.norm2,
        }
    }

    fn timed<R>(&self, f: impl FnOnce() -> R) -> R {
        let clock = std::time::Instant::now();
        let r = f();
        self.moe_seconds
            .set(self.moe_seconds.get() + clock.elapsed().as_secs_f64());
        r
    }
}

impl<T: Value, X: Transport> block::Dense for HostPass<'_, T, X> {
    type F = HostF<T>;
    type Error = ModelError;

    fn n_layers(&self) -> usize {
        self.model.blocks.len()
    }

    fn embed(&self) -> Result<Vec<T>, ModelError> {
        Ok(embed(self.cfg, self.model, self.tokens, self.seq))
    }

    fn copy(&self, x: &Vec<T>) -> Result<Vec<T>, ModelError> {
        Ok(x.clone())
    }

    fn norm(&self, li: usize, which: Norm, x: &Vec<T>) -> Result<(Vec<T>, Vec<T>), ModelError> {
        let mut y = vec![T::zero(); x.len()];
        let inv = rmsnorm(x, self.gain(li, which), self.cfg.eps(), &mut y);
        Ok((y, inv))
    }

    fn attention(&self, li: usize, a: &Vec<T>) -> Result<(AttnForward<T>, Vec<T>), ModelError> {
        attention_forward(self.cfg, &self.model.blocks[li], a, self.seq)
    }

    fn out_project(&self, li: usize, attn: &Vec<T>, x: &mut Vec<T>) -> Result<(), ModelError> {
        let (d, qd) = (self.cfg.d_model, self.cfg.n_heads * self.cfg.head_width());
        let n = x.len() / d;
        let wo = &self.model.blocks[li].wo;
        Ok(matmul(x, attn, Op::N, wo, Op::N, (n, qd, d), true)?)
    }

    fn moe_forward(&self, li: usize, m: &Vec<T>, x: &mut Vec<T>) -> Result<Saved<T>, ModelError> {
        let layer_call;
        let call = match layer_call_of(self.run, li) {
            Some(c) => {
                layer_call = c;
                &layer_call
            }
            None => self.run.backward,
        };
        let (moe_cfg, b) = (self.cfg.moe(), &self.model.blocks[li]);
        let (y, moe) = self
            .timed(|| layer::forward(self.comm, &moe_cfg, call, &b.moe, self.run.placement, m))?;
        for (xv, yv) in x.iter_mut().zip(&y) {
            *xv += *yv;
        }
        Ok(moe)
    }

    fn head_loss(&self, x: Vec<T>) -> Result<Top<T>, ModelError> {
        head_loss(self.cfg, self.model, x, self.targets)
    }

    fn head_backward(&self, top: Top<T>) -> Result<(Vec<T>, Vec<T>, Vec<T>), ModelError> {
        head_backward(
            self.cfg,
            self.model,
            top,
            self.targets,
            self.comm.world_size(),
        )
    }

    fn moe_backward(
        &self,
        li: usize,
        moe: Saved<T>,
        dx: &Vec<T>,
    ) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), ModelError> {
        let (moe_cfg, b) = (self.cfg.moe(), &self.model.blocks[li]);
        Ok(self
            .timed(|| layer::backward(self.comm, &moe_cfg, self.run.backward, &b.moe, &moe, dx))?)
    }

    fn norm_backward(
        &self,
        li: usize,
        which: Norm,
        (x, inv): (&Vec<T>, &Vec<T>),
        dy: &Vec<T>,
        dx: &mut Vec<T>,
    ) -> Result<Vec<T>, ModelError> {
        let w = self.gain(li, which);
        let mut dw = vec![T::zero(); w.len()];
        rmsnorm_backward(x, w, inv, dy, dx, &mut dw);
        Ok(dw)
    }

    fn out_project_backward(
        &self,
        li: usize,
        attn: &Vec<T>,
        dx: &Vec<T>,
    ) -> Result<(Vec<T>, Vec<T>), ModelError> {
        let (d, qd) = (self.cfg.d_model, self.cfg.n_heads * self.cfg.head_width());
        let n = dx.len() / d;
        let mut d_wo = vec![T::zero(); qd * d];
        matmul(&mut d_wo, attn, Op::T, dx, Op::N, (qd, n, d), false)?;
        let mut dattn = vec![T::zero(); n * qd];
        let wo = &self.model.blocks[li].wo;
        matmul(&mut dattn, dx, Op::N, wo, Op::T, (n, d, qd), false)?;
        Ok((d_wo, dattn))
    }

    fn attention_backward(
        &self,
        li: usize,
        att: AttnForward<T>,
        a: &Vec<T>,
        dattn: Vec<T>,
    ) -> Result<(Vec<T>, QkvGrads<Vec<T>>), ModelError> {
        attention_backward(self.cfg, &self.model.blocks[li], &att, a, &dattn, self.seq)
    }

    fn embed_backward(&self, dx: &Vec<T>) -> Result<(Vec<T>, Option<Vec<T>>), ModelError> {
        Ok(embed_backward(
            self.cfg,
            self.model,
            self.tokens,
            dx,
            self.seq,
        ))
    }
}

/// Loss (mean cross-entropy over this rank's tokens, in nats) and cache.
/// `tokens` and `targets` are `n_seq × seq` row-major.
pub fn forward<T: Value, X: Transport>(
    comm: &X,
    cfg: &ModelConfig,
    model: &Model<T>,
    run: &MoeRun<'_>,
    tokens: &[u32],
    targets: &[u32],
    seq: usize,
) -> Result<(f64, Cache<T>), ModelError> {
    cfg.validate()?;
    check_batch(cfg, tokens, targets, seq)?;
    let be = HostPass::new((comm, cfg, model), run, (tokens, targets), seq);
    let pass = block::forward(&be)?;
    let loss = pass.top.loss;
    let aux_loss = pass.blocks.iter().map(|b| b.moe.aux_loss()).sum::<f64>();
    if !loss.is_finite() || !aux_loss.is_finite() {
        return Err(ModelError::NonFinite("loss"));
    }
    let cache = Cache {
        tokens: tokens.to_vec(),
        targets: targets.to_vec(),
        pass,
        moe_seconds: be.moe_seconds.get(),
        aux_loss,
    };
    Ok((loss, cache))
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

/// The LM head's and final norm's backward: the gradient of the residual
/// stream at the top, the final norm's and the head's gradients.
/// `d loss / d logits = (p − onehot) / (n · world)`.
#[allow(clippy::type_complexity)]
fn head_backward<T: Value>(
    cfg: &ModelConfig,
    model: &Model<T>,
    top: Top<T>,
    targets: &[u32],
    world: usize,
) -> Result<(Vec<T>, Vec<T>, Vec<T>), ModelError> {
    let (d, v_n) = (cfg.d_model, cfg.vocab);
    let n = targets.len();
    let inv_n = T::of(1.0 / (n as f64 * world as f64));
    let mut dlogits = top.probs;
    for (row, &t) in dlogits.chunks_exact_mut(v_n).zip(targets) {
        row[t as usize] -= T::one();
        row.iter_mut().for_each(|v| *v *= inv_n);
    }
    let mut d_head = vec![T::zero(); d * v_n];
    matmul(
        &mut d_head,
        &top.hf,
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
    let mut d_norm_f = vec![T::zero(); d];
    rmsnorm_backward(
        &top.x_final,
        &model.norm_f,
        &top.inv_f,
        &dhf,
        &mut dx,
        &mut d_norm_f,
    );
    Ok((dx, d_norm_f, d_head))
}

/// Causal attention's backward per (sequence, query head) from the
/// context gradient `dctx` (head-major): `(dq, dk, dv)`, head-major; a
/// key/value head sums the gradients of its group's queries.
#[allow(clippy::type_complexity)]
fn heads_backward<T: Value>(
    cfg: &ModelConfig,
    c: &AttnForward<T>,
    dctx: &[T],
    seq: usize,
) -> Result<(Vec<T>, Vec<T>, Vec<T>), ModelError> {
    let (h, kv, dh) = (cfg.n_heads, cfg.kv_heads(), cfg.head_width());
    let (qd, kd, group) = (h * dh, kv * dh, h / kv);
    let n = dctx.len() / qd;
    let n_seq = n / seq;
    let scale = T::of(1.0 / (dh as f64).sqrt());
    let mut dq = vec![T::zero(); n * qd];
    let mut dk = vec![T::zero(); n * kd];
    let mut dv = vec![T::zero(); n * kd];
    let mut dp = vec![T::zero(); seq * seq];
    for sh in 0..n_seq * h {
        let ks_i = (sh / h) * kv + (sh % h) / group;
        let r = sh * seq * dh..(sh + 1) * seq * dh;
        let rk = ks_i * seq * dh..(ks_i + 1) * seq * dh;
        let p = &c.probs[sh * seq * seq..(sh + 1) * seq * seq];
        matmul(
            &mut dv[rk.clone()],
            p,
            Op::T,
            &dctx[r.clone()],
            Op::N,
            (seq, seq, dh),
            true,
        )?;
        matmul(
            &mut dp,
            &dctx[r.clone()],
            Op::N,
            &c.v[rk.clone()],
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
            &c.k[rk.clone()],
            Op::N,
            (seq, seq, dh),
            false,
        )?;
        matmul(
            &mut dk[rk],
            &dp,
            Op::T,
            &c.q[r],
            Op::N,
            (seq, seq, dh),
            true,
        )?;
    }
    Ok((dq, dk, dv))
}

/// Attention's backward from the context rows' gradient `dattn`
/// (token-major): the gradient at the normed rows `a`, and the q/k/v
/// projections' (and head norms') gradients.
fn attention_backward<T: Value>(
    cfg: &ModelConfig,
    b: &Block<T>,
    c: &AttnForward<T>,
    a: &[T],
    dattn: &[T],
    seq: usize,
) -> Result<(Vec<T>, QkvGrads<Vec<T>>), ModelError> {
    let d = cfg.d_model;
    let (h, kv, dh) = (cfg.n_heads, cfg.kv_heads(), cfg.head_width());
    let (qd, kd) = (h * dh, kv * dh);
    let n = dattn.len() / qd;
    let mut dctx = vec![T::zero(); n * qd];
    split_heads(dattn, seq, h, dh, &mut dctx);
    let (dq, dk, dv) = heads_backward(cfg, c, &dctx, seq)?;
    // Back to token-major rows, through the rotation and the head norms.
    let by_token = |t: &[T], heads: usize| {
        let mut o = vec![T::zero(); t.len()];
        merge_heads(t, seq, heads, dh, &mut o);
        o
    };
    let (mut dqt, mut dkt, dvt) = (by_token(&dq, h), by_token(&dk, kv), by_token(&dv, kv));
    if let Some(theta) = cfg.rope_theta {
        rope(&mut dqt, seq, qd, dh, theta, true);
        rope(&mut dkt, seq, kd, dh, theta, true);
    }
    let mut head_norms = None;
    if cfg.qk_norm {
        let norm_back = |dt: &mut Vec<T>, raw: &[T], w: &[T], inv: &[T]| {
            let (mut draw, mut gw) = (vec![T::zero(); dt.len()], vec![T::zero(); w.len()]);
            rmsnorm_backward(raw, w, inv, dt, &mut draw, &mut gw);
            *dt = draw;
            gw
        };
        let gq = norm_back(&mut dqt, &c.q_raw, &b.q_norm, &c.q_inv);
        let gk = norm_back(&mut dkt, &c.k_raw, &b.k_norm, &c.k_inv);
        head_norms = Some((gq, gk));
    }
    let mut da = vec![T::zero(); n * d];
    let mut proj_back = |dproj: &[T], w: &[T], width: usize| -> Result<Vec<T>, ModelError> {
        let mut gw = vec![T::zero(); d * width];
        matmul(&mut gw, a, Op::T, dproj, Op::N, (d, n, width), false)?;
        matmul(&mut da, dproj, Op::N, w, Op::T, (n, width, d), true)?;
        Ok(gw)
    };
    let wq = proj_back(&dqt, &b.wq, qd)?;
    let wk = proj_back(&dkt, &b.wk, kd)?;
    let wv = proj_back(&dvt, &b.wv, kd)?;
    let grads = QkvGrads {
        wq,
        wk,
        wv,
        head_norms,
    };
    Ok((da, grads))
}

/// The embeddings' gradients (token; learned position when the model has
/// them) from the gradient at the bottom of the residual stream.
fn embed_backward<T: Value>(
    cfg: &ModelConfig,
    model: &Model<T>,
    tokens: &[u32],
    dx: &[T],
    seq: usize,
) -> (Vec<T>, Option<Vec<T>>) {
    let d = cfg.d_model;
    let mut g_embed = vec![T::zero(); model.embed.len()];
    let mut g_pos = (!model.pos.is_empty()).then(|| vec![T::zero(); model.pos.len()]);
    for (i, (row, &t)) in dx.chunks_exact(d).zip(tokens).enumerate() {
        for (gv, &v) in g_embed[t as usize * d..(t as usize + 1) * d]
            .iter_mut()
            .zip(row)
        {
            *gv += v;
        }
        if let Some(g_pos) = &mut g_pos {
            let p = i % seq;
            for (gv, &v) in g_pos[p * d..(p + 1) * d].iter_mut().zip(row) {
                *gv += v;
            }
        }
    }
    (g_embed, g_pos)
}

/// A pass's gradients as a [`Model`] of gradients.
fn model_grads<T: Value>(g: PassGrads<HostF<T>>) -> Model<T> {
    let blocks = g
        .blocks
        .into_iter()
        .map(|b| {
            let (q_norm, k_norm) = b.qkv.head_norms.unwrap_or_default();
            Block {
                norm1: b.norm1,
                wq: b.qkv.wq,
                wk: b.qkv.wk,
                wv: b.qkv.wv,
                wo: b.wo,
                q_norm,
                k_norm,
                norm2: b.norm2,
                moe: b.moe,
            }
        })
        .collect();
    Model {
        embed: g.embed,
        pos: g.pos.unwrap_or_default(),
        blocks,
        norm_f: g.norm_f,
        head: g.head,
    }
}

/// Gradients of the mean loss over *all* ranks' tokens (each rank holds the
/// same number), summed over ranks so every rank gets the same result; and
/// each MoE layer's backward figures for this rank. The cache is consumed:
/// each block's activations are released once its backward has read them.
pub fn backward<T: Value, X: Transport>(
    comm: &X,
    cfg: &ModelConfig,
    model: &Model<T>,
    run: &MoeRun<'_>,
    cache: Cache<T>,
    seq: usize,
) -> Result<Gradients<T>, ModelError> {
    let Cache {
        tokens,
        targets,
        pass,
        ..
    } = cache;
    let be = HostPass::new((comm, cfg, model), run, (&tokens, &targets), seq);
    let mut pg = block::backward(&be, pass)?;
    let stats = std::mem::take(&mut pg.stats);
    let mut g = model_grads(pg);
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
        moe_seconds: be.moe_seconds.get(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use layer::run_local;
    use std::time::Duration;

    fn tiny() -> ModelConfig {
        ModelConfig::small(7)
    }

    /// The Qwen3-MoE block: grouped-query attention, per-head q/k norms,
    /// rotary positions, head_dim not d_model / n_heads.
    fn tiny_qwen3() -> ModelConfig {
        ModelConfig {
            n_heads: 4,
            n_kv_heads: Some(2),
            head_dim: Some(4),
            rope_theta: Some(10_000.0),
            qk_norm: true,
            rms_eps: Some(1e-5),
            ..ModelConfig::small(7)
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
            owner: (0..cfg.n_experts)
                .map(|e| e * ranks / cfg.n_experts)
                .collect(),
            replicas: vec![],
        };
        let run = plain_moe_run(&placement, bwd);
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
            // The objective the gradients belong to.
            let objective = l + c.aux_loss;
            let g = backward(t, cfg, model, &run, c, seq)?;
            Ok((objective, g.grads))
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
    fn qwen3_block_gradients_match_central_finite_differences() {
        let cfg = tiny_qwen3();
        let model = Model::<f64>::init(&cfg, 11);
        assert!(model.pos.is_empty() && model.blocks[0].q_norm.len() == 4);
        assert_eq!(model.blocks[0].wk.len(), 8 * 2 * 4);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 5 % 7 + 1) as u32 % 7).collect();
        let call = CallConfig::default();
        for ranks in [1, 2] {
            assert_fd(&cfg, &model, &tokens, &targets, 6, ranks, &call, &|_| true);
        }
    }

    #[test]
    fn rope_is_a_relative_rotation() {
        let (seq, dh) = (7, 6);
        let q: Vec<f64> = (0..dh).map(|i| (i as f64 * 0.7).sin()).collect();
        let k: Vec<f64> = (0..dh).map(|i| (i as f64 * 1.3).cos()).collect();
        let at = |v: &[f64]| {
            let mut x: Vec<f64> = (0..seq).flat_map(|_| v.iter().copied()).collect();
            rope(&mut x, seq, dh, dh, 500.0, false);
            x
        };
        let (rq, rk) = (at(&q), at(&k));
        let dot =
            |i: usize, j: usize| -> f64 { (0..dh).map(|t| rq[i * dh + t] * rk[j * dh + t]).sum() };
        // Position 0 is untouched; norms are kept; scores depend on i − j.
        assert_eq!(&rq[..dh], &q[..]);
        let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
        assert!((norm(&rq[3 * dh..4 * dh]) - norm(&q)).abs() < 1e-12);
        assert!((dot(5, 3) - dot(2, 0)).abs() < 1e-12);
        assert!((dot(6, 6) - dot(0, 0)).abs() < 1e-12);
        assert!(
            (dot(4, 1) - dot(1, 4)).abs() > 1e-6,
            "not symmetric in i − j"
        );
        let mut back = rq.clone();
        rope(&mut back, seq, dh, dh, 500.0, true);
        for (a, b) in back.chunks_exact(dh).flatten().zip(q.iter().cycle()) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn grouped_query_attention_equals_multi_head_with_shared_key_heads() {
        let gqa = tiny_qwen3();
        let mha = ModelConfig {
            n_kv_heads: None,
            ..gqa
        };
        let g = Model::<f64>::init(&gqa, 5);
        let mut m = Model::<f64>::zeros(&mha);
        m.embed.clone_from(&g.embed);
        m.norm_f.clone_from(&g.norm_f);
        m.head.clone_from(&g.head);
        let (d, dh) = (gqa.d_model, 4);
        for (mb, gb) in m.blocks.iter_mut().zip(&g.blocks) {
            let keep = (mb.wk.len(), mb.wv.len());
            *mb = gb.clone();
            // Key/value head j of the multi-head model copies head j / 2.
            let widen = |w: &[f64]| -> Vec<f64> {
                let mut out = vec![0.0; d * 4 * dh];
                for r in 0..d {
                    for j in 0..4 {
                        for t in 0..dh {
                            out[r * 4 * dh + j * dh + t] = w[r * 2 * dh + (j / 2) * dh + t];
                        }
                    }
                }
                out
            };
            mb.wk = widen(&gb.wk);
            mb.wv = widen(&gb.wv);
            assert_eq!((mb.wk.len(), mb.wv.len()), keep);
        }
        let tokens: Vec<u32> = (0..12).map(|i| (i * 3 % 7) as u32).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 2 % 7) as u32).collect();
        let (lg, _) = loss_and_grads(&gqa, &g, &tokens, &targets, 6, 1);
        let (lm, _) = loss_and_grads(&mha, &m, &tokens, &targets, 6, 1);
        assert!((lg - lm).abs() < 1e-12, "{lg} vs {lm}");
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
            replica_rule: quota::ReplicaRule::Fill,
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
        let run = plain_moe_run(&placement, &bwd);
        let res: Vec<Result<(), ModelError>> = run_local(1, Duration::from_secs(5), |t| {
            forward(t, &cfg, &model, &run, &[9, 1], &[1, 1], 2).map(|_| ())
        });
        assert!(matches!(res[0], Err(ModelError::Batch(_))));
        let bad = ModelConfig { n_heads: 3, ..cfg };
        assert!(matches!(bad.validate(), Err(ModelError::Config(_))));
        let bad = ModelConfig { top_k: 9, ..cfg };
        assert!(bad.validate().is_err());
        for bad in [
            ModelConfig {
                n_kv_heads: Some(3),
                ..tiny_qwen3()
            },
            ModelConfig {
                n_kv_heads: Some(0),
                ..tiny_qwen3()
            },
            ModelConfig {
                head_dim: Some(3),
                ..tiny_qwen3()
            },
            ModelConfig {
                head_dim: Some(0),
                ..tiny_qwen3()
            },
            ModelConfig {
                rope_theta: Some(f64::NAN),
                ..tiny_qwen3()
            },
            ModelConfig {
                rms_eps: Some(0.0),
                ..tiny_qwen3()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(ModelError::Config(_))),
                "{bad:?}"
            );
        }
        // head_dim frees d_model from dividing by n_heads.
        let odd = ModelConfig {
            n_heads: 3,
            head_dim: Some(4),
            ..tiny_qwen3()
        };
        assert!(ModelConfig {
            n_kv_heads: None,
            ..odd
        }
        .validate()
        .is_ok());
        // The classic model's description is unchanged (old checkpoints).
        let json = serde_json::to_string(&tiny()).unwrap();
        assert!(!json.contains("rope") && !json.contains("kv"), "{json}");
    }
}
