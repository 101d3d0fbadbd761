//! Host-side index plans of the device-resident expert-parallel layer
//! (`Gpu::ep_forward` / `Gpu::ep_backward`, features `cuda` + `nccl`).
//!
//! Experts are owned in contiguous blocks: rank `r` owns experts
//! `r·E_l .. (r+1)·E_l`, `E_l = E / W`. A source rank's pair rows grouped by
//! expert are therefore grouped by destination too, and go out in one
//! variable all-to-all. An owner receives them *source-major* (source 0's
//! rows for its experts, then source 1's, …) and regroups them
//! *expert-major* (expert by expert, sources in rank order) for the grouped
//! GEMM. Sources hold consecutive token ranges, so expert-major order is
//! the single-GPU layer's order on the concatenated tokens: selection ties
//! break alike. Pure functions on counts, tested in CI; the backward's
//! kept-row plans are built on the device from the index arrays these give
//! (`group_by_expert`, `gather_32`, `gather_u8`, `kept_counts`).

use crate::KernelError;

/// Experts per rank: `experts / world`, which must divide evenly.
pub fn experts_per_rank(experts: usize, world: usize) -> Result<usize, KernelError> {
    if world == 0 || experts == 0 || experts % world != 0 {
        return Err(KernelError::Shape {
            what: "experts (a positive multiple of the world size)",
            expected: world.max(1),
            got: experts,
        });
    }
    Ok(experts / world)
}

/// Rows a source sends each rank: its routed counts summed per owner block.
pub fn send_rows(counts: &[u32], per_rank: usize) -> Vec<usize> {
    counts
        .chunks(per_rank.max(1))
        .map(|b| b.iter().map(|&c| c as usize).sum())
        .collect()
}

/// What an owner receives and how it regroups it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvLayout {
    /// Rows from each source.
    pub from: Vec<usize>,
    /// Expert-major row `j` ← source-major row `perm[j]`.
    pub perm: Vec<u32>,
    /// Source-major row `i` ← expert-major row `inv[i]` (the inverse).
    pub inv: Vec<u32>,
    /// Expert-major group offsets, `E_l + 1` entries.
    pub offsets: Vec<u32>,
    /// Rows per local expert over all sources.
    pub per_expert: Vec<u32>,
}

/// The owner `rank`'s receive layout from every source's routed counts
/// (`counts_all[s]`: source `s`'s pairs per global expert).
pub fn recv_layout(
    counts_all: &[Vec<u32>],
    rank: usize,
    per_rank: usize,
) -> Result<RecvLayout, KernelError> {
    let lo = rank * per_rank;
    for c in counts_all {
        if c.len() < lo + per_rank {
            return Err(KernelError::Shape {
                what: "routed counts per expert",
                expected: lo + per_rank,
                got: c.len(),
            });
        }
    }
    let mine = |s: usize| &counts_all[s][lo..lo + per_rank];
    let from: Vec<usize> = (0..counts_all.len())
        .map(|s| mine(s).iter().map(|&c| c as usize).sum())
        .collect();
    // Source-major start of (source s, local expert e).
    let mut start = vec![vec![0usize; per_rank]; counts_all.len()];
    let mut at = 0usize;
    for (s, row) in start.iter_mut().enumerate() {
        for (e, st) in row.iter_mut().enumerate() {
            *st = at;
            at += mine(s)[e] as usize;
        }
    }
    let total = at;
    let mut perm = Vec::with_capacity(total);
    let mut offsets = Vec::with_capacity(per_rank + 1);
    let mut per_expert = Vec::with_capacity(per_rank);
    offsets.push(0u32);
    for e in 0..per_rank {
        let mut n = 0u32;
        for (s, st) in start.iter().enumerate() {
            let c = mine(s)[e];
            perm.extend((st[e]..st[e] + c as usize).map(|i| i as u32));
            n += c;
        }
        per_expert.push(n);
        offsets.push(perm.len() as u32);
    }
    Ok(RecvLayout {
        from,
        inv: inverse(&perm),
        perm,
        offsets,
        per_expert,
    })
}

/// The inverse of a permutation of `0..n`.
pub fn inverse(perm: &[u32]) -> Vec<u32> {
    let mut inv = vec![0u32; perm.len()];
    for (j, &i) in perm.iter().enumerate() {
        inv[i as usize] = j as u32;
    }
    inv
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
        assert_eq!(send_rows(&counts[0], 2), vec![1, 3]);
        let l = recv_layout(&counts, 1, 2).unwrap();
        assert_eq!(l.from, vec![3, 3]);
        // Source-major: s0e2 s0e2 s0e3 | s1e2 s1e3 s1e3 → rows 0..6.
        assert_eq!(l.perm, vec![0, 1, 3, 2, 4, 5]);
        assert_eq!(l.offsets, vec![0, 3, 6]);
        assert_eq!(l.per_expert, vec![3, 3]);
        for (i, &j) in l.inv.iter().enumerate() {
            assert_eq!(l.perm[j as usize] as usize, i);
        }
        assert!(recv_layout(&counts, 2, 2).is_err());
    }

    #[test]
    fn segments_label_rows() {
        assert_eq!(segments([2, 0, 1]), (vec![0, 0, 2], vec![0, 2, 2, 3]));
        assert_eq!(segments([]), (vec![], vec![0]));
    }
}
