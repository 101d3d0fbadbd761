//! The whole model resident on one GPU (`lrmoe train --device cuda` for a
//! model with rotary positions, e.g. `--model-config
//! examples/qwen3-moe-mini.config.json`): f32 master weights, AdamW
//! moments and their bf16 working copies, the training and validation
//! corpora, every activation and gradient stay on the device. Per step the
//! host sends the batch's window starts (and, with the balancing bias,
//! one value per expert and layer) and reads back scalars — the loss, the
//! gradient norm, the MoE layers' routed counts for the controller and
//! the metrics; checkpoints download the weights only when saved.
//!
//! The math is [`crate::model`]'s (the CPU model is the reference the
//! device tests hold it to), and so is the order: both are backends of
//! `crate::block`, where the block's and the pass's forward and backward
//! are written once; this file supplies the device's primitives. Embedding (plus the learned positions when
//! the model has no RoPE), per block RMSNorm → q/k/v projections →
//! per-head q/k RMSNorm → RoPE → causal grouped-query attention → output
//! projection → residual → RMSNorm → the MoE layer through
//! `layer::device` (the controller's quotas, the LRMoE backward, the
//! forced hot expert and the balancing bias, exactly as the host-driven
//! device executor runs them) → residual; final RMSNorm, LM head, fused
//! cross-entropy. The residual stream and norms are f32; GEMM inputs,
//! outputs and weight gradients bf16 with f32 accumulation (the grouped
//! CUTLASS GEMM: the projections are one group, attention one group per
//! (sequence, key/value head) whose rows are that head's queries, so
//! grouped-query attention needs no repeated keys); AdamW with weight
//! decay and global-norm clipping runs fused on the device, the clip
//! factor read from the device's norm.
//!
//! Several GPUs (launched ranks, one GPU each, `--executor device`): the
//! experts are sharded by expert parallelism (rank `r` holds the masters
//! and moments of experts `r·E/W .. (r+1)·E/W`; the MoE layers exchange
//! rows over NCCL inside `layer::device`), the dense weights and the router
//! are replicated, their gradients summed over the ranks on the device
//! (`layer::device::sum_over_ranks`; the router's is summed by the
//! executor); the global norm counts the replicated gradients once. Each
//! rank trains on its share of the batch; checkpoints gather the experts
//! to every rank. **Not yet run on two GPUs** (no two-GPU machine in the
//! session that wrote it); one GPU is the same code with `W = 1`.
//!
//! Limits (errors, not silent fallbacks): widths that are GEMM dimensions
//! (`d_model`, heads × head_dim, `ffn`, the vocabulary, the sequence
//! length, `head_dim`) must be multiples of 8; experts divide evenly over
//! the ranks; no micro-batching.

use layer::{BackwardStats, CallPlan};

use crate::model::{ModelConfig, ModelError};
#[cfg(not(feature = "cuda"))]
use {
    crate::model::Model,
    crate::optim::{AdamWConfig, AdamWState},
    layer::CallConfig,
};

/// What one training step reports.
#[derive(Debug, Clone)]
pub struct DeviceStep {
    /// Mean cross-entropy of the batch, nats per token.
    pub loss: f64,
    /// The MoE layers' auxiliary balancing losses, summed.
    pub aux_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Device time in the MoE layers (forward + backward), seconds.
    pub moe_seconds: f64,
    /// The step's device time split, milliseconds: dense forward (with the
    /// loss), MoE forward, dense backward, MoE backward, optimizer (norm,
    /// clip, AdamW). One GPU: no communication.
    pub split_ms: [f64; 5],
    /// Device memory in use after the step (bytes, `cuMemGetInfo`: the
    /// stream-ordered pool keeps freed memory, so this is the step's peak
    /// reservation plus the context).
    pub device_bytes: u64,
    /// Each layer's plan.
    pub plans: Vec<CallPlan>,
    /// Each micro-batch's per-layer backward figures.
    pub stats: Vec<Vec<BackwardStats>>,
}

/// The device model's limits on a configuration, checked before any
/// allocation (also without CUDA, so a bad configuration is named first).
pub fn check(cfg: &ModelConfig, seq: Option<usize>, world: usize) -> Result<(), ModelError> {
    cfg.validate()?;
    if world == 0 || cfg.n_experts % world != 0 {
        return Err(ModelError::Config(format!(
            "the device-resident model shards experts in equal blocks: {} experts on {world} ranks",
            cfg.n_experts
        )));
    }
    let dh = cfg.head_width();
    for (what, v) in [
        ("d_model", cfg.d_model),
        ("n_heads × head_dim", cfg.n_heads * dh),
        ("n_kv_heads × head_dim", cfg.kv_heads() * dh),
        ("ffn", cfg.ffn),
        ("vocab", cfg.vocab),
        ("seq_len", seq.unwrap_or(8)),
        ("head_dim", dh),
    ] {
        if v % 8 != 0 || v == 0 {
            return Err(ModelError::Config(format!(
                "the device model's GEMMs need {what} = {v} to be a positive multiple of 8"
            )));
        }
    }
    Ok(())
}

/// A vocabulary rounded up to a multiple of 8 (the LM head is a GEMM
/// dimension; Megatron pads its vocabulary the same way): unused rows are
/// never a target and learn to stay unlikely.
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(8) * 8
}

#[cfg(feature = "cuda")]
pub use imp::DeviceModel;

/// Without CUDA there is no device model: [`DeviceModel::new`] says so.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct DeviceModel<'a>(std::marker::PhantomData<&'a ()>);

#[cfg(not(feature = "cuda"))]
fn no_cuda<T>() -> Result<T, ModelError> {
    Err(ModelError::Kernel(
        kernels::KernelError::NotCompiledWithCuda,
    ))
}

#[cfg(not(feature = "cuda"))]
impl DeviceModel<'_> {
    /// Always `NotCompiledWithCuda` in this build.
    pub fn new(
        _gpu: std::sync::Arc<kernels::gpu::Gpu>,
        _comm: layer::device::DeviceComm<'_>,
        _cfg: &ModelConfig,
        _model: &Model<f32>,
        _adam: &AdamWState<f32>,
        _call: &CallConfig,
        _corpus: (&[u32], &[u32]),
    ) -> Result<Self, ModelError> {
        no_cuda()
    }
    /// See the CUDA build.
    pub fn train_step(
        &mut self,
        _starts: &[usize],
        _seq: usize,
        _micro: usize,
        _optim: &AdamWConfig,
        _lr: f64,
        _expert_bias: &[Vec<f64>],
    ) -> Result<DeviceStep, ModelError> {
        no_cuda()
    }
    /// See the CUDA build.
    pub fn set_replica_load(&mut self, _load: &[Vec<u64>]) {}
    /// See the CUDA build.
    pub fn eval_loss(
        &mut self,
        _starts: &[usize],
        _seq: usize,
        _expert_bias: &[Vec<f64>],
    ) -> Result<f64, ModelError> {
        no_cuda()
    }
    /// See the CUDA build.
    pub fn download<X: layer::Transport>(
        &self,
        _comm: &X,
    ) -> Result<(Model<f32>, AdamWState<f32>), ModelError> {
        no_cuda()
    }
}

pub use crate::block::phase;

#[cfg(feature = "cuda")]
mod imp {
    use std::cell::RefCell;
    use std::sync::Arc;

    use kernels::cpu::GemmVariant;
    use kernels::dense::AdamHp;
    use kernels::gpu::{AttnSaved, AttnShape, CudaSlice, Gpu};
    use layer::device::{DeviceComm, DeviceSaved, DeviceWeights};
    use layer::{BackwardStats, CallConfig, DevicePlanner, ExpertWeights};

    use super::{check, DeviceStep};
    use crate::block::{self, Dense, Family, Norm, Pass, QkvGrads};
    use crate::model::{Model, ModelConfig, ModelError};
    use crate::optim::{AdamWConfig, AdamWState};

    /// One parameter: f32 master and moments.
    struct Param {
        p: CudaSlice<f32>,
        m: CudaSlice<f32>,
        v: CudaSlice<f32>,
        decay: bool,
    }

