//! # cluster — what N GPUs would take
//!
//! A model of the links between GPUs, for a simulator that measures each
//! rank's work on one GPU and needs the time of the exchanges between them
//! (issue 30). Ranks sit [`Cluster::gpus_per_node`] to a node, numbered node
//! by node; two ranks of one node talk over the intra-node link (NVLink),
//! ranks on different nodes over the inter-node one (one RDMA NIC per GPU).
//! Each link class has a bandwidth per GPU and direction and a latency.
//!
//! ## Contract
//!
//! * **Exchange** (an all-to-all with any sizes, [`Cluster::exchange_s`]):
//!   for each link class, `latency + (the most bytes any rank sends or
//!   receives over that class) / bandwidth`; the classes use different
//!   wires and run at once, so the exchange takes the slower class. The
//!   message to self is free (a device copy, part of the measured compute).
//!   An exchange that moves no byte between ranks takes no time.
//! * **All-reduce** ([`Cluster::all_reduce_s`]) follows the ring model:
//!   `2(n−1)` steps of `B/n` bytes at the bandwidth of the slowest class
//!   the ring crosses, plus the class's latency once (the fixed cost of a
//!   collective call, as fitted; NCCL pipelines the ring's steps);
//!   **all-gather** ([`Cluster::all_gather_s`]) `n−1` steps.
//! * **A call's own cost** ([`Cluster::call_s`]): the simulator adds
//!   `call_overhead_us` to every collective, for the fixed costs of the
//!   executor's collective path that the links do not have (0 by default;
//!   on small layer calls they dominate: `docs/benchmarks.md`), and
//!   `layer_call_overhead_us` to every MoE-layer call, forward or backward,
//!   per micro-batch ([`Cluster::layer_call_s`]: an executor's fixed cost a
//!   call, such as host round trips, that the ranks' timed kernels do not
//!   see; 0 by default).
//! * **The slowest link N ranks span**
//!   ([`Cluster::slowest_link_bytes_per_s`]): inter-node once they exceed
//!   a node, else intra-node — what the controller times a replica's
//!   traffic with before it knows where the replica goes.
//! * **Phases** are bulk-synchronous ([`bulk_synchronous`]): a phase ends
//!   when its slowest rank does; overlapped work takes the longer of the two
//!   ([`overlapped`]) — exactly what the executor overlaps, nothing more
//!   ([`Cluster::overlap`]: the dispatch beside the experts on a rank's own
//!   rows, the backward's dX return beside the weight gradients; that work
//!   slowed by [`Cluster::overlap_work_factor`] for the SMs the exchange
//!   holds meanwhile).
//! * Defaults ([`Cluster::default`]): the intra-node link is fitted to every
//!   all-to-all this project measured on 2 and 4 H200s
//!   ([`measured_exchanges`], within ±14% of each: [`check`]); nominal
//!   NVLink 4 on H200 is 450 GB/s per direction, NCCL's all-to-all reaches
//!   about 75% of it. The inter-node link is DeepEP's published RDMA figure
//!   (43–58 GB/s per GPU with 400 Gb/s ConnectX-7 NICs; 45 taken) and a
//!   latency of 30 µs; neither is validated here (no machine with several
//!   nodes has been lent to the project).
//!
//! Errors are values ([`ClusterError`]); nothing here does I/O or knows
//! CUDA. Depends on nothing of the workspace.

use serde::{Deserialize, Serialize};

/// A bad cluster description or shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClusterError {
    /// A field is out of range.
    #[error("cluster.{field} must be {range} (got {got})")]
    Field {
        /// The field's name in `[cluster]`.
        field: &'static str,
        /// Its range, in words.
        range: &'static str,
        /// The value given.
        got: String,
    },
    /// A byte matrix is not square.
    #[error("an exchange's bytes must be a square ranks × ranks matrix (row {row} has {got} entries, {ranks} rows)")]
    NotSquare {
        /// The row at fault.
        row: usize,
        /// Its length.
        got: usize,
        /// The number of rows.
        ranks: usize,
    },
}

