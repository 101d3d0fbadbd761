//! N GPUs simulated from N ranks timed on one: the ranks' timelines
//! (`layer::timeline`, recorded by `layer::run_local_timed`) through the
//! cluster model (`cluster`).
//!
//! Each rank's timeline is its own work (measured with the GPU to itself)
//! cut by its collectives. The ranks run the same collectives in the same
//! order; between two collectives they run independently, so that stretch
//! ends when the slowest rank's work does (bulk-synchronous), and each
//! collective takes what the cluster model says for the bytes every rank
//! sent. The in-process exchange completes before the work after it, but
//! the NCCL path runs some of that work beside its exchange (the dispatch
//! beside the experts on a rank's own rows, the backward's dX return
//! beside the weight gradients): the timeline marks where such an exchange
//! is waited for (`Entry::Joined`), and with `cluster.overlap` (the
//! default) the simulator overlaps exactly that work with the exchange —
//! each rank's window, slowed by `cluster.overlap_work_factor`, against the
//! exchange, the longer of the two, then the rank's rest of the stretch.
//! With `overlap = false` every exchange is waited for first (the executor
//! with its overlap switched off). Work and collectives in bookkeeping
//! phases (`layer::timeline::is_bookkeeping`) are not counted.

use std::collections::BTreeMap;

use cluster::{bulk_synchronous, overlapped, Cluster};
use layer::timeline::{is_bookkeeping, Entry};
use serde::Serialize;

/// The simulated time of one step on `ranks` GPUs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Simulated {
    /// Ranks (simulated GPUs).
    pub ranks: usize,
    /// The step, seconds.
    pub step_s: f64,
    /// Its MoE layers (their work and their collectives), seconds.
    pub moe_s: f64,
    /// Its collectives, seconds (each with `cluster.call_overhead_us`);
    /// an overlapped exchange counts with the seconds it adds to its
    /// stretch (beyond the work beside it), not its own.
    pub collectives_s: f64,
    /// Seconds the overlaps saved: the step without them (every exchange
    /// waited for before the work after it) is `step_s` plus these. Zero
    /// with `cluster.overlap` off.
    pub overlap_saved_s: f64,
    /// Those of them in the MoE layers (`moe_s` plus these is the MoE
    /// layers' time without the overlaps).
    pub moe_overlap_saved_s: f64,
    /// The collectives counted (the simulation's own bookkeeping not).
    pub calls: usize,
    /// Those of them in the MoE layers.
    pub moe_calls: usize,
    /// MoE-layer calls in each direction (layers × micro-batches), each
    /// forward and each backward charged `cluster.layer_call_overhead_us`
    /// (under the phases' `layer calls` parts).
    pub moe_layer_calls: usize,
    /// Every rank's own work summed (what one GPU ran), seconds.
    pub work_all_ranks_s: f64,
    /// Seconds per phase, collectives included; the MoE layers' work is
    /// split into their parts (`"moe forward: route"`, …), their
    /// collectives and any work after the last part stay under the phase.
    pub phases: BTreeMap<String, f64>,
    /// Host seconds per phase of the same pieces (the slowest rank's in
    /// each stretch, collectives not included): where a phase's host
    /// seconds come close to its seconds, the GPU waited for the host
    /// (planning, enqueueing) rather than computed.
    pub host_phases: BTreeMap<String, f64>,
    /// Seconds a fixed host workload ([`host_probe`]) took on the host
    /// that timed this step (`None` where it was not run): the lent
    /// machine's host speed moves between and within calls, and where the
    /// GPU waits for the host (`host_phases`) the step moves with it, so
    /// modes trained one after the other are compared with this beside.
    pub host_probe_s: Option<f64>,
    /// The most device memory each rank held at once during the step,
    /// bytes (rank order; empty where the ranks were not timed on a GPU).
    pub held_bytes: Vec<u64>,
}

impl Simulated {
    /// Seconds of `phase` with its parts.
    pub fn phase_s(&self, phase: &str) -> f64 {
        self.phases
            .iter()
            .filter(|(p, _)| crate::device_model::phase::within(p, phase))
            .map(|(_, s)| s)
            .sum()
    }
}