    /// One transformer block's parameters and bf16 working copies.
    struct Block {
        norm1: Param,
        wq: Param,
        wk: Param,
        wv: Param,
        wo: Param,
        q_norm: Option<Param>,
        k_norm: Option<Param>,
        norm2: Param,
        router: Param,
        gate: Param,
        up: Param,
        down: Param,
        wq16: CudaSlice<u16>,
        wk16: CudaSlice<u16>,
        wv16: CudaSlice<u16>,
        wo16: CudaSlice<u16>,
        /// The MoE layer's bf16 router and experts (written by AdamW).
        moe: DeviceWeights,
    }

    /// The model on the device (this rank's share of it).
    pub struct DeviceModel<'a> {
        gpu: Arc<Gpu>,
        comm: DeviceComm<'a>,
        /// This rank, the ranks, experts per rank.
        rank: usize,
        world: usize,
        el: usize,
        cfg: ModelConfig,
        call: CallConfig,
        embed: Param,
        pos: Option<Param>,
        blocks: Vec<Block>,
        norm_f: Param,
        head: Param,
        head16: CudaSlice<u16>,
        adam_t: u64,
        train: CudaSlice<u32>,
        val: CudaSlice<u32>,
        lens: (usize, usize),
        /// Profiling (`LRMOE_PARTS=1`): an event at every part boundary of
        /// a step; the time since the previous boundary is the named
        /// part's ([`Self::tick`]).
        parts: Option<std::sync::Mutex<Vec<(&'static str, kernels::gpu::Mark)>>>,
        /// Each layer's previous routed pairs per expert, the SYMI-like
        /// replicas' input ([`Self::set_replica_load`]); empty: none.
        replica_load: Vec<Vec<u64>>,
    }

