//! The plan of one layer call, shared by every executor.
//!
//! From the routed counts `n[s][e]` of a call, [`plan_call`] runs the
//! controller (`quota`): this call's replicas, the per-expert quotas `q_e`
//! and their split over sources, per-rank pair caps under budgets, and the
//! [`Selection`] rule the backward follows. The host executor
//! ([`crate::forward`] / [`crate::backward`]) stores the [`CallPlan`] in its
//! saved state; the device executors get theirs from [`device_plan_call`]
//! (the same `plan_call`, restricted to what they run today) and take its
//! per-expert quotas.

use pack::ep::Split;
use quota::{CostModel, Placement, Policy, RankBudget};
use serde::Serialize;

use crate::config::{shape, MoeConfig};
use crate::LayerError;

/// How many pairs the backward keeps.
#[derive(Debug, Clone, PartialEq)]
pub enum Retention {
    /// Every pair (exact gradient).
    Full,
    /// `round(r · n_e)` pairs of every expert, `n_e` its routed pairs over
    /// all sources, `r ∈ [0, 1]`.
    Ratio(f64),
    /// Keep a share `f ∈ [0, 1]` of all routed pairs, trimming only the
    /// ranks whose load exceeds their fair share of that budget: rank loads
    /// `L_r` (each expert's pairs spread evenly over its instances) are
    /// capped at `c` with `Σ_r min(L_r, c) = f · Σ_r L_r`, and expert `e`
    /// keeps `round(n_e · min(1, c / max_{r ∋ e} L_r))` — under-loaded ranks
    /// stay whole, the straggler's surplus goes.
    Surplus(f64),
    /// The controller's quotas under per-rank budgets.
    Budgeted {
        /// One budget per rank.
        budgets: Vec<RankBudget>,
        /// Quota policy.
        policy: Policy,
    },
}

/// Backward planning settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CallConfig {
    /// Quotas.
    pub retention: Retention,
    /// Replicas each rank may host in this call.
    pub replica_slots_per_rank: usize,
    /// Share of a rank's free memory replicas may use (budgeted mode).
    pub replica_memory_fraction: f64,
    /// Which of the controller's replicas are placed: those that pay for
    /// their traffic in the cost model (the default), or every one the
    /// slots allow ([`quota::ReplicaRule`]).
    pub replica_rule: quota::ReplicaRule,
    /// Whether [`Retention::Budgeted`]'s budgets hold
    /// `replica_slots_per_rank` instances a rank for replicas (as the
    /// trainer's do): a slot the controller leaves empty then stays empty
    /// instead of holding rows, so the token buffer keeps the size the
    /// budget gave it. `false`: every byte no instance takes may hold rows.
    pub slots_reserved: bool,
    /// The budget holding the forward's rows: the most routed pairs one
    /// rank may compute in this call's forward, which the controller's
    /// replicas try to bring every rank within
    /// ([`quota::Config::forward_rows_cap`]). `None`: not held.
    pub forward_rows_cap: Option<u64>,
    /// The link rate the controller's cost model times replica traffic
    /// with, bytes/s per rank and direction.
    pub link_bytes_per_s: f64,
    /// The compute rate the controller's cost model times expert work
    /// with, FLOP/s per rank.
    pub flops_per_s: f64,
    /// Solver of the backward redistribution.
    pub solver: redistribute::Solver,
    /// Capacity-factor token dropping (the Switch/Megatron baseline, not
    /// LRMoE): each source rank sends an expert at most
    /// `⌈factor · pairs / n_experts⌉` pairs, first come first served; the
    /// rest skip the expert in forward *and* backward. `None`: dropless.
    pub capacity_factor: Option<f64>,
    /// A forced hot-expert workload (benchmarks): `hot_bias` is added to
    /// the router logits of experts `0..hot_experts` before the softmax. It
    /// is a constant, so every gradient formula holds unchanged; 0 and 0.0
    /// route as the weights say.
    pub hot_experts: usize,
    /// The logit bias of the hot experts.
    pub hot_bias: f64,
    /// A skewed workload (benchmarks): `-zipf_skew · ln(1 + e)` is added to
    /// expert `e`'s router logit, so expert loads fall off like a power
    /// law (expert 0 the hottest) and the per-layer max/mean load grows
    /// with the skew — published Qwen3-30B-A3B routing statistics span
    /// max/mean 4–13. A constant like `hot_bias`; 0 routes as the weights
    /// say.
    pub zipf_skew: f64,
    /// Where this rank's expert GEMMs run (forward and backward).
    pub experts: crate::experts::ExpertBackend,
    /// Which pairs the backward keeps within each quota (see
    /// [`lrm_score::Rule`]; weights of the unbiased rules scale the kept
    /// pairs' `g·δ` rows).
    pub rule: lrm_score::Rule,
    /// Seed of the random rules (mixed with each call's routed counts).
    pub rule_seed: u64,
    /// Coefficient `α` of the Switch/GShard auxiliary load-balancing loss
    /// `α · E · Σ_e f_e · P_e` on each rank's tokens (`f_e`: share of the
    /// rank's routed pairs at expert `e`, `P_e`: mean router probability of
    /// `e`); 0 turns it off. See [`crate::Saved::aux_loss`].
    pub aux_loss_coeff: f64,
    /// The auxiliary-loss-free balancing bias (DeepSeek-V3): `b[e]` is
    /// added to expert `e`'s router probability for the top-k choice only;
    /// the gates stay the unbiased probabilities, so no gradient changes
    /// form. Empty: none. The trainer updates it between steps
    /// (`moe.expert_bias_rate`).
    pub expert_bias: Vec<f64>,
    /// Binding quotas trimmed to whole GEMM tiles where that drops little
    /// (see [`quota::align_to_tiles`]); `None`: quotas as the controller
    /// made them.
    pub tile_align: Option<TileAlign>,
    /// SYMI-like replication: this call's replicas from this per-expert
    /// load (the previous call's routed pairs) by
    /// [`quota::replicas_by_load`], `replica_slots_per_rank` per rank, the
    /// owners kept; `None`: the controller's replicas from this call's
    /// counts ([`quota::plan_replicas`]). With
    /// [`redistribute::Solver::Even`] the pairs are then split evenly over
    /// the instances in forward and backward, as SYMI does.
    pub replica_load: Option<Vec<u64>>,
    /// Device executor, calls without replicas: each owner keeps the
    /// projections `x·W_gate`, `x·W_up` of its forward rows (`2 · F`
    /// bf16 values a row) and the backward reads its kept rows' instead of
    /// recomputing them — two grouped GEMMs fewer for that memory. `false`
    /// (the default): recompute, keep nothing.
    pub keep_projections: bool,
}