/// The links of a cluster (`[cluster]` in a training TOML).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Cluster {
    /// GPUs per node; ranks are numbered node by node.
    pub gpus_per_node: usize,
    /// Intra-node bandwidth per GPU and direction, GB/s (10⁹ bytes/s).
    pub intra_gb_per_s: f64,
    /// Intra-node latency of one exchange or ring step, µs.
    pub intra_latency_us: f64,
    /// Inter-node bandwidth per GPU and direction, GB/s.
    pub inter_gb_per_s: f64,
    /// Inter-node latency, µs.
    pub inter_latency_us: f64,
    /// The executor's own fixed cost of one collective call, µs, beside the
    /// links' (host waits, launches on the communicator's stream, the
    /// deadline's polling): added to every collective the simulator counts,
    /// bytes or none. 0 by default (the links alone); see
    /// [`Cluster::call_s`].
    pub call_overhead_us: f64,
    /// The executor's own fixed cost of one MoE-layer call, µs: one
    /// layer's forward or backward over one micro-batch, beside its
    /// kernels and collectives (host round trips where the dense parts run
    /// on the host, as in the 2-GPU runs of 2026-12-01; launches and
    /// synchronisation a call). Added once per call, so it grows with the
    /// micro-batches. 0 by default (the ranks' timed work alone); see
    /// [`Cluster::layer_call_s`].
    pub layer_call_overhead_us: f64,
    /// Whether exchanges overlap what the executor runs beside them: on
    /// the NCCL path the dispatch runs beside the experts on a rank's own
    /// rows and the backward's dX return beside the weight gradients (the
    /// windows timed ranks record as `Joined`), so such an exchange and
    /// that work take the longer of the two ([`overlapped`], the work
    /// scaled by [`Cluster::overlap_work_factor`]). `false`: every exchange
    /// is waited for before the work after it (the executor with its
    /// overlap switched off, as the 2-GPU layer was measured on
    /// 2026-11-30). Default `true`.
    pub overlap: bool,
    /// The work beside an exchange takes this many times its timed
    /// seconds: the NCCL path's grouped GEMMs leave `LRMOE_COMM_SMS` (16)
    /// of an H100's or H200's 132 SMs to the exchange while it runs, where
    /// the timed ranks ran that work on every SM. 132 / 116 by default;
    /// at least 1.
    pub overlap_work_factor: f64,
}

impl Default for Cluster {
    fn default() -> Self {
        Self {
            gpus_per_node: 8,
            intra_gb_per_s: 336.0,
            intra_latency_us: 56.0,
            inter_gb_per_s: 45.0,
            inter_latency_us: 30.0,
            call_overhead_us: 0.0,
            layer_call_overhead_us: 0.0,
            overlap: true,
            overlap_work_factor: 132.0 / 116.0,
        }
    }
}

/// The link between two ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkClass {
    /// Same node.
    Intra,
    /// Different nodes.
    Inter,
}

