//! # quota — the LRMoE controller
//!
//! Before a layer's backward runs, the controller sees how many routed pairs
//! reached each expert from each source rank, `n[s][e]`, and fixes how many
//! of them the backward keeps, `k[s][e] ≤ n[s][e]` (the expert's quota is
//! `q_e = Σ_s k[s][e]`). It also plans the forward-time replicas of hot
//! experts ([`plan_replicas`]; [`replicas_by_load`] is the SYMI-like
//! baseline's rule, from the previous call's load). Quotas are fixed for the
//! whole layer call; which pairs fill them is decided later by their LRM
//! scores (`lrm-score`).
//!
//! ## Cost model ([`CostModel`])
//!
//! A kept pair carries `row = act_row_bytes + grad_row_bytes` bytes (its saved
//! activation row and its output-gradient row) from its source rank to the
//! instance that computes its backward, and occupies `row` bytes of backward
//! buffer there. An expert instance holds `W + G = expert_weight_bytes +
//! expert_grad_bytes`. For rank `r` with `o_r` owned experts and `ρ_r`
//! replicas, and at most `P_r` pairs processed:
//!
//! ```text
//! memory_r   = (o_r + ρ_r)·(W + G) + P_r·row                ≤ memory_bytes_r
//! dispatch_in_r  = P_r·row   (upper bound: every pair remote) ≤ network_bytes_r
//! dispatch_out_s = K_s·row   (K_s = Σ_e k[s][e])              ≤ network_bytes_s
//! compute_r  = P_r·flops_per_pair / flops_per_s
//! network_r  = max(dispatch_in_r, dispatch_out_r) / link_bytes_per_s
//! ```
//!
//! The network budget bounds the backward *dispatch* all-to-all (kept rows
//! to instances); the return of input-gradient rows moves `grad_row_bytes`
//! per pair the other way and is reported, not budgeted. From the budgets
//! each rank gets a pair capacity
//! `cap_r = min(⌊(memory_bytes_r − (o_r+ρ_r)(W+G)) / row⌋, ⌊network_bytes_r / row⌋)`
//! and each source a send capacity `⌊network_bytes_s / row⌋`. A rank whose
//! weights alone exceed its memory budget is [`QuotaError::InsufficientMemory`]
//! naming the rank and the shortfall.
//!
//! The caps go to `redistribute` as its `rank_capacity`, so *any* assignment
//! it returns keeps every rank within budget. Quotas are feasible exactly when
//! the flow network
//!
//! ```text
//! SOURCE →(send cap_s)→ s →(k[s][e])→ e →(∞)→ r ∈ instances(e) →(cap_r)→ SINK
//! ```
//!
//! carries `Σ k[s][e]` — checked with `redistribute::flow`'s max-flow. When
//! every send capacity is unlimited (memory-only budgets) sources constrain
//! nothing, and the network has one cell per expert instead (`SOURCE →(q_e)→
//! e`); the expert's floors are kept per source and any extra max-min pairs
//! go to the sources in rank order, up to what each routed.
//!
//! ## Policies ([`Policy`])
//!
//! * **Uniform:** one retention ratio `ρ ∈ [0, 1]` for every cell,
//!   `k[s][e] = ⌊ρ·n[s][e]⌋`, with `ρ = j / 2²⁰` the largest feasible value.
//!   `ρ = 1` is tried first so unlimited budgets keep every pair. Up to 12
//!   ranks a bisection checks Gale's subset condition instead of a flow.
//!   Past 12 ranks the search starts from bounds that need no flow — every
//!   expert on its owner or split evenly over its instances fits below, the
//!   experts one rank alone holds overflow it above — and is cut-guided from
//!   the top: a ratio whose flow falls short names a minimum cut, and the
//!   search moves to the largest ratio at which that cut carries every floor
//!   (nothing between can be feasible), each flow augmenting the lower
//!   bound's instead of starting afresh; three flows where a bisection
//!   took twenty at 16 ranks.
//!   Feasibility is monotone in `ρ` and in the budgets, so a
//!   larger budget never lowers a quota.
//! * **Max-min fair:** first the uniform `ρ*` (this maximises the smallest
//!   retention ratio up to the floor), then, keeping every `k[s][e] ≥
//!   ⌊ρ*·n[s][e]⌋`, the total kept pairs are maximised by augmenting the same
//!   flow with the lower bounds frozen. Its smallest ratio never falls as
//!   budgets grow; an individual expert's extra pairs may move between
//!   experts (max-min allocations are not monotone per flow in general).
//!
//! ## Replicas ([`plan_replicas`])
//!
//! Greedy, as in deepseek-ai/EPLB: repeatedly give one more instance to the
//! expert with the largest routed load per instance, on the rank with the
//! smallest modelled load that does not host it, has a free replica slot,
//! and keeps replica memory within `replica_memory_fraction` of the memory
//! its budget leaves after owned experts. Replicas cost buffer memory, so
//! [`plan`] trades them off through that fraction.
//!
//! A replica also costs time: its weights travel from the owner before the
//! forward and its gradient back after the backward. With
//! [`ReplicaRule::Paying`] (the default) the controller keeps the prefix of
//! the greedy's sequence whose modelled call time is smallest
//! ([`modelled_call_seconds`]); [`plan_replicas_and_fill`] returns that
//! prefix and the whole sequence from one pass. The model follows the layer call's
//! phases, each ending when its busiest rank does: the expert work, with
//! `m_r` the routed pairs rank `r` serves (each expert's split over its
//! instances as a min-max split would, approximated by water-filling: the
//! experts with the fewest instances first, then the largest); the
//! replicas' traffic, with `in_r`, `out_r` the bytes rank `r` receives and
//! sends (a host receives `W` and sends `G` per replica it holds, an owner
//! the reverse per replica of its experts); and, with `x =
//! exchange_row_bytes > 0`, the four token exchanges (the forward's
//! dispatch and combine, the backward's dispatch of kept `[x | δ]` rows and
//! return of input gradients; every pair counted as kept, since the quotas
//! come later), in which `a_r`, the pairs rank `r` serves for other ranks,
//! and `d_r`, its own pairs served elsewhere, each cross once per exchange
//! (each source's pairs of an expert are taken to spread over its
//! instances as the expert's do, so a rank serving a share of an expert
//! serves that share of its own pairs locally):
//!
//! ```text
//! T = max_r m_r·(flops_per_pair + forward_flops_per_pair) / flops_per_s
//!   + max_r max(in_r, out_r) / link_bytes_per_s
//!   + max_r max(a_r, d_r)·(3·x + row) / link_bytes_per_s
//! ```
//!
//! With `x = 0` the model is the one the rule used before it counted the
//! rows, each rank's compute and replica traffic added and the slowest
//! rank's sum taken, `T = max_r (m_r·(b + f)/F + max(in_r, out_r)/L)`;
//! [`ReplicaRule::PayingCompute`] plans with it whatever `x` is, to compare
//! the two in one run. Without the rows, moving `m` pairs off the busiest rank
//! pays once `m·(b + f) / F > W / L`: for a SwiGLU expert in bf16 (`W =
//! 6·hidden·ffn` bytes, `b + f = 22·hidden·ffn` FLOP) that is `m > 3·F /
//! (11·L)` whatever the shape — about 485 pairs at an H200's 800 TFLOP/s
//! and 450 GB/s. The rows (`10·hidden` bytes a remote pair in bf16) shift
//! that both ways. Pairs routed from other ranks cross the links whichever
//! instance serves them, so moving them off the busiest rank also takes
//! their rows off its link: the replica pays once
//! `m > 6·ffn / (22·ffn·L/F + 10)` (≈ 236 at `ffn` 768 over NVLink, ≈ 421
//! over a 45 GB/s inter-node link, which also makes the weights dearer).
//! Pairs routed from the owner's own rank start crossing a link when a
//! replica serves them, so for those it pays only once
//! `m > 6·ffn / (22·ffn·L/F − 10)`, and never where `22·ffn·L/F ≤ 10`
//! (the A3B and qwen3-moe-mini experts over NVLink). At small batches (tens
//! of pairs per expert) no replica pays, and the slots' memory stays with
//! the token buffers;
//! [`ReplicaRule::Fill`] places every replica the slots allow. A caller
//! that reserves the slots whatever the rule places (the trainer) plans the
//! quotas with [`budgets_without_empty_slots`], so that an empty slot's bytes
//! hold no rows.
//!
//! Where the caller's budget holds the forward's rows too
//! ([`Config::forward_rows_cap`]: the most routed pairs one rank may compute
//! in the forward), a call whose busiest rank is over it must be split into
//! micro-batches, a cost `T` does not price. The paying rule then lengthens
//! its prefix to the shortest one whose modelled forward rows `m_r`
//! ([`modelled_forward_rows`]) are within the cap on every rank, if any
//! prefix's are; otherwise it keeps its own.
//!
//! ## Tile alignment ([`align_to_tiles`])
//!
//! The expert GEMMs pad each expert's rows to whole `tile`-row blocks, so a
//! quota of `t·tile + rem` pays a block of work for `rem` rows. Optionally,
//! a binding quota whose remainder is at most `max_drop` of it is trimmed to
//! `t·tile` (never up, so every budget still holds).
//!
//! ## Not here
//!
//! No I/O, no CUDA, no choice of *which* pairs are kept (`lrm-score`) and no
//! assignment of pairs to instances (`redistribute`).

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use redistribute::flow::{EdgeId, FlowGraph};
use serde::{Deserialize, Serialize};

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuotaError {
    /// A vector's length does not match the problem's dimensions.
    #[error("{what}: expected length {expected}, got {got}")]
    Shape {
        /// Which field.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// A placement names a rank outside `0..n_ranks` or repeats one.
    #[error("expert {expert}: rank {rank} is out of range or repeated (n_ranks = {n_ranks})")]
    BadRank {
        /// The expert.
        expert: usize,
        /// The rank.
        rank: usize,
        /// Number of ranks.
        n_ranks: usize,
    },
    /// The experts placed on a rank alone exceed its memory budget.
    #[error("rank {rank}: expert weights and gradients need {needed_bytes} B but the memory budget is {budget_bytes} B (short by {shortfall_bytes} B)")]
    InsufficientMemory {
        /// The rank.
        rank: usize,
        /// Bytes of owned and replicated experts.
        needed_bytes: u64,
        /// Its memory budget.
        budget_bytes: u64,
        /// `needed − budget`.
        shortfall_bytes: u64,
    },
    /// A sum the controller needs does not fit in `u64`.
    #[error("{what} overflows u64")]
    Overflow {
        /// Which sum.
        what: &'static str,
    },
    /// A cost-model value is negative, NaN or infinite (or 0 where a rate
    /// or a backward cost is meant).
    #[error("cost model field {field} must be finite and > 0 (≥ 0 for forward_flops_per_pair; got {value})")]
    BadCost {
        /// Field name.
        field: &'static str,
        /// Value.
        value: f64,
    },
    /// A fraction is outside `[0, 1]`.
    #[error("{field} must be in [0, 1] (got {value})")]
    BadFraction {
        /// Field name.
        field: &'static str,
        /// Value.
        value: f64,
    },
}

/// Where each expert lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// Owner rank of each expert, `[n_experts]`.
    pub owner: Vec<usize>,
    /// Replica ranks of each expert, `[n_experts][*]` (may be empty).
    #[serde(default)]
    pub replicas: Vec<Vec<usize>>,
}