impl CallConfig {
    /// The solver that spreads the forward's pairs over the instances: the
    /// exact one, or the even split when the call asks for it.
    pub fn forward_solver(&self) -> redistribute::Solver {
        match self.solver {
            redistribute::Solver::Even => redistribute::Solver::Even,
            _ => redistribute::Solver::Exact,
        }
    }

    /// The balancing bias [`CallConfig::expert_bias`], or `None` when it
    /// is empty; a configuration error unless it holds one finite value
    /// per expert.
    pub fn selection_bias(&self, experts: usize) -> Result<Option<&[f64]>, LayerError> {
        let b = &self.expert_bias;
        if b.is_empty() {
            return Ok(None);
        }
        if b.len() != experts || b.iter().any(|v| !v.is_finite()) {
            return Err(LayerError::Config(format!(
                "expert bias: {} finite values expected (one per expert), got {}",
                experts,
                b.len()
            )));
        }
        Ok(Some(b))
    }

    /// The constant added to each expert's router logit by the forced
    /// workloads (`hot_experts`/`hot_bias`, `zipf_skew`), or `None` when
    /// there is none; a configuration error names a bad setting.
    pub fn logit_bias(&self, experts: usize) -> Result<Option<Vec<f64>>, LayerError> {
        if self.hot_experts > experts || !self.hot_bias.is_finite() {
            return Err(LayerError::Config(format!(
                "hot_experts = {} (of {experts}) with bias {}",
                self.hot_experts, self.hot_bias
            )));
        }
        if !(self.zipf_skew.is_finite() && self.zipf_skew >= 0.0) {
            return Err(LayerError::Config(format!(
                "zipf_skew = {} must be finite and ≥ 0",
                self.zipf_skew
            )));
        }
        let hot = self.hot_experts > 0 && self.hot_bias != 0.0;
        if !hot && self.zipf_skew == 0.0 {
            return Ok(None);
        }
        Ok(Some(
            (0..experts)
                .map(|e| {
                    let h = if e < self.hot_experts {
                        self.hot_bias
                    } else {
                        0.0
                    };
                    h - self.zipf_skew * (1.0 + e as f64).ln()
                })
                .collect(),
        ))
    }
}

impl Default for CallConfig {
    fn default() -> Self {
        Self {
            retention: Retention::Full,
            replica_slots_per_rank: 0,
            replica_memory_fraction: 0.25,
            replica_rule: quota::ReplicaRule::Paying,
            slots_reserved: false,
            forward_rows_cap: None,
            link_bytes_per_s: quota::H200_LINK_BYTES_PER_S,
            flops_per_s: quota::H200_FLOPS_PER_S,
            solver: redistribute::Solver::Exact,
            capacity_factor: None,
            hot_experts: 0,
            hot_bias: 0.0,
            zipf_skew: 0.0,
            experts: crate::experts::ExpertBackend::Cpu,
            rule: lrm_score::Rule::TopQ,
            rule_seed: 0,
            aux_loss_coeff: 0.0,
            expert_bias: Vec::new(),
            tile_align: None,
            replica_load: None,
            keep_projections: false,
        }
    }
}

/// Tile alignment of the backward's quotas ([`CallConfig::tile_align`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TileAlign {
    /// Rows of one block of the expert GEMMs (128 on the device).
    pub rows: u64,
    /// Largest share of an expert's quota that may be dropped to align it.
    pub max_drop: f64,
}

impl TileAlign {
    /// The device executor's grouped GEMM blocks (128 rows); at most 1/16
    /// of a quota dropped.
    pub const DEVICE: Self = Self {
        rows: 128,
        max_drop: 1.0 / 16.0,
    };
}

/// Which pairs compete for an expert's quota (see the crate doc,
/// "Selection").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// Expert `e` keeps its `q_e` best pairs over every source's pairs.
    PerExpert,
    /// Source `s` keeps its `k[s][e]` best pairs of each expert `e`.
    PerSourceExpert,
}