impl Cluster {
    /// Every field in range: at least one GPU per node, bandwidths finite
    /// and positive, latencies and overheads finite and non-negative, the
    /// overlap's work factor finite and at least 1.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.gpus_per_node == 0 {
            return Err(ClusterError::Field {
                field: "gpus_per_node",
                range: "≥ 1",
                got: "0".into(),
            });
        }
        for (field, v) in [
            ("intra_gb_per_s", self.intra_gb_per_s),
            ("inter_gb_per_s", self.inter_gb_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ClusterError::Field {
                    field,
                    range: "finite and > 0",
                    got: v.to_string(),
                });
            }
        }
        for (field, v) in [
            ("intra_latency_us", self.intra_latency_us),
            ("inter_latency_us", self.inter_latency_us),
            ("call_overhead_us", self.call_overhead_us),
            ("layer_call_overhead_us", self.layer_call_overhead_us),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ClusterError::Field {
                    field,
                    range: "finite and ≥ 0",
                    got: v.to_string(),
                });
            }
        }
        if !(self.overlap_work_factor.is_finite() && self.overlap_work_factor >= 1.0) {
            return Err(ClusterError::Field {
                field: "overlap_work_factor",
                range: "finite and ≥ 1",
                got: self.overlap_work_factor.to_string(),
            });
        }
        Ok(())
    }

    /// The executor's fixed cost of one collective call, seconds
    /// ([`Cluster::call_overhead_us`]).
    pub fn call_s(&self) -> f64 {
        self.call_overhead_us * 1e-6
    }

    /// The executor's fixed cost of one MoE-layer call, seconds
    /// ([`Cluster::layer_call_overhead_us`]).
    pub fn layer_call_s(&self) -> f64 {
        self.layer_call_overhead_us * 1e-6
    }

    /// The slowest link `ranks` ranks span, bytes per second and direction:
    /// between nodes once they exceed one node, else within it (what the
    /// controller times a replica's traffic with, not knowing yet where it
    /// goes).
    pub fn slowest_link_bytes_per_s(&self, ranks: usize) -> f64 {
        let class = if ranks > self.gpus_per_node.max(1) {
            LinkClass::Inter
        } else {
            LinkClass::Intra
        };
        self.link(class).0
    }

    /// The class of the link from rank `a` to rank `b`.
    pub fn class(&self, a: usize, b: usize) -> LinkClass {
        let n = self.gpus_per_node.max(1);
        if a / n == b / n {
            LinkClass::Intra
        } else {
            LinkClass::Inter
        }
    }

    /// Bytes per second and latency in seconds of a class.
    fn link(&self, class: LinkClass) -> (f64, f64) {
        match class {
            LinkClass::Intra => (self.intra_gb_per_s * 1e9, self.intra_latency_us * 1e-6),
            LinkClass::Inter => (self.inter_gb_per_s * 1e9, self.inter_latency_us * 1e-6),
        }
    }

    /// Seconds of one exchange: `bytes[s][d]` go from rank `s` to rank `d`
    /// (see the crate doc).
    pub fn exchange_s(&self, bytes: &[Vec<u64>]) -> Result<f64, ClusterError> {
        self.exchange_scaled_s(bytes, 1)
    }

    /// Seconds of one exchange of `counts[s][d] × bytes_each` bytes from
    /// rank `s` to rank `d` (rows of one width). Sends and receives count
    /// alike, so the exchange the other way (the transpose) takes as long.
    pub fn exchange_scaled_s(
        &self,
        counts: &[Vec<u64>],
        bytes_each: u64,
    ) -> Result<f64, ClusterError> {
        self.validate()?;
        let n = counts.len();
        if let Some((row, r)) = counts.iter().enumerate().find(|(_, r)| r.len() != n) {
            return Err(ClusterError::NotSquare {
                row,
                got: r.len(),
                ranks: n,
            });
        }
        let mut worst = 0.0f64;
        let (mut out, mut inn) = (vec![0u128; n], vec![0u128; n]);
        for class in [LinkClass::Intra, LinkClass::Inter] {
            out.fill(0);
            inn.fill(0);
            for (s, row) in counts.iter().enumerate() {
                for (d, &b) in row.iter().enumerate() {
                    if s != d && self.class(s, d) == class {
                        out[s] += u128::from(b);
                        inn[d] += u128::from(b);
                    }
                }
            }
            let most = out.iter().chain(&inn).copied().max().unwrap_or(0) * u128::from(bytes_each);
            if most > 0 {
                let (bw, lat) = self.link(class);
                worst = worst.max(lat + most as f64 / bw);
            }
        }
        Ok(worst)
    }

    /// The slowest class a collective over `ranks` ranks crosses.
    fn ring_link(&self, ranks: usize) -> (f64, f64) {
        self.link(if ranks > self.gpus_per_node.max(1) {
            LinkClass::Inter
        } else {
            LinkClass::Intra
        })
    }

    /// Seconds of a ring all-reduce of `bytes` (each rank's buffer) over
    /// `ranks` ranks; zero for one rank or no bytes.
    pub fn all_reduce_s(&self, bytes: u64, ranks: usize) -> Result<f64, ClusterError> {
        self.validate()?;
        if ranks <= 1 || bytes == 0 {
            return Ok(0.0);
        }
        let (bw, lat) = self.ring_link(ranks);
        let steps = 2.0 * (ranks - 1) as f64;
        Ok(lat + steps / ranks as f64 * bytes as f64 / bw)
    }

    /// Seconds of a ring all-gather in which every rank contributes
    /// `bytes_per_rank`; zero for one rank or no bytes.
    pub fn all_gather_s(&self, bytes_per_rank: u64, ranks: usize) -> Result<f64, ClusterError> {
        self.validate()?;
        if ranks <= 1 || bytes_per_rank == 0 {
            return Ok(0.0);
        }
        let (bw, lat) = self.ring_link(ranks);
        let steps = (ranks - 1) as f64;
        Ok(lat + steps * bytes_per_rank as f64 / bw)
    }
}