/// Why timelines cannot be simulated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// Ranks disagree on their collectives.
    #[error("the ranks' timelines differ: {0}")]
    Mismatch(String),
    /// The cluster model refused.
    #[error(transparent)]
    Cluster(#[from] cluster::ClusterError),
}

/// The work between two collectives on one rank.
#[derive(Default)]
struct Stretch<'a> {
    /// Per phase: `[GPU seconds, host seconds]`.
    phases: BTreeMap<&'a str, [f64; 2]>,
    /// GPU seconds recorded before the stretch's first `Joined` (the work
    /// the NCCL path runs beside the collective before the stretch), if it
    /// has one.
    beside: Option<f64>,
}

impl Stretch<'_> {
    fn gpu_s(&self) -> f64 {
        self.phases.values().map(|v| v[0]).sum()
    }
}

/// One rank's timeline cut at its collectives: the work before each, then
/// the collective; the work after the last.
struct Cut<'a> {
    stretches: Vec<Stretch<'a>>,
    collectives: Vec<&'a Entry>,
    held: Option<u64>,
}

fn cut(entries: &[Entry]) -> Cut<'_> {
    let mut stretches = vec![Stretch::default()];
    let mut collectives = Vec::new();
    let mut held = None;
    for e in entries {
        let st = stretches
            .last_mut()
            .expect("invariant: one stretch per collective plus one");
        match e {
            Entry::Work {
                phase,
                seconds,
                host_seconds,
            } => {
                if !is_bookkeeping(phase) {
                    let at = st.phases.entry(phase.as_str()).or_insert([0.0; 2]);
                    at[0] += seconds;
                    at[1] += host_seconds;
                }
            }
            Entry::Joined { .. } => {
                if st.beside.is_none() {
                    st.beside = Some(st.gpu_s());
                }
            }
            Entry::Held { bytes } => held = Some(held.unwrap_or(0).max(*bytes)),
            Entry::Exchange { .. } | Entry::Reduce { .. } => {
                collectives.push(e);
                stretches.push(Stretch::default());
            }
        }
    }
    Cut {
        stretches,
        collectives,
        held,
    }
}