/// The controller's decision for one call, identical on every rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallPlan {
    /// Routed pairs `[source][expert]`.
    pub routed: Vec<Vec<u64>>,
    /// Placement with this call's replicas.
    pub placement: Placement,
    /// Backward quotas per expert, `q_e` (what [`Selection::PerExpert`]
    /// selects; `Σ_s kept[s][e]`).
    pub quotas: Vec<u64>,
    /// Backward quotas `[source][expert]`, the controller's split of `q_e`
    /// over sources (what [`Selection::PerSourceExpert`] selects).
    pub kept: Vec<Vec<u64>>,
    /// How the backward selects within the quotas.
    pub selection: Selection,
    /// Per-rank pair caps (budgeted mode).
    pub caps: Option<Vec<u64>>,
}

impl CallPlan {
    /// The seed of this call's priority sampling on a device layer when
    /// `call` selects by [`lrm_score::Rule::Priority`] (`None`: top-q).
    pub fn priority_seed(&self, call: &CallConfig) -> Option<u64> {
        (call.rule == lrm_score::Rule::Priority).then(|| call_seed(call.rule_seed, &self.routed))
    }

    /// The per-expert quotas as the device layers take them (saturating at
    /// `u32::MAX`, which keeps every pair).
    pub fn device_quotas(&self) -> Vec<u32> {
        self.quotas
            .iter()
            .map(|&q| u32::try_from(q).unwrap_or(u32::MAX))
            .collect()
    }
}

/// The controller's cost model for this layer with elements of `bytes`
/// and the call's rates (the budgets bind in bytes; the rates time the
/// replicas, [`CallConfig::replica_rule`]).
fn cost_model(cfg: &MoeConfig, bwd: &CallConfig, bytes: u64) -> CostModel {
    CostModel::swiglu_expert(
        cfg.hidden,
        cfg.ffn,
        bytes,
        bwd.link_bytes_per_s,
        bwd.flops_per_s,
    )
}

/// The controller's plan for one call from the all-gathered routed counts
/// `routed[s][e]`: this call's replicas and backward quotas (what
/// [`crate::forward`] stores in [`crate::Saved::plan`]). `T` sets the element size of the
/// cost model. Also used by the GPU layer, whose forward returns the counts.
pub fn plan_call<T>(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    routed: Vec<Vec<u64>>,
    placement: &Placement,
) -> Result<CallPlan, LayerError> {
    plan_call_bytes(cfg, bwd, routed, placement, std::mem::size_of::<T>() as u64)
}

/// [`plan_call`] with elements of `bytes`: the call's replicas, then its
/// quotas.
fn plan_call_bytes(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    routed: Vec<Vec<u64>>,
    placement: &Placement,
    bytes: u64,
) -> Result<CallPlan, LayerError> {
    let with_replicas = call_replicas(cfg, bwd, &routed, placement, bytes)?;
    call_quotas(cfg, bwd, routed, placement, with_replicas, bytes)
}

/// The first half of a call's plan, all its forward needs: `placement`
/// with this call's replicas (the configured replica load's, or the
/// controller's [`quota::plan_replicas`]).
fn call_replicas(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    routed: &[Vec<u64>],
    placement: &Placement,
    bytes: u64,
) -> Result<Placement, LayerError> {
    if let Some(load) = &bwd.replica_load {
        return Ok(quota::replicas_by_load(
            placement,
            load,
            routed.len(),
            bwd.replica_slots_per_rank,
        )?);
    }
    let cost = cost_model(cfg, bwd, bytes);
    let (budgets, policy) = call_budgets(bwd, routed.len())?;
    let inputs = quota::Inputs {
        counts: routed,
        placement,
        cost: &cost,
        budgets: &budgets,
    };
    let qcfg = quota::Config {
        policy,
        replica_slots_per_rank: bwd.replica_slots_per_rank,
        replica_memory_fraction: bwd.replica_memory_fraction,
        replica_rule: bwd.replica_rule,
        forward_rows_cap: bwd.forward_rows_cap,
    };
    Ok(quota::plan_replicas(&inputs, &qcfg)?)
}

/// The second half of a call's plan, what only its backward needs: the
/// quotas (and caps) under the call's retention over `with_replicas`
/// ([`call_replicas`]'s placement from `placement`, the owners').
fn call_quotas(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    routed: Vec<Vec<u64>>,
    placement: &Placement,
    with_replicas: Placement,
    bytes: u64,
) -> Result<CallPlan, LayerError> {
    let (mut kept, caps) = match &bwd.retention {
        Retention::Full => (routed.clone(), None),
        Retention::Surplus(f) => (surplus_kept(cfg, &routed, &with_replicas, *f)?, None),
        Retention::Ratio(r) => {
            if !(0.0..=1.0).contains(r) {
                return Err(LayerError::Config(format!(
                    "retention ratio {r} is not in [0, 1]"
                )));
            }
            // Per expert: round(r · n_e).
            (
                split_over_sources(cfg, &routed, &|_, n| ((n as f64) * r).round() as u64),
                None,
            )
        }
        Retention::Budgeted { .. } => {
            let cost = cost_model(cfg, bwd, bytes);
            let (budgets, policy) = call_budgets(bwd, routed.len())?;
            let trimmed;
            let budgets = if bwd.slots_reserved {
                trimmed = quota::budgets_without_empty_slots(
                    &budgets,
                    bwd.replica_slots_per_rank,
                    placement,
                    &with_replicas,
                    &cost,
                );
                &trimmed
            } else {
                &budgets
            };
            let inputs = quota::Inputs {
                counts: &routed,
                placement: &with_replicas,
                cost: &cost,
                budgets,
            };
            let p = quota::quotas(&inputs, policy)?;
            let caps = p.ranks.iter().map(|r| r.pair_capacity).collect();
            (p.quotas.per_source().to_vec(), Some(caps))
        }
    };
    // Quotas that keep every routed pair (full retention) never bind, so
    // alignment leaves them whole.
    if let Some(a) = bwd.tile_align {
        quota::align_to_tiles(&mut kept, &routed, a.rows, a.max_drop)?;
    }
    let selection = selection_of(bwd);
    let quotas = (0..cfg.n_experts)
        .map(|e| kept.iter().map(|row: &Vec<u64>| row[e]).sum())
        .collect();
    Ok(CallPlan {
        routed,
        placement: with_replicas,
        quotas,
        kept,
        selection,
        caps,
    })
}