impl Placement {
    /// Every rank holding an instance of `expert`: owner first.
    pub fn instances(&self, expert: usize) -> Vec<usize> {
        self.instance_ranks(expert).collect()
    }

    /// [`Self::instances`] without the allocation: the owner, then the
    /// replicas.
    fn instance_ranks(&self, expert: usize) -> impl Iterator<Item = usize> + '_ {
        let replicas: &[usize] = self.replicas.get(expert).map_or(&[], Vec::as_slice);
        std::iter::once(self.owner[expert]).chain(replicas.iter().copied())
    }

    /// Instances of every expert.
    pub fn all_instances(&self) -> Vec<Vec<usize>> {
        (0..self.owner.len()).map(|e| self.instances(e)).collect()
    }

    /// Number of expert instances (owned plus replicas) on each rank.
    pub fn instances_per_rank(&self, n_ranks: usize) -> Vec<u64> {
        let mut n = vec![0u64; n_ranks];
        for e in 0..self.owner.len() {
            for r in self.instance_ranks(e) {
                n[r] += 1;
            }
        }
        n
    }
}

/// Byte and rate costs (see the crate doc).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// Saved activation bytes per kept pair.
    pub act_row_bytes: u64,
    /// Output-gradient bytes per kept pair.
    pub grad_row_bytes: u64,
    /// Bytes of one expert's weights.
    pub expert_weight_bytes: u64,
    /// Bytes of one expert's weight gradient.
    pub expert_grad_bytes: u64,
    /// Backward FLOPs per kept pair.
    pub flops_per_pair: f64,
    /// Forward FLOPs per routed pair (every routed pair runs forward; only
    /// the replica rule reads it, see [`ReplicaRule::Paying`]). 0: the
    /// forward is left out of the replicas' gain.
    #[serde(default)]
    pub forward_flops_per_pair: f64,
    /// Bytes of one token row (`hidden` values) that the call's exchanges
    /// move per routed pair: the forward's dispatch and combine, the
    /// backward's return of input gradients (see [`ReplicaRule::Paying`];
    /// only the replica rule reads it). 0: the token exchanges are left out
    /// of the replicas' gain.
    #[serde(default)]
    pub exchange_row_bytes: u64,
    /// Link bandwidth per rank and direction, bytes/s.
    pub link_bytes_per_s: f64,
    /// Compute rate per rank, FLOP/s.
    pub flops_per_s: f64,
}

/// Dense bf16 rate of one H200 that default cost models assume, FLOP/s.
pub const H200_FLOPS_PER_S: f64 = 8.0e14;

/// One direction of one H200's NVLink that default cost models assume,
/// bytes per second.
pub const H200_LINK_BYTES_PER_S: f64 = 4.5e11;

impl CostModel {
    /// The cost model of a SwiGLU expert (`gate`, `up`: hidden × ffn;
    /// `down`: ffn × hidden) with `element_bytes` per value: a kept pair
    /// carries its saved input row and its output-gradient row (`hidden`
    /// values each); an instance holds three weight matrices and their
    /// gradients; a pair's backward costs `16·hidden·ffn` FLOP (the three
    /// data-gradient and three weight-gradient GEMM rows plus the SwiGLU
    /// recompute, rounded), its forward `6·hidden·ffn` (three GEMM rows).
    /// Sizes saturate at `u64::MAX`.
    pub fn swiglu_expert(
        hidden: usize,
        ffn: usize,
        element_bytes: u64,
        link_bytes_per_s: f64,
        flops_per_s: f64,
    ) -> Self {
        let (h, f) = (hidden as u64, ffn as u64);
        let row = h.saturating_mul(element_bytes);
        let matrices = h
            .saturating_mul(f)
            .saturating_mul(3)
            .saturating_mul(element_bytes);
        CostModel {
            act_row_bytes: row,
            grad_row_bytes: row,
            expert_weight_bytes: matrices,
            expert_grad_bytes: matrices,
            flops_per_pair: 16.0 * hidden as f64 * ffn as f64,
            forward_flops_per_pair: 6.0 * hidden as f64 * ffn as f64,
            exchange_row_bytes: row,
            link_bytes_per_s,
            flops_per_s,
        }
    }

    /// Bytes a kept pair moves and buffers.
    pub fn row_bytes(&self) -> u64 {
        self.act_row_bytes.saturating_add(self.grad_row_bytes)
    }

    /// Bytes of one expert instance (weights and gradient).
    pub fn instance_bytes(&self) -> u64 {
        self.expert_weight_bytes
            .saturating_add(self.expert_grad_bytes)
    }

    fn validate(&self) -> Result<(), QuotaError> {
        for (field, value) in [
            ("flops_per_pair", self.flops_per_pair),
            ("link_bytes_per_s", self.link_bytes_per_s),
            ("flops_per_s", self.flops_per_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(QuotaError::BadCost { field, value });
            }
        }
        let value = self.forward_flops_per_pair;
        if !(value.is_finite() && value >= 0.0) {
            return Err(QuotaError::BadCost {
                field: "forward_flops_per_pair",
                value,
            });
        }
        Ok(())
    }
}

/// One rank's budgets for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankBudget {
    /// Memory for owned and replicated experts plus backward buffers, bytes.
    pub memory_bytes: u64,
    /// Backward dispatch bytes per direction.
    pub network_bytes: u64,
}

impl RankBudget {
    /// No limit on either resource.
    pub const UNLIMITED: Self = Self {
        memory_bytes: u64::MAX,
        network_bytes: u64::MAX,
    };
}

/// How quotas share a scarce budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// One retention ratio for every (source, expert) cell.
    #[default]
    Uniform,
    /// Maximise the smallest ratio, then the total kept pairs.
    Maxmin,
}

/// Controller settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Quota policy.
    pub policy: Policy,
    /// Replicas each rank may host (0 disables replication).
    pub replica_slots_per_rank: usize,
    /// Share of a rank's post-placement memory that replicas may use.
    pub replica_memory_fraction: f64,
    /// Which of the greedy's replicas are placed.
    pub replica_rule: ReplicaRule,
    /// The budget holding the forward's rows: the most routed pairs one
    /// rank may compute in the call's forward (`None`: not held). Where the
    /// prefix [`ReplicaRule::Paying`] (or `PayingCompute`) picks leaves a
    /// rank's modelled forward rows ([`modelled_forward_rows`]) above it,
    /// the rule takes the shortest longer prefix of the greedy's sequence
    /// that brings every rank within it — a call over the budget must be
    /// split into micro-batches, which the model does not price — or,
    /// where no prefix does, the one it picked. [`ReplicaRule::Fill`]
    /// places every replica either way.
    pub forward_rows_cap: Option<u64>,
}

/// Which replicas [`plan_replicas`] places (see the crate doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaRule {
    /// The greedy's replicas up to the first that no longer pays: the
    /// prefix of its sequence with the smallest modelled call time
    /// ([`modelled_call_seconds`]; ties: fewer replicas). A slot left empty
    /// leaves its memory to the token buffer unless the caller's budgets
    /// keep it out (the trainer's do: `layer::CallConfig::slots_reserved`).
    #[default]
    Paying,
    /// Every replica the slots and memory allow (EPLB's greedy as is).
    Fill,
    /// [`ReplicaRule::Paying`] with the token exchanges left out of the
    /// model (`exchange_row_bytes` taken as 0): the rule as it was before
    /// it counted them, kept to compare the two in one run.
    #[serde(rename = "paying-compute")]
    PayingCompute,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: Policy::Uniform,
            replica_slots_per_rank: 0,
            replica_memory_fraction: 0.25,
            replica_rule: ReplicaRule::Paying,
            forward_rows_cap: None,
        }
    }
}