/// A bulk-synchronous phase: it ends when its slowest rank does. Zero for
/// no ranks.
pub fn bulk_synchronous(per_rank_s: &[f64]) -> f64 {
    per_rank_s.iter().copied().fold(0.0, f64::max)
}

/// Two pieces of work the executor runs at once take the longer of the two.
pub fn overlapped(a_s: f64, b_s: f64) -> f64 {
    a_s.max(b_s)
}

/// The bytes of an all-to-all in which every rank's buffer of
/// `bytes_per_rank` is split equally over the `ranks` ranks (itself
/// included): what NCCL's and PyTorch's all-to-all benchmarks time.
pub fn equal_split(bytes_per_rank: u64, ranks: usize) -> Vec<Vec<u64>> {
    let each = bytes_per_rank / ranks.max(1) as u64;
    vec![vec![each; ranks]; ranks]
}

/// An exchange (or a sequence of exchanges timed together) measured on
/// real GPUs, with the bytes each rank sent to each other rank.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredExchange {
    /// What it was, as in `docs/benchmarks.md`.
    pub what: String,
    /// Date and machine.
    pub when: &'static str,
    /// Ranks (one GPU each, one node).
    pub ranks: usize,
    /// Exchanges timed back to back, each `bytes[s][d]`.
    pub exchanges: Vec<Vec<Vec<u64>>>,
    /// The measured time, ms.
    pub measured_ms: f64,
}

const MIB: u64 = 1 << 20;

/// The routed pairs per expert of `lrmoe-dist-bench`'s backward table:
/// 16 384 tokens × top-8 per rank over 128 experts with Zipf(0.8)
/// popularity in expert order (the remainder to expert 0), the same on
/// every rank.
fn zipf08_counts() -> Vec<u64> {
    const EXPERTS: usize = 128;
    const PAIRS: u64 = 16_384 * 8;
    let w: Vec<f64> = (1..=EXPERTS).map(|i| (i as f64).powf(-0.8)).collect();
    let s: f64 = w.iter().sum();
    let mut c: Vec<u64> = w.iter().map(|x| (x / s * PAIRS as f64) as u64).collect();
    let short = PAIRS - c.iter().sum::<u64>();
    c[0] += short;
    c
}

/// The LRMoE backward's two exchanges of that table at retention `r`:
/// kept `[x | g·δ]` rows (2 × 2048 bf16) from every source to the experts'
/// owners (blocks of `128 / ranks`), then `dX` rows (2048 bf16) back.
fn backward_exchanges(ranks: usize, r: f64) -> Vec<Vec<Vec<u64>>> {
    let kept: Vec<u64> = zipf08_counts()
        .iter()
        .map(|&n| (n as f64 * r).round() as u64)
        .collect();
    let to: Vec<u64> = (0..ranks)
        .map(|d| {
            kept.iter()
                .enumerate()
                .filter(|(e, _)| e * ranks / kept.len() == d)
                .map(|(_, &k)| k)
                .sum()
        })
        .collect();
    let out = (0..ranks)
        .map(|_| to.iter().map(|&p| p * 2 * 2048 * 2).collect())
        .collect();
    let back = (0..ranks)
        .map(|s| (0..ranks).map(|_| to[s] * 2048 * 2).collect())
        .collect();
    vec![out, back]
}