/// The ranks' budgets and the quota policy of a call: the configured ones
/// for [`Retention::Budgeted`] (one budget per rank), else unlimited and
/// uniform.
fn call_budgets(bwd: &CallConfig, n_ranks: usize) -> Result<(Vec<RankBudget>, Policy), LayerError> {
    match &bwd.retention {
        Retention::Budgeted { budgets, policy } => {
            if budgets.len() != n_ranks {
                return Err(LayerError::Config(format!(
                    "{} budgets for {n_ranks} ranks",
                    budgets.len()
                )));
            }
            Ok((budgets.clone(), *policy))
        }
        _ => Ok((vec![RankBudget::UNLIMITED; n_ranks], Policy::Uniform)),
    }
}

/// Which pairs compete for a quota. Per-expert selection may take an
/// expert's quota from any source, which a per-source send budget cannot
/// allow; with unlimited sends only the per-expert totals bind (the
/// controller's own flow network is then one cell per expert), so any
/// split the selection makes stays placeable.
fn selection_of(bwd: &CallConfig) -> Selection {
    match &bwd.retention {
        Retention::Budgeted { budgets, .. }
            if budgets.iter().any(|b| b.network_bytes != u64::MAX) =>
        {
            Selection::PerSourceExpert
        }
        _ => Selection::PerExpert,
    }
}

/// Per expert: its quota `quota(e, n_e)` (at most its routed pairs `n_e`),
/// split over sources in rank order, `[source][expert]` (the split only
/// describes the quota; selection is per expert).
fn split_over_sources(
    cfg: &MoeConfig,
    routed: &[Vec<u64>],
    quota: &dyn Fn(usize, u64) -> u64,
) -> Vec<Vec<u64>> {
    let per_expert = (0..cfg.n_experts)
        .map(|e| {
            let n_e: u64 = routed.iter().map(|row| row[e]).sum();
            let mut left = quota(e, n_e).min(n_e);
            routed
                .iter()
                .map(|row| {
                    let take = left.min(row[e]);
                    left -= take;
                    take
                })
                .collect::<Vec<u64>>()
        })
        .collect::<Vec<_>>();
    (0..routed.len())
        .map(|s| per_expert.iter().map(|col| col[s]).collect())
        .collect()
}

/// [`Retention::Surplus`]: the share `f` of all routed pairs is kept,
/// trimming only the ranks whose even share of their instances' loads is
/// above the water level; an expert keeps the ratio its busiest instance
/// allows.
fn surplus_kept(
    cfg: &MoeConfig,
    routed: &[Vec<u64>],
    with_replicas: &Placement,
    f: f64,
) -> Result<Vec<Vec<u64>>, LayerError> {
    if !(0.0..=1.0).contains(&f) {
        return Err(LayerError::Config(format!(
            "surplus retention {f} is not in [0, 1]"
        )));
    }
    let n_ranks = routed.len();
    let instances = with_replicas.all_instances();
    let n_e: Vec<f64> = (0..cfg.n_experts)
        .map(|e| routed.iter().map(|row| row[e] as f64).sum())
        .collect();
    let mut load = vec![0f64; n_ranks];
    for (e, inst) in instances.iter().enumerate() {
        for &r in inst {
            if r < n_ranks {
                load[r] += n_e[e] / inst.len() as f64;
            }
        }
    }
    let cap = water_fill(&load, f * n_e.iter().sum::<f64>());
    let ratio: Vec<f64> = instances
        .iter()
        .map(|inst| {
            let worst = inst.iter().map(|&r| load[r]).fold(0.0, f64::max);
            if worst <= cap {
                1.0
            } else {
                cap / worst
            }
        })
        .collect();
    Ok(split_over_sources(cfg, routed, &|e, n| {
        ((n as f64) * ratio[e]).round() as u64
    }))
}

/// The random rules' seed of one call: the configured seed mixed with the
/// call's routed counts (identical on every rank, different per call).
pub(crate) fn call_seed(seed: u64, routed: &[Vec<u64>]) -> u64 {
    let mut h = seed ^ 0x243F_6A88_85A3_08D3;
    for &c in routed.iter().flatten() {
        h = (h ^ c).wrapping_mul(0x0000_0100_0000_01B3).rotate_left(17);
    }
    h
}

/// The cap `c` with `Σ_r min(load_r, c) = budget` (every load when the
/// budget covers them all).
fn water_fill(load: &[f64], budget: f64) -> f64 {
    let mut sorted = load.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut below = 0.0;
    for (i, &l) in sorted.iter().enumerate() {
        let above = (sorted.len() - i) as f64;
        if below + l * above >= budget {
            return (budget - below) / above;
        }
        below += l;
    }
    sorted.last().copied().unwrap_or(0.0)
}