/// The seconds of collective `i` given every rank's record of it.
fn collective_s(i: usize, records: &[&Entry], cluster: &Cluster) -> Result<f64, SimError> {
    let n = records.len();
    match records[0] {
        Entry::Exchange { .. } => {
            let bytes = records
                .iter()
                .map(|e| match e {
                    Entry::Exchange { bytes_to, .. } if bytes_to.len() == n => Ok(bytes_to.clone()),
                    other => Err(SimError::Mismatch(format!(
                        "collective {i}: an exchange on rank 0, {other:?} elsewhere"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(cluster.exchange_s(&bytes)?)
        }
        Entry::Reduce { .. } => {
            let most = records
                .iter()
                .map(|e| match e {
                    Entry::Reduce { bytes, .. } => Ok(*bytes),
                    other => Err(SimError::Mismatch(format!(
                        "collective {i}: a sum on rank 0, {other:?} elsewhere"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .max()
                .unwrap_or(0);
            Ok(cluster.all_reduce_s(most, n)?)
        }
        Entry::Work { .. } | Entry::Held { .. } | Entry::Joined { .. } => Err(SimError::Mismatch(
            format!("collective {i} is not a collective"),
        )),
    }
}

/// Times a fixed host workload of the planner's kind (nested vectors
/// allocated and freed, an integer sort, branchy scans; ~0.1–0.3 ms on
/// one core): the same work every call, so its seconds follow the host's
/// speed. Returns the best of three runs, seconds.
pub fn host_probe() -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let cells: Vec<Vec<Vec<u32>>> = (0..16)
            .map(|_| {
                (0..128)
                    .map(|_| (0..16).map(|_| (next() % 97) as u32).collect())
                    .collect()
            })
            .collect();
        let mut keys: Vec<u64> = cells
            .iter()
            .flat_map(|r| {
                r.iter()
                    .map(|c| c.iter().map(|&v| u64::from(v)).sum::<u64>())
            })
            .chain((0..16_384).map(|_| next()))
            .collect();
        keys.sort_unstable();
        let odd = keys.iter().filter(|&&k| k % 3 == 1).count();
        std::hint::black_box((cells, odd));
        best = best.min(t0.elapsed().as_secs_f64());
    }
    best
}

/// Simulates one step from every rank's timeline (rank order) that made
/// `moe_layer_calls` MoE-layer calls in each direction (layers ×
/// micro-batches), each charged the cluster's fixed cost of a layer call.
pub fn simulate(
    timelines: &[Vec<Entry>],
    cluster: &Cluster,
    moe_layer_calls: usize,
) -> Result<Simulated, SimError> {
    cluster.validate()?;
    let cuts: Vec<Cut<'_>> = timelines.iter().map(|t| cut(t)).collect();
    let n_coll = cuts.first().map_or(0, |c| c.collectives.len());
    if let Some((r, c)) = cuts
        .iter()
        .enumerate()
        .find(|(_, c)| c.collectives.len() != n_coll)
    {
        return Err(SimError::Mismatch(format!(
            "rank 0 has {n_coll} collectives, rank {r} {}",
            c.collectives.len()
        )));
    }
    let mut phases: BTreeMap<String, f64> = BTreeMap::new();
    let mut host_phases: BTreeMap<String, f64> = BTreeMap::new();
    let (mut step, mut collectives, mut saved, mut moe_saved) = (0.0, 0.0, 0.0, 0.0);
    let (mut calls, mut moe_calls) = (0, 0);
    // The collective before the current stretch where that stretch runs
    // work beside it: its seconds and phase.
    let mut beside: Option<(f64, &str)> = None;
    let factor = cluster.overlap_work_factor;
    for k in 0..=n_coll {
        // The stretch before collective k (or after the last): it ends with
        // its slowest rank, split over phases as that rank's is. After an
        // overlapped collective of `c` seconds a rank ends at
        // max(c, factor · beside) + the rest of its stretch.
        let stretch: Vec<&Stretch<'_>> = cuts.iter().map(|c| &c.stretches[k]).collect();
        let prev = beside.take();
        let end = |st: &Stretch<'_>| match prev {
            None => st.gpu_s(),
            Some((c, _)) => {
                let b = st.beside.unwrap_or(0.0);
                overlapped(c, factor * b) + (st.gpu_s() - b)
            }
        };
        let slowest = stretch.iter().max_by(|a, b| end(a).total_cmp(&end(b)));
        if let Some(st) = slowest {
            for (p, [s, h]) in &st.phases {
                *phases.entry((*p).to_string()).or_insert(0.0) += s;
                *host_phases.entry((*p).to_string()).or_insert(0.0) += h;
            }
            let ends = end(st);
            step += ends;
            if let Some((c, phase)) = prev {
                // The collective's share: what its stretch took beyond the
                // slowest rank's work; the saving: against waiting for it.
                let added = ends - st.gpu_s();
                *phases.entry(phase.to_string()).or_insert(0.0) += added;
                collectives += added;
                let work: Vec<f64> = stretch.iter().map(|s| s.gpu_s()).collect();
                let s = c + bulk_synchronous(&work) - ends;
                saved += s;
                if crate::device_model::phase::is_moe(phase) {
                    moe_saved += s;
                }
            }
        }
        if k == n_coll {
            break;
        }
        let records: Vec<&Entry> = cuts.iter().map(|c| c.collectives[k]).collect();
        let phase = records[0].phase();
        if let Some(r) = records.iter().position(|e| e.phase() != phase) {
            return Err(SimError::Mismatch(format!(
                "collective {k}: phase {phase:?} on rank 0, {:?} on rank {r}",
                records[r].phase()
            )));
        }
        if is_bookkeeping(phase) {
            continue;
        }
        let s = collective_s(k, &records, cluster)? + cluster.call_s();
        calls += 1;
        if crate::device_model::phase::is_moe(phase) {
            moe_calls += 1;
        }
        let joined = cuts
            .iter()
            .filter(|c| c.stretches[k + 1].beside.is_some())
            .count();
        if joined != 0 && joined != cuts.len() {
            return Err(SimError::Mismatch(format!(
                "collective {k}: {joined} of {} ranks run work beside it",
                cuts.len()
            )));
        }
        if cluster.overlap && joined > 0 && matches!(records[0], Entry::Exchange { .. }) {
            beside = Some((s, phase));
        } else {
            *phases.entry(phase.to_string()).or_insert(0.0) += s;
            step += s;
            collectives += s;
        }
    }
    let fixed = moe_layer_calls as f64 * cluster.layer_call_s();
    if fixed > 0.0 {
        for p in crate::device_model::phase::MOE {
            *phases.entry(format!("{p}: layer calls")).or_insert(0.0) += fixed;
            step += fixed;
        }
    }
    let moe_s = phases
        .iter()
        .filter(|(p, _)| crate::device_model::phase::is_moe(p))
        .map(|(_, s)| s)
        .sum();
    let held_bytes = cuts.iter().map(|c| c.held).collect::<Option<Vec<u64>>>();
    let work_all_ranks_s = cuts
        .iter()
        .flat_map(|c| c.stretches.iter().map(Stretch::gpu_s))
        .sum();
    Ok(Simulated {
        ranks: timelines.len(),
        step_s: step,
        moe_s,
        collectives_s: collectives,
        overlap_saved_s: saved,
        moe_overlap_saved_s: moe_saved,
        calls,
        moe_calls,
        moe_layer_calls,
        work_all_ranks_s,
        phases,
        host_phases,
        host_probe_s: None,
        held_bytes: held_bytes.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(phase: &str, seconds: f64) -> Entry {
        Entry::Work {
            phase: phase.into(),
            seconds,
            host_seconds: seconds / 2.0,
        }
    }

    fn ex(phase: &str, bytes_to: Vec<u64>) -> Entry {
        Entry::Exchange {
            phase: phase.into(),
            bytes_to,
        }
    }

    #[test]
    fn the_host_probe_takes_a_time_of_its_kind() {
        let s = host_probe();
        // Well under a second on any host; more than nothing.
        assert!(s.is_finite() && s > 1e-6 && s < 1.0, "{s}");
    }

    #[test]
    fn stretches_end_with_their_slowest_rank_and_collectives_follow_the_links() {
        let c = Cluster {
            gpus_per_node: 8,
            intra_gb_per_s: 100.0,
            intra_latency_us: 0.0,
            inter_gb_per_s: 10.0,
            inter_latency_us: 0.0,
            call_overhead_us: 0.0,
            layer_call_overhead_us: 0.0,
            ..Cluster::default()
        };
        let t = vec![
            vec![
                work("dense forward", 1.0),
                work("moe forward", 2.0),
                ex("moe forward", vec![0, 1_000_000_000]),
                work("moe forward", 0.5),
                work("(staging)", 9.0),
                Entry::Reduce {
                    phase: "gradient sums".into(),
                    bytes: 400_000_000,
                },
            ],
            vec![
                work("dense forward", 1.5),
                work("moe forward: route", 0.5),
                ex("moe forward", vec![2_000_000_000, 0]),
                work("moe forward: combine", 1.0),
                Entry::Reduce {
                    phase: "gradient sums".into(),
                    bytes: 400_000_000,
                },
                work("optimizer", 0.25),
            ],
        ];
        let s = simulate(&t, &c, 1).unwrap();
        // Stretch 0: rank 0's 3 s; the exchange: rank 1 sends 2 GB at
        // 100 GB/s; stretch 1: rank 1's 1 s (rank 0's staging is not
        // counted); the sum: 2·1/2·0.4 GB at 100 GB/s; stretch 2: 0.25 s.
        let want = 3.0 + 0.02 + 1.0 + 0.004 + 0.25;
        assert!((s.step_s - want).abs() < 1e-12, "{s:?}");
        assert!((s.moe_s - (2.0 + 0.02 + 1.0)).abs() < 1e-12, "{s:?}");
        assert!((s.collectives_s - 0.024).abs() < 1e-12);
        assert_eq!(s.phases["dense forward"], 1.0);
        // Stretch 1's slowest rank is rank 1, whose work is a part.
        assert_eq!(s.phases["moe forward: combine"], 1.0);
        // Host seconds follow the same (slowest) rank's pieces: half of
        // each here; stretch 1 is rank 1's, so rank 0's 0.5 s is absent.
        assert_eq!(s.host_phases["moe forward: combine"], 0.5);
        assert_eq!(s.host_phases["moe forward"], 1.0);
        assert!(!s.host_phases.contains_key("(staging)"));
        assert!((s.phase_s("moe forward") - (2.0 + 0.02 + 1.0)).abs() < 1e-12);
        assert_eq!(s.phase_s("moe"), 0.0, "a prefix of a word is not a part");
        assert!((s.work_all_ranks_s - 6.75).abs() < 1e-12);
        assert_eq!(s.ranks, 2);
        assert!(s.held_bytes.is_empty(), "untimed ranks hold nothing known");
        assert_eq!((s.calls, s.moe_calls), (2, 1));
        // A fixed cost per call: 1 ms more for each of the two.
        let slow = simulate(
            &t,
            &Cluster {
                call_overhead_us: 1000.0,
                ..c
            },
            1,
        )
        .unwrap();
        assert!((slow.step_s - (want + 0.002)).abs() < 1e-12, "{slow:?}");
        assert!((slow.moe_s - (s.moe_s + 0.001)).abs() < 1e-12, "{slow:?}");
        assert!((slow.collectives_s - 0.026).abs() < 1e-12);
        // A fixed cost per MoE-layer call: 3 calls each way at 0.1 s, in
        // the MoE phases' `layer calls` parts, not in the collectives.
        let calls = simulate(
            &t,
            &Cluster {
                layer_call_overhead_us: 100_000.0,
                ..c
            },
            3,
        )
        .unwrap();
        assert!((calls.step_s - (want + 0.6)).abs() < 1e-12, "{calls:?}");
        assert!((calls.moe_s - (s.moe_s + 0.6)).abs() < 1e-12, "{calls:?}");
        assert!((calls.phases["moe backward: layer calls"] - 0.3).abs() < 1e-12);
        assert!((calls.phase_s("moe forward") - (s.phase_s("moe forward") + 0.3)).abs() < 1e-12);
        assert_eq!(
            (calls.collectives_s, calls.moe_layer_calls),
            (s.collectives_s, 3)
        );
        assert!(
            !s.phases.contains_key("moe forward: layer calls"),
            "none at 0 µs"
        );
    }

    #[test]
    fn an_exchange_overlaps_the_work_up_to_its_join_and_no_more() {
        let joined = |phase: &str| Entry::Joined {
            phase: phase.into(),
        };
        // Two ranks: 1 s, then a dispatch of 2 GB from rank 1 (0.02 s at
        // 100 GB/s), then each rank's own rows beside it (10 and 50 ms),
        // the join, and the rest (0.5 and 0.2 s).
        let rank = |own: f64, rest: f64, bytes_to: Vec<u64>| {
            vec![
                work("moe forward", 1.0),
                ex("moe forward", bytes_to),
                work("moe forward: experts (own rows)", own),
                joined("moe forward"),
                work("moe forward: a2a x + experts", rest),
            ]
        };
        let t = vec![
            rank(0.01, 0.5, vec![0, 1_000_000_000]),
            rank(0.05, 0.2, vec![2_000_000_000, 0]),
        ];
        let c = Cluster {
            intra_gb_per_s: 100.0,
            intra_latency_us: 0.0,
            overlap_work_factor: 1.0,
            ..Cluster::default()
        };
        let off = simulate(
            &t,
            &Cluster {
                overlap: false,
                ..c
            },
            1,
        )
        .unwrap();
        // Waited for: 1 + 0.02 + rank 0's 0.51.
        assert!((off.step_s - 1.53).abs() < 1e-12, "{off:?}");
        assert_eq!((off.overlap_saved_s, off.moe_overlap_saved_s), (0.0, 0.0));
        // Overlapped: rank 0 ends at max(0.02, 0.01) + 0.5, rank 1 at
        // max(0.02, 0.05) + 0.2; the exchange adds 0.01 beyond rank 0's work.
        let on = simulate(&t, &c, 1).unwrap();
        assert!((on.step_s - 1.52).abs() < 1e-12, "{on:?}");
        assert!((on.collectives_s - 0.01).abs() < 1e-12, "{on:?}");
        assert!((on.overlap_saved_s - 0.01).abs() < 1e-12, "{on:?}");
        assert!((on.step_s + on.overlap_saved_s - off.step_s).abs() < 1e-12);
        assert!((on.moe_s + on.moe_overlap_saved_s - off.moe_s).abs() < 1e-12);
        assert!((on.phases["moe forward"] - 1.01).abs() < 1e-12, "{on:?}");
        assert_eq!(on.phases["moe forward: experts (own rows)"], 0.01);
        assert_eq!(on.work_all_ranks_s, off.work_all_ranks_s);
        // The work beside the exchange slowed tenfold: rank 1 now ends last
        // (max(0.02, 0.5) + 0.2), its parts are the stretch's, and the
        // overlap costs more than waiting would have (a negative saving).
        let slow = simulate(
            &t,
            &Cluster {
                overlap_work_factor: 10.0,
                ..c
            },
            1,
        )
        .unwrap();
        assert!((slow.step_s - 1.7).abs() < 1e-12, "{slow:?}");
        assert_eq!(slow.phases["moe forward: a2a x + experts"], 0.2);
        assert!((slow.overlap_saved_s - (1.53 - 1.7)).abs() < 1e-12);
        // A sum before the join is not overlapped (only exchanges are).
        let sum = |r: &[Entry]| {
            let mut v = r.to_vec();
            v[1] = Entry::Reduce {
                phase: "moe forward".into(),
                bytes: 400_000_000,
            };
            v
        };
        let s = simulate(&[sum(&t[0]), sum(&t[1])], &c, 1).unwrap();
        assert_eq!(s.overlap_saved_s, 0.0);
        // Ranks that disagree on the join are an error.
        let mut one = t.clone();
        one[1].retain(|e| !matches!(e, Entry::Joined { .. }));
        assert!(matches!(simulate(&one, &c, 1), Err(SimError::Mismatch(_))));
    }

    #[test]
    fn each_rank_holds_its_largest_mark() {
        let held = |b| Entry::Held { bytes: b };
        let t = vec![
            vec![work("optimizer", 1.0), held(7)],
            vec![work("optimizer", 2.0), held(9)],
        ];
        let s = simulate(&t, &Cluster::default(), 1).unwrap();
        assert_eq!(s.held_bytes, vec![7, 9]);
        assert_eq!(s.step_s, 2.0, "a mark of memory is not a collective");
        // One rank without the figure: none is reported.
        let t = vec![vec![held(7)], vec![work("optimizer", 2.0)]];
        assert!(simulate(&t, &Cluster::default(), 1)
            .unwrap()
            .held_bytes
            .is_empty());
    }

    #[test]
    fn ranks_that_disagree_are_an_error() {
        let c = Cluster::default();
        let t = vec![
            vec![work("a", 1.0), ex("a", vec![0, 1])],
            vec![work("a", 1.0)],
        ];
        assert!(matches!(simulate(&t, &c, 1), Err(SimError::Mismatch(_))));
        let t = vec![vec![ex("a", vec![0, 1])], vec![ex("b", vec![1, 0])]];
        assert!(matches!(simulate(&t, &c, 1), Err(SimError::Mismatch(_))));
        let bad = Cluster {
            intra_gb_per_s: -1.0,
            ..Cluster::default()
        };
        assert!(matches!(simulate(&[], &bad, 1), Err(SimError::Cluster(_))));
    }

    #[test]
    fn one_rank_is_its_own_work() {
        let t = vec![vec![work("moe backward", 0.5), work("optimizer", 0.25)]];
        let s = simulate(&t, &Cluster::default(), 1).unwrap();
        assert_eq!(s.step_s, 0.75);
        assert_eq!(s.moe_s, 0.5);
    }
}