    impl std::fmt::Debug for DeviceModel<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DeviceModel")
                .field("cfg", &self.cfg)
                .field("adam_t", &self.adam_t)
                .finish()
        }
    }

    /// A parameter's gradient: f32 (embeddings, gains, the router) or bf16
    /// (the GEMMs' weight gradients).
    enum Grad {
        F32(CudaSlice<f32>),
        Bf16(CudaSlice<u16>),
    }

    /// Query and key projections before their head norms, and the norms'
    /// `1 / rms` per head row.
    struct HeadNorms {
        q: CudaSlice<u16>,
        k: CudaSlice<u16>,
        q_inv: CudaSlice<f32>,
        k_inv: CudaSlice<f32>,
    }

    /// The device model's buffers, [`crate::block`]'s family: the residual
    /// stream and norms f32, GEMM rows bf16.
    struct DevF;

    impl Family for DevF {
        type Stream = CudaSlice<f32>;
        type Rows = CudaSlice<u16>;
        type Inv = CudaSlice<f32>;
        type Attn = DevAttn;
        type Moe = DeviceSaved;
        type MoeGrads = DevMoeGrads;
        type Grad = Grad;
        type Top = DevTop;
    }

    /// What attention keeps: the raw q/k projections and their norms
    /// (with `qk_norm`), the attention kernel's saved state.
    struct DevAttn {
        qk_raw: Option<HeadNorms>,
        att: AttnSaved,
    }

    /// One MoE layer call's gradients: the router's (summed over ranks by
    /// the executor) and this rank's experts'.
    struct DevMoeGrads {
        router: CudaSlice<f32>,
        experts: layer::Experts<CudaSlice<u16>>,
    }

    /// What the head keeps: the final norm's input, `1 / rms` and output
    /// rows (bf16), and the logits' gradient.
    struct DevTop {
        x_final: CudaSlice<f32>,
        inv_f: CudaSlice<f32>,
        hf: CudaSlice<u16>,
        dlogits: CudaSlice<u16>,
    }

    /// A timed span on the device (two events).
    type Span = (kernels::gpu::Mark, kernels::gpu::Mark);

    /// What the backward returns: every parameter's gradient, each
    /// layer's figures and the MoE layers' spans.
    type Backward = (Vec<(Share, Grad)>, Vec<BackwardStats>, Vec<Span>);

    /// One forward's batch on the device: its windows' tokens and targets,
    /// each token's position (learned positions only), the group offsets
    /// of the one-group projections and of attention (one group per
    /// sequence and key/value head), and the tokens the loss is a mean over
    /// (the scale of the logits' gradient).
    struct Batch {
        n_seq: usize,
        seq: usize,
        tok: CudaSlice<u32>,
        tgt: CudaSlice<u32>,
        pos_idx: Option<CudaSlice<u32>>,
        one: CudaSlice<i32>,
        att: CudaSlice<i32>,
        shape: AttnShape,
        total_tokens: usize,
    }

    /// One pass of the model on a batch: [`crate::block`]'s device
    /// backend. The MoE calls' spans and plans and the loss sum are
    /// collected as the pass runs.
    struct Dev<'m, 'a> {
        m: &'m DeviceModel<'a>,
        b: &'m Batch,
        spans: RefCell<Vec<Span>>,
        plans: RefCell<Vec<layer::CallPlan>>,
        loss_sum: RefCell<Option<CudaSlice<f32>>>,
    }

    /// One forward's state.
    struct Forward {
        batch: Batch,
        pass: Pass<DevF>,
        loss_sum: CudaSlice<f32>,
        aux_loss: f64,
        moe_ms: Vec<Span>,
        plans: Vec<layer::CallPlan>,
    }

    /// Adds one micro-batch's gradients to the step's (f32 accumulators;
    /// one micro-batch: its gradients as they are).
    fn accumulate(
        g: &Gpu,
        acc: Option<Vec<(Share, Grad)>>,
        grads: Vec<(Share, Grad)>,
        micro: usize,
    ) -> Result<Vec<(Share, Grad)>, ModelError> {
        Ok(match acc {
            None if micro == 1 => grads,
            None => grads
                .into_iter()
                .map(|(sh, gr)| Ok((sh, Grad::F32(as_f32(g, gr)?))))
                .collect::<Result<_, ModelError>>()?,
            Some(mut a) => {
                for ((_, to), (_, gr)) in a.iter_mut().zip(grads) {
                    let add = as_f32(g, gr)?;
                    match to {
                        Grad::F32(x) => g.add_f32(x, &add, add.len()).map_err(k)?,
                        Grad::Bf16(_) => {
                            return Err(ModelError::Config("a bf16 accumulator".into()))
                        }
                    }
                }
                a
            }
        })
    }

    /// `sequences` split into `micro` equal micro-batches, or the error.
    fn check_micro(sequences: usize, micro: usize) -> Result<(), ModelError> {
        if micro == 0 || sequences % micro != 0 {
            return Err(ModelError::Batch(format!(
                "{sequences} sequences do not split into {micro} micro-batches"
            )));
        }
        Ok(())
    }

    /// The milliseconds of timed spans, summed.
    fn span_ms(v: &[Span]) -> Result<f64, ModelError> {
        v.iter().map(|(a, b)| b.ms_since(a).map_err(k)).sum()
    }

    /// The step's loss (a mean over `tokens`) and squared gradient norm,
    /// downloaded; non-finite values are an error.
    fn step_scalars(
        g: &Gpu,
        ns: &CudaSlice<f32>,
        loss_sums: &[CudaSlice<f32>],
        tokens: usize,
    ) -> Result<(f64, f32), ModelError> {
        let norm_sq = g.download(ns, 1).map_err(k)?[0];
        let mut l = 0.0f64;
        for ls in loss_sums {
            l += f64::from(g.download(ls, 1).map_err(k)?[0]);
        }
        let loss = l / tokens as f64;
        if !(loss.is_finite() && norm_sq.is_finite()) {
            return Err(ModelError::NonFinite("loss or gradient"));
        }
        Ok((loss, norm_sq))
    }

    /// One parameter and its moments, uploaded.
    fn upload_param(
        g: &Gpu,
        p: &[f32],
        m: &[f32],
        v: &[f32],
        decay: bool,
    ) -> Result<Param, ModelError> {
        Ok(Param {
            p: g.upload(p).map_err(k)?,
            m: g.upload(m).map_err(k)?,
            v: g.upload(v).map_err(k)?,
            decay,
        })
    }

    /// Block `i` of the weights and moments `[model, m, v]` on the device:
    /// the dense parameters whole, the experts in `mine` stacked, and the
    /// bf16 copies written from the masters.
    fn upload_block(
        g: &Gpu,
        comm: DeviceComm<'_>,
        moe_cfg: &layer::MoeConfig,
        [model, am, av]: [&Model<f32>; 3],
        i: usize,
        mine: std::ops::Range<usize>,
    ) -> Result<Block, ModelError> {
        let (b, bm, bv) = (&model.blocks[i], &am.blocks[i], &av.blocks[i]);
        let param = |p: &[f32], m: &[f32], v: &[f32], decay| upload_param(g, p, m, v, decay);
        let norm =
            |p: &Vec<f32>, m: &Vec<f32>, v: &Vec<f32>| -> Result<Option<Param>, ModelError> {
                if p.is_empty() {
                    Ok(None)
                } else {
                    param(p, m, v, false).map(Some)
                }
            };
        let stack = |p: &Model<f32>, sel: fn(&ExpertWeights<f32>) -> &Vec<f32>| {
            p.blocks[i].moe.experts[mine.clone()]
                .iter()
                .flat_map(|e| sel(e).iter().copied())
                .collect::<Vec<f32>>()
        };
        let experts = |sel: fn(&ExpertWeights<f32>) -> &Vec<f32>| -> Result<Param, ModelError> {
            param(&stack(model, sel), &stack(am, sel), &stack(av, sel), true)
        };
        let mut blk = Block {
            norm1: param(&b.norm1, &bm.norm1, &bv.norm1, false)?,
            wq: param(&b.wq, &bm.wq, &bv.wq, true)?,
            wk: param(&b.wk, &bm.wk, &bv.wk, true)?,
            wv: param(&b.wv, &bm.wv, &bv.wv, true)?,
            wo: param(&b.wo, &bm.wo, &bv.wo, true)?,
            q_norm: norm(&b.q_norm, &bm.q_norm, &bv.q_norm)?,
            k_norm: norm(&b.k_norm, &bm.k_norm, &bv.k_norm)?,
            norm2: param(&b.norm2, &bm.norm2, &bv.norm2, false)?,
            router: param(&b.moe.router, &bm.moe.router, &bv.moe.router, true)?,
            gate: experts(|e| &e.gate)?,
            up: experts(|e| &e.up)?,
            down: experts(|e| &e.down)?,
            wq16: g.zeros(b.wq.len()).map_err(k)?,
            wk16: g.zeros(b.wk.len()).map_err(k)?,
            wv16: g.zeros(b.wv.len()).map_err(k)?,
            wo16: g.zeros(b.wo.len()).map_err(k)?,
            moe: DeviceWeights::zeros(g, comm, moe_cfg)?,
        };
        // The bf16 copies from the masters.
        for (src, dst) in [
            (&blk.wq.p, &mut blk.wq16),
            (&blk.wk.p, &mut blk.wk16),
            (&blk.wv.p, &mut blk.wv16),
            (&blk.wo.p, &mut blk.wo16),
        ] {
            g.to_bf16_into(src, dst, src.len()).map_err(k)?;
        }
        let [r16, g16, u16_, d16] = blk.moe.buffers_mut();
        for (src, dst) in [
            (&blk.router.p, r16),
            (&blk.gate.p, g16),
            (&blk.up.p, u16_),
            (&blk.down.p, d16),
        ] {
            g.to_bf16_into(src, dst, src.len()).map_err(k)?;
        }
        Ok(blk)
    }

    /// A parameter's master (0), first (1) or second (2) moment.
    fn pick(p: &Param, which: usize) -> &CudaSlice<f32> {
        match which {
            0 => &p.p,
            1 => &p.m,
            _ => &p.v,
        }
    }

    /// A gradient as f32 (bf16 widened on the device).
    fn as_f32(g: &Gpu, gr: Grad) -> Result<CudaSlice<f32>, ModelError> {
        match gr {
            Grad::F32(x) => Ok(x),
            Grad::Bf16(x) => g.to_f32_dev(&x, x.len()).map_err(k),
        }
    }

    /// The attention shape of a batch of `n_seq` windows of `seq` tokens.
    fn attn_shape(cfg: &ModelConfig, n_seq: usize, seq: usize) -> AttnShape {
        AttnShape {
            n_seq,
            seq,
            heads: cfg.n_heads,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_width(),
            theta: cfg.rope_theta.unwrap_or(0.0) as f32,
        }
    }

    fn k(e: kernels::KernelError) -> ModelError {
        ModelError::Kernel(e)
    }

    /// Which gradients are summed over ranks and counted once in the norm.
    #[derive(Clone, Copy, PartialEq)]
    enum Share {
        /// Replicated dense weights: summed over ranks here.
        Dense,
        /// The router: replicated, its gradient summed by the executor.
        Router,
        /// This rank's experts: local.
        Expert,
    }

    impl<'a> DeviceModel<'a> {
        /// Uploads `model` and its optimizer state (f32; this rank's block
        /// of experts) and both corpora; `comm` reaches the other ranks
        /// (`DeviceComm::Local` on one GPU).
        pub fn new(
            gpu: Arc<Gpu>,
            comm: DeviceComm<'a>,
            cfg: &ModelConfig,
            model: &Model<f32>,
            adam: &AdamWState<f32>,
            call: &CallConfig,
            (train, val): (&[u32], &[u32]),
        ) -> Result<Self, ModelError> {
            let (rank, world) = (comm.rank(), comm.world_size());
            check(cfg, None, world)?;
            let el = cfg.n_experts / world;
            layer::check_device_call(call)?;
            layer::check_device_shape(&cfg.moe())?;
            let g = &*gpu;
            let param =
                |p: &[f32], m: &[f32], v: &[f32], decay: bool| upload_param(g, p, m, v, decay);
            let (am, av) = (&adam.m, &adam.v);
            let moe_cfg = cfg.moe();
            // The forced hot-expert workload's router logit bias, the same
            // for every layer.
            let logit_bias: Option<Vec<f32>> = call
                .logit_bias(cfg.n_experts)?
                .map(|b| b.iter().map(|&x| x as f32).collect());
            let mut blocks = Vec::with_capacity(cfg.n_layers);
            for i in 0..model.blocks.len() {
                let mut blk = upload_block(
                    g,
                    comm,
                    &moe_cfg,
                    [model, am, av],
                    i,
                    rank * el..(rank + 1) * el,
                )?;
                if let Some(b32) = &logit_bias {
                    layer::device::set_logit_bias(g, &moe_cfg, &mut blk.moe, b32)?;
                }
                blocks.push(blk);
            }
            let head = param(&model.head, &am.head, &av.head, true)?;
            let mut head16 = g.zeros::<u16>(model.head.len()).map_err(k)?;
            g.to_bf16_into(&head.p, &mut head16, model.head.len())
                .map_err(k)?;
            Ok(Self {
                embed: param(&model.embed, &am.embed, &av.embed, false)?,
                pos: if model.pos.is_empty() {
                    None
                } else {
                    Some(param(&model.pos, &am.pos, &av.pos, false)?)
                },
                blocks,
                norm_f: param(&model.norm_f, &am.norm_f, &av.norm_f, false)?,
                head,
                head16,
                adam_t: adam.t,
                train: g.upload(train).map_err(k)?,
                val: g.upload(val).map_err(k)?,
                lens: (train.len(), val.len()),
                parts: (std::env::var("LRMOE_PARTS").as_deref() == Ok("1"))
                    .then(|| std::sync::Mutex::new(Vec::new())),
                replica_load: Vec::new(),
                cfg: *cfg,
                call: call.clone(),
                gpu,
                comm,
                rank,
                world,
                el,
            })
        }

        /// The weights and optimizer state, on the host (checkpoints): a
        /// collective over `comm` (the same ranks), every rank gets every
        /// expert.
        pub fn download<X: layer::Transport>(
            &self,
            comm: &X,
        ) -> Result<(Model<f32>, AdamWState<f32>), ModelError> {
            let g = &*self.gpu;
            let cfg = &self.cfg;
            let mut out = [
                Model::<f32>::zeros(cfg),
                Model::zeros(cfg),
                Model::zeros(cfg),
            ];
            let dl = |x: &CudaSlice<f32>, n: usize| g.download(x, n).map_err(k);
            let (h, f) = (cfg.d_model, cfg.ffn);
            for (which, model) in out.iter_mut().enumerate() {
                let pick = |p| pick(p, which);
                let n = model.embed.len();
                model.embed = dl(pick(&self.embed), n)?;
                if let Some(pos) = &self.pos {
                    let n = model.pos.len();
                    model.pos = dl(pick(pos), n)?;
                }
                for (mb, b) in model.blocks.iter_mut().zip(&self.blocks) {
                    for (dst, src) in [
                        (&mut mb.norm1, &b.norm1),
                        (&mut mb.wq, &b.wq),
                        (&mut mb.wk, &b.wk),
                        (&mut mb.wv, &b.wv),
                        (&mut mb.wo, &b.wo),
                        (&mut mb.norm2, &b.norm2),
                        (&mut mb.moe.router, &b.router),
                    ] {
                        let n = dst.len();
                        *dst = dl(pick(src), n)?;
                    }
                    for (dst, src) in [(&mut mb.q_norm, &b.q_norm), (&mut mb.k_norm, &b.k_norm)] {
                        if let Some(src) = src {
                            let n = dst.len();
                            *dst = dl(pick(src), n)?;
                        }
                    }
                    let el = self.el;
                    let mine: Vec<f32> = [
                        dl(pick(&b.gate), el * h * f)?,
                        dl(pick(&b.up), el * h * f)?,
                        dl(pick(&b.down), el * f * h)?,
                    ]
                    .concat();
                    let all = layer::transport::all_gather(comm, &mine)?;
                    let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
                    for owner in &all {
                        let (a, rest) = owner.split_at(el * h * f);
                        let (b_, c) = rest.split_at(el * h * f);
                        gate.extend_from_slice(a);
                        up.extend_from_slice(b_);
                        down.extend_from_slice(c);
                    }
                    for (i, ex) in mb.moe.experts.iter_mut().enumerate() {
                        ex.gate = gate[i * h * f..(i + 1) * h * f].to_vec();
                        ex.up = up[i * h * f..(i + 1) * h * f].to_vec();
                        ex.down = down[i * f * h..(i + 1) * f * h].to_vec();
                    }
                }
                let n = model.norm_f.len();
                model.norm_f = dl(pick(&self.norm_f), n)?;
                let n = model.head.len();
                model.head = dl(pick(&self.head), n)?;
            }
            let [p, m, v] = out;
            Ok((
                p,
                AdamWState {
                    m,
                    v,
                    t: self.adam_t,
                },
            ))
        }

        fn starts(
            &self,
            starts: &[usize],
            seq: usize,
            val: bool,
        ) -> Result<CudaSlice<u32>, ModelError> {
            let len = if val { self.lens.1 } else { self.lens.0 };
            let s: Vec<u32> = starts
                .iter()
                .map(|&s| {
                    if s + seq < len {
                        u32::try_from(s)
                            .map_err(|_| ModelError::Batch(format!("window start {s} beyond u32")))
                    } else {
                        Err(ModelError::Batch(format!(
                            "window {s}..{} outside the corpus of {len}",
                            s + seq + 1
                        )))
                    }
                })
                .collect::<Result<_, _>>()?;
            self.gpu.upload(&s).map_err(k)
        }

        fn set_bias(&mut self, expert_bias: &[Vec<f64>]) -> Result<(), ModelError> {
            let moe_cfg = self.cfg.moe();
            for (b, bias) in self.blocks.iter_mut().zip(expert_bias) {
                if bias.is_empty() {
                    continue;
                }
                let call = CallConfig {
                    expert_bias: bias.clone(),
                    ..self.call.clone()
                };
                if let Some(sb) = call.selection_bias(self.cfg.n_experts)? {
                    let v: Vec<f32> = sb.iter().map(|&x| x as f32).collect();
                    layer::device::set_selection_bias(&self.gpu, &moe_cfg, &mut b.moe, &v)?;
                }
            }
            Ok(())
        }

        /// Each layer's previous routed pairs per expert (all ranks): the
        /// SYMI-like replicas of the next step's calls; empty: none (the
        /// trainer sets it in its SYMI-like mode only).
        pub fn set_replica_load(&mut self, load: &[Vec<u64>]) {
            self.replica_load = load.to_vec();
        }

        /// Layer `li`'s call: this model's, with the layer's previous load
        /// as the SYMI-like replicas' input where it has one.
        fn layer_call(&self, li: usize) -> CallConfig {
            CallConfig {
                replica_load: self.replica_load.get(li).filter(|l| !l.is_empty()).cloned(),
                ..self.call.clone()
            }
        }

        /// Profiling: the work queued since the previous boundary belongs
        /// to part `name` (no-op unless `LRMOE_PARTS=1`).
        fn tick(&self, name: &'static str) -> Result<(), ModelError> {
            if let Some(parts) = &self.parts {
                let mark = self.gpu.mark().map_err(k)?;
                let mut parts = parts.lock().unwrap_or_else(|p| p.into_inner());
                if name == "start" {
                    // A step's first boundary: what came before (evaluations) is not the step's.
                    parts.clear();
                }
                parts.push((name, mark));
            }
            Ok(())
        }

        /// Profiling: the step's milliseconds per part (in first-seen
        /// order), logged; the boundaries are cleared.
        fn report_parts(&self) -> Result<(), ModelError> {
            let Some(parts) = &self.parts else {
                return Ok(());
            };
            let marks = std::mem::take(&mut *parts.lock().unwrap_or_else(|p| p.into_inner()));
            let mut ms: Vec<(&str, f64)> = Vec::new();
            for w in marks.windows(2) {
                let t = w[1].1.ms_since(&w[0].1).map_err(k)?;
                match ms.iter_mut().find(|(n, _)| *n == w[1].0) {
                    Some((_, v)) => *v += t,
                    None => ms.push((w[1].0, t)),
                }
            }
            let json: serde_json::Map<String, serde_json::Value> = ms
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.into()))
                .collect();
            tracing::info!(parts_ms = %serde_json::Value::Object(json), "device step by part");
            Ok(())
        }

        /// The windows at `starts` (of the training corpus, or the
        /// validation one) on the device, with their positions and group
        /// offsets; `total_tokens`: the tokens the loss is a mean over
        /// (this forward's, over every rank and micro-batch of the step).
        fn batch(
            &self,
            starts: &[usize],
            seq: usize,
            val: bool,
            total_tokens: usize,
        ) -> Result<Batch, ModelError> {
            let g = &*self.gpu;
            let cfg = &self.cfg;
            check(cfg, Some(seq), 1)?;
            if seq > cfg.max_seq {
                return Err(ModelError::Batch(format!(
                    "sequences of {seq} exceed the model's {}",
                    cfg.max_seq
                )));
            }
            let n_seq = starts.len();
            let n = n_seq * seq;
            let corpus = if val { &self.val } else { &self.train };
            let st = self.starts(starts, seq, val)?;
            // SAFETY: every window lies inside the corpus (checked above).
            let (tok, tgt) = unsafe { g.batch_windows(corpus, &st, n_seq, seq) }.map_err(k)?;
            let pos_idx = match &self.pos {
                Some(_) => {
                    let p: Vec<u32> = (0..n).map(|i| (i % seq) as u32).collect();
                    Some(g.upload(&p).map_err(k)?)
                }
                None => None,
            };
            let one = g.even_offsets(1, n).map_err(k)?;
            let shape = attn_shape(cfg, n_seq, seq);
            let att = g
                .even_offsets(shape.groups(), shape.rows_each())
                .map_err(k)?;
            Ok(Batch {
                n_seq,
                seq,
                tok,
                tgt,
                pos_idx,
                one,
                att,
                shape,
                total_tokens,
            })
        }

        /// This model on `b` as [`crate::block`]'s backend.
        fn backend<'m>(&'m self, b: &'m Batch) -> Dev<'m, 'a> {
            Dev {
                m: self,
                b,
                spans: RefCell::new(Vec::new()),
                plans: RefCell::new(Vec::new()),
                loss_sum: RefCell::new(None),
            }
        }

        /// The forward on the windows at `starts` (see [`Self::batch`]),
        /// through the loss and its logits' gradient: [`crate::block`]'s
        /// pass.
        fn forward(
            &self,
            starts: &[usize],
            seq: usize,
            val: bool,
            total_tokens: usize,
        ) -> Result<Forward, ModelError> {
            let batch = self.batch(starts, seq, val, total_tokens)?;
            let dev = self.backend(&batch);
            let pass = block::forward(&dev)?;
            let aux_loss = pass.blocks.iter().map(|s| s.moe.aux_loss).sum();
            let loss_sum = dev
                .loss_sum
                .take()
                .ok_or(ModelError::Config("the forward kept no loss".into()))?;
            let (moe_ms, plans) = (dev.spans.take(), dev.plans.take());
            drop(dev);
            Ok(Forward {
                batch,
                pass,
                loss_sum,
                aux_loss,
                moe_ms,
                plans,
            })
        }

        /// Mean validation loss of the windows at `starts` (of the
        /// validation corpus).
        pub fn eval_loss(
            &mut self,
            starts: &[usize],
            seq: usize,
            expert_bias: &[Vec<f64>],
        ) -> Result<f64, ModelError> {
            self.set_bias(expert_bias)?;
            let f = self.forward(starts, seq, true, starts.len() * seq * self.world)?;
            let l = self.gpu.download(&f.loss_sum, 1).map_err(k)?[0];
            let loss = f64::from(l) / (starts.len() * seq) as f64;
            if !loss.is_finite() {
                return Err(ModelError::NonFinite("loss"));
            }
            Ok(loss)
        }

        /// The backward of `pass` on `batch`: every parameter's gradient,
        /// in the order of [`Self::params`]. Each block's state is released
        /// once its backward has read it (the MoE layer's forward rows as
        /// soon as the kept ones are gathered), as autograd frees saved
        /// tensors.
        fn backward(&self, batch: &Batch, pass: Pass<DevF>) -> Result<Backward, ModelError> {
            let dev = self.backend(batch);
            let mut pg = block::backward(&dev, pass)?;
            let stats = std::mem::take(&mut pg.stats);
            let mut grads = vec![(Share::Dense, pg.embed)];
            grads.extend(pg.pos.map(|p| (Share::Dense, p)));
            for b in pg.blocks {
                let q = b.qkv;
                grads.extend([b.norm1, q.wq, q.wk, q.wv, b.wo].map(|x| (Share::Dense, x)));
                if let Some((qn, kn)) = q.head_norms {
                    grads.extend([(Share::Dense, qn), (Share::Dense, kn)]);
                }
                grads.extend([
                    (Share::Dense, b.norm2),
                    (Share::Router, Grad::F32(b.moe.router)),
                    (Share::Expert, Grad::Bf16(b.moe.experts.gate)),
                    (Share::Expert, Grad::Bf16(b.moe.experts.up)),
                    (Share::Expert, Grad::Bf16(b.moe.experts.down)),
                ]);
            }
            grads.extend([(Share::Dense, pg.norm_f), (Share::Dense, pg.head)]);
            Ok((grads, stats, dev.spans.take()))
        }

        /// The replicated dense weights' gradients summed over the ranks
        /// (as f32); the router's (summed by the executor) and this rank's
        /// experts' as they are. One rank: unchanged.
        fn sum_dense(&self, grads: Vec<(Share, Grad)>) -> Result<Vec<(Share, Grad)>, ModelError> {
            if self.world == 1 {
                return Ok(grads);
            }
            let g = &*self.gpu;
            let mut dense = Vec::new();
            let mut rest = Vec::with_capacity(grads.len());
            for (share, gr) in grads {
                match (share, gr) {
                    (Share::Dense, Grad::F32(x)) => {
                        rest.push(None);
                        dense.push(x);
                    }
                    (Share::Dense, Grad::Bf16(x)) => {
                        rest.push(None);
                        dense.push(g.to_f32_dev(&x, x.len()).map_err(k)?);
                    }
                    other => rest.push(Some(other)),
                }
            }
            let mut summed = layer::device::sum_over_ranks(g, self.comm, dense)?.into_iter();
            rest.into_iter()
                .map(|r| match r {
                    Some(x) => Ok(x),
                    None => summed
                        .next()
                        .map(|x| (Share::Dense, Grad::F32(x)))
                        .ok_or(ModelError::Config("a summed gradient went missing".into())),
                })
                .collect()
        }

        /// Every parameter with the bf16 copy AdamW writes (if any), in
        /// the order of the backward's gradients.
        fn params(&mut self) -> Vec<(&mut Param, Option<&mut CudaSlice<u16>>)> {
            let mut v: Vec<(&mut Param, Option<&mut CudaSlice<u16>>)> =
                vec![(&mut self.embed, None)];
            if let Some(p) = &mut self.pos {
                v.push((p, None));
            }
            for b in &mut self.blocks {
                let Block {
                    norm1,
                    wq,
                    wk,
                    wv,
                    wo,
                    q_norm,
                    k_norm,
                    norm2,
                    router,
                    gate,
                    up,
                    down,
                    wq16,
                    wk16,
                    wv16,
                    wo16,
                    moe,
                } = b;
                v.push((norm1, None));
                v.push((wq, Some(wq16)));
                v.push((wk, Some(wk16)));
                v.push((wv, Some(wv16)));
                v.push((wo, Some(wo16)));
                if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                    v.push((qn, None));
                    v.push((kn, None));
                }
                v.push((norm2, None));
                let [r16, g16, u16_, d16] = moe.buffers_mut();
                v.push((router, Some(r16)));
                v.push((gate, Some(g16)));
                v.push((up, Some(u16_)));
                v.push((down, Some(d16)));
            }
            v.push((&mut self.norm_f, None));
            v.push((&mut self.head, Some(&mut self.head16)));
            v
        }

        /// The squared global norm of the step's gradients, on the device:
        /// replicated gradients (identical on every rank) counted by rank 0
        /// only, each rank's experts by it; summed over the ranks.
        fn norm_sq(&self, grads: &[(Share, Grad)]) -> Result<CudaSlice<f32>, ModelError> {
            let g = &*self.gpu;
            let mut ns = g.zeros::<f32>(1).map_err(k)?;
            for (share, gr) in grads {
                if *share != Share::Expert && self.rank != 0 {
                    continue;
                }
                match gr {
                    Grad::F32(x) => g.sq_sum_into(x, x.len(), &mut ns),
                    Grad::Bf16(x) => g.sq_sum_into(x, x.len(), &mut ns),
                }
                .map_err(k)?;
            }
            if self.world > 1 {
                ns = layer::device::sum_over_ranks(g, self.comm, vec![ns])?
                    .pop()
                    .ok_or(ModelError::Config("the norm's sum went missing".into()))?;
            }
            Ok(ns)
        }

        /// AdamW at `lr` on every parameter with its gradient (clipped by
        /// the global norm `ns`), the bf16 copies rewritten.
        fn adamw(
            &mut self,
            grads: &[(Share, Grad)],
            optim: &AdamWConfig,
            lr: f64,
            ns: &CudaSlice<f32>,
        ) -> Result<(), ModelError> {
            let g = self.gpu.clone();
            self.adam_t += 1;
            let t = self.adam_t as i32;
            let base = AdamHp {
                lr: lr as f32,
                beta1: optim.beta1 as f32,
                beta2: optim.beta2 as f32,
                eps: optim.eps as f32,
                weight_decay: 0.0,
                bc1: (1.0 - optim.beta1.powi(t)) as f32,
                bc2: (1.0 - optim.beta2.powi(t)) as f32,
                clip: optim.clip as f32,
            };
            let params = self.params();
            if params.len() != grads.len() {
                return Err(ModelError::Config(format!(
                    "{} parameters but {} gradients",
                    params.len(),
                    grads.len()
                )));
            }
            for ((p, copy), (_, gr)) in params.into_iter().zip(grads) {
                let hp = AdamHp {
                    weight_decay: if p.decay {
                        optim.weight_decay as f32
                    } else {
                        0.0
                    },
                    ..base
                };
                match gr {
                    Grad::F32(x) => g.adamw(&mut p.p, &mut p.m, &mut p.v, x, copy, &hp, ns),
                    Grad::Bf16(x) => g.adamw(&mut p.p, &mut p.m, &mut p.v, x, copy, &hp, ns),
                }
                .map_err(k)?;
            }
            Ok(())
        }

        /// One training step on the windows at `starts` of the training
        /// corpus: forward, backward, clip and AdamW at `lr`.
        #[allow(clippy::too_many_arguments)]
        pub fn train_step(
            &mut self,
            starts: &[usize],
            seq: usize,
            micro: usize,
            optim: &AdamWConfig,
            lr: f64,
            expert_bias: &[Vec<f64>],
        ) -> Result<DeviceStep, ModelError> {
            check_micro(starts.len(), micro)?;
            self.set_bias(expert_bias)?;
            let g = self.gpu.clone();
            let chunk = starts.len() / micro;
            let total = starts.len() * seq * self.world;
            // Micro-batches: each one's forward and backward, the gradients
            // accumulated in f32 (their sum is the step's: every logits
            // gradient is scaled by the step's token count).
            let mut acc: Option<Vec<(Share, Grad)>> = None;
            let (mut fwd_ms, mut bwd_ms_all, mut dense_ms) = (Vec::new(), Vec::new(), [0.0f64; 2]);
            let mut stats = Vec::with_capacity(micro);
            let mut plans = Vec::new();
            let mut loss_sums = Vec::with_capacity(micro);
            let mut aux_loss = 0.0;
            self.tick("start")?;
            for i in 0..micro {
                let m0 = g.mark().map_err(k)?;
                let f = self.forward(&starts[i * chunk..(i + 1) * chunk], seq, false, total)?;
                let m1 = g.mark().map_err(k)?;
                let (grads, st, bwd_ms) = self.backward(&f.batch, f.pass)?;
                let m2 = g.mark().map_err(k)?;
                acc = Some(accumulate(&g, acc, grads, micro)?);
                self.tick("micro-batch accumulation")?;
                dense_ms[0] += m1.ms_since(&m0).map_err(k)? - span_ms(&f.moe_ms)?;
                dense_ms[1] += m2.ms_since(&m1).map_err(k)? - span_ms(&bwd_ms)?;
                fwd_ms.extend(f.moe_ms);
                bwd_ms_all.extend(bwd_ms);
                stats.push(st);
                if i == 0 {
                    plans = f.plans;
                }
                aux_loss += f.aux_loss / micro as f64;
                loss_sums.push(f.loss_sum);
            }
            self.comm.phase(super::phase::GRADIENT_SUMS)?;
            let grads = self.sum_dense(acc.unwrap_or_default())?;
            self.tick("gradient sums")?;
            let bwd_ms = bwd_ms_all;
            let m2 = g.mark().map_err(k)?;
            let ns = self.norm_sq(&grads)?;
            self.tick("gradient norm")?;
            self.comm.phase(super::phase::OPTIMIZER)?;
            self.adamw(&grads, optim, lr, &ns)?;
            self.tick("adamw")?;
            let m3 = g.mark().map_err(k)?;
            // The step's scalars (the one synchronisation of the step; the
            // sums over ranks first, with the communicator's deadline).
            layer::device::settle(self.comm)?;
            let (loss, norm_sq) = step_scalars(&g, &ns, &loss_sums, starts.len() * seq)?;
            self.report_parts()?;
            let (moe_f, moe_b) = (span_ms(&fwd_ms)?, span_ms(&bwd_ms)?);
            let split_ms = [
                dense_ms[0],
                moe_f,
                dense_ms[1],
                moe_b,
                m3.ms_since(&m2).map_err(k)?,
            ];
            Ok(DeviceStep {
                loss,
                aux_loss,
                grad_norm: f64::from(norm_sq).sqrt(),
                moe_seconds: (moe_f + moe_b) / 1e3,
                split_ms,
                device_bytes: g.used_bytes().map_err(k)?,
                plans,
                stats,
            })
        }

        /// This rank's loss and the gradients of one batch (this rank's
        /// windows), on the host (f32, in the CPU model's shapes; the
        /// dense ones summed over the ranks, the experts this rank's only,
        /// others zero), without an update: the device tests hold them to
        /// the CPU model's.
        pub fn loss_and_grads(
            &mut self,
            starts: &[usize],
            seq: usize,
        ) -> Result<(f64, Model<f32>), ModelError> {
            let f = self.forward(starts, seq, false, starts.len() * seq * self.world)?;
            let (grads, _, _) = self.backward(&f.batch, f.pass)?;
            let grads = self.sum_dense(grads)?;
            layer::device::settle(self.comm)?;
            let g = self.gpu.clone();
            let host: Vec<Vec<f32>> = grads
                .iter()
                .map(|(_, gr)| match gr {
                    Grad::F32(x) => g.download(x, x.len()),
                    Grad::Bf16(x) => g
                        .download(x, x.len())
                        .map(|v| v.into_iter().map(kernels::cpu::bf16_bits_to_f32).collect()),
                })
                .collect::<Result<_, _>>()
                .map_err(k)?;
            let cfg = self.cfg;
            let (h, ff) = (cfg.d_model, cfg.ffn);
            let mut m = Model::<f32>::zeros(&cfg);
            let mut it = host.into_iter();
            let mut next = |len: usize| -> Result<Vec<f32>, ModelError> {
                let v = it
                    .next()
                    .ok_or(ModelError::Config("missing gradient".into()))?;
                Ok(v[..len].to_vec())
            };
            m.embed = next(m.embed.len())?;
            if self.pos.is_some() {
                m.pos = next(m.pos.len())?;
            }
            for b in &mut m.blocks {
                b.norm1 = next(b.norm1.len())?;
                b.wq = next(b.wq.len())?;
                b.wk = next(b.wk.len())?;
                b.wv = next(b.wv.len())?;
                b.wo = next(b.wo.len())?;
                if cfg.qk_norm {
                    b.q_norm = next(b.q_norm.len())?;
                    b.k_norm = next(b.k_norm.len())?;
                }
                b.norm2 = next(b.norm2.len())?;
                b.moe.router = next(b.moe.router.len())?;
                let el = self.el;
                let (gate, up, down) = (next(el * h * ff)?, next(el * h * ff)?, next(el * ff * h)?);
                let own = &mut b.moe.experts[self.rank * el..(self.rank + 1) * el];
                for (i, ex) in own.iter_mut().enumerate() {
                    ex.gate = gate[i * h * ff..(i + 1) * h * ff].to_vec();
                    ex.up = up[i * h * ff..(i + 1) * h * ff].to_vec();
                    ex.down = down[i * ff * h..(i + 1) * ff * h].to_vec();
                }
            }
            m.norm_f = next(m.norm_f.len())?;
            m.head = next(m.head.len())?;
            let l = g.download(&f.loss_sum, 1).map_err(k)?[0];
            Ok((f64::from(l) / (starts.len() * seq) as f64, m))
        }
    }

    impl Dev<'_, '_> {
        /// Rows in the batch.
        fn n(&self) -> usize {
            self.b.n_seq * self.b.seq
        }

        /// One-group GEMM over the batch's rows.
        fn gemm(
            &self,
            v: GemmVariant,
            (x, w): (&CudaSlice<u16>, &CudaSlice<u16>),
            (kd, nd): (usize, usize),
        ) -> Result<CudaSlice<u16>, ModelError> {
            let n = self.n();
            self.m
                .gpu
                .gemm_dev(v, &self.b.one, 1, n, x, w, kd, nd)
                .map_err(k)
        }
    }

    impl Dense for Dev<'_, '_> {
        type F = DevF;
        type Error = ModelError;

        fn n_layers(&self) -> usize {
            self.m.blocks.len()
        }

        fn phase(&self, name: &'static str) -> Result<(), ModelError> {
            Ok(self.m.comm.phase(name)?)
        }

        fn tick(&self, name: &'static str) -> Result<(), ModelError> {
            self.m.tick(name)
        }

        fn embed(&self) -> Result<CudaSlice<f32>, ModelError> {
            let (g, b, d) = (&*self.m.gpu, self.b, self.m.cfg.d_model);
            let n = self.n();
            // SAFETY: corpus tokens are below the corpus vocabulary, which
            // the model's vocabulary covers (TrainConfig::model_config).
            let mut x = unsafe { g.embed(&self.m.embed.p, &b.tok, n, d) }.map_err(k)?;
            if let (Some(pos), Some(pd)) = (&self.m.pos, &b.pos_idx) {
                // SAFETY: positions are below seq ≤ max_seq, the table's rows.
                unsafe { g.embed_add(&pos.p, pd, &mut x, n, d) }.map_err(k)?;
            }
            Ok(x)
        }

        fn copy(&self, x: &CudaSlice<f32>) -> Result<CudaSlice<f32>, ModelError> {
            self.m.gpu.duplicate(x).map_err(k)
        }

        fn norm(
            &self,
            li: usize,
            which: Norm,
            x: &CudaSlice<f32>,
        ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), ModelError> {
            let eps = self.m.cfg.eps() as f32;
            let w = gain(&self.m.blocks[li], which);
            self.m.gpu.rmsnorm(x, w, self.n(), eps).map_err(k)
        }

        fn norm_keeping(
            &self,
            li: usize,
            which: Norm,
            x: &CudaSlice<f32>,
        ) -> Result<kernels::gpu::NormKeeping, ModelError> {
            let eps = self.m.cfg.eps() as f32;
            let w = gain(&self.m.blocks[li], which);
            self.m.gpu.rmsnorm_keeping(x, w, self.n(), eps).map_err(k)
        }

        fn attention(
            &self,
            li: usize,
            a: &CudaSlice<u16>,
        ) -> Result<(DevAttn, CudaSlice<u16>), ModelError> {
            let (g, cfg, blk) = (&*self.m.gpu, &self.m.cfg, &self.m.blocks[li]);
            let n = self.n();
            let (d, h, kv, dh) = (cfg.d_model, cfg.n_heads, cfg.kv_heads(), cfg.head_width());
            let (qd, kd, eps) = (h * dh, kv * dh, cfg.eps() as f32);
            let proj = |w: &CudaSlice<u16>, width: usize| {
                self.gemm(GemmVariant::Forward, (a, w), (d, width))
            };
            let (mut qt, mut kt) = (proj(&blk.wq16, qd)?, proj(&blk.wk16, kd)?);
            let vt = proj(&blk.wv16, kd)?;
            let mut qk_raw = None;
            if let (Some(qn), Some(kn)) = (&blk.q_norm, &blk.k_norm) {
                let (qo, q_inv) = g.rmsnorm_bf16(&qt, &qn.p, n * h, eps).map_err(k)?;
                let (ko, k_inv) = g.rmsnorm_bf16(&kt, &kn.p, n * kv, eps).map_err(k)?;
                qk_raw = Some(HeadNorms {
                    q: std::mem::replace(&mut qt, qo),
                    k: std::mem::replace(&mut kt, ko),
                    q_inv,
                    k_inv,
                });
            }
            self.tick("qkv projections")?;
            let (attn, att) = g
                .attention_forward(self.b.shape, &self.b.att, (&qt, &kt, &vt))
                .map_err(k)?;
            self.tick("attention")?;
            Ok((DevAttn { qk_raw, att }, attn))
        }

        fn out_project(
            &self,
            li: usize,
            attn: &CudaSlice<u16>,
            x: &mut CudaSlice<f32>,
        ) -> Result<(), ModelError> {
            let cfg = &self.m.cfg;
            let (d, qd) = (cfg.d_model, cfg.n_heads * cfg.head_width());
            let wo = &self.m.blocks[li].wo16;
            let o = self.gemm(GemmVariant::Forward, (attn, wo), (qd, d))?;
            self.m.gpu.add_into(x, &o, self.n() * d).map_err(k)
        }

        fn moe_forward(
            &self,
            li: usize,
            m: &CudaSlice<u16>,
            x: &mut CudaSlice<f32>,
        ) -> Result<DeviceSaved, ModelError> {
            let (g, comm) = (&*self.m.gpu, self.m.comm);
            let call = self.m.layer_call(li);
            let moe_cfg = self.m.cfg.moe();
            let planner = DevicePlanner::new(moe_cfg, call.clone())?;
            comm.phase(super::phase::MOE_FORWARD)?;
            let t0 = g.mark().map_err(k)?;
            let blk = &self.m.blocks[li];
            let sv = layer::device::forward(g, comm, &moe_cfg, &blk.moe, m, &planner)?;
            let t1 = g.mark().map_err(k)?;
            comm.phase(super::phase::DENSE_FORWARD)?;
            let plan = match planner.take_last_plan() {
                Some(p) => p,
                None => layer::device_plan_call(&moe_cfg, &call, sv.routed_counts())?,
            };
            g.add_into(x, &sv.y, self.n() * self.m.cfg.d_model)
                .map_err(k)?;
            self.spans.borrow_mut().push((t0, t1));
            self.plans.borrow_mut().push(plan);
            Ok(sv)
        }

        fn head_loss(&self, x: CudaSlice<f32>) -> Result<DevTop, ModelError> {
            let (g, m) = (&*self.m.gpu, self.m);
            let (d, vocab, eps) = (m.cfg.d_model, m.cfg.vocab, m.cfg.eps() as f32);
            let n = self.n();
            let (hf, inv_f) = g.rmsnorm(&x, &m.norm_f.p, n, eps).map_err(k)?;
            self.tick("norms")?;
            let logits = self.gemm(GemmVariant::Forward, (&hf, &m.head16), (d, vocab))?;
            self.tick("lm head")?;
            let mut loss_sum = g.zeros::<f32>(1).map_err(k)?;
            let scale = 1.0 / self.b.total_tokens.max(1) as f32;
            // SAFETY: targets are corpus tokens, below the vocabulary.
            let dlogits =
                unsafe { g.cross_entropy(&logits, &self.b.tgt, &mut loss_sum, (n, vocab), scale) }
                    .map_err(k)?;
            self.tick("cross-entropy")?;
            *self.loss_sum.borrow_mut() = Some(loss_sum);
            Ok(DevTop {
                x_final: x,
                inv_f,
                hf,
                dlogits,
            })
        }

        fn head_backward(&self, top: DevTop) -> Result<(CudaSlice<f32>, Grad, Grad), ModelError> {
            let (g, m) = (&*self.m.gpu, self.m);
            let n = self.n();
            let (d, vocab) = (m.cfg.d_model, m.cfg.vocab);
            let d_head = self.gemm(GemmVariant::WeightGrad, (&top.hf, &top.dlogits), (d, vocab))?;
            let dhf = self.gemm(GemmVariant::DataGrad, (&top.dlogits, &m.head16), (d, vocab))?;
            self.tick("lm head backward")?;
            let mut dx = g.zeros::<f32>(n * d).map_err(k)?;
            let mut d_norm_f = g.zeros::<f32>(d).map_err(k)?;
            g.rmsnorm_backward(
                &top.x_final,
                &m.norm_f.p,
                &top.inv_f,
                &dhf,
                &mut dx,
                &mut d_norm_f,
                n,
            )
            .map_err(k)?;
            self.tick("norms backward")?;
            Ok((dx, Grad::F32(d_norm_f), Grad::Bf16(d_head)))
        }

        fn moe_backward(
            &self,
            li: usize,
            mut sv: DeviceSaved,
            dx: &CudaSlice<f32>,
        ) -> Result<(CudaSlice<u16>, DevMoeGrads, BackwardStats), ModelError> {
            let (g, m) = (&*self.m.gpu, self.m);
            let (n, d) = (self.n(), m.cfg.d_model);
            let dxb = g.to_bf16(dx, n * d).map_err(k)?;
            let planner = DevicePlanner::new(m.cfg.moe(), m.call.clone())?;
            // One rank per GPU: the pool's peak during the call is this
            // layer's backward (ranks staged through one GPU share the
            // pool, so they report the kept rows instead, below).
            let pool_base = match m.comm {
                layer::device::DeviceComm::Staged(_) => None,
                _ => Some(g.pool_reset_peak().map_err(k)?),
            };
            m.comm.phase(super::phase::MOE_BACKWARD)?;
            let t0 = g.mark().map_err(k)?;
            let blk = &m.blocks[li];
            let mg =
                layer::device::backward_releasing(g, m.comm, &blk.moe, &mut sv, &dxb, &planner)?;
            let t1 = g.mark().map_err(k)?;
            m.comm.phase(super::phase::DENSE_BACKWARD)?;
            let pool_peak = pool_base
                .map(|base| g.pool_peak_bytes().map(|p| p.saturating_sub(base)))
                .transpose()
                .map_err(k)?;
            self.spans.borrow_mut().push((t0, t1));
            let st = BackwardStats {
                expert_load: sv.expert_load(),
                routed_pairs: n * m.cfg.top_k,
                kept_pairs: mg.kept_pairs,
                kept: vec![],
                scores: vec![],
                pairs_per_rank: vec![mg.kept_pairs as u64],
                // The most device memory the backward call held above
                // what was in use when it started (its pool's peak);
                // staged ranks: the kept `[x | g·δ]` bf16 rows, the
                // controller's unit.
                buffer_bytes: pool_peak.unwrap_or((mg.kept_pairs * 2 * d * 2) as u64),
                // The forward's rows on this rank's instances, in and out,
                // bf16 (the same unit as the staged ranks' backward rows).
                forward_buffer_bytes: (mg.forward_rows * 2 * d * 2) as u64,
                forward_rows: mg.forward_rows,
                bytes_sent: mg.bytes_sent as u64,
                times: layer::StageTimes::default(),
            };
            let grads = DevMoeGrads {
                router: mg.router,
                experts: mg.experts,
            };
            Ok((mg.dx, grads, st))
        }

        fn norm_backward(
            &self,
            li: usize,
            which: Norm,
            (x, inv): (&CudaSlice<f32>, &CudaSlice<f32>),
            dy: &CudaSlice<u16>,
            dx: &mut CudaSlice<f32>,
        ) -> Result<Grad, ModelError> {
            let g = &*self.m.gpu;
            let mut dw = g.zeros::<f32>(self.m.cfg.d_model).map_err(k)?;
            let w = gain(&self.m.blocks[li], which);
            g.rmsnorm_backward(x, w, inv, dy, dx, &mut dw, self.n())
                .map_err(k)?;
            Ok(Grad::F32(dw))
        }

        fn out_project_backward(
            &self,
            li: usize,
            attn: &CudaSlice<u16>,
            dx: &CudaSlice<f32>,
        ) -> Result<(Grad, CudaSlice<u16>), ModelError> {
            let cfg = &self.m.cfg;
            let (d, qd) = (cfg.d_model, cfg.n_heads * cfg.head_width());
            let dxb = self.m.gpu.to_bf16(dx, self.n() * d).map_err(k)?;
            let d_wo = self.gemm(GemmVariant::WeightGrad, (attn, &dxb), (qd, d))?;
            let wo = &self.m.blocks[li].wo16;
            let dattn = self.gemm(GemmVariant::DataGrad, (&dxb, wo), (qd, d))?;
            Ok((Grad::Bf16(d_wo), dattn))
        }

        fn attention_backward(
            &self,
            li: usize,
            at: DevAttn,
            a: &CudaSlice<u16>,
            dattn: CudaSlice<u16>,
        ) -> Result<(CudaSlice<u16>, QkvGrads<Grad>), ModelError> {
            let (g, cfg, blk) = (&*self.m.gpu, &self.m.cfg, &self.m.blocks[li]);
            let n = self.n();
            let (d, h, kv, dh) = (cfg.d_model, cfg.n_heads, cfg.kv_heads(), cfg.head_width());
            let (qd, kd) = (h * dh, kv * dh);
            let (mut dqt, mut dkt, dvt) = g
                .attention_backward(self.b.shape, &self.b.att, &at.att, &dattn)
                .map_err(k)?;
            self.tick("attention backward")?;
            let mut head_norms = None;
            if let (Some(raw), Some(qn), Some(kn)) = (&at.qk_raw, &blk.q_norm, &blk.k_norm) {
                let mut d_qn = g.zeros::<f32>(dh).map_err(k)?;
                let mut d_kn = g.zeros::<f32>(dh).map_err(k)?;
                dqt = g
                    .rmsnorm_bf16_backward(&raw.q, &qn.p, &raw.q_inv, &dqt, &mut d_qn, n * h)
                    .map_err(k)?;
                dkt = g
                    .rmsnorm_bf16_backward(&raw.k, &kn.p, &raw.k_inv, &dkt, &mut d_kn, n * kv)
                    .map_err(k)?;
                head_norms = Some((Grad::F32(d_qn), Grad::F32(d_kn)));
            }
            let wgrad = |dproj: &CudaSlice<u16>, width: usize| {
                self.gemm(GemmVariant::WeightGrad, (a, dproj), (d, width))
                    .map(Grad::Bf16)
            };
            let dgrad = |dproj: &CudaSlice<u16>, w: &CudaSlice<u16>, width: usize| {
                self.gemm(GemmVariant::DataGrad, (dproj, w), (d, width))
            };
            let (wq, wk, wv) = (wgrad(&dqt, qd)?, wgrad(&dkt, kd)?, wgrad(&dvt, kd)?);
            let da = g
                .add(
                    &dgrad(&dqt, &blk.wq16, qd)?,
                    &dgrad(&dkt, &blk.wk16, kd)?,
                    n * d,
                )
                .map_err(k)?;
            let da = g.add(&da, &dgrad(&dvt, &blk.wv16, kd)?, n * d).map_err(k)?;
            let grads = QkvGrads {
                wq,
                wk,
                wv,
                head_norms,
            };
            Ok((da, grads))
        }

        fn embed_backward(&self, dx: &CudaSlice<f32>) -> Result<(Grad, Option<Grad>), ModelError> {
            let (g, m, b) = (&*self.m.gpu, self.m, self.b);
            let (n, d) = (self.n(), m.cfg.d_model);
            let mut d_embed = g.zeros::<f32>(m.cfg.vocab * d).map_err(k)?;
            // SAFETY: tokens below the vocabulary (the forward embedded them).
            unsafe { g.embed_backward(dx, &b.tok, &mut d_embed, n, d) }.map_err(k)?;
            let mut d_pos = None;
            if let Some(pd) = &b.pos_idx {
                let mut dp = g.zeros::<f32>(m.cfg.max_seq * d).map_err(k)?;
                // SAFETY: positions below seq ≤ max_seq.
                unsafe { g.embed_backward(dx, pd, &mut dp, n, d) }.map_err(k)?;
                d_pos = Some(Grad::F32(dp));
            }
            Ok((Grad::F32(d_embed), d_pos))
        }
    }

    /// Block `b`'s pre-norm gain `which`.
    fn gain(b: &Block, which: Norm) -> &CudaSlice<f32> {
        match which {
            Norm::Attention => &b.norm1.p,
            Norm::Moe => &b.norm2.p,
        }
    }
}