/// The plan of one call for a device executor, from every source's routed
/// counts per expert (`routed[s][e]`; one source for one GPU): the same
/// [`plan_call`] the host executor runs (bf16 rows, the controller under
/// [`Retention::Budgeted`], replicas when `replica_slots_per_rank > 0`).
/// Experts are owned in contiguous blocks.
pub fn device_plan_call(
    cfg: &MoeConfig,
    call: &CallConfig,
    routed: &[Vec<u32>],
) -> Result<CallPlan, LayerError> {
    plan_over_blocks(cfg, call, routed, 2)
}

/// [`device_plan_call`] with rows of `bytes` elements (bf16 on the
/// device, the host backend's `f32` or `f64`).
fn plan_over_blocks(
    cfg: &MoeConfig,
    call: &CallConfig,
    routed: &[Vec<u32>],
    bytes: u64,
) -> Result<CallPlan, LayerError> {
    let (counts, placement) = owned_in_blocks(cfg, routed)?;
    plan_call_bytes(cfg, call, counts, &placement, bytes)
}

/// The routed counts in 64 bits and the owners' placement of a call whose
/// experts are owned in contiguous blocks (`e / (E / W)`), checked.
fn owned_in_blocks(
    cfg: &MoeConfig,
    routed: &[Vec<u32>],
) -> Result<(Vec<Vec<u64>>, Placement), LayerError> {
    cfg.validate()?;
    let n_ranks = routed.len();
    if n_ranks == 0 || cfg.n_experts % n_ranks != 0 {
        return Err(LayerError::Config(format!(
            "{} experts cannot be owned in equal blocks by {n_ranks} ranks",
            cfg.n_experts
        )));
    }
    let counts: Vec<Vec<u64>> = routed
        .iter()
        .map(|row| {
            shape("routed counts", cfg.n_experts, row.len())?;
            Ok(row.iter().map(|&c| u64::from(c)).collect())
        })
        .collect::<Result<_, LayerError>>()?;
    let placement = Placement {
        owner: (0..cfg.n_experts)
            .map(|e| e / (cfg.n_experts / n_ranks))
            .collect(),
        replicas: vec![],
    };
    Ok((counts, placement))
}

/// Rejects layers the device operations cannot run: widths must be
/// positive multiples of 8 (the grouped GEMM's alignment), experts a
/// multiple of 8 up to 1024, `top_k` at most 32.
pub fn check_device_shape(cfg: &MoeConfig) -> Result<(), LayerError> {
    cfg.validate()?;
    let bad = |m: String| Err(LayerError::Config(m));
    if cfg.hidden % 8 != 0 || cfg.ffn % 8 != 0 {
        return bad(format!(
            "the device executor needs hidden and ffn multiples of 8 (got {} and {})",
            cfg.hidden, cfg.ffn
        ));
    }
    if cfg.n_experts % 8 != 0 || cfg.n_experts > 1024 {
        return bad(format!(
            "the device executor needs a multiple of 8 experts, at most 1024 (got {})",
            cfg.n_experts
        ));
    }
    if cfg.top_k > kernels::limits::MAX_TOP_K {
        return bad(format!(
            "the device executor routes at most {} experts per token (got {})",
            kernels::limits::MAX_TOP_K,
            cfg.top_k
        ));
    }
    Ok(())
}

/// Refuses what the device executor cannot run: selection rules other
/// than top-q and priority sampling; the error says to use the host
/// executor.
pub fn check_device_call(call: &CallConfig) -> Result<(), LayerError> {
    let refuse = |what: String| {
        Err(LayerError::Config(format!(
            "{what} runs on the host executor only (--executor host, or --device cpu)"
        )))
    };
    if !matches!(call.rule, lrm_score::Rule::TopQ | lrm_score::Rule::Priority) {
        return refuse(format!("the {} selection rule", call.rule.name()));
    }
    if selection_of(call) == Selection::PerSourceExpert {
        return refuse("selection per source (a binding per-source send budget)".into());
    }
    Ok(())
}

/// One call's plan as the device executor follows it, identical on every
/// rank: [`DevicePlanner`] resolves a [`CallPlan`] (quotas, replicas, caps)
/// into the instances of each expert and the forward's split of every
/// routed pair over them. Experts are
/// owned in contiguous blocks: expert `e`'s owner is `e / (E / W)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpPlan {
    /// Ranks holding an instance of each expert in this call, owner first
    /// then its replicas (no rank twice).
    pub instances: Vec<Vec<usize>>,
    /// The forward's split of every routed pair over the instances,
    /// `(source, expert, rank)` (zero where a rank holds no instance).
    pub forward: Split,
    /// Pairs each expert keeps in the backward, selected over every
    /// source's pairs (more than routed keeps all).
    pub quotas: Vec<u32>,
    /// Per-rank pair caps the backward's redistribution honours, if any.
    pub caps: Option<Vec<u64>>,
    /// How each quota is filled ([`lrm_score::Rule`]): top-q (the `q`
    /// best scores), or a sampling rule drawing from [`EpPlan::seed`] —
    /// priority sampling keeps the `q` largest keys `√score / u(seed, id)`
    /// and weights kept pairs `max(√score, τ) / √score` (unbiased).
    pub rule: lrm_score::Rule,
    /// This call's seed of the sampling rules (the same on every rank).
    pub seed: u64,
    /// With [`Selection::PerSourceExpert`] (a per-source send budget
    /// binds): each source's quota of each expert, `[source][expert]`,
    /// selected over that source's pairs alone; `None`: per expert over
    /// every source's pairs ([`EpPlan::quotas`]).
    pub cells: Option<Vec<Vec<u32>>>,
}

