//! # pack — physical compaction of the kept rows
//!
//! Masking dropped rows inside full-size tensors saves nothing: the
//! all-to-all and the expert GEMMs only get cheaper when the tensors
//! themselves shrink. This crate builds the index plans that make them
//! shrink, and moves rows by them.
//!
//! ## Sender side ([`plan`])
//!
//! One source rank holds `n` pair rows (one per routed token–expert pair, in
//! any order); pair `i` belongs to expert `expert[i]` and is kept or not
//! (`kept[i]`). The redistribution says how many kept pairs of each expert
//! go to each destination rank ([`SendRoute`]). The kept pairs of expert `e`
//! are dealt to its routes in ascending destination order, lowest row first.
//! The resulting [`PackPlan`] orders the packed buffer
//!
//! ```text
//! [dest 0: [expert 0 rows][expert 1 rows]…][dest 1: …]…   (rows ascending in each block)
//! ```
//!
//! with no padding: `gather[j]` is the source row of packed row `j`,
//! `block_sizes[d][e]` the rows of expert `e` for destination `d`,
//! `send_counts[d] = Σ_e block_sizes[d][e]`, and `inverse[i]` the packed row of
//! source row `i` (or [`DROPPED`]).
//!
//! ## Receiver side ([`receive_plan`])
//!
//! A receiver gets one message per source, each laid out as above for itself.
//! [`RecvPlan`] reorders them into one dense group per expert (groups in
//! expert order, sources ascending within a group) for the grouped GEMM:
//! `group_sizes[e]`, and `order[k]` = position in the concatenated received
//! buffer of grouped row `k`. The same `order` scatters results back.
//!
//! ## Expert-parallel owners ([`ep`])
//!
//! For the device expert-parallel executor, [`ep::instance_layout`] is one
//! exchange under a split of rows over expert instances (owner and
//! replicas; an [`ep::Split`], rows per source, expert and rank in one
//! dense buffer): what each source sends where, in which order, and how each
//! instance regroups what it receives (with the inverse permutation and
//! group offsets a device executor uploads). Its maps are [`ep::Runs`]:
//! blocks of consecutive rows, so the host's work grows with experts and
//! ranks, not with rows; the device expands them. [`ep::replica_routes`] is
//! the one order in which every executor sends replica weights out and
//! their gradients back (owner → replica per peer rank, by expert).
//!
//! ## Row movement
//!
//! [`gather_rows`], [`gather_rows_split`] (a gather that also splits each
//! row into two outputs) and [`unpack_rows`] move `width`-element rows of any
//! `Copy` type (`f32`, `half::bf16`), rayon-parallel over output rows, with
//! every output row written exactly once (no atomics, no `unsafe`).
//! **Unpack writes zero into dropped rows** — the documented value for
//! gradients of pairs the backward dropped.
//!
//! ## Invariants
//!
//! Unpack ∘ pack is the identity on kept rows; block sizes equal the route
//! counts; the plan is a pure function of its inputs (deterministic order);
//! zero-size blocks, destinations with nothing and sources with no rows are
//! ordinary.
//!
//! ## Not here
//!
//! No communication (the transport lives in `layer`), no GEMMs, no GPU (the
//! CUDA twin of the row movers lives in `kernels`).

#![deny(missing_docs)]

pub mod ep;

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use rayon::prelude::*;
use serde::Serialize;