/// Routed pair counts and everything the controller needs to plan.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// Routed pairs `[n_ranks][n_experts]`, source rank × expert.
    pub counts: &'a [Vec<u64>],
    /// Expert placement (replicas given here are kept).
    pub placement: &'a Placement,
    /// Cost model.
    pub cost: &'a CostModel,
    /// Budgets `[n_ranks]`.
    pub budgets: &'a [RankBudget],
}

impl Inputs<'_> {
    fn n_ranks(&self) -> usize {
        self.budgets.len()
    }

    fn n_experts(&self) -> usize {
        self.placement.owner.len()
    }

    fn validate(&self) -> Result<(), QuotaError> {
        let (n_ranks, n_experts) = (self.n_ranks(), self.n_experts());
        shape("counts", n_ranks, self.counts.len())?;
        for row in self.counts {
            shape("counts[source]", n_experts, row.len())?;
        }
        if !self.placement.replicas.is_empty() {
            shape(
                "placement.replicas",
                n_experts,
                self.placement.replicas.len(),
            )?;
        }
        for expert in 0..n_experts {
            // Each instance a rank below `n_ranks` that no earlier one
            // (the owner first) holds.
            let earlier = |i: usize| self.placement.instance_ranks(expert).take(i);
            for (i, rank) in self.placement.instance_ranks(expert).enumerate() {
                if rank >= n_ranks || earlier(i).any(|r| r == rank) {
                    return Err(QuotaError::BadRank {
                        expert,
                        rank,
                        n_ranks,
                    });
                }
            }
        }
        // Every later sum of pairs (per expert, per rank, kept totals) is
        // bounded by this one.
        self.counts
            .iter()
            .flatten()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .ok_or(QuotaError::Overflow {
                what: "the total of counts",
            })?;
        self.cost.validate()
    }

    fn routed_per_expert(&self) -> Vec<u64> {
        let mut n = vec![0u64; self.n_experts()];
        for row in self.counts {
            for (e, &c) in row.iter().enumerate() {
                n[e] = n[e].saturating_add(c);
            }
        }
        n
    }
}

fn shape(what: &'static str, expected: usize, got: usize) -> Result<(), QuotaError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuotaError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// Kept pairs per (source, expert). Only the controller builds one, so a
/// `Quotas` value always satisfies `k[s][e] ≤ n[s][e]` and the budgets it was
/// planned for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quotas {
    per_source: Vec<Vec<u64>>,
}

impl Quotas {
    /// `k[s][e]`: kept pairs of expert `e` from source rank `s`.
    pub fn per_source(&self) -> &[Vec<u64>] {
        &self.per_source
    }

    /// `q_e = Σ_s k[s][e]`.
    pub fn per_expert(&self) -> Vec<u64> {
        let n_experts = self.per_source.first().map_or(0, Vec::len);
        let mut q = vec![0u64; n_experts];
        for row in &self.per_source {
            for (e, &k) in row.iter().enumerate() {
                q[e] += k;
            }
        }
        q
    }

    /// Total kept pairs.
    pub fn total(&self) -> u64 {
        self.per_source.iter().flatten().sum()
    }
}

/// The modelled backward of one rank (see the crate doc's formulas).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RankModel {
    /// Bytes of owned experts (weights + gradients).
    pub placement_bytes: u64,
    /// Bytes of replicas (weights + gradients).
    pub replica_bytes: u64,
    /// Backward buffer bytes at the pair capacity.
    pub buffer_bytes: u64,
    /// Sum of the three.
    pub memory_bytes: u64,
    /// Most pairs this rank may process (`cap_r`, also given to `redistribute`).
    pub pair_capacity: u64,
    /// Kept pairs whose source is this rank (`K_s`).
    pub source_pairs: u64,
    /// Upper bound on dispatch bytes received.
    pub dispatch_in_bytes: u64,
    /// Upper bound on dispatch bytes sent.
    pub dispatch_out_bytes: u64,
    /// Modelled compute time at the capacity, seconds.
    pub compute_s: f64,
    /// Modelled dispatch time, seconds.
    pub network_s: f64,
}

/// The controller's decision for one layer call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Kept pairs per (source, expert).
    pub quotas: Quotas,
    /// Placement including the replicas added for this call.
    pub placement: Placement,
    /// `(expert, rank)` of each replica added by the controller.
    pub replicas_added: Vec<(usize, usize)>,
    /// Retention ratio every cell reaches at least (`ρ*`).
    pub retention_floor: f64,
    /// Kept fraction of all routed pairs.
    pub kept_fraction: f64,
    /// Per-rank model.
    pub ranks: Vec<RankModel>,
    /// Policy used.
    pub policy: Policy,
}

/// Static (weights and gradients) bytes per rank under `placement`.
fn static_bytes(inputs: &Inputs<'_>, placement: &Placement) -> Vec<u64> {
    placement
        .instances_per_rank(inputs.n_ranks())
        .iter()
        .map(|&n| n.saturating_mul(inputs.cost.instance_bytes()))
        .collect()
}

/// Per-rank pair capacity and per-source send capacity.
fn capacities(
    inputs: &Inputs<'_>,
    placement: &Placement,
) -> Result<(Vec<u64>, Vec<u64>), QuotaError> {
    let row = inputs.cost.row_bytes();
    // An unlimited budget stays unlimited (not MAX / row), so callers can
    // recognise it.
    let per = |bytes: u64| {
        if bytes == u64::MAX {
            u64::MAX
        } else {
            bytes.checked_div(row).unwrap_or(u64::MAX)
        }
    };
    let stat = static_bytes(inputs, placement);
    let mut caps = Vec::with_capacity(inputs.n_ranks());
    for (rank, b) in inputs.budgets.iter().enumerate() {
        let Some(free) = b.memory_bytes.checked_sub(stat[rank]) else {
            return Err(QuotaError::InsufficientMemory {
                rank,
                needed_bytes: stat[rank],
                budget_bytes: b.memory_bytes,
                shortfall_bytes: stat[rank] - b.memory_bytes,
            });
        };
        caps.push(per(free).min(per(b.network_bytes)));
    }
    let send = inputs
        .budgets
        .iter()
        .map(|b| per(b.network_bytes))
        .collect();
    Ok((caps, send))
}

/// Source index of a per-expert cell (unlimited send capacities).
const AGGREGATED: usize = usize::MAX;

/// The quota flow network (see the crate doc).
struct Network {
    graph: FlowGraph,
    /// `(source, expert, mandatory edge, extra edge)` per non-empty cell.
    cells: Vec<(usize, usize, EdgeId, EdgeId)>,
    /// Each cell's floor terms: its routed count, or an aggregated cell's
    /// non-zero count per source.
    terms: Terms,
    sink: usize,
}

/// Cell `i`'s terms are `wide[start[i]..start[i + 1]]`; `narrow` holds the
/// same in 32 bits when every one fits (the floors' fast path).
struct Terms {
    wide: Vec<u64>,
    narrow: Option<Vec<u32>>,
    start: Vec<usize>,
}

impl Terms {
    fn new(cells: &[(usize, usize, EdgeId, EdgeId)], inputs: &Inputs<'_>) -> Self {
        let (mut wide, mut start) = (Vec::new(), vec![0]);
        for &(s, e, _, _) in cells {
            if s == AGGREGATED {
                wide.extend(inputs.counts.iter().map(|row| row[e]).filter(|&n| n > 0));
            } else {
                wide.push(inputs.counts[s][e]);
            }
            start.push(wide.len());
        }
        let narrow = wide.iter().map(|&n| u32::try_from(n).ok()).collect();
        Self {
            wide,
            narrow,
            start,
        }
    }

    fn range(&self, cell: usize) -> std::ops::Range<usize> {
        self.start[cell]..self.start[cell + 1]
    }

    /// Cell `cell`'s pairs routed.
    fn routed(&self, cell: usize) -> u64 {
        self.wide[self.range(cell)].iter().sum()
    }

    /// Cell `cell`'s uniform floor at ratio `num / DEN`: the sum of its
    /// terms' floors (each source keeps its own).
    fn floor(&self, cell: usize, num: u64) -> u64 {
        let r = self.range(cell);
        floor_sum(
            &self.wide[r.clone()],
            self.narrow.as_ref().map(|v| &v[r]),
            num,
        )
    }
}

/// `Σ ⌊n·x/DEN⌋` over `wide`, from `narrow` (the same counts in 32 bits)
/// when there is one: a loop the compiler vectorises, n·x < 2⁵² with
/// x ≤ DEN = 2²⁰. The routed totals were checked to fit `u64`, so their
/// floors do.
fn floor_sum(wide: &[u64], narrow: Option<&[u32]>, x: u64) -> u64 {
    match narrow {
        Some(v) => floor_sum_u32(v, x),
        None => wide.iter().map(|&n| floor_ratio(n, x)).sum(),
    }
}