impl EpPlan {
    /// The seed of this call's priority sampling (`None`: another rule).
    pub fn priority_seed(&self) -> Option<u64> {
        (self.rule == lrm_score::Rule::Priority).then_some(self.seed)
    }
}

/// The forward's half of a call's plan ([`DevicePlanner::routes`]):
/// this call's instances of each expert and the forward's split of every
/// routed pair over them. The quotas and caps only the backward needs
/// follow from it ([`DevicePlanner::complete`]), so an executor sends the
/// rows out first and runs the rest of the controller while the experts
/// compute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpRoutes {
    /// As [`EpPlan::instances`].
    pub instances: Vec<Vec<usize>>,
    /// As [`EpPlan::forward`].
    pub forward: Split,
    /// The routed counts `[source][expert]` the routes split.
    routed: Vec<Vec<u64>>,
    /// The owners' placement, and the same with this call's replicas.
    owners: Placement,
    placement: Placement,
}

/// Whether every expert has exactly one instance (its owner): no replica
/// in the call, so nothing is split, no weight is sent and no gradient
/// returns — the rule every executor's shortcut tests.
pub fn one_instance_each(instances: &[Vec<usize>]) -> bool {
    instances.iter().all(|i| i.len() == 1)
}

/// Checks a split `(source, expert, rank)` against the counts it divides
/// and the instances it may use; the plan's error otherwise.
pub fn check_split(
    split: &Split,
    counts: &[Vec<u32>],
    instances: &[Vec<usize>],
) -> Result<(), LayerError> {
    let bad = |m: String| Err(LayerError::Config(m));
    let world = counts.len();
    if split.sources() != world || split.ranks() != world {
        return bad(format!(
            "a split for {} sources and {} ranks, {world} expected",
            split.sources(),
            split.ranks()
        ));
    }
    let experts = instances.len();
    // `away[e·world + r]`: all ones where rank `r` holds no instance of
    // expert `e`, so a cell sends astray iff `cell & away` is not zero.
    let mut away = vec![u32::MAX; experts * world];
    for (e, inst) in instances.iter().enumerate() {
        inst.iter()
            .filter(|&&r| r < world)
            .for_each(|&r| away[e * world + r] = 0);
    }
    for (s, n) in counts.iter().enumerate() {
        if split.experts() != n.len() || split.experts() != experts {
            return bad(format!(
                "source {s}: a split for {} experts, {} expected",
                split.experts(),
                n.len()
            ));
        }
        // The common case in one pass over the source's cells: no pair
        // astray (one OR against the mask), every cell's sum as counted.
        let cells = &split.counts()[s * experts * world..(s + 1) * experts * world];
        let sums_hold = (cells.chunks_exact(world.max(1)).zip(n))
            .all(|(cell, &c)| cell.iter().map(|&v| u64::from(v)).sum::<u64>() == u64::from(c));
        if sums_hold && !split.astray(s, &away) {
            continue;
        }
        // Otherwise the first bad cell, named.
        for (e, (cell, &c)) in split.row(s).zip(n).enumerate() {
            let sum: u64 = cell.iter().map(|&v| u64::from(v)).sum();
            if sum != u64::from(c) {
                return bad(format!(
                    "source {s}, expert {e}: the split carries {sum} pairs, {c} expected"
                ));
            }
            let m = &away[e * world..(e + 1) * world];
            if let Some(r) = (0..world).find(|&r| cell[r] & m[r] != 0) {
                return bad(format!(
                    "source {s}, expert {e}: pairs sent to rank {r}, which holds no instance"
                ));
            }
        }
    }
    Ok(())
}

/// Checks a plan for `world` ranks with experts owned in blocks of
/// `per_rank` against the routed counts.
pub fn check_plan(plan: &EpPlan, routed: &[Vec<u32>], per_rank: usize) -> Result<(), LayerError> {
    check_routes(&plan.instances, &plan.forward, routed, per_rank)?;
    check_quotas(plan, routed.len())
}

/// The forward's half of [`check_plan`]: each expert's instances (its
/// owner first, each rank once) and the split of the routed counts over
/// them.
pub fn check_routes(
    instances: &[Vec<usize>],
    forward: &Split,
    routed: &[Vec<u32>],
    per_rank: usize,
) -> Result<(), LayerError> {
    let world = routed.len();
    let experts = routed.first().map_or(0, Vec::len);
    if instances.len() != experts {
        return Err(LayerError::Config(format!(
            "a plan for {} experts, {experts} expected",
            instances.len(),
        )));
    }
    for (e, inst) in instances.iter().enumerate() {
        let owner = e / per_rank.max(1);
        let dup = inst.iter().enumerate().any(|(i, r)| inst[..i].contains(r));
        if inst.first() != Some(&owner) || dup || inst.iter().any(|&r| r >= world) {
            return Err(LayerError::Config(format!(
                "expert {e}: instances {inst:?} must start with its owner {owner}, each rank once, below {world}"
            )));
        }
    }
    check_split(forward, routed, instances)
}