/// Marks a source row that is not in the packed buffer.
pub const DROPPED: u32 = u32::MAX;

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    /// A buffer's length does not match the declared shape.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// A pair or route names an expert outside `0..n_experts`.
    #[error("expert {expert} out of range (n_experts = {n_experts})")]
    ExpertOutOfRange {
        /// The expert.
        expert: usize,
        /// Number of experts.
        n_experts: usize,
    },
    /// A route names a rank outside `0..n_ranks`.
    #[error("destination rank {rank} out of range (n_ranks = {n_ranks})")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// Number of ranks.
        n_ranks: usize,
    },
    /// A split sends rows of an expert to a rank that holds no instance of it.
    #[error(
        "source {from} sends expert {expert}'s rows to rank {rank}, which holds no instance of it"
    )]
    NoInstance {
        /// The source rank.
        from: usize,
        /// The expert.
        expert: usize,
        /// The rank without an instance.
        rank: usize,
    },
    /// The routes of an expert do not add up to its kept pairs.
    #[error("expert {expert}: routes carry {routed} pairs but {kept} are kept")]
    RouteMismatch {
        /// The expert.
        expert: usize,
        /// Pairs in its routes.
        routed: u64,
        /// Its kept pairs.
        kept: u64,
    },
    /// An index points outside its source buffer.
    #[error("index {index} at position {position} is out of range ({rows} rows)")]
    IndexOutOfRange {
        /// Position in the index list.
        position: usize,
        /// The index.
        index: u32,
        /// Rows available.
        rows: usize,
    },
    /// More rows than a `u32` index can name.
    #[error("{rows} rows exceed the u32 index range")]
    TooManyRows {
        /// Rows given.
        rows: usize,
    },
}

/// `pairs` kept pairs of `expert` go to `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRoute {
    /// Expert.
    pub expert: usize,
    /// Destination rank.
    pub rank: usize,
    /// Pairs.
    pub pairs: u64,
}

/// A source rank's compaction plan (see the crate doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PackPlan {
    /// Source row of each packed row.
    pub gather: Vec<u32>,
    /// Packed row of each source row, or [`DROPPED`].
    pub inverse: Vec<u32>,
    /// Rows per destination.
    pub send_counts: Vec<usize>,
    /// Start of each destination's message in the packed buffer, `[n_ranks + 1]`.
    pub send_offsets: Vec<usize>,
    /// Rows per destination and expert, `[n_ranks][n_experts]`.
    pub block_sizes: Vec<Vec<usize>>,
}

impl PackPlan {
    /// Rows in the packed buffer.
    pub fn packed_rows(&self) -> usize {
        self.gather.len()
    }
}

