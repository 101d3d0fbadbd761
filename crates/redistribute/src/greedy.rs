//! Greedy baseline: experts in decreasing kept count (longest processing
//! time first), each water-filled onto its least-loaded instances.

use crate::{ExpertFlows, LoadModel, Problem};

/// Pairs instance with load `l` and remaining cap `room` can take while
/// staying at or below `level`.
fn take_at(level: u64, l: u64, room: u64, c: u64) -> u64 {
    level.checked_sub(l).map_or(0, |s| (s / c).min(room))
}

/// `None` when the rank caps leave an expert's pairs without room.
pub(crate) fn solve(problem: &Problem, load: &LoadModel) -> Option<ExpertFlows> {
    let c = load.compute_per_pair;
    let kept = problem.kept_per_expert();
    let mut loads = problem.base_load.clone();
    let mut room: Vec<u64> = (0..problem.n_ranks).map(|r| problem.cap(r)).collect();
    let mut flows: ExpertFlows = problem.instances.iter().map(|i| vec![0; i.len()]).collect();
    let mut order: Vec<usize> = (0..problem.n_experts()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(kept[e]), e));
    for e in order {
        let q = kept[e];
        if q == 0 {
            continue;
        }
        let inst = &problem.instances[e];
        let total_room = inst.iter().fold(0u64, |a, &r| a.saturating_add(room[r]));
        if total_room < q {
            return None;
        }
        let fits = |level: u64| -> u64 {
            inst.iter().fold(0u64, |a, &r| {
                a.saturating_add(take_at(level, loads[r], room[r], c))
            })
        };
        // Smallest level at which the instances can absorb q pairs.
        let mut lo = inst.iter().map(|&r| loads[r]).min().unwrap_or(0);
        let mut hi = inst.iter().map(|&r| loads[r]).max().unwrap_or(0) + c * q;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) >= q {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let below = lo.saturating_sub(1);
        let mut left = q;
        let mut give: Vec<u64> = inst
            .iter()
            .map(|&r| take_at(below, loads[r], room[r], c).min(q))
            .collect();
        left -= give.iter().sum::<u64>().min(left);
        for (i, &r) in inst.iter().enumerate() {
            if left == 0 {
                break;
            }
            if take_at(lo, loads[r], room[r], c) > give[i] {
                give[i] += 1;
                left -= 1;
            }
        }
        for (i, &r) in inst.iter().enumerate() {
            loads[r] += c * give[i];
            room[r] -= give[i];
            flows[e][i] = give[i];
        }
    }
    Some(flows)
}