/// The backward's half of [`check_plan`]: a quota per expert, a cap per
/// rank if any (what [`DevicePlanner::complete`] adds to routes that
/// [`check_routes`] passed).
pub(crate) fn check_quotas(plan: &EpPlan, world: usize) -> Result<(), LayerError> {
    if plan.quotas.len() != plan.instances.len() {
        return Err(LayerError::Config(format!(
            "{} quotas for {} experts",
            plan.quotas.len(),
            plan.instances.len()
        )));
    }
    if let Some(c) = &plan.caps {
        if c.len() != world {
            return Err(LayerError::Config(format!(
                "{} caps for {world} ranks",
                c.len()
            )));
        }
    }
    Ok(())
}

/// The controller of the device executor
/// (`layer::device::forward` / `backward`): [`device_plan_call`]
/// (replicas, per-expert quotas, pair caps) from the routed counts, the
/// forward's pairs spread over the instances and the backward's kept pairs
/// redistributed over the same instances by `redistribute` (the exact
/// solver for the forward, [`CallConfig::solver`] for the backward, under
/// the caps). Deterministic, so every rank computes the same plan.
#[derive(Debug)]
pub struct DevicePlanner {
    cfg: MoeConfig,
    call: CallConfig,
    /// The controller's plan of the last forward, for the caller's figures.
    last: std::sync::Mutex<Option<CallPlan>>,
    /// Per-expert quotas that replace the controller's (a plan replayed
    /// from elsewhere).
    fixed: Option<Vec<u32>>,
    /// Bytes of one row element, for the controller's budgets (2: bf16).
    value_bytes: u64,
}

impl DevicePlanner {
    /// A planner for this layer and call settings on the device
    /// ([`check_device_call`]).
    pub fn new(cfg: MoeConfig, call: CallConfig) -> Result<Self, LayerError> {
        check_device_call(&call)?;
        let mut p = Self::host(cfg, call)?;
        p.value_bytes = 2;
        Ok(p)
    }

    /// A planner for this layer and call settings on the host backend
    /// (every rule and selection; rows of `f32` unless
    /// [`DevicePlanner::for_values`] says otherwise).
    pub fn host(cfg: MoeConfig, call: CallConfig) -> Result<Self, LayerError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            call,
            last: std::sync::Mutex::new(None),
            fixed: None,
            value_bytes: 4,
        })
    }

    /// The controller's plan of the last forward this planner made (routed
    /// counts, placement with replicas, quotas), taken out.
    pub fn take_last_plan(&self) -> Option<CallPlan> {
        self.last.lock().ok().and_then(|mut l| l.take())
    }

    /// Keeps `round(r · n_e)` pairs of every expert (`r ≥ 1`: all), no
    /// replicas: for tests and benchmarks.
    pub fn ratio(cfg: &MoeConfig, r: f64) -> Self {
        Self::ratio_with_replicas(cfg, r, 0)
    }

    /// [`DevicePlanner::ratio`] with `slots` replica slots per rank (the
    /// controller places replicas of the hottest experts).
    pub fn ratio_with_replicas(cfg: &MoeConfig, r: f64, slots: usize) -> Self {
        let retention = if r >= 1.0 {
            Retention::Full
        } else {
            Retention::Ratio(r.max(0.0))
        };
        Self {
            cfg: *cfg,
            call: CallConfig {
                retention,
                replica_slots_per_rank: slots,
                ..CallConfig::default()
            },
            last: std::sync::Mutex::new(None),
            fixed: None,
            value_bytes: 2,
        }
    }

    /// The same planner with its binding quotas trimmed to whole GEMM
    /// tiles ([`CallConfig::tile_align`]).
    pub fn tile_aligned(mut self, align: TileAlign) -> Self {
        self.call.tile_align = Some(align);
        self
    }

    /// The same planner for rows of `T` (the host backend's `f32` or
    /// `f64`): the controller's budgets count `T`'s bytes.
    pub fn for_values<T>(mut self) -> Self {
        self.value_bytes = std::mem::size_of::<T>() as u64;
        self
    }

    /// The call's capacity factor (the capacity-factor baseline), if any.
    pub fn capacity_factor(&self) -> Option<f64> {
        self.call.capacity_factor
    }

    /// The auxiliary balancing loss's coefficient (0: off).
    pub fn aux_loss_coeff(&self) -> f64 {
        self.call.aux_loss_coeff
    }

    /// Whether owners keep their forward rows' projections for the
    /// backward ([`CallConfig::keep_projections`]).
    pub fn keep_projections(&self) -> bool {
        self.call.keep_projections
    }

    /// Keeps exactly `quotas[e]` pairs of expert `e` (at most what was
    /// routed), no replicas: a plan made elsewhere, replayed (the device
    /// tests give one GPU the quotas a multi-GPU controller chose).
    pub fn fixed_quotas(cfg: &MoeConfig, quotas: Vec<u32>) -> Self {
        Self {
            fixed: Some(quotas),
            ..Self::ratio(cfg, 1.0)
        }
    }

    fn solve(
        &self,
        counts: &[Vec<u32>],
        instances: &[Vec<usize>],
        caps: Option<Vec<u64>>,
        solver: redistribute::Solver,
    ) -> Result<Split, LayerError> {
        let n_ranks = counts.len();
        if one_instance_each(instances) {
            // One instance per expert: nothing to choose (the caps were
            // honoured by the quotas).
            return owners_split(counts, |e| instances[e][0], n_ranks);
        }
        let problem = redistribute::Problem {
            n_ranks,
            kept: counts
                .iter()
                .map(|row| row.iter().map(|&c| u64::from(c)).collect())
                .collect(),
            instances: instances.to_vec(),
            base_load: vec![0; n_ranks],
            rank_capacity: caps,
        };
        let cfg = redistribute::Config {
            solver,
            ..redistribute::Config::default()
        };
        let a = redistribute::solve(&problem, &cfg)?;
        let mut split = Split::zeros(n_ranks, instances.len(), n_ranks);
        for r in &a.routes {
            let cell = &mut split[(r.source, r.expert, r.rank)];
            *cell = u32::try_from(u64::from(*cell) + r.pairs).map_err(|_| {
                LayerError::Config(format!("{} pairs in one route exceed u32", r.pairs))
            })?;
        }
        Ok(split)
    }
}