fn shape(what: &'static str, expected: usize, got: usize) -> Result<(), PackError> {
    if expected == got {
        Ok(())
    } else {
        Err(PackError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// Builds the sender's plan. `expert` and `kept` have one entry per source
/// row; `routes` may list an `(expert, rank)` more than once (counts add).
pub fn plan(
    expert: &[u32],
    kept: &[bool],
    routes: &[SendRoute],
    n_ranks: usize,
    n_experts: usize,
) -> Result<PackPlan, PackError> {
    let n = expert.len();
    shape("kept", n, kept.len())?;
    if n >= DROPPED as usize {
        return Err(PackError::TooManyRows { rows: n });
    }
    // Kept rows per expert, ascending (counting sort).
    let mut kept_per_expert = vec![0usize; n_experts + 1];
    for (&e, &k) in expert.iter().zip(kept) {
        if e as usize >= n_experts {
            return Err(PackError::ExpertOutOfRange {
                expert: e as usize,
                n_experts,
            });
        }
        if k {
            kept_per_expert[e as usize + 1] += 1;
        }
    }
    let mut start = kept_per_expert.clone();
    for e in 0..n_experts {
        start[e + 1] += start[e];
    }
    let mut by_expert = vec![0u32; start[n_experts]];
    let mut cursor = start.clone();
    for (i, (&e, &k)) in expert.iter().zip(kept).enumerate() {
        if k {
            by_expert[cursor[e as usize]] = i as u32;
            cursor[e as usize] += 1;
        }
    }

    let mut block_sizes = vec![vec![0usize; n_experts]; n_ranks];
    for r in routes {
        if r.expert >= n_experts {
            return Err(PackError::ExpertOutOfRange {
                expert: r.expert,
                n_experts,
            });
        }
        if r.rank >= n_ranks {
            return Err(PackError::RankOutOfRange {
                rank: r.rank,
                n_ranks,
            });
        }
        block_sizes[r.rank][r.expert] += r.pairs as usize;
    }
    for e in 0..n_experts {
        let routed: u64 = block_sizes.iter().map(|b| b[e] as u64).sum();
        let k = kept_per_expert[e + 1] as u64;
        if routed != k {
            return Err(PackError::RouteMismatch {
                expert: e,
                routed,
                kept: k,
            });
        }
    }

    let send_counts: Vec<usize> = block_sizes.iter().map(|b| b.iter().sum()).collect();
    let mut send_offsets = vec![0usize; n_ranks + 1];
    for d in 0..n_ranks {
        send_offsets[d + 1] = send_offsets[d] + send_counts[d];
    }
    let mut gather = vec![0u32; by_expert.len()];
    let mut inverse = vec![DROPPED; n];
    // Deal each expert's kept rows to destinations in ascending rank order.
    let mut taken = start[..n_experts].to_vec();
    let mut pos = send_offsets[..n_ranks].to_vec();
    for (d, blocks) in block_sizes.iter().enumerate() {
        for (e, &size) in blocks.iter().enumerate() {
            for &row in &by_expert[taken[e]..taken[e] + size] {
                gather[pos[d]] = row;
                inverse[row as usize] = pos[d] as u32;
                pos[d] += 1;
            }
            taken[e] += size;
        }
    }
    Ok(PackPlan {
        gather,
        inverse,
        send_counts,
        send_offsets,
        block_sizes,
    })
}

/// A receiver's regrouping plan (see the crate doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecvPlan {
    /// Rows received from each source.
    pub recv_counts: Vec<usize>,
    /// Start of each source's message in the received buffer, `[n_sources + 1]`.
    pub recv_offsets: Vec<usize>,
    /// Rows of each expert after regrouping.
    pub group_sizes: Vec<usize>,
    /// Received-buffer position of each grouped row.
    pub order: Vec<u32>,
}

/// Builds the receiver's plan from the block sizes each source sends it,
/// `blocks_from[s][e]` (row `d` of that source's `PackPlan::block_sizes`).
pub fn receive_plan(blocks_from: &[Vec<usize>], n_experts: usize) -> Result<RecvPlan, PackError> {
    for b in blocks_from {
        shape("blocks_from[source]", n_experts, b.len())?;
    }
    let recv_counts: Vec<usize> = blocks_from.iter().map(|b| b.iter().sum()).collect();
    let mut recv_offsets = vec![0usize; blocks_from.len() + 1];
    for s in 0..blocks_from.len() {
        recv_offsets[s + 1] = recv_offsets[s] + recv_counts[s];
    }
    let total = recv_offsets[blocks_from.len()];
    if total >= DROPPED as usize {
        return Err(PackError::TooManyRows { rows: total });
    }
    let group_sizes: Vec<usize> = (0..n_experts)
        .map(|e| blocks_from.iter().map(|b| b[e]).sum())
        .collect();
    let mut order = Vec::with_capacity(total);
    // Start of expert e's block inside source s's message.
    let block_starts: Vec<Vec<usize>> = blocks_from
        .iter()
        .enumerate()
        .map(|(s, b)| {
            let mut acc = recv_offsets[s];
            b.iter()
                .map(|&x| {
                    let here = acc;
                    acc += x;
                    here
                })
                .collect()
        })
        .collect();
    for e in 0..n_experts {
        for (s, b) in blocks_from.iter().enumerate() {
            let at = block_starts[s][e];
            order.extend((at..at + b[e]).map(|p| p as u32));
        }
    }
    Ok(RecvPlan {
        recv_counts,
        recv_offsets,
        group_sizes,
        order,
    })
}

/// `out[j] = src[idx[j]]` row by row (`width` elements per row).
pub fn gather_rows<T: Copy + Send + Sync>(
    src: &[T],
    width: usize,
    idx: &[u32],
    out: &mut [T],
) -> Result<(), PackError> {
    shape("out", idx.len() * width, out.len())?;
    if width == 0 {
        return Ok(());
    }
    let rows = src.len() / width;
    shape("src", rows * width, src.len())?;
    indices_below(idx, rows)?;
    let rows_per_task = (16384 / width.max(1)).max(1);
    out.par_chunks_mut(width * rows_per_task)
        .zip(idx.par_chunks(rows_per_task))
        .for_each(|(chunk, ids)| {
            for (dst, &i) in chunk.chunks_exact_mut(width).zip(ids) {
                let i = i as usize;
                dst.copy_from_slice(&src[i * width..(i + 1) * width]);
            }
        });
    Ok(())
}

/// [`gather_rows`] that also splits each row: row `idx[j]` of `src`
/// (`left + right` elements wide) goes to row `j` of `out_left` (its first
/// `left` elements) and of `out_right` (the rest) — a regroup of
/// concatenated operands (`[x | g·δ]`) into separate ones, with no
/// regrouped copy between.
pub fn gather_rows_split<T: Copy + Send + Sync>(
    src: &[T],
    (left, right): (usize, usize),
    idx: &[u32],
    out_left: &mut [T],
    out_right: &mut [T],
) -> Result<(), PackError> {
    shape("out_left", idx.len() * left, out_left.len())?;
    shape("out_right", idx.len() * right, out_right.len())?;
    let width = left + right;
    // One side empty: a plain gather into the other.
    if left == 0 {
        return gather_rows(src, width, idx, out_right);
    }
    if right == 0 {
        return gather_rows(src, width, idx, out_left);
    }
    let rows = src.len() / width;
    shape("src", rows * width, src.len())?;
    indices_below(idx, rows)?;
    let rows_per_task = (16384 / width).max(1);
    out_left
        .par_chunks_mut(left * rows_per_task)
        .zip(out_right.par_chunks_mut(right * rows_per_task))
        .zip(idx.par_chunks(rows_per_task))
        .for_each(|((l, r), ids)| {
            for ((dl, dr), &i) in l
                .chunks_exact_mut(left)
                .zip(r.chunks_exact_mut(right))
                .zip(ids)
            {
                let row = &src[i as usize * width..(i as usize + 1) * width];
                dl.copy_from_slice(&row[..left]);
                dr.copy_from_slice(&row[left..]);
            }
        });
    Ok(())
}

/// Every index below `rows`, or the first that is not.
fn indices_below(idx: &[u32], rows: usize) -> Result<(), PackError> {
    match idx.iter().enumerate().find(|(_, &i)| i as usize >= rows) {
        Some((position, &index)) => Err(PackError::IndexOutOfRange {
            position,
            index,
            rows,
        }),
        None => Ok(()),
    }
}

/// Scatters packed rows back: `out[i] = packed[inverse[i]]`, and `zero` in
/// every row whose `inverse[i]` is [`DROPPED`].
pub fn unpack_rows<T: Copy + Send + Sync>(
    packed: &[T],
    width: usize,
    inverse: &[u32],
    zero: T,
    out: &mut [T],
) -> Result<(), PackError> {
    shape("out", inverse.len() * width, out.len())?;
    if width == 0 {
        return Ok(());
    }
    let rows = packed.len() / width;
    shape("packed", rows * width, packed.len())?;
    if let Some((position, &index)) = inverse
        .iter()
        .enumerate()
        .find(|(_, &i)| i != DROPPED && i as usize >= rows)
    {
        return Err(PackError::IndexOutOfRange {
            position,
            index,
            rows,
        });
    }
    let rows_per_task = (16384 / width).max(1);
    out.par_chunks_mut(width * rows_per_task)
        .zip(inverse.par_chunks(rows_per_task))
        .for_each(|(chunk, ids)| {
            for (dst, &i) in chunk.chunks_exact_mut(width).zip(ids) {
                if i == DROPPED {
                    dst.fill(zero);
                } else {
                    let i = i as usize;
                    dst.copy_from_slice(&packed[i * width..(i + 1) * width]);
                }
            }
        });
    Ok(())
}

/// Inverse of a permutation-like index list: `inv[idx[j]] = j`, others
/// [`DROPPED`]. Used to scatter grouped results back into received order.
pub fn invert(idx: &[u32], n_rows: usize) -> Result<Vec<u32>, PackError> {
    let mut inv = vec![DROPPED; n_rows];
    for (j, &i) in idx.iter().enumerate() {
        match inv.get_mut(i as usize) {
            Some(slot) => *slot = j as u32,
            None => {
                return Err(PackError::IndexOutOfRange {
                    position: j,
                    index: i,
                    rows: n_rows,
                })
            }
        }
    }
    Ok(inv)
}

#[cfg(test)]
mod tests;