fn build_network(
    inputs: &Inputs<'_>,
    placement: &Placement,
    caps: &[u64],
    send: &[u64],
) -> Network {
    let (n_ranks, n_experts) = (inputs.n_ranks(), inputs.n_experts());
    let expert_node = |e: usize| 1 + n_ranks + e;
    let rank_node = |r: usize| 1 + n_ranks + n_experts + r;
    let sink = 1 + 2 * n_ranks + n_experts;
    let mut graph = FlowGraph::new(sink + 1);
    let routed = inputs.routed_per_expert();
    let mut cells = Vec::new();
    if send.iter().all(|&c| c == u64::MAX) {
        // Sources do not constrain anything: one cell per expert (source
        // `AGGREGATED`) keeps the network E + R nodes instead of S · E cells.
        for (e, &n) in routed.iter().enumerate() {
            if n > 0 {
                let mandatory = graph.add_edge(0, expert_node(e), 0);
                let extra = graph.add_edge(0, expert_node(e), 0);
                cells.push((AGGREGATED, e, mandatory, extra));
            }
        }
    } else {
        for (s, row) in inputs.counts.iter().enumerate() {
            graph.add_edge(0, 1 + s, send[s]);
            for (e, &n) in row.iter().enumerate() {
                if n > 0 {
                    let mandatory = graph.add_edge(1 + s, expert_node(e), 0);
                    let extra = graph.add_edge(1 + s, expert_node(e), 0);
                    cells.push((s, e, mandatory, extra));
                }
            }
        }
    }
    for (e, &n) in routed.iter().enumerate() {
        for r in placement.instance_ranks(e) {
            graph.add_edge(expert_node(e), rank_node(r), n);
        }
    }
    for (r, &cap) in caps.iter().enumerate() {
        graph.add_edge(rank_node(r), sink, cap);
    }
    let terms = Terms::new(&cells, inputs);
    Network {
        graph,
        cells,
        terms,
        sink,
    }
}

const RATIO_DEN: u64 = 1 << 20;

/// `Σ ⌊n·x/DEN⌋` over 32-bit counts, `x ≤ DEN` (no term overflows: each is
/// below 2³², so the sum of fewer than 2³² terms fits).
fn floor_sum_u32(counts: &[u32], x: u64) -> u64 {
    debug_assert!(x <= RATIO_DEN);
    counts
        .iter()
        .map(|&n| (u64::from(n) * x) >> RATIO_DEN.trailing_zeros())
        .sum()
}

fn floor_ratio(n: u64, num: u64) -> u64 {
    ((u128::from(n) * u128::from(num)) / u128::from(RATIO_DEN)) as u64
}

/// Whether every cell can keep `⌊num/DEN · n[s][e]⌋` pairs: the flow of
/// those pairs, from none, if so.
fn uniform_flow(net: &mut Network, num: u64) -> Option<u64> {
    net.graph.clear_flow();
    let mut want = 0u64;
    for (i, &(_, _, mandatory, extra)) in net.cells.iter().enumerate() {
        let k = net.terms.floor(i, num);
        want += k;
        net.graph.set_capacity(extra, 0);
        net.graph.set_capacity(mandatory, k);
    }
    (net.graph.max_flow(0, net.sink) == want).then_some(want)
}

/// Raises every cell's mandatory capacity to `⌊num/DEN · n[s][e]⌋` on top of
/// the current flow (capacities only grow); returns the pairs wanted.
fn raise_uniform(net: &mut Network, num: u64) -> u64 {
    let mut want = 0u64;
    for (i, &(_, _, mandatory, _)) in net.cells.iter().enumerate() {
        let k = net.terms.floor(i, num);
        want += k;
        net.graph.set_capacity(mandatory, k);
    }
    want
}

/// The largest feasible uniform ratio numerator by max-flow, leaving `net`
/// holding a feasible uniform flow at it. `bracket`: `lo` feasible or 0,
/// `hi` infeasible below `DEN` (`hi ≥ DEN`: nothing known above `lo`, and
/// `DEN` itself is checked first; `(0, DEN)` knows nothing). The search is
/// cut-guided from above (see `redistribute::flow`): a ratio whose flow
/// falls short names a minimum cut, the search moves to the largest ratio
/// that cut allows (necessary, so nothing between is feasible), and the
/// first ratio whose flow carries every floor is the largest feasible one.
/// Each check augments `lo`'s saved flow (raising the ratio only raises
/// capacities).
fn flow_search(net: &mut Network, bracket: (u64, u64)) -> u64 {
    if bracket.1 >= RATIO_DEN && uniform_flow(net, RATIO_DEN).is_some() {
        return RATIO_DEN;
    }
    let (mut lo, mut hi) = (bracket.0.min(RATIO_DEN - 1), bracket.1.min(RATIO_DEN));
    let kept = match uniform_flow(net, lo).filter(|_| lo < hi) {
        Some(kept) => kept,
        None => {
            // A bracket that does not hold (it never should): search it all.
            (lo, hi) = (0, RATIO_DEN);
            uniform_flow(net, 0).unwrap_or(0)
        }
    };
    let saved = net.graph.snapshot();
    let mut num = hi - 1;
    while num > lo {
        net.graph.restore(&saved);
        let want = raise_uniform(net, num);
        if kept + net.graph.max_flow(0, net.sink) == want {
            return num;
        }
        num = cut_ratio(net, lo, num);
    }
    net.graph.restore(&saved);
    lo
}

/// The largest numerator in `[lo, num)` at which the minimum cut of the
/// network's current flow (short at `num`; `lo` feasible) carries every
/// floor: with `fixed` the capacity of the edges it crosses whose capacity
/// does not follow the ratio, the floors of the cells whose mandatory edge
/// it does not cross must sum to at most `fixed`.
fn cut_ratio(net: &mut Network, lo: u64, num: u64) -> u64 {
    let side = net.graph.source_side(0);
    let (graph, terms) = (&net.graph, &net.terms);
    let mut mandatory = vec![false; graph.edges().len()];
    let mut behind: Vec<u64> = Vec::new();
    let mut narrow: Option<Vec<u32>> = terms.narrow.as_ref().map(|_| Vec::new());
    for (i, &(_, _, edge, _)) in net.cells.iter().enumerate() {
        mandatory[edge.index()] = true;
        if graph.crosses(edge, &side) {
            continue;
        }
        behind.extend_from_slice(&terms.wide[terms.range(i)]);
        if let (Some(v), Some(all)) = (&mut narrow, &terms.narrow) {
            v.extend_from_slice(&all[terms.range(i)]);
        }
    }
    let fixed = graph
        .cut_edges(&side)
        .filter(|&(e, _, _)| !mandatory[e.index()])
        .fold(0u128, |a, (e, _, _)| a + u128::from(graph.capacity(e)));
    let floors = |x: u64| u128::from(floor_sum(&behind, narrow.as_deref(), x));
    // Σ ⌊n·x/DEN⌋ lies within `behind.len()` of x·Σn/DEN: the answer is
    // within that window of fixed·DEN/Σn, so the bisection is short.
    let total: u128 = behind.iter().map(|&n| u128::from(n)).sum();
    let den = u128::from(RATIO_DEN);
    let (mut a, mut b) = match total {
        0 => (lo, num), // cannot bind (it always does); step down by one
        _ => {
            let within = |x: u128| u64::try_from(x).unwrap_or(u64::MAX).clamp(lo, num);
            let slack = behind.len() as u128 + 1;
            (
                within(fixed * den / total),
                within((fixed + slack) * den / total + 1),
            )
        }
    };
    // floors(a) ≤ fixed < floors(b), b ≤ num.
    if floors(a) > fixed {
        a = lo;
    }
    if b < num && floors(b) <= fixed {
        b = num;
    }
    while b - a > 1 {
        let mid = a + (b - a) / 2;
        if floors(mid) <= fixed {
            a = mid;
        } else {
            b = mid;
        }
    }
    a
}

