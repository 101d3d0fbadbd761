//! Plans of an expert-parallel exchange where ranks own contiguous blocks
//! of experts (rank `r` owns experts `r·E_l .. (r+1)·E_l`, `E_l = E / W`).
//!
//! A source's pair rows grouped by expert are then grouped by destination
//! too, and go out in one variable all-to-all of [`block_rows`] rows per
//! rank. The owner receives them source-major and regroups them
//! expert-major for the grouped GEMM with the same [`receive_plan`] as any
//! receiver; [`owner_layout`] adds what a device executor uploads: the
//! inverse permutation and the group offsets. Sources hold consecutive
//! token ranges, so expert-major order is the single-GPU order on the
//! concatenated tokens (selection ties break alike).

use crate::{invert, receive_plan, PackError};

/// Experts per rank under contiguous ownership: `experts / world`, which
/// must divide evenly (both positive).
pub fn experts_per_rank(experts: usize, world: usize) -> Result<usize, PackError> {
    if world == 0 || experts == 0 || experts % world != 0 {
        return Err(PackError::Shape {
            what: "experts (a positive multiple of the world size)",
            expected: world.max(1),
            got: experts,
        });
    }
    Ok(experts / world)
}

/// Rows a source sends each owner: its routed counts per expert summed over
/// each owner's block of `per_rank` experts.
pub fn block_rows(counts: &[u32], per_rank: usize) -> Vec<usize> {
    counts
        .chunks(per_rank.max(1))
        .map(|b| b.iter().map(|&c| c as usize).sum())
        .collect()
}

/// What an owner receives and how it regroups it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerLayout {
    /// Rows from each source.
    pub from: Vec<usize>,
    /// Expert-major row `j` ← source-major row `perm[j]` (the receive
    /// plan's `order`).
    pub perm: Vec<u32>,
    /// Source-major row `i` ← expert-major row `inv[i]` (the inverse).
    pub inv: Vec<u32>,
    /// Expert-major group offsets, `E_l + 1` entries.
    pub offsets: Vec<u32>,
    /// Rows per local expert over all sources.
    pub per_expert: Vec<u32>,
}

/// Owner `rank`'s layout from every source's routed counts per global
/// expert (`counts_all[s][e]`).
pub fn owner_layout(
    counts_all: &[Vec<u32>],
    rank: usize,
    per_rank: usize,
) -> Result<OwnerLayout, PackError> {
    let lo = rank * per_rank;
    let blocks: Vec<Vec<usize>> = counts_all
        .iter()
        .map(|c| {
            c.get(lo..lo + per_rank)
                .map(|b| b.iter().map(|&n| n as usize).collect())
                .ok_or(PackError::Shape {
                    what: "routed counts per expert",
                    expected: lo + per_rank,
                    got: c.len(),
                })
        })
        .collect::<Result<_, _>>()?;
    let plan = receive_plan(&blocks, per_rank)?;
    let mut offsets = Vec::with_capacity(per_rank + 1);
    offsets.push(0u32);
    for &g in &plan.group_sizes {
        offsets.push(offsets[offsets.len() - 1] + g as u32);
    }
    Ok(OwnerLayout {
        inv: invert(&plan.order, plan.order.len())?,
        per_expert: plan.group_sizes.iter().map(|&g| g as u32).collect(),
        from: plan.recv_counts,
        perm: plan.order,
        offsets,
    })
}

/// Segment `k` of `sizes[k]` rows: each row's segment, and the segments'
/// offsets (`sizes.len() + 1` entries).
pub fn segments(sizes: impl IntoIterator<Item = usize>) -> (Vec<u32>, Vec<u32>) {
    let (mut key, mut off) = (Vec::new(), vec![0u32]);
    for (k, n) in sizes.into_iter().enumerate() {
        key.extend(std::iter::repeat_n(k as u32, n));
        off.push(key.len() as u32);
    }
    (key, off)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn experts_must_split_evenly() {
        assert_eq!(experts_per_rank(8, 2).unwrap(), 4);
        assert!(experts_per_rank(6, 4).is_err());
        assert!(experts_per_rank(8, 0).is_err());
        assert!(experts_per_rank(0, 2).is_err());
    }

    #[test]
    fn layouts_regroup_source_major_rows_by_expert() {
        // Two sources, four experts, rank 1 owns experts 2 and 3.
        let counts = vec![vec![1, 0, 2, 1], vec![0, 3, 1, 2]];
        assert_eq!(block_rows(&counts[0], 2), vec![1, 3]);
        let l = owner_layout(&counts, 1, 2).unwrap();
        assert_eq!(l.from, vec![3, 3]);
        // Source-major: s0e2 s0e2 s0e3 | s1e2 s1e3 s1e3 → rows 0..6.
        assert_eq!(l.perm, vec![0, 1, 3, 2, 4, 5]);
        assert_eq!(l.offsets, vec![0, 3, 6]);
        assert_eq!(l.per_expert, vec![3, 3]);
        for (i, &j) in l.inv.iter().enumerate() {
            assert_eq!(l.perm[j as usize] as usize, i);
        }
        assert!(owner_layout(&counts, 2, 2).is_err());
    }

    #[test]
    fn segments_label_rows() {
        assert_eq!(segments([2, 0, 1]), (vec![0, 0, 2], vec![0, 2, 2, 3]));
        assert_eq!(segments([]), (vec![], vec![0]));
    }

    proptest! {
        /// The layout regroups every received row exactly once, expert by
        /// expert with sources ascending, and `inv` undoes `perm`.
        #[test]
        fn owner_layouts_are_permutations_in_expert_then_source_order(
            (world, per_rank, counts) in (1usize..4, 1usize..4).prop_flat_map(|(w, el)| {
                (Just(w), Just(el), prop::collection::vec(prop::collection::vec(0u32..5, w * el), w))
            }),
        ) {
            for rank in 0..world {
                let l = owner_layout(&counts, rank, per_rank).unwrap();
                let n = l.perm.len();
                let mut seen = vec![false; n];
                for &p in &l.perm {
                    prop_assert!(!seen[p as usize]);
                    seen[p as usize] = true;
                }
                for (i, &j) in l.inv.iter().enumerate() {
                    prop_assert_eq!(l.perm[j as usize] as usize, i);
                }
                // Source-major position of (source s, local expert e, k-th row).
                let mut start = vec![vec![0usize; per_rank]; world];
                let mut at = 0;
                for (s, row) in start.iter_mut().enumerate() {
                    for (e, st) in row.iter_mut().enumerate() {
                        *st = at;
                        at += counts[s][rank * per_rank + e] as usize;
                    }
                }
                let mut want = Vec::new();
                for e in 0..per_rank {
                    for (s, row) in start.iter().enumerate() {
                        let c = counts[s][rank * per_rank + e] as usize;
                        want.extend((row[e]..row[e] + c).map(|i| i as u32));
                    }
                }
                prop_assert_eq!(&l.perm, &want);
                prop_assert_eq!(*l.offsets.last().unwrap() as usize, n);
                prop_assert_eq!(l.from.iter().sum::<usize>(), n);
                prop_assert_eq!(block_rows(&counts[0], per_rank).len(), world);
            }
        }
    }
}
