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
//! break alike. Pure functions on counts and masks, tested in CI.

use crate::KernelError;

/// Marks a row that is not kept.
pub const NONE: u32 = u32::MAX;

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

/// The owner's plan for the kept rows, from the selection's mask over its
/// expert-major rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerKept {
    /// The mask in source-major order (sent back to the sources).
    pub mask_src: Vec<u8>,
    /// Kept rows from each source (what the δ all-to-all brings).
    pub from: Vec<usize>,
    /// Expert-major kept row `q` ← expert-major row `x_rows[q]` (its saved input).
    pub x_rows: Vec<u32>,
    /// Expert-major kept row `q` ← row `d_rows[q]` of the received δ buffer
    /// (source-major, kept rows only).
    pub d_rows: Vec<u32>,
    /// Received-δ row `i` ← expert-major kept row `back[i]` (for sending dX).
    pub back: Vec<u32>,
    /// Expert-major kept group offsets, `E_l + 1` entries.
    pub offsets: Vec<i32>,
}

/// Plans the owner's kept rows.
pub fn owner_kept(layout: &RecvLayout, kept: &[u8]) -> Result<OwnerKept, KernelError> {
    let n = layout.perm.len();
    if kept.len() != n {
        return Err(KernelError::Shape {
            what: "kept mask",
            expected: n,
            got: kept.len(),
        });
    }
    let mut mask_src = vec![0u8; n];
    for (j, &i) in layout.perm.iter().enumerate() {
        mask_src[i as usize] = u8::from(kept[j] != 0);
    }
    // Position of each kept source-major row in the received δ buffer.
    let mut pos = vec![NONE; n];
    let mut from = Vec::with_capacity(layout.from.len());
    let (mut at, mut i0) = (0u32, 0usize);
    for &rows in &layout.from {
        let mut c = 0usize;
        for i in i0..i0 + rows {
            if mask_src[i] != 0 {
                pos[i] = at;
                at += 1;
                c += 1;
            }
        }
        from.push(c);
        i0 += rows;
    }
    let (mut x_rows, mut d_rows) = (Vec::new(), Vec::new());
    let mut offsets = vec![0i32];
    for w in layout.offsets.windows(2) {
        for j in w[0]..w[1] {
            if kept[j as usize] != 0 {
                x_rows.push(j);
                d_rows.push(pos[layout.perm[j as usize] as usize]);
            }
        }
        offsets.push(x_rows.len() as i32);
    }
    Ok(OwnerKept {
        mask_src,
        from,
        back: inverse(&d_rows),
        x_rows,
        d_rows,
        offsets,
    })
}

/// A source's plan for its kept rows, from the mask its owners sent back
/// (one flag per grouped row, in send order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceKept {
    /// Grouped rows that are kept, in send order.
    pub rows: Vec<u32>,
    /// Kept rows per destination.
    pub to: Vec<usize>,
    /// Grouped row → its place among the kept rows, or [`NONE`].
    pub place: Vec<u32>,
}

/// Plans a source's kept rows (`send`: rows per destination).
pub fn source_kept(mask: &[u8], send: &[usize]) -> Result<SourceKept, KernelError> {
    let n: usize = send.iter().sum();
    if mask.len() != n {
        return Err(KernelError::Shape {
            what: "kept mask from the owners",
            expected: n,
            got: mask.len(),
        });
    }
    let mut rows = Vec::new();
    let mut place = vec![NONE; n];
    let mut to = Vec::with_capacity(send.len());
    let mut i0 = 0usize;
    for &c in send {
        let before = rows.len();
        for j in i0..i0 + c {
            if mask[j] != 0 {
                place[j] = rows.len() as u32;
                rows.push(j as u32);
            }
        }
        to.push(rows.len() - before);
        i0 += c;
    }
    Ok(SourceKept { rows, to, place })
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
    fn kept_plans_agree_between_owner_and_sources() {
        let counts = vec![vec![1, 0, 2, 1], vec![0, 3, 1, 2]];
        let l = recv_layout(&counts, 1, 2).unwrap();
        // Expert-major rows: e2: s0,s0,s1 ; e3: s0,s1,s1. Keep 1st, 3rd, 5th.
        let kept = [1, 0, 1, 0, 1, 0];
        let o = owner_kept(&l, &kept).unwrap();
        // Source-major: s0e2(kept) s0e2 s0e3 | s1e2(kept) s1e3(kept) s1e3.
        assert_eq!(o.mask_src, vec![1, 0, 0, 1, 1, 0]);
        assert_eq!(o.from, vec![1, 2]);
        assert_eq!(o.x_rows, vec![0, 2, 4]);
        assert_eq!(o.d_rows, vec![0, 1, 2]);
        assert_eq!(o.offsets, vec![0, 2, 3]);
        // Source 1's part of the mask, in its send order for rank 1 (its
        // rows for rank 0 first: three, none kept here).
        let s1 = source_kept(&[0, 0, 0, 1, 1, 0], &[3, 3]).unwrap();
        assert_eq!(s1.rows, vec![3, 4]);
        assert_eq!(s1.to, vec![0, 2]);
        assert_eq!(s1.place, vec![NONE, NONE, NONE, 0, 1, NONE]);
        assert!(owner_kept(&l, &[1]).is_err());
        assert!(source_kept(&[1], &[3, 3]).is_err());
    }
}