/// Bounds on the largest feasible ratio numerator that need no flow, from
/// one pass over the counts: `lo` passes a sufficient condition (every
/// expert's kept pairs split evenly over its instances, or all on its
/// owner, fit every rank's capacity with a pair of slack per instance for
/// the rounding, and every source's kept pairs fit its sends), `hi` fails a
/// necessary one (the experts only one rank holds fit it, all kept pairs
/// fit all ranks, each source's fit its sends, each with the floors' most
/// loss). `flow_search` checks `lo` with a flow before it trusts it.
fn ratio_bracket(
    inputs: &Inputs<'_>,
    placement: &Placement,
    caps: &[u64],
    send: &[u64],
) -> (u64, u64) {
    let den = RATIO_DEN as f64;
    let (n_ranks, n_experts) = (inputs.n_ranks(), inputs.n_experts());
    let routed = inputs.routed_per_expert();
    let mut cells = vec![0u64; n_experts];
    for row in inputs.counts {
        for (e, &n) in row.iter().enumerate() {
            cells[e] += u64::from(n > 0);
        }
    }
    let mut owned = vec![0.0f64; n_ranks];
    let mut even = vec![0.0f64; n_ranks];
    let mut slots = vec![0.0f64; n_ranks];
    let mut alone = vec![(0.0f64, 0.0f64); n_ranks];
    let mut inst = Vec::new();
    for e in 0..n_experts {
        let n = routed[e] as f64;
        inst.clear();
        inst.extend(placement.instance_ranks(e));
        inst.sort_unstable();
        inst.dedup();
        owned[placement.owner[e]] += n;
        for &r in &inst {
            even[r] += n / inst.len() as f64;
            slots[r] += 1.0;
        }
        if let [r] = inst[..] {
            alone[r].0 += n;
            alone[r].1 += cells[e] as f64;
        }
    }
    let cap = |c: u64| {
        if c == u64::MAX {
            f64::INFINITY
        } else {
            c as f64
        }
    };
    // num ≤ room·DEN/load for every (room, load): the largest such num.
    let most = |pairs: &mut dyn Iterator<Item = (f64, f64)>| -> f64 {
        pairs
            .filter(|&(_, load)| load > 0.0)
            .map(|(room, load)| (room.max(0.0) * den / load).floor())
            .fold(den, f64::min)
    };
    let sends = |slack: f64| {
        inputs.counts.iter().zip(send).map(move |(row, &c)| {
            let busy = row.iter().filter(|&&n| n > 0).count() as f64;
            (cap(c) + slack * busy, row.iter().sum::<u64>() as f64)
        })
    };
    let by_owner = most(&mut (0..n_ranks).map(|r| (cap(caps[r]), owned[r])));
    let by_split = most(&mut (0..n_ranks).map(|r| (cap(caps[r]) - slots[r], even[r])));
    let lo = by_owner.max(by_split).min(most(&mut sends(0.0)));
    let total_cap = caps.iter().map(|&c| cap(c)).sum::<f64>();
    let all_cells = cells.iter().sum::<u64>() as f64;
    let total = routed.iter().sum::<u64>() as f64;
    let hi = most(&mut (0..n_ranks).map(|r| (cap(caps[r]) + alone[r].1, alone[r].0)))
        .min(most(&mut std::iter::once((total_cap + all_cells, total))))
        .min(most(&mut sends(1.0)));
    // `hi` is the largest num the necessary condition allows, so the first
    // infeasible one is past it; with a margin for the floating point (`lo`
    // is checked with a flow anyway, `hi` must not cut off a feasible
    // ratio).
    let lo = (lo * (1.0 - 1e-9) - 1.0).max(0.0) as u64;
    let hi = (hi * (1.0 + 1e-9)).min(den) as u64 + 2;
    (lo, hi.max(lo + 1))
}

/// Feasibility by Gale's theorem when sources are unconstrained and ranks are
/// few: expert supplies `q_e` fit the rank capacities iff for every rank set
/// `M`, the experts whose instances all lie in `M` need at most `cap(M)`.
/// All `2^R` sums come from one subset-sum (zeta) transform, so a check costs
/// `O(R · 2^R + S · E)` instead of a max-flow.
struct HallCheck {
    /// Instance mask of each expert.
    masks: Vec<usize>,
    /// `cap(M)` for every rank set.
    cap: Vec<u64>,
}

/// Rank counts up to which [`HallCheck`] replaces the max-flow search.
const HALL_MAX_RANKS: usize = 12;

impl HallCheck {
    fn new(inputs: &Inputs<'_>, placement: &Placement, caps: &[u64], send: &[u64]) -> Option<Self> {
        let r = inputs.n_ranks();
        if r == 0 || r > HALL_MAX_RANKS || send.iter().any(|&c| c != u64::MAX) {
            return None;
        }
        let masks = (0..inputs.n_experts())
            .map(|e| {
                placement
                    .instance_ranks(e)
                    .fold(0usize, |m, rank| m | (1 << rank))
            })
            .collect();
        let cap = (0..1usize << r)
            .map(|m| {
                (0..r)
                    .filter(|&i| m & (1 << i) != 0)
                    .fold(0u64, |a, i| a.saturating_add(caps[i]))
            })
            .collect();
        Some(Self { masks, cap })
    }

    fn feasible(&self, inputs: &Inputs<'_>, num: u64) -> bool {
        let mut need = vec![0u64; self.cap.len()];
        for (e, &m) in self.masks.iter().enumerate() {
            need[m] += inputs
                .counts
                .iter()
                .map(|row| floor_ratio(row[e], num))
                .sum::<u64>();
        }
        // need[M] ← Σ over subsets of M (zeta transform).
        let bits = self.cap.len().trailing_zeros() as usize;
        for i in 0..bits {
            for m in 0..need.len() {
                if m & (1 << i) != 0 {
                    need[m] += need[m ^ (1 << i)];
                }
            }
        }
        need.iter().zip(&self.cap).all(|(n, c)| n <= c)
    }

