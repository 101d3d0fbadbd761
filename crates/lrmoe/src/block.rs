//! One model, written once: the transformer block's forward and backward
//! and the whole pass (embedding → blocks → head and loss, and back),
//! generic over a [`Dense`] backend. The CPU model ([`crate::model`],
//! `f32`/`f64` slices over any `layer::Transport`) and the GPU model
//! ([`crate::device_model`], device buffers, bf16 GEMMs with f32 residuals)
//! are its two backends; each supplies the primitives in its own numbers,
//! this file fixes their order:
//!
//! ```text
//! block forward:  x_in = x; a = norm1(x); attn = attention(a); x += attn·Wo;
//!                 x_mid = x; m = norm2(x); x += moe(m)
//! block backward: dm = moe'(dx); dx += norm2'(dm); dattn = Wo'(dx);
//!                 da = attention'(dattn); dx += norm1'(da)
//! pass:           x = embed(tokens); blocks; loss = head(x) — and back,
//!                 head', blocks in reverse, embed'
//! ```
//!
//! A backend holds its step's context (weights, the batch, the transport);
//! block `li`'s weights are its own. Everything a block's backward reads is
//! in its [`BlockSaved`], consumed by the backward, so a backend that frees
//! on drop releases each block's activations once its backward has run.

use layer::BackwardStats;

/// The phases a timed rank's work is recorded under
/// (`layer::timeline`; the simulator's per-phase table).
pub mod phase {
    /// Embedding, attention, norms, the LM head and loss.
    pub const DENSE_FORWARD: &str = "dense forward";
    /// The MoE layers' forward calls.
    pub const MOE_FORWARD: &str = "moe forward";
    /// The dense parts' backward.
    pub const DENSE_BACKWARD: &str = "dense backward";
    /// The MoE layers' backward calls.
    pub const MOE_BACKWARD: &str = "moe backward";
    /// The data-parallel sums of dense gradients and the global norm.
    pub const GRADIENT_SUMS: &str = "gradient sums";
    /// AdamW and the step's scalars.
    pub const OPTIMIZER: &str = "optimizer";
    /// The phases of the MoE layers.
    pub const MOE: [&str; 2] = [MOE_FORWARD, MOE_BACKWARD];

    /// Whether a recorded phase is `phase` or one of its parts
    /// (`"<phase>: <part>"`, `layer::Transport::part`).
    pub fn within(recorded: &str, phase: &str) -> bool {
        recorded
            .strip_prefix(phase)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(": "))
    }

    /// Whether a recorded phase belongs to the MoE layers.
    pub fn is_moe(recorded: &str) -> bool {
        MOE.iter().any(|p| within(recorded, p))
    }
}

/// Which of a block's two pre-norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Norm {
    /// Before attention (`norm1`).
    Attention,
    /// Before the MoE layer (`norm2`).
    Moe,
}

/// A backend's buffer types (a plain type with no lifetime, so saved state
/// outlives the borrowed context that made it).
pub(crate) trait Family {
    /// The residual stream's rows.
    type Stream;
    /// A norm's output rows, a projection's input or output rows.
    type Rows;
    /// A norm's `1 / rms` per row.
    type Inv;
    /// What attention keeps for its backward (projections, head norms,
    /// probabilities or their stand-in).
    type Attn;
    /// What one MoE layer call keeps for its backward.
    type Moe;
    /// One MoE layer call's gradients (router and experts).
    type MoeGrads;
    /// One weight's gradient.
    type Grad;
    /// What the head keeps for its backward (final norm, logits' gradient
    /// or probabilities, the loss).
    type Top;
}

type Stream<D> = <<D as Dense>::F as Family>::Stream;
type Rows<D> = <<D as Dense>::F as Family>::Rows;
type Inv<D> = <<D as Dense>::F as Family>::Inv;
type Attn<D> = <<D as Dense>::F as Family>::Attn;
type Moe<D> = <<D as Dense>::F as Family>::Moe;
type MoeGrads<D> = <<D as Dense>::F as Family>::MoeGrads;
type Grad<D> = <<D as Dense>::F as Family>::Grad;
type Top<D> = <<D as Dense>::F as Family>::Top;

/// The primitives of one model pass on one backend, which holds the
/// step's context (weights, batch, transport). Each adds into or returns
/// its family's buffers; the composition is [`forward`] and [`backward`].
pub(crate) trait Dense {
    /// The backend's buffer types.
    type F: Family;
    /// The backend's error.
    type Error;