impl DevicePlanner {
    /// This call's plan from every source's routed pairs per expert
    /// (`[sources][experts]`): the controller's quotas, replicas and caps,
    /// and the forward's pairs spread over the instances (exact solver).
    /// [`DevicePlanner::routes`] then [`DevicePlanner::complete`].
    pub fn forward(&self, routed: &[Vec<u32>]) -> Result<EpPlan, LayerError> {
        self.complete(self.routes(routed)?)
    }

    /// The forward's half of [`DevicePlanner::forward`]: this call's
    /// replicas and the forward's pairs spread over the instances (exact
    /// solver), all the forward's dispatch waits for.
    pub fn routes(&self, routed: &[Vec<u32>]) -> Result<EpRoutes, LayerError> {
        let (counts, owners) = owned_in_blocks(&self.cfg, routed)?;
        let placement = call_replicas(&self.cfg, &self.call, &counts, &owners, self.value_bytes)?;
        let instances = placement.all_instances();
        let forward = self.solve(routed, &instances, None, self.call.forward_solver())?;
        Ok(EpRoutes {
            instances,
            forward,
            routed: counts,
            owners,
            placement,
        })
    }

    /// The backward's half of [`DevicePlanner::forward`]: the quotas and
    /// caps of the call `routes` places (the controller under the call's
    /// retention), which an executor may compute while the forward's
    /// experts run. The plan is the one [`DevicePlanner::forward`] gives.
    pub fn complete(&self, routes: EpRoutes) -> Result<EpPlan, LayerError> {
        let EpRoutes {
            instances,
            forward,
            routed,
            owners,
            placement,
        } = routes;
        let plan = call_quotas(
            &self.cfg,
            &self.call,
            routed,
            &owners,
            placement,
            self.value_bytes,
        )?;
        let cells = (plan.selection == Selection::PerSourceExpert).then(|| {
            (plan.kept.iter())
                .map(|row| {
                    row.iter()
                        .map(|&q| u32::try_from(q).unwrap_or(u32::MAX))
                        .collect()
                })
                .collect()
        });
        let quotas = match &self.fixed {
            Some(q) if q.len() == self.cfg.n_experts => q.clone(),
            Some(q) => {
                return Err(LayerError::Config(format!(
                    "{} fixed quotas for {} experts",
                    q.len(),
                    self.cfg.n_experts
                )))
            }
            None => plan.device_quotas(),
        };
        let out = EpPlan {
            quotas,
            instances,
            forward,
            caps: plan.caps.clone(),
            rule: self.call.rule,
            seed: call_seed(self.call.rule_seed, &plan.routed),
            cells,
        };
        if let Ok(mut l) = self.last.lock() {
            *l = Some(plan);
        }
        Ok(out)
    }

    /// Whether every call of this planner keeps each expert on its owner
    /// alone (no replica slots): then a call's forward split is its routed
    /// counts, known before the controller runs, so an executor can send
    /// the rows first and plan while the experts compute.
    pub fn owners_only(&self) -> bool {
        self.call.replica_slots_per_rank == 0
    }

    /// The backward's split of the kept pairs (`kept[s][e]`, after
    /// selection) over the plan's instances, `(source, expert, rank)`,
    /// under the plan's caps ([`CallConfig::solver`]).
    pub fn backward(&self, plan: &EpPlan, kept: &[Vec<u32>]) -> Result<Split, LayerError> {
        self.solve(kept, &plan.instances, plan.caps.clone(), self.call.solver)
    }
}

/// The split `(source, expert, rank)` of a call whose experts each have
/// one instance, `owner(e)`: every pair goes to its expert's owner (what
/// the exact solver gives for one instance per expert). The one-instance
/// rule of every executor.
pub(crate) fn owners_split(
    counts: &[Vec<u32>],
    owner: impl Fn(usize) -> usize,
    n_ranks: usize,
) -> Result<Split, LayerError> {
    let experts = counts.first().map_or(0, Vec::len);
    let mut split = Split::zeros(counts.len(), experts, n_ranks);
    for (s, row) in counts.iter().enumerate() {
        if row.len() != experts {
            return Err(LayerError::Config(format!(
                "source {s}: counts for {} experts, {experts} expected",
                row.len()
            )));
        }
        for (e, &c) in row.iter().enumerate() {
            let o = owner(e);
            if o >= n_ranks {
                return Err(LayerError::Config(format!(
                    "expert {e}'s owner {o} is not a rank"
                )));
            }
            split[(s, e, o)] = c;
        }
    }
    Ok(split)
}