    fn largest_feasible(&self, inputs: &Inputs<'_>) -> u64 {
        if self.feasible(inputs, RATIO_DEN) {
            return RATIO_DEN;
        }
        let (mut lo, mut hi) = self.bracket(inputs);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.feasible(inputs, mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// `(lo, hi)` with `lo` feasible and `hi` not, from the condition
    /// without floors: with `N(M)` the pairs routed to the experts held
    /// within `M` and `L(M)` their non-empty cells, the floors' sum lies in
    /// `(x·N(M)/DEN − L(M), x·N(M)/DEN]`, so `x ≤ cap(M)·DEN/N(M)` for every
    /// `M` is feasible and `x ≥ (cap(M) + L(M))·DEN/N(M)` for some `M` is not.
    /// The bisection between them takes ~13 checks where `[0, DEN)` took 20.
    fn bracket(&self, inputs: &Inputs<'_>) -> (u64, u64) {
        let mut routed = vec![0u128; self.cap.len()];
        let mut cells = vec![0u128; self.cap.len()];
        for (e, &m) in self.masks.iter().enumerate() {
            for row in inputs.counts {
                routed[m] += u128::from(row[e]);
                cells[m] += u128::from(row[e] > 0);
            }
        }
        let bits = self.cap.len().trailing_zeros() as usize;
        for i in 0..bits {
            for m in 0..self.cap.len() {
                if m & (1 << i) != 0 {
                    routed[m] += routed[m ^ (1 << i)];
                    cells[m] += cells[m ^ (1 << i)];
                }
            }
        }
        let den = u128::from(RATIO_DEN);
        let (mut lo, mut hi) = (den, den);
        for m in 0..self.cap.len() {
            let cap = u128::from(self.cap[m]);
            // No pairs within `M`: no bound.
            if let Some(x) = (cap * den).checked_div(routed[m]) {
                lo = lo.min(x);
                hi = hi.min((cap + cells[m]) * den / routed[m] + 1);
            }
        }
        // `RATIO_DEN` itself was checked and failed: `lo < DEN`.
        let lo = lo.min(den - 1) as u64;
        (lo, (hi as u64).clamp(lo + 1, RATIO_DEN))
    }
}

/// Quotas and the per-rank model for a fixed placement (no replicas added).
pub fn quotas(inputs: &Inputs<'_>, policy: Policy) -> Result<Plan, QuotaError> {
    inputs.validate()?;
    let placement = inputs.placement.clone();
    let (caps, send) = capacities(inputs, &placement)?;
    let hall = HallCheck::new(inputs, &placement, &caps, &send);
    let (num, per_source) = match hall.as_ref().map(|h| h.largest_feasible(inputs)) {
        // Every pair fits: each cell keeps all it routed, under either
        // policy (its floor at the full ratio is its count, and nothing is
        // left over), so no flow is needed to say so.
        Some(RATIO_DEN) => (RATIO_DEN, inputs.counts.to_vec()),
        searched => searched_quotas(inputs, &placement, (&caps, &send), searched, policy),
    };

    let quotas = Quotas { per_source };
    let routed: u64 = inputs.routed_per_expert().iter().sum();
    let kept_fraction = if routed == 0 {
        1.0
    } else {
        quotas.total() as f64 / routed as f64
    };
    let ranks = rank_models(inputs, &placement, &caps, &quotas);
    Ok(Plan {
        quotas,
        placement,
        replicas_added: Vec::new(),
        retention_floor: num as f64 / RATIO_DEN as f64,
        kept_fraction,
        ranks,
        policy,
    })
}

/// The largest feasible retention numerator and each source's quota per
/// expert, from the flow network: at `known` where [`HallCheck`] found it
/// (and the network only carries its flow), else by the cut-guided search;
/// under [`Policy::Maxmin`] the capacity left after every cell's floor is
/// filled as far as it goes.
fn searched_quotas(
    inputs: &Inputs<'_>,
    placement: &Placement,
    (caps, send): (&[u64], &[u64]),
    known: Option<u64>,
    policy: Policy,
) -> (u64, Vec<Vec<u64>>) {
    let mut net = build_network(inputs, placement, caps, send);
    // Either way the network is left holding a feasible uniform flow at
    // `num`.
    let num = match known {
        Some(num) => {
            let ok = uniform_flow(&mut net, num).is_some();
            debug_assert!(ok, "invariant: the searched ratio is feasible");
            num
        }
        None => flow_search(&mut net, ratio_bracket(inputs, placement, caps, send)),
    };

    if policy == Policy::Maxmin {
        for (i, &(_, _, mandatory, extra)) in net.cells.iter().enumerate() {
            net.graph.freeze(mandatory);
            let (n, k) = (net.terms.routed(i), net.terms.floor(i, num));
            net.graph.set_capacity(extra, n - k);
        }
        net.graph.max_flow(0, net.sink);
    }

    let mut per_source = vec![vec![0u64; inputs.n_experts()]; inputs.n_ranks()];
    for &(s, e, mandatory, extra) in &net.cells {
        if s != AGGREGATED {
            per_source[s][e] = net.graph.flow(mandatory) + net.graph.flow(extra);
            continue;
        }
        // Each source keeps its floor; the expert's extra pairs go to the
        // sources in rank order, up to what each routed.
        let mut extra_left = net.graph.flow(extra);
        for (src, row) in inputs.counts.iter().enumerate() {
            let floor = floor_ratio(row[e], num);
            let more = extra_left.min(row[e] - floor);
            per_source[src][e] = floor + more;
            extra_left -= more;
        }
    }
    (num, per_source)
}

fn rank_models(
    inputs: &Inputs<'_>,
    placement: &Placement,
    caps: &[u64],
    quotas: &Quotas,
) -> Vec<RankModel> {
    let cost = inputs.cost;
    let row = cost.row_bytes();
    let total = quotas.total();
    let owned = {
        let mut n = vec![0u64; inputs.n_ranks()];
        for &r in &placement.owner {
            n[r] += 1;
        }
        n
    };
    let all = placement.instances_per_rank(inputs.n_ranks());
    (0..inputs.n_ranks())
        .map(|r| {
            let pair_capacity = caps[r].min(total);
            let source_pairs: u64 = quotas.per_source[r].iter().sum();
            let placement_bytes = owned[r].saturating_mul(cost.instance_bytes());
            let replica_bytes = (all[r] - owned[r]).saturating_mul(cost.instance_bytes());
            let buffer_bytes = pair_capacity.saturating_mul(row);
            let dispatch_in_bytes = buffer_bytes;
            let dispatch_out_bytes = source_pairs.saturating_mul(row);
            RankModel {
                placement_bytes,
                replica_bytes,
                buffer_bytes,
                memory_bytes: placement_bytes
                    .saturating_add(replica_bytes)
                    .saturating_add(buffer_bytes),
                pair_capacity,
                source_pairs,
                dispatch_in_bytes,
                dispatch_out_bytes,
                compute_s: pair_capacity as f64 * cost.flops_per_pair / cost.flops_per_s,
                network_s: dispatch_in_bytes.max(dispatch_out_bytes) as f64 / cost.link_bytes_per_s,
            }
        })
        .collect()
}

/// `n` whole units split in proportion to the weights `w` (their sum
/// `total`): each gets the floor of its share, the units left go to the
/// largest remainders (ties to the lower index).
pub fn largest_remainder(w: &[f64], total: f64, n: u64) -> Vec<u64> {
    let exact: Vec<f64> = w.iter().map(|x| x / total * n as f64).collect();
    let mut out: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
    let mut left = n.saturating_sub(out.iter().sum::<u64>());
    let mut rem: Vec<(usize, f64)> = exact
        .iter()
        .enumerate()
        .map(|(i, x)| (i, x - x.floor()))
        .collect();
    rem.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for (i, _) in rem {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    out
}

/// SYMI-like replicas (arXiv 2504.19925) with the owners kept: every
/// expert gets instances in proportion to `load` (its routed pairs in the
/// previous call; its owner counts as one), `slots_per_rank` replicas per
/// rank in all, no two instances of an expert on one rank; the replicas go,
/// heaviest per-instance load first, onto the rank with the least load so
/// far that has a free slot. Unlike [`plan_replicas`] it looks at the
/// previous call's load, not this one's, and keeps no memory model: the
/// slots are the budget. Replicas already in `placement` are replaced.
pub fn replicas_by_load(
    placement: &Placement,
    load: &[u64],
    n_ranks: usize,
    slots_per_rank: usize,
) -> Result<Placement, QuotaError> {
    let experts = placement.owner.len();
    if load.len() != experts {
        return Err(QuotaError::Shape {
            what: "load",
            expected: experts,
            got: load.len(),
        });
    }
    if let Some((expert, &rank)) = placement
        .owner
        .iter()
        .enumerate()
        .find(|(_, &r)| r >= n_ranks)
    {
        return Err(QuotaError::BadRank {
            expert,
            rank,
            n_ranks,
        });
    }
    let total = (slots_per_rank * n_ranks).min(experts * n_ranks.saturating_sub(1));
    let weights: Vec<f64> = load.iter().map(|&l| l as f64 + 1e-9).collect();
    let extra = largest_remainder(&weights, weights.iter().sum(), total as u64);
    let count: Vec<usize> = extra
        .iter()
        .map(|&x| (1 + x as usize).min(n_ranks))
        .collect();
    let per = |e: usize| load[e] as f64 / count[e] as f64;
    let mut rank_load = vec![0f64; n_ranks];
    for (e, &o) in placement.owner.iter().enumerate() {
        rank_load[o] += per(e);
    }
    let mut items: Vec<(f64, usize)> = (0..experts)
        .flat_map(|e| (1..count[e]).map(move |_| (per(e), e)))
        .collect();
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut used = vec![0usize; n_ranks];
    let mut replicas: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (per, e) in items {
        let holds = |r: usize| placement.owner[e] == r || replicas[e].contains(&r);
        let pick = (0..n_ranks)
            .filter(|&r| used[r] < slots_per_rank && !holds(r))
            .min_by(|&a, &b| rank_load[a].total_cmp(&rank_load[b]).then(a.cmp(&b)));
        if let Some(r) = pick {
            replicas[e].push(r);
            used[r] += 1;
            rank_load[r] += per;
        }
    }
    for r in &mut replicas {
        r.sort_unstable();
    }
    Ok(Placement {
        owner: placement.owner.clone(),
        replicas,
    })
}

/// Adds replicas of hot experts to `inputs.placement` (see the crate doc).
pub fn plan_replicas(inputs: &Inputs<'_>, cfg: &Config) -> Result<Placement, QuotaError> {
    let filled = fill_replicas(inputs, cfg)?;
    Ok(apply_rule(inputs, cfg, filled))
}

/// [`plan_replicas`]' placement under `cfg.replica_rule`, then the one
/// [`ReplicaRule::Fill`] gives (every replica the slots allow), from one
/// pass over the slots: the rule's replicas are a prefix of the filled
/// ones. For a caller that needs both (`lrmoe replay`: replication and
/// LRMoE).
pub fn plan_replicas_and_fill(
    inputs: &Inputs<'_>,
    cfg: &Config,
) -> Result<(Placement, Placement), QuotaError> {
    let filled = fill_replicas(inputs, cfg)?;
    let all = filled.placement.clone();
    Ok((apply_rule(inputs, cfg, filled), all))
}

/// Every replica the slots allow: the placement with them, the placement
/// before them and the replicas in the order they were added.
struct Filled {
    placement: Placement,
    given: Placement,
    added: Vec<(usize, usize)>,
}

/// The rule's placement from the filled one.
fn apply_rule(inputs: &Inputs<'_>, cfg: &Config, filled: Filled) -> Placement {
    let Filled {
        placement,
        given,
        added,
    } = filled;
    let cap = cfg.forward_rows_cap;
    match cfg.replica_rule {
        ReplicaRule::Fill => placement,
        ReplicaRule::Paying => paying_prefix(inputs, given, &added, cap),
        ReplicaRule::PayingCompute => {
            let cost = CostModel {
                exchange_row_bytes: 0,
                ..*inputs.cost
            };
            let inputs = Inputs {
                cost: &cost,
                ..*inputs
            };
            paying_prefix(&inputs, given, &added, cap)
        }
    }
}

/// [`ReplicaRule::Fill`]'s replicas, the hottest expert per instance onto
/// the least-loaded rank with room, in order (see the crate doc).
fn fill_replicas(inputs: &Inputs<'_>, cfg: &Config) -> Result<Filled, QuotaError> {
    inputs.validate()?;
    if !(0.0..=1.0).contains(&cfg.replica_memory_fraction) {
        return Err(QuotaError::BadFraction {
            field: "replica_memory_fraction",
            value: cfg.replica_memory_fraction,
        });
    }
    let (n_ranks, n_experts) = (inputs.n_ranks(), inputs.n_experts());
    let mut placement = inputs.placement.clone();
    placement.replicas.resize(n_experts, Vec::new());
    let stat = static_bytes(inputs, &placement);
    let mut replica_room: Vec<u64> = (0..n_ranks)
        .map(|r| {
            let free = inputs.budgets[r].memory_bytes.saturating_sub(stat[r]);
            (free as f64 * cfg.replica_memory_fraction) as u64
        })
        .collect();
    let mut slots: Vec<usize> = (0..n_ranks)
        .map(|r| {
            let hosted = placement.replicas.iter().filter(|v| v.contains(&r)).count();
            cfg.replica_slots_per_rank.saturating_sub(hosted)
        })
        .collect();
    let routed = inputs.routed_per_expert();
    let per_instance =
        |e: usize, p: &Placement| routed[e] as f64 / (1 + p.replicas[e].len()) as f64;
    let mut rank_load = vec![0.0f64; n_ranks];
    for e in 0..n_experts {
        let share = per_instance(e, &placement);
        rank_load[placement.owner[e]] += share;
        for &r in &placement.replicas[e] {
            rank_load[r] += share;
        }
    }
    // Experts by load per instance, largest first (ties: smaller id). An
    // expert's entry only falls when it gains a replica, so a popped entry
    // whose value is stale is pushed back with the current one.
    let key = |e: usize, p: &Placement| (OrdF64(per_instance(e, p)), std::cmp::Reverse(e));
    let mut heap: std::collections::BinaryHeap<(OrdF64, std::cmp::Reverse<usize>)> = (0..n_experts)
        .filter(|&e| routed[e] > 0)
        .map(|e| key(e, &placement))
        .collect();
    // Ranks that can still take a replica, keyed by modelled load (ties:
    // smaller rank). A rank's load only matters while it can take one
    // (slots and room only shrink). When expert e gains a replica the loads
    // of its hosts fall, but e's own search skips its hosts, so their keys
    // are refreshed lazily — only before another expert searches. A hot
    // expert taking many replicas in a row re-keys its hosts once, not once
    // per replica; the plain loads are updated at once (one add per host).
    let inst_bytes = inputs.cost.instance_bytes();
    let open = |r: usize, slots: &[usize], room: &[u64]| slots[r] > 0 && room[r] >= inst_bytes;
    let mut is_candidate: Vec<bool> = (0..n_ranks)
        .map(|r| open(r, &slots, &replica_room))
        .collect();
    let mut key_of = rank_load.clone();
    let mut candidates: std::collections::BTreeSet<(OrdF64, usize)> = (0..n_ranks)
        .filter(|&r| is_candidate[r])
        .map(|r| (OrdF64(rank_load[r]), r))
        .collect();
    let mut open_hosts: Vec<Vec<usize>> = (0..n_experts)
        .map(|e| {
            std::iter::once(placement.owner[e])
                .chain(placement.replicas[e].iter().copied())
                .filter(|&r| is_candidate[r])
                .collect()
        })
        .collect();
    let mut stale: Vec<usize> = Vec::new();
    let mut hosts = vec![usize::MAX; n_ranks];
    let given = placement.clone();
    let mut added: Vec<(usize, usize)> = Vec::new();
    while let Some((OrdF64(value), std::cmp::Reverse(e))) = heap.pop() {
        if value != per_instance(e, &placement) {
            heap.push(key(e, &placement));
            continue;
        }
        // Every candidate but e's own hosts gets its current key.
        for x in std::mem::take(&mut stale) {
            if x == e {
                stale.push(x);
                continue;
            }
            for &r in &open_hosts[x] {
                if is_candidate[r] && key_of[r] != rank_load[r] {
                    candidates.remove(&(OrdF64(key_of[r]), r));
                    key_of[r] = rank_load[r];
                    candidates.insert((OrdF64(key_of[r]), r));
                }
            }
        }
        // Mark e's candidate hosts; the least-loaded candidate not among them
        // takes the replica (at most |open hosts| candidates are skipped).
        open_hosts[e].retain(|&r| is_candidate[r]);
        for &r in &open_hosts[e] {
            hosts[r] = e;
        }
        let Some(&(_, r)) = candidates.iter().find(|&&(_, r)| hosts[r] != e) else {
            continue; // no rank can host another instance of e: e is done
        };
        let old = per_instance(e, &placement);
        placement.replicas[e].push(r);
        added.push((e, r));
        let new = per_instance(e, &placement);
        // Hosts that can no longer take a replica keep no load at all.
        for &i in &open_hosts[e] {
            rank_load[i] += new - old;
        }
        if !open_hosts[e].is_empty() && !stale.contains(&e) {
            stale.push(e);
        }
        candidates.remove(&(OrdF64(key_of[r]), r));
        rank_load[r] += new;
        slots[r] -= 1;
        replica_room[r] -= inst_bytes;
        if open(r, &slots, &replica_room) {
            key_of[r] = rank_load[r];
            candidates.insert((OrdF64(key_of[r]), r));
            open_hosts[e].push(r);
        } else {
            is_candidate[r] = false;
        }
        heap.push(key(e, &placement));
    }
    Ok(Filled {
        placement,
        given,
        added,
    })
}

/// The placement `given` plus the prefix of `added` with the smallest
/// [`modelled_call_seconds`] (the first smallest: fewer replicas on a tie).
fn paying_prefix(
    inputs: &Inputs<'_>,
    given: Placement,
    added: &[(usize, usize)],
    forward_cap: Option<u64>,
) -> Placement {
    let mut model = CallModel::new(inputs);
    let mut p = given.clone();
    // Each prefix's modelled time and busiest forward rows.
    let mut prefixes = Vec::with_capacity(added.len() + 1);
    prefixes.push((model.seconds(&p), model.busiest()));
    for &(e, r) in added {
        p.replicas[e].push(r);
        prefixes.push((model.seconds(&p), model.busiest()));
    }
    let mut best = 0;
    for (k, &(t, _)) in prefixes.iter().enumerate() {
        if t < prefixes[best].0 {
            best = k;
        }
    }
    if let Some(cap) = forward_cap {
        let fits = |k: usize| prefixes[k].1 <= cap as f64;
        if !fits(best) {
            best = (best + 1..prefixes.len())
                .find(|&k| fits(k))
                .unwrap_or(best);
        }
    }
    let mut p = given;
    for &(e, r) in &added[..best] {
        p.replicas[e].push(r);
    }
    p
}

/// The routed pairs each rank computes in the forward under `placement`,
/// as [`modelled_call_seconds`] splits them over each expert's instances
/// (water-filling, the experts with the fewest instances first): what
/// [`Config::forward_rows_cap`] holds the forward to.
pub fn modelled_forward_rows(inputs: &Inputs<'_>, placement: &Placement) -> Vec<f64> {
    let mut model = CallModel::new(inputs);
    model.seconds(placement);
    model.pairs
}

/// `budgets` less the replica slots `with` leaves empty on each rank: a
/// rank hosting `h` replicas beyond those of `given` keeps
/// `slots_per_rank − h` instances' bytes (`cost.instance_bytes()`) out of
/// its memory budget, so an empty slot does not hold rows (the trainer's
/// budgets reserve the slots whether or not [`ReplicaRule::Paying`] fills
/// them). Unlimited budgets stay unlimited; the network budgets are kept.
pub fn budgets_without_empty_slots(
    budgets: &[RankBudget],
    slots_per_rank: usize,
    given: &Placement,
    with: &Placement,
    cost: &CostModel,
) -> Vec<RankBudget> {
    let n = budgets.len();
    let (before, after) = (given.instances_per_rank(n), with.instances_per_rank(n));
    budgets
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let hosted = after[r].saturating_sub(before[r]);
            let empty = (slots_per_rank as u64).saturating_sub(hosted);
            let memory_bytes = if b.memory_bytes == u64::MAX {
                u64::MAX
            } else {
                b.memory_bytes
                    .saturating_sub(empty.saturating_mul(cost.instance_bytes()))
            };
            RankBudget { memory_bytes, ..*b }
        })
        .collect()
}

/// The modelled time of one layer call's expert work under `placement`,
/// seconds (the crate doc's `T`, which [`ReplicaRule::Paying`] minimises),
/// phase by phase, each ending with its busiest rank: the compute for the
/// routed pairs each rank serves, the replica traffic (weights out to the
/// replicas before the forward, gradients back after the backward, the
/// larger direction), and with `cost.exchange_row_bytes > 0` the token
/// exchanges of the pairs served away from their source. The pairs
/// are split over each expert's instances as the executors' min-max split
/// would, approximately: the experts with the fewest instances first (one
/// instance: no choice), then the largest, each pour theirs into their
/// instances' least-loaded ranks up to a common level (water-filling).
/// `inputs`' placement is ignored; its counts and cost model are used as
/// given (call [`plan_replicas`] or [`plan`] for checked inputs).
pub fn modelled_call_seconds(inputs: &Inputs<'_>, placement: &Placement) -> f64 {
    CallModel::new(inputs).seconds(placement)
}

/// Experts by most routed pairs, then smaller id: [`fill_order`]'s order
/// within one instance count, sorted once per call of the planner.
fn by_load(routed: &[u64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..routed.len()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(routed[e]), e));
    order
}