    /// Blocks in the model.
    fn n_layers(&self) -> usize;
    /// The phase the work from here on belongs to (timed in-process ranks;
    /// elsewhere nothing).
    fn phase(&self, _name: &'static str) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Profiling: the work since the previous boundary is part `name`'s
    /// (nothing unless the backend profiles).
    fn tick(&self, _name: &'static str) -> Result<(), Self::Error> {
        Ok(())
    }
    /// The token (and position) embeddings of the batch.
    fn embed(&self) -> Result<Stream<Self>, Self::Error>;
    /// A copy of the residual stream.
    fn copy(&self, x: &Stream<Self>) -> Result<Stream<Self>, Self::Error>;
    /// Block `li`'s pre-norm `which` of `x`: the rows and their `1 / rms`.
    fn norm(
        &self,
        li: usize,
        which: Norm,
        x: &Stream<Self>,
    ) -> Result<(Rows<Self>, Inv<Self>), Self::Error>;
    /// [`Dense::copy`] of `x`, then [`Dense::norm`] of it: `(copy, rows,
    /// 1 / rms)` (a backend may read `x` once for both).
    #[allow(clippy::type_complexity)]
    fn norm_keeping(
        &self,
        li: usize,
        which: Norm,
        x: &Stream<Self>,
    ) -> Result<(Stream<Self>, Rows<Self>, Inv<Self>), Self::Error> {
        let copy = self.copy(x)?;
        let (rows, inv) = self.norm(li, which, x)?;
        Ok((copy, rows, inv))
    }
    /// Block `li`'s attention on normed rows `a`, up to (not including) the
    /// output projection: its saved state and context rows.
    fn attention(&self, li: usize, a: &Rows<Self>)
        -> Result<(Attn<Self>, Rows<Self>), Self::Error>;
    /// `x += attn · Wo` (block `li`'s output projection).
    fn out_project(
        &self,
        li: usize,
        attn: &Rows<Self>,
        x: &mut Stream<Self>,
    ) -> Result<(), Self::Error>;
    /// `x += moe(m)`: block `li`'s MoE layer call; what it keeps.
    fn moe_forward(
        &self,
        li: usize,
        m: &Rows<Self>,
        x: &mut Stream<Self>,
    ) -> Result<Moe<Self>, Self::Error>;
    /// The final norm, the LM head and the loss on the top of the stream.
    fn head_loss(&self, x: Stream<Self>) -> Result<Top<Self>, Self::Error>;

    /// The head's backward: the gradient at the top of the stream, the
    /// final norm's and the head's gradients.
    #[allow(clippy::type_complexity)]
    fn head_backward(
        &self,
        top: Top<Self>,
    ) -> Result<(Stream<Self>, Grad<Self>, Grad<Self>), Self::Error>;
    /// Block `li`'s MoE layer backward from the stream's gradient `dx`:
    /// the gradient at the layer's input rows, the layer's gradients and
    /// its figures.
    fn moe_backward(
        &self,
        li: usize,
        moe: Moe<Self>,
        dx: &Stream<Self>,
    ) -> Result<(Rows<Self>, MoeGrads<Self>, BackwardStats), Self::Error>;
    /// Block `li`'s pre-norm `which` backward: `dx += norm'(dy)` at the
    /// norm's input `x`; the gain's gradient.
    fn norm_backward(
        &self,
        li: usize,
        which: Norm,
        saved: (&Stream<Self>, &Inv<Self>),
        dy: &Rows<Self>,
        dx: &mut Stream<Self>,
    ) -> Result<Grad<Self>, Self::Error>;
    /// The output projection's backward from the stream's gradient `dx`:
    /// `Wo`'s gradient and the context rows' gradient.
    fn out_project_backward(
        &self,
        li: usize,
        attn: &Rows<Self>,
        dx: &Stream<Self>,
    ) -> Result<(Grad<Self>, Rows<Self>), Self::Error>;
    /// Attention's backward from the context rows' gradient: the gradient
    /// at the normed rows `a`, and the q/k/v projections' (and head
    /// norms') gradients.
    #[allow(clippy::type_complexity)]
    fn attention_backward(
        &self,
        li: usize,
        att: Attn<Self>,
        a: &Rows<Self>,
        dattn: Rows<Self>,
    ) -> Result<(Rows<Self>, QkvGrads<Grad<Self>>), Self::Error>;
    /// The embeddings' gradients (token; learned position where the model
    /// has them) from the gradient at the bottom of the stream.
    #[allow(clippy::type_complexity)]
    fn embed_backward(
        &self,
        dx: &Stream<Self>,
    ) -> Result<(Grad<Self>, Option<Grad<Self>>), Self::Error>;
}

/// What one block's backward reads, kept by its forward.
pub(crate) struct BlockSaved<F: Family> {
    x_in: F::Stream,
    inv1: F::Inv,
    a: F::Rows,
    att: F::Attn,
    attn: F::Rows,
    x_mid: F::Stream,
    inv2: F::Inv,
    /// The MoE layer call's saved state.
    pub(crate) moe: F::Moe,
}

/// One forward's saved state: the blocks', then the head's.
pub(crate) struct Pass<F: Family> {
    pub(crate) blocks: Vec<BlockSaved<F>>,
    pub(crate) top: F::Top,
}

/// The q/k/v projections' gradients and the head norms' (with `qk_norm`).
pub(crate) struct QkvGrads<G> {
    pub(crate) wq: G,
    pub(crate) wk: G,
    pub(crate) wv: G,
    pub(crate) head_norms: Option<(G, G)>,
}

/// One block's gradients.
pub(crate) struct BlockGrads<F: Family> {
    pub(crate) norm1: F::Grad,
    pub(crate) qkv: QkvGrads<F::Grad>,
    pub(crate) wo: F::Grad,
    pub(crate) norm2: F::Grad,
    pub(crate) moe: F::MoeGrads,
}

/// Every gradient of one pass, and each MoE layer's figures (layer order).
pub(crate) struct PassGrads<F: Family> {
    pub(crate) embed: F::Grad,
    pub(crate) pos: Option<F::Grad>,
    pub(crate) blocks: Vec<BlockGrads<F>>,
    pub(crate) norm_f: F::Grad,
    pub(crate) head: F::Grad,
    pub(crate) stats: Vec<BackwardStats>,
}

/// Block `li`'s forward on the residual stream `x` (updated in place).
pub(crate) fn block_forward<D: Dense>(
    be: &D,
    li: usize,
    x: &mut Stream<D>,
) -> Result<BlockSaved<D::F>, D::Error> {
    be.phase(phase::DENSE_FORWARD)?;
    let (x_in, a, inv1) = be.norm_keeping(li, Norm::Attention, x)?;
    be.tick("norms")?;
    let (att, attn) = be.attention(li, &a)?;
    be.out_project(li, &attn, x)?;
    be.tick("o projection")?;
    let (x_mid, m, inv2) = be.norm_keeping(li, Norm::Moe, x)?;
    be.tick("norms")?;
    let moe = be.moe_forward(li, &m, x)?;
    be.tick("moe forward")?;
    Ok(BlockSaved {
        x_in,
        inv1,
        a,
        att,
        attn,
        x_mid,
        inv2,
        moe,
    })
}

/// Block `li`'s backward: `dx`, the gradient at the block's output, to
/// the gradient at its input (in place); the block's gradients and its MoE
/// layer's figures.
pub(crate) fn block_backward<D: Dense>(
    be: &D,
    li: usize,
    s: BlockSaved<D::F>,
    dx: &mut Stream<D>,
) -> Result<(BlockGrads<D::F>, BackwardStats), D::Error> {
    let (dm, moe, stats) = be.moe_backward(li, s.moe, dx)?;
    be.tick("moe backward")?;
    let norm2 = be.norm_backward(li, Norm::Moe, (&s.x_mid, &s.inv2), &dm, dx)?;
    drop((dm, s.x_mid, s.inv2));
    be.tick("norms backward")?;
    let (wo, dattn) = be.out_project_backward(li, &s.attn, dx)?;
    drop(s.attn);
    be.tick("o projection backward")?;
    let (da, qkv) = be.attention_backward(li, s.att, &s.a, dattn)?;
    be.tick("qkv projections backward")?;
    let norm1 = be.norm_backward(li, Norm::Attention, (&s.x_in, &s.inv1), &da, dx)?;
    be.tick("norms backward")?;
    let grads = BlockGrads {
        norm1,
        qkv,
        wo,
        norm2,
        moe,
    };
    Ok((grads, stats))
}

/// The forward of the backend's batch through the loss.
pub(crate) fn forward<D: Dense>(be: &D) -> Result<Pass<D::F>, D::Error> {
    let mut x = be.embed()?;
    be.tick("embedding")?;
    let blocks = (0..be.n_layers())
        .map(|li| block_forward(be, li, &mut x))
        .collect::<Result<Vec<_>, _>>()?;
    let top = be.head_loss(x)?;
    Ok(Pass { blocks, top })
}

/// The backward of `pass`: every gradient, each block's state released
/// once its backward has read it.
pub(crate) fn backward<D: Dense>(be: &D, pass: Pass<D::F>) -> Result<PassGrads<D::F>, D::Error> {
    be.phase(phase::DENSE_BACKWARD)?;
    let (mut dx, norm_f, head) = be.head_backward(pass.top)?;
    let n = pass.blocks.len();
    let mut blocks = Vec::with_capacity(n);
    let mut stats = Vec::with_capacity(n);
    for (li, s) in pass.blocks.into_iter().enumerate().rev() {
        let (g, st) = block_backward(be, li, s, &mut dx)?;
        blocks.push(g);
        stats.push(st);
    }
    blocks.reverse();
    stats.reverse();
    let (embed, pos) = be.embed_backward(&dx)?;
    be.tick("embedding backward")?;
    Ok(PassGrads {
        embed,
        pos,
        blocks,
        norm_f,
        head,
        stats,
    })
}