/// Every all-to-all on record in `docs/benchmarks.md` (and its history in
/// git) measured with NCCL on H200s of one node (NV18): the equal-split
/// benchmark at 16, 128 and 1024 MiB per rank on 2 and 4 GPUs, and the
/// LRMoE backward's exchanges at retention 1, 0.5 and 0.25 (2 GPUs: each
/// exchange, twice; 4 GPUs: both together). Rank 0's medians.
pub fn measured_exchanges() -> Vec<MeasuredExchange> {
    let mut v = Vec::new();
    let equal = |ranks: usize, mib: u64, ms: f64, when| MeasuredExchange {
        what: format!("all-to-all, {mib} MiB per rank, equal split"),
        when,
        ranks,
        exchanges: vec![equal_split(mib * MIB, ranks)],
        measured_ms: ms,
    };
    // 2 GPUs: median ms as printed.
    for (mib, ms) in [(16, 0.072), (128, 0.297), (1024, 1.651)] {
        v.push(equal(2, mib, ms, "2026-11-29, h200-x2"));
    }
    // 4 GPUs: printed as algbw GB/s (buffer bytes / time).
    for (mib, gbps) in [(16u64, 204.0), (128, 352.0), (1024, 442.0)] {
        let ms = (mib * MIB) as f64 / (gbps * 1e9) * 1e3;
        v.push(equal(4, mib, ms, "2026-11-29, h200-x4"));
    }
    let backward = |ranks, r: f64, which: Option<usize>, ms, when| {
        let mut ex = backward_exchanges(ranks, r);
        let what = match which {
            Some(0) => "backward all-to-all out (x and g·δ rows)",
            Some(_) => "backward all-to-all back (dX rows)",
            None => "backward all-to-all, out and back",
        };
        if let Some(i) = which {
            ex = vec![ex.swap_remove(i)];
        }
        MeasuredExchange {
            what: format!("{what}, Zipf(0.8), r = {r}"),
            when,
            ranks,
            exchanges: ex,
            measured_ms: ms,
        }
    };
    for (r, out, back) in [
        (1.0, 2.417, 1.246),
        (0.5, 1.218, 0.670),
        (0.25, 0.628, 0.347),
    ] {
        v.push(backward(2, r, Some(0), out, "2026-11-29, h200-x2"));
        v.push(backward(2, r, Some(1), back, "2026-11-29, h200-x2"));
    }
    for (r, total) in [(1.0, 3.633), (0.5, 1.896), (0.25, 1.012)] {
        v.push(backward(2, r, None, total, "2026-11-29 (2nd), h200-x2"));
    }
    for (r, total) in [(1.0, 8.63), (0.5, 4.37), (0.25, 2.12)] {
        v.push(backward(4, r, None, total, "2026-11-29, h200-x4"));
    }
    v
}

/// One measured exchange beside the model's prediction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// What was measured.
    pub what: String,
    /// Date and machine.
    pub when: &'static str,
    /// Ranks.
    pub ranks: usize,
    /// The most bytes any rank sent or received between ranks, summed over
    /// the exchanges.
    pub busiest_bytes: u64,
    /// Measured, ms.
    pub measured_ms: f64,
    /// Predicted, ms.
    pub predicted_ms: f64,
}

impl Check {
    /// `predicted / measured − 1`.
    pub fn error(&self) -> f64 {
        self.predicted_ms / self.measured_ms - 1.0
    }
}

/// The model's prediction of every measured exchange.
pub fn check(cluster: &Cluster) -> Result<Vec<Check>, ClusterError> {
    measured_exchanges()
        .into_iter()
        .map(|m| {
            let mut predicted = 0.0;
            let mut busiest = 0u64;
            for ex in &m.exchanges {
                predicted += cluster.exchange_s(ex)?;
                busiest += busiest_bytes(ex);
            }
            Ok(Check {
                what: m.what,
                when: m.when,
                ranks: m.ranks,
                busiest_bytes: busiest,
                measured_ms: m.measured_ms,
                predicted_ms: predicted * 1e3,
            })
        })
        .collect()
}

/// The most bytes any rank sends or receives to or from other ranks.
pub fn busiest_bytes(bytes: &[Vec<u64>]) -> u64 {
    let n = bytes.len();
    let mut inn = vec![0u64; n];
    let mut most = 0u64;
    for (s, row) in bytes.iter().enumerate() {
        let mut out = 0u64;
        for (d, &b) in row.iter().enumerate() {
            if s != d {
                out = out.saturating_add(b);
                if let Some(i) = inn.get_mut(d) {
                    *i = i.saturating_add(b);
                }
            }
        }
        most = most.max(out);
    }
    most.max(inn.into_iter().max().unwrap_or(0))
}

/// The validation table (Markdown).
pub fn check_table(checks: &[Check]) -> String {
    let mut t = String::from(
        "| measured | ranks | busiest rank MB | measured ms | model ms | model ÷ measured − 1 |\n|---|---|---|---|---|---|\n",
    );
    for c in checks {
        t.push_str(&format!(
            "| {} ({}) | {} | {:.1} | {:.3} | {:.3} | {:+.1}% |\n",
            c.what,
            c.when,
            c.ranks,
            c.busiest_bytes as f64 / 1e6,
            c.measured_ms,
            c.predicted_ms,
            100.0 * c.error()
        ));
    }
    t
}

#[cfg(test)]
mod tests;

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