/// The order the modelled split fills experts in: fewest instances first
/// (an expert on one rank has no choice), then most routed pairs, then
/// smaller id — `by_load` ([`by_load`]) bucketed stably by instance count;
/// into `order`, with `start` as scratch.
fn fill_order(
    by_load: &[usize],
    placement: &Placement,
    start: &mut Vec<usize>,
    order: &mut [usize],
) {
    let n_inst = |e: usize| placement.replicas.get(e).map_or(0, Vec::len);
    let most = by_load.iter().map(|&e| n_inst(e)).max().unwrap_or(0);
    start.clear();
    start.resize(most + 2, 0);
    for &e in by_load {
        start[n_inst(e) + 1] += 1;
    }
    for k in 1..start.len() {
        start[k] += start[k - 1];
    }
    for &e in by_load {
        let k = n_inst(e);
        order[start[k]] = e;
        start[k] += 1;
    }
}

/// [`modelled_call_seconds`] for one call's inputs under any number of
/// placements: what does not depend on the placement (the routed pairs
/// per expert, their [`by_load`] order, each rank's routed pairs) is
/// computed once, and the scratch is kept between placements.
struct CallModel<'a> {
    inputs: &'a Inputs<'a>,
    routed: Vec<u64>,
    by_load: Vec<usize>,
    /// Pairs each rank routes (where the rows count).
    routes: Vec<f64>,
    order: Vec<usize>,
    start: Vec<usize>,
    pairs: Vec<f64>,
    bytes_in: Vec<f64>,
    bytes_out: Vec<f64>,
    served_in: Vec<f64>,
    sent_away: Vec<f64>,
    levels: Vec<(f64, usize)>,
}

impl<'a> CallModel<'a> {
    fn new(inputs: &'a Inputs<'a>) -> Self {
        let routed = inputs.routed_per_expert();
        let by_load = by_load(&routed);
        let n_ranks = inputs.n_ranks();
        let routes = if inputs.cost.exchange_row_bytes > 0 {
            (inputs.counts.iter())
                .map(|row| row.iter().sum::<u64>() as f64)
                .collect()
        } else {
            vec![0.0; n_ranks]
        };
        Self {
            inputs,
            order: vec![0; routed.len()],
            routed,
            by_load,
            routes,
            start: Vec::new(),
            pairs: vec![0.0; n_ranks],
            bytes_in: vec![0.0; n_ranks],
            bytes_out: vec![0.0; n_ranks],
            served_in: vec![0.0; n_ranks],
            sent_away: vec![0.0; n_ranks],
            levels: Vec::new(),
        }
    }

    /// The most routed pairs one rank computes under the placement the
    /// last [`CallModel::seconds`] modelled.
    fn busiest(&self) -> f64 {
        self.pairs.iter().fold(0.0f64, |a, &b| a.max(b))
    }

    /// The modelled seconds of the call under `placement`.
    fn seconds(&mut self, placement: &Placement) -> f64 {
        fill_order(&self.by_load, placement, &mut self.start, &mut self.order);
        let inputs = self.inputs;
        let cost = inputs.cost;
        let n_ranks = inputs.n_ranks();
        let per_pair = (cost.flops_per_pair + cost.forward_flops_per_pair) / cost.flops_per_s;
        let (w, g) = (
            cost.expert_weight_bytes as f64,
            cost.expert_grad_bytes as f64,
        );
        let Self {
            routed,
            order,
            pairs,
            bytes_in,
            bytes_out,
            served_in,
            sent_away,
            levels,
            ..
        } = self;
        for v in [
            &mut *pairs,
            &mut *bytes_in,
            &mut *bytes_out,
            &mut *served_in,
        ] {
            v.fill(0.0);
        }
        // Pairs each rank serves for other ranks, and sends to other ranks.
        let rows = cost.exchange_row_bytes > 0;
        sent_away.copy_from_slice(&self.routes);
        for &e in order.iter() {
            let owner = placement.owner[e];
            let reps: &[usize] = placement.replicas.get(e).map_or(&[], Vec::as_slice);
            let n = routed[e] as f64;
            if reps.is_empty() {
                // One instance (most experts): the general case below with
                // one level, the same operations in the same order.
                let load = pairs[owner];
                let level = n + load;
                if load < level {
                    pairs[owner] = level;
                }
                if rows && n > 0.0 {
                    let here = (pairs[owner] - load).max(0.0) / n;
                    let mine = inputs.counts[owner][e] as f64;
                    served_in[owner] += here * (n - mine);
                    sent_away[owner] -= here * mine;
                }
                continue;
            }
            levels.clear();
            levels.extend(
                std::iter::once(owner)
                    .chain(reps.iter().copied())
                    .map(|r| (pairs[r], r)),
            );
            levels.sort_by(|a, b| a.0.total_cmp(&b.0));
            // The level L with Σ max(0, L − load) = n over the instances.
            let (mut sum, mut level) = (0.0, 0.0);
            for (j, &(load, _)) in levels.iter().enumerate() {
                if j > 0 && load * j as f64 - sum > n {
                    break;
                }
                sum += load;
                level = (n + sum) / (j + 1) as f64;
            }
            for &(load, r) in levels.iter() {
                if load < level {
                    pairs[r] = level;
                }
            }
            if rows && n > 0.0 {
                // Every source's pairs of e spread over its instances as e's
                // do: a rank serving a share of e serves that share of its own
                // pairs locally; the rest cross the links (`sent_away` starts
                // at every pair a rank routes; its local ones come off here).
                for &(load, r) in levels.iter() {
                    let here = (pairs[r] - load).max(0.0) / n;
                    let mine = inputs.counts[r][e] as f64;
                    served_in[r] += here * (n - mine);
                    sent_away[r] -= here * mine;
                }
            }
            bytes_out[owner] += reps.len() as f64 * w;
            bytes_in[owner] += reps.len() as f64 * g;
            for &r in reps {
                bytes_in[r] += w;
                bytes_out[r] += g;
            }
        }
        let most = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, f64::max);
        let replica_s = |r: usize| bytes_in[r].max(bytes_out[r]) / cost.link_bytes_per_s;
        if !rows {
            // The model as it was before it counted the rows: each rank's
            // compute and replica traffic, the slowest rank's sum.
            return most(&mut (0..n_ranks).map(|r| pairs[r] * per_pair + replica_s(r)));
        }
        let compute = most(&mut pairs.iter().map(|&p| p * per_pair));
        let replicas = most(&mut (0..n_ranks).map(replica_s));
        // Each exchange (dispatch, combine, the backward's dispatch and
        // return) moves every remote pair once, in one direction or the
        // other, and ends with its busiest rank.
        let per_remote =
            (cost.exchange_row_bytes.saturating_mul(3)).saturating_add(cost.row_bytes()) as f64;
        let exchanges =
            most(&mut (0..n_ranks).map(|r| served_in[r].max(sent_away[r]))) * per_remote;
        compute + replicas + exchanges / cost.link_bytes_per_s
    }
}

/// A total order on the finite loads the replica planner compares.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);

impl Eq for OrdF64 {}

impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Trims each binding quota down to a whole number of GEMM tiles when that
/// drops little: the expert GEMMs pad every expert's rows up to a multiple
/// of their `tile`-row blocks, so an expert keeping `t·tile + rem` pairs
/// pays a whole block of work for its last `rem` rows. Where expert `e`'s
/// quota binds (`q_e < n_e`, its routed pairs) and `0 < rem ≤ max_drop·q_e`
/// with `q_e ≥ tile`, its quota becomes `q_e − rem`; the pairs come off the
/// last sources first (`kept[s][e]`, highest `s` first). Quotas that keep
/// every routed pair, or below one tile, are left alone, and no quota ever
/// grows, so every budget the quotas met still holds. Returns the pairs
/// dropped. With replicas the kept pairs of an expert are split over its
/// instances afterwards, so only the expert's total is aligned.
///
/// `kept` and `routed` are `[source][expert]`; `tile = 0` or `max_drop =
/// 0` changes nothing.
pub fn align_to_tiles(
    kept: &mut [Vec<u64>],
    routed: &[Vec<u64>],
    tile: u64,
    max_drop: f64,
) -> Result<u64, QuotaError> {
    if !(0.0..=1.0).contains(&max_drop) {
        return Err(QuotaError::BadFraction {
            field: "max_drop",
            value: max_drop,
        });
    }
    if kept.len() != routed.len() {
        return Err(QuotaError::Shape {
            what: "kept (sources)",
            expected: routed.len(),
            got: kept.len(),
        });
    }
    let experts = routed.first().map_or(0, Vec::len);
    for (k, r) in kept.iter().zip(routed) {
        for (what, got) in [("routed (experts)", r.len()), ("kept (experts)", k.len())] {
            if got != experts {
                return Err(QuotaError::Shape {
                    what,
                    expected: experts,
                    got,
                });
            }
        }
        if k.iter().zip(r).any(|(k, r)| k > r) {
            return Err(QuotaError::Shape {
                what: "kept pairs above the routed pairs of a cell",
                expected: r.iter().sum::<u64>() as usize,
                got: k.iter().sum::<u64>() as usize,
            });
        }
    }
    if tile == 0 || max_drop == 0.0 {
        return Ok(0);
    }
    let mut dropped = 0u64;
    for e in 0..experts {
        let q: u64 = kept.iter().map(|row| row[e]).sum();
        let n: u64 = routed.iter().map(|row| row[e]).sum();
        let rem = q % tile;
        if q >= n || q < tile || rem == 0 || rem as f64 > max_drop * q as f64 {
            continue;
        }
        let mut left = rem;
        for row in kept.iter_mut().rev() {
            let take = left.min(row[e]);
            row[e] -= take;
            left -= take;
        }
        dropped += rem;
    }
    Ok(dropped)
}

/// Replica plan, then quotas for it: the controller's whole decision.
pub fn plan(inputs: &Inputs<'_>, cfg: &Config) -> Result<Plan, QuotaError> {
    let placement = plan_replicas(inputs, cfg)?;
    let with_replicas = Inputs {
        placement: &placement,
        ..*inputs
    };
    let mut p = quotas(&with_replicas, cfg.policy)?;
    let given = inputs.placement;
    p.replicas_added = (0..placement.owner.len())
        .flat_map(|e| {
            let before: &[usize] = given.replicas.get(e).map_or(&[], Vec::as_slice);
            placement.replicas[e]
                .iter()
                .filter(|r| !before.contains(r))
                .map(move |&r| (e, r))
                .collect::<Vec<_>>()
        })
        .collect();
    Ok(p)
}

#[cfg(test)]
mod tests;
