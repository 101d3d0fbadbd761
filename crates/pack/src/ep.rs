//! Plans of an expert-parallel exchange where ranks own contiguous blocks
//! of experts (rank `r` owns experts `r·E_l .. (r+1)·E_l`, `E_l = E / W`)
//! and a call may add replicas.
//!
//! [`instance_layout`] is one exchange under a split of rows over the
//! experts' instances: a source's rows grouped by expert go out
//! destination-major in one variable all-to-all, and each instance
//! regroups what it receives by local expert with the same
//! [`receive_plan`](crate::receive_plan) as any receiver, plus what a device executor uploads
//! (the inverse permutation and the group offsets, [`OwnerLayout`]).
//! Sources hold consecutive token ranges, so without replicas the
//! expert-major order is the single-GPU order on the concatenated tokens
//! (selection ties break alike).
//!
//! Every map these plans hold is a [`Runs`]: blocks of consecutive rows
//! (one per source, expert and destination at most), so a plan costs the
//! host `O(E·W²)` whatever the row count, and a device executor expands
//! the runs it needs on the device ([`Runs::flat`] is what it uploads).

use crate::PackError;

/// A map of `0..len` onto `u32` given as runs: entry `dst + i` of the run
/// `[dst, src, n]` holds `src + i·step` (`step` 1: a permutation's runs;
/// `step` 0: segment keys). The runs are ascending by `dst`, non-empty and
/// tile `0..len`; adjacent runs that continue each other are merged, so
/// the identity is one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runs {
    /// Entries of the map.
    pub len: usize,
    /// 1 for permutations, 0 for segment keys.
    pub step: u32,
    /// `[dst, src, n]` triples.
    pub runs: Vec<[u32; 3]>,
}

impl Runs {
    /// An empty map with the given step; grow it with [`Runs::push`].
    pub fn new(step: u32) -> Self {
        Self {
            len: 0,
            step,
            runs: Vec::new(),
        }
    }

    /// The identity of `0..n`.
    pub fn identity(n: usize) -> Self {
        let mut r = Self::new(1);
        r.push(0, n);
        r
    }

    /// Appends `n` entries `src, src + step, …` at the end.
    pub fn push(&mut self, src: u32, n: usize) {
        if n == 0 {
            return;
        }
        let dst = self.len as u32;
        self.len += n;
        if let Some(last) = self.runs.last_mut() {
            if last[0] + last[2] == dst && last[1] + last[2] * self.step == src {
                last[2] += n as u32;
                return;
            }
        }
        self.runs.push([dst, src, n as u32]);
    }

    /// Whether this is the identity of `0..len` (the empty map is).
    pub fn is_identity(&self) -> bool {
        self.len == 0 || (self.step == 1 && self.runs.len() == 1 && self.runs[0][1] == 0)
    }

    /// Every entry, in order (`len` values).
    pub fn expand(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len);
        for &[_, src, n] in &self.runs {
            v.extend((0..n).map(|i| src + i * self.step));
        }
        v
    }

    /// The triples flattened (`3 × runs`), as a device executor uploads them.
    pub fn flat(&self) -> Vec<u32> {
        self.runs.iter().flatten().copied().collect()
    }

    /// The inverse permutation (`step` 1 and a permutation of `0..len`;
    /// an error otherwise).
    pub fn inverse(&self) -> Result<Runs, PackError> {
        let bad = PackError::Shape {
            what: "a permutation's runs",
            expected: self.len,
            got: self.runs.iter().map(|r| r[2] as usize).sum(),
        };
        if self.step != 1 {
            return Err(bad);
        }
        let mut by_src = self.runs.clone();
        by_src.sort_unstable_by_key(|r| r[1]);
        let mut inv = Runs::new(1);
        for [dst, src, n] in by_src {
            if src as usize != inv.len {
                return Err(bad);
            }
            inv.push(dst, n as usize);
        }
        if inv.len != self.len {
            return Err(bad);
        }
        Ok(inv)
    }

    /// Segment keys: `sizes[k]` entries of `k` each.
    pub fn segments(sizes: impl IntoIterator<Item = usize>) -> Self {
        let mut r = Self::new(0);
        for (k, n) in sizes.into_iter().enumerate() {
            r.push(k as u32, n);
        }
        r
    }
}

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

/// What an instance host (an owner, or a rank with replicas) receives and
/// how it regroups it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerLayout {
    /// Rows from each source.
    pub from: Vec<usize>,
    /// Expert-major row `j` ← source-major row `perm[j]` (the receive
    /// plan's `order`, [`crate::receive_plan`]).
    pub perm: Runs,
    /// Source-major row `i` ← expert-major row `inv[i]` (the inverse).
    pub inv: Runs,
    /// Expert-major group offsets, `E_l + 1` entries.
    pub offsets: Vec<u32>,
    /// Rows per local expert over all sources.
    pub per_expert: Vec<u32>,
    /// Each source's message grouped by local instance on its own:
    /// `chunks[s]` holds `E_l + 1` offsets into source `s`'s rows (which
    /// arrive instance-major), so an instance can run its experts on one
    /// source's rows as soon as they arrive, with no regrouping.
    pub chunks: Vec<Vec<u32>>,
}

/// Offsets (`len + 1` entries, from 0) of consecutive groups of `sizes`.
fn group_offsets(sizes: impl IntoIterator<Item = usize>) -> Vec<u32> {
    let mut v = vec![0u32];
    for g in sizes {
        v.push(v[v.len() - 1] + g as u32);
    }
    v
}

/// Rows of one exchange per (source, expert, rank): [`Split::cell`]`(s, e)[r]`
/// rows of source `s`'s expert `e` go to rank `r`. Dense and source-major
/// in one allocation (`sources × experts × ranks` counts), so a plan of
/// 16 ranks and 128 experts is one buffer, not 2 048.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    sources: usize,
    experts: usize,
    ranks: usize,
    cells: Vec<u32>,
}

impl Split {
    /// All zero.
    pub fn zeros(sources: usize, experts: usize, ranks: usize) -> Self {
        Self {
            sources,
            experts,
            ranks,
            cells: vec![0; sources * experts * ranks],
        }
    }

    /// From nested `[source][expert][rank]` counts; every source must have
    /// the same experts and every cell the same ranks.
    pub fn from_nested(split: &[Vec<Vec<u32>>]) -> Result<Self, PackError> {
        let experts = split.first().map_or(0, Vec::len);
        let ranks = split.first().and_then(|r| r.first()).map_or(0, Vec::len);
        let mut out = Self::zeros(split.len(), experts, ranks);
        let shape = |what, expected, got| PackError::Shape {
            what,
            expected,
            got,
        };
        for (s, row) in split.iter().enumerate() {
            if row.len() != experts {
                return Err(shape("experts of the split", experts, row.len()));
            }
            for (e, cell) in row.iter().enumerate() {
                if cell.len() != ranks {
                    return Err(shape("ranks of the split", ranks, cell.len()));
                }
                out.cell_mut(s, e).copy_from_slice(cell);
            }
        }
        Ok(out)
    }

    /// As nested `[source][expert][rank]` counts.
    pub fn to_nested(&self) -> Vec<Vec<Vec<u32>>> {
        (0..self.sources)
            .map(|s| self.row(s).map(<[u32]>::to_vec).collect())
            .collect()
    }

    /// Sources (the first index).
    pub fn sources(&self) -> usize {
        self.sources
    }

    /// Experts (the second index).
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Ranks (the third index).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    fn at(&self, s: usize, e: usize) -> usize {
        assert!(
            s < self.sources && e < self.experts,
            "split cell ({s}, {e}) outside {} sources × {} experts",
            self.sources,
            self.experts
        );
        (s * self.experts + e) * self.ranks
    }

    /// Source `s`'s rows of expert `e` per rank, or `None` outside the
    /// shape.
    pub fn get(&self, s: usize, e: usize) -> Option<&[u32]> {
        (s < self.sources && e < self.experts).then(|| self.cell(s, e))
    }

    /// Source `s`'s rows of expert `e` per rank.
    ///
    /// # Panics
    ///
    /// Outside the shape, as slice indexing does ([`Split::get`] does not).
    pub fn cell(&self, s: usize, e: usize) -> &[u32] {
        let at = self.at(s, e);
        &self.cells[at..at + self.ranks]
    }

    /// The same, to write (panics outside the shape).
    pub fn cell_mut(&mut self, s: usize, e: usize) -> &mut [u32] {
        let at = self.at(s, e);
        let r = self.ranks;
        &mut self.cells[at..at + r]
    }

    /// Source `s`'s cells, expert by expert (panics for a source outside
    /// the shape, unless there are no experts).
    pub fn row(&self, s: usize) -> impl ExactSizeIterator<Item = &[u32]> + '_ {
        (0..self.experts).map(move |e| self.cell(s, e))
    }

    /// Every count, source-major, then expert, then rank.
    pub fn counts(&self) -> &[u32] {
        &self.cells
    }

    /// Whether source `s` sends a row where `away` forbids it: `away`
    /// holds one mask per (expert, rank), `experts × ranks`, all ones where
    /// the rank holds no instance of the expert and zero where it does.
    /// One OR over the source's cells, the common case of the checks that
    /// then name the first such cell.
    ///
    /// # Panics
    ///
    /// For a source outside the shape.
    pub fn astray(&self, s: usize, away: &[u32]) -> bool {
        let n = self.experts * self.ranks;
        (self.cells[s * n..(s + 1) * n].iter())
            .zip(away)
            .fold(0u32, |acc, (&c, &m)| acc | (c & m))
            != 0
    }

    /// Rows each rank receives over every source and expert.
    pub fn loads(&self) -> Vec<u64> {
        let mut loads = vec![0u64; self.ranks];
        if self.ranks > 0 {
            for cell in self.cells.chunks_exact(self.ranks) {
                loads
                    .iter_mut()
                    .zip(cell)
                    .for_each(|(l, &c)| *l += u64::from(c));
            }
        }
        loads
    }
}

impl std::ops::Index<(usize, usize, usize)> for Split {
    type Output = u32;
    fn index(&self, (s, e, r): (usize, usize, usize)) -> &u32 {
        &self.cell(s, e)[r]
    }
}

impl std::ops::IndexMut<(usize, usize, usize)> for Split {
    fn index_mut(&mut self, (s, e, r): (usize, usize, usize)) -> &mut u32 {
        &mut self.cell_mut(s, e)[r]
    }
}

/// One exchange of an expert-parallel call whose experts may have several
/// instances (owner and replicas): `split[(s, e, r)]` rows of source `s` and
/// expert `e` go to rank `r`, which must host an instance of `e`
/// (`local[r]`: the experts with an instance on rank `r`, ascending).
///
/// A source's rows of expert `e` (consecutive in its expert-major order)
/// are cut in rank order: the first `split[(s, e, 0)]` to rank 0, the next
/// to rank 1, and so on. They go out destination-major, and within a
/// destination in the order of its `local` list, which is also the order
/// the instance regroups them in ([`receive_plan`](crate::receive_plan)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceLayout {
    /// Rows this source sends each rank.
    pub send: Vec<usize>,
    /// Send row `j` ← this source's expert-major row `send_order[j]`.
    pub send_order: Runs,
    /// Expert-major row `i` → send row `send_inv[i]` (the inverse).
    pub send_inv: Runs,
    /// This rank as an instance host: rows from each source, regrouped by
    /// local instance (`per_expert`/`offsets` over `local[me]`).
    pub recv: OwnerLayout,
}

/// [`InstanceLayout`] of rank `me`; errors name a split that sends rows to
/// a rank without an instance, or shapes that disagree.
pub fn instance_layout(
    split: &Split,
    local: &[Vec<usize>],
    me: usize,
) -> Result<InstanceLayout, PackError> {
    let world = local.len();
    let shape = |what, expected, got| PackError::Shape {
        what,
        expected,
        got,
    };
    if split.sources() != world || me >= world {
        return Err(shape("sources of the split", world, split.sources()));
    }
    if split.ranks() != world {
        return Err(shape("ranks of the split", world, split.ranks()));
    }
    let experts = split.experts();
    // `away[e·world + r]`: all ones where rank `r` holds no instance of
    // expert `e`, so a cell sends astray iff `cell & away` is not zero.
    let mut away = vec![u32::MAX; experts * world];
    for (r, l) in local.iter().enumerate() {
        if l.windows(2).any(|w| w[0] >= w[1]) || l.last().is_some_and(|&e| e >= experts) {
            return Err(shape("ascending local experts", experts, l.len()));
        }
        l.iter().for_each(|&e| away[e * world + r] = 0);
    }
    if (0..world).any(|s| split.astray(s, &away)) {
        // The first such cell by rank, source, expert.
        let (rank, from, expert) = (0..world)
            .flat_map(|r| (0..world).flat_map(move |s| (0..experts).map(move |e| (r, s, e))))
            .find(|&(r, s, e)| split[(s, e, r)] & away[e * world + r] != 0)
            .unwrap_or_default();
        return Err(PackError::NoInstance { from, expert, rank });
    }
    // Source side: expert-major starts, then each expert's cut per rank
    // (`cut[e·world + r]`: where its rows to rank `r` begin).
    let mut cut = vec![0usize; experts * world];
    let mut at = 0usize;
    for (e, cell) in split.row(me).enumerate() {
        for (r, &c) in cell.iter().enumerate() {
            cut[e * world + r] = at;
            at += c as usize;
        }
    }
    let mut send = vec![0usize; world];
    let mut send_order = Runs::new(1);
    for (d, l) in local.iter().enumerate() {
        for &e in l {
            let c = split[(me, e, d)] as usize;
            send_order.push(cut[e * world + d] as u32, c);
            send[d] += c;
        }
    }
    if send_order.len != at || at >= crate::DROPPED as usize {
        return Err(shape("rows this source sends", at, send_order.len));
    }
    let send_inv = send_order.inverse()?;
    // Instance side: each source's rows arrive grouped by local instance;
    // expert-major is instance, then source.
    let blocks: Vec<Vec<usize>> = (0..world)
        .map(|s| {
            local[me]
                .iter()
                .map(|&e| split[(s, e, me)] as usize)
                .collect()
        })
        .collect();
    let groups = local[me].len();
    let chunks: Vec<Vec<u32>> = blocks
        .iter()
        .map(|b| group_offsets(b.iter().copied()))
        .collect();
    let from: Vec<usize> = blocks.iter().map(|b| b.iter().sum()).collect();
    let starts = group_offsets(from.iter().copied());
    let mut perm = Runs::new(1);
    let mut per_expert = Vec::with_capacity(groups);
    for g in 0..groups {
        let before = perm.len;
        for (s, b) in blocks.iter().enumerate() {
            perm.push(starts[s] + chunks[s][g], b[g]);
        }
        per_expert.push((perm.len - before) as u32);
    }
    if perm.len >= crate::DROPPED as usize {
        return Err(PackError::TooManyRows { rows: perm.len });
    }
    Ok(InstanceLayout {
        send,
        send_order,
        send_inv,
        recv: OwnerLayout {
            inv: perm.inverse()?,
            offsets: group_offsets(per_expert.iter().map(|&g| g as usize)),
            per_expert,
            from,
            perm,
            chunks,
        },
    })
}

/// The experts with an instance on each rank (`instances[e]`: the ranks
/// holding expert `e`), ascending: the `local` lists of [`instance_layout`].
pub fn local_experts(instances: &[Vec<usize>], world: usize) -> Vec<Vec<usize>> {
    let mut local = vec![Vec::new(); world];
    for (e, ranks) in instances.iter().enumerate() {
        for &r in ranks {
            if r < world && local[r].last() != Some(&e) {
                local[r].push(e);
            }
        }
    }
    local
}

/// The global expert-major order of every source's pairs (expert, then
/// source, then the source's expert-major order) that the device
/// executor's per-expert selection runs in, for source `rank` with `p`
/// pairs per source (`counts_all[s][e]`: source `s`'s pairs of expert
/// `e`, rows of `s` expert-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalOrder {
    /// Global row → index into the all-gathered scores (`s·p + row`);
    /// within an expert it increases with (source, row): the tie rule.
    pub perm: Runs,
    /// This source's expert-major rows → their global rows.
    pub mine: Runs,
    /// The experts' offsets in the global order (`E + 1`).
    pub offsets: Vec<u32>,
}

/// [`GlobalOrder`] of source `rank`; an error when a source's counts do
/// not fit in `p` rows or the sources disagree on the experts.
pub fn global_order(
    counts_all: &[Vec<u32>],
    rank: usize,
    p: usize,
) -> Result<GlobalOrder, PackError> {
    let world = counts_all.len();
    let experts = counts_all.first().map_or(0, Vec::len);
    if rank >= world.max(1) || counts_all.iter().any(|c| c.len() != experts) {
        return Err(PackError::Shape {
            what: "counts per source (one row per rank, equal lengths)",
            expected: experts,
            got: counts_all.get(rank).map_or(0, Vec::len),
        });
    }
    let mut bases = Vec::with_capacity(world);
    for c in counts_all {
        let mut b = Vec::with_capacity(experts + 1);
        let mut sum = 0u64;
        b.push(0u32);
        for &n in c {
            sum += u64::from(n);
            b.push(sum.min(u64::from(u32::MAX)) as u32);
        }
        if sum > p as u64 || (world * p) as u64 > u64::from(u32::MAX) {
            return Err(PackError::Shape {
                what: "pairs of one source (at most p; W·p below 2^32)",
                expected: p,
                got: sum as usize,
            });
        }
        bases.push(b);
    }
    let mut perm = Runs::new(1);
    // This source's expert-major rows are its runs in expert order.
    let mut mine = Runs::new(1);
    let mut offsets = Vec::with_capacity(experts + 1);
    for e in 0..experts {
        offsets.push(perm.len as u32);
        for s in 0..world {
            let (lo, n) = (bases[s][e], counts_all[s][e]);
            if s == rank {
                mine.push(perm.len as u32, n as usize);
            }
            perm.push((s * p) as u32 + lo, n as usize);
        }
    }
    offsets.push(perm.len as u32);
    Ok(GlobalOrder {
        perm,
        mine,
        offsets,
    })
}

/// The replica traffic of one call seen from `rank`, in the one order every
/// executor sends it: `send[d]` holds the experts `rank` owns (the first
/// entry of `instances[e]`) of which rank `d` holds a replica, `recv[s]`
/// the experts rank `s` owns of which `rank` holds one, each by ascending
/// expert. In the forward the owners' weights travel along `send` (and
/// arrive along `recv`); in the backward the replicas' gradients travel
/// back, along `recv` out of the replica's rank and `send` into the
/// owner's. A replica listed on its owner's own rank moves nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRoutes {
    /// Experts this rank sends weights of (and receives gradients of), per
    /// peer rank.
    pub send: Vec<Vec<usize>>,
    /// Experts this rank receives weights of (and sends gradients of), per
    /// peer rank.
    pub recv: Vec<Vec<usize>>,
}

/// [`ReplicaRoutes`] of `rank` among `world` ranks (`instances[e]`: the
/// ranks holding expert `e`, owner first; ranks at or past `world` are
/// ignored).
pub fn replica_routes(instances: &[Vec<usize>], rank: usize, world: usize) -> ReplicaRoutes {
    let mut send = vec![Vec::new(); world];
    let mut recv = vec![Vec::new(); world];
    for (e, inst) in instances.iter().enumerate() {
        let Some((&owner, replicas)) = inst.split_first() else {
            continue;
        };
        for &r in replicas.iter().filter(|&&r| r != owner && r < world) {
            if owner == rank {
                send[r].push(e);
            }
            if r == rank && owner < world {
                recv[owner].push(e);
            }
        }
    }
    for list in send.iter_mut().chain(recv.iter_mut()) {
        list.dedup();
    }
    ReplicaRoutes { send, recv }
}

/// Who sends which expert blocks where when a call has replicas, from rank
/// `rank`'s view (experts owned in blocks of `per_rank`; `local` from
/// [`local_experts`]). The forward sends owners' weights to the replicas'
/// ranks; the backward sends replicas' gradients back to the owners, the
/// same counts in reverse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaTraffic {
    /// Own blocks (index within the rank's `per_rank` experts) sent as
    /// weights, destination-major, ascending expert.
    pub weights_out: Vec<usize>,
    /// Weight blocks sent to each rank (= gradient blocks received from it).
    pub weights_send: Vec<usize>,
    /// Weight blocks received from each rank (= gradient blocks sent to it).
    pub weights_recv: Vec<usize>,
    /// Replicas this rank hosts of experts below its own block: its local
    /// list is `below` replicas, its own block, then the other replicas.
    pub below: usize,
    /// Positions in this rank's local list of the replicas it hosts
    /// (gradients sent to their owners), owner-major, ascending expert.
    pub grads_out: Vec<usize>,
    /// Own block receiving each incoming replica gradient, in receive
    /// order (source-major, ascending expert).
    pub grads_in: Vec<usize>,
}

/// [`ReplicaTraffic`] of `rank` (`instances[e]`: the ranks holding expert
/// `e`, owner first).
pub fn replica_traffic(
    instances: &[Vec<usize>],
    local: &[Vec<usize>],
    rank: usize,
    per_rank: usize,
) -> ReplicaTraffic {
    let world = local.len();
    let base = rank * per_rank.max(1);
    let routes = replica_routes(instances, rank, world);
    let mine = local.get(rank).map_or(&[][..], Vec::as_slice);
    let position = |e: usize| mine.iter().position(|&x| x == e);
    ReplicaTraffic {
        weights_out: routes.send.iter().flatten().map(|&e| e - base).collect(),
        weights_send: routes.send.iter().map(Vec::len).collect(),
        weights_recv: routes.recv.iter().map(Vec::len).collect(),
        below: routes.recv[..rank.min(world)].iter().map(Vec::len).sum(),
        grads_out: routes
            .recv
            .iter()
            .flatten()
            .filter_map(|&e| position(e))
            .collect(),
        grads_in: routes.send.iter().flatten().map(|&e| e - base).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{invert, receive_plan};
    use proptest::prelude::*;

    /// The device executor's traffic as it was computed before
    /// [`replica_routes`] (owners in blocks of `per_rank`, lists in local
    /// order): the routes must give exactly this.
    fn traffic_by_blocks(
        instances: &[Vec<usize>],
        local: &[Vec<usize>],
        rank: usize,
        el: usize,
    ) -> ReplicaTraffic {
        let world = local.len();
        let mut weights_out = Vec::new();
        let mut weights_send = vec![0usize; world];
        for (d, sd) in weights_send.iter_mut().enumerate() {
            let (lo, hi) = (rank * el, (rank + 1) * el);
            for (i, inst) in instances[lo..hi].iter().enumerate() {
                if d != rank && inst.iter().skip(1).any(|&r| r == d) {
                    weights_out.push(i);
                    *sd += 1;
                }
            }
        }
        let mut weights_recv = vec![0usize; world];
        let (mut below, mut grads_out) = (0usize, Vec::new());
        for (i, &e) in local[rank].iter().enumerate() {
            let o = e / el;
            if o != rank {
                weights_recv[o] += 1;
                grads_out.push(i);
                below += usize::from(o < rank);
            }
        }
        let mut grads_in = Vec::new();
        for (r, l) in local.iter().enumerate() {
            for &e in l {
                if r != rank && e / el == rank {
                    grads_in.push(e - rank * el);
                }
            }
        }
        ReplicaTraffic {
            weights_out,
            weights_send,
            weights_recv,
            below,
            grads_out,
            grads_in,
        }
    }

    /// A map's canonical runs, entry by entry.
    fn runs_of(v: &[u32]) -> Runs {
        let mut r = Runs::new(1);
        for &x in v {
            r.push(x, 1);
        }
        r
    }

    /// The owner-only layout, written directly (the oracle of
    /// [`instance_layout`] without replicas): owner `rank`'s layout from every source's routed counts per global
    /// expert (`counts_all[s][e]`).
    fn owner_layout(
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
        Ok(OwnerLayout {
            inv: runs_of(&invert(&plan.order, plan.order.len())?),
            per_expert: plan.group_sizes.iter().map(|&g| g as u32).collect(),
            from: plan.recv_counts,
            perm: runs_of(&plan.order),
            offsets: group_offsets(plan.group_sizes.iter().copied()),
            chunks: blocks
                .iter()
                .map(|b| group_offsets(b.iter().copied()))
                .collect(),
        })
    }

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
        let l = owner_layout(&counts, 1, 2).unwrap();
        assert_eq!(l.from, vec![3, 3]);
        // Source-major: s0e2 s0e2 s0e3 | s1e2 s1e3 s1e3 → rows 0..6.
        let (perm, inv) = (l.perm.expand(), l.inv.expand());
        assert_eq!(perm, vec![0, 1, 3, 2, 4, 5]);
        assert_eq!(l.offsets, vec![0, 3, 6]);
        assert_eq!(l.per_expert, vec![3, 3]);
        for (i, &j) in inv.iter().enumerate() {
            assert_eq!(perm[j as usize] as usize, i);
        }
        assert!(owner_layout(&counts, 2, 2).is_err());
    }

    #[test]
    fn splits_are_dense_and_refuse_ragged_input() {
        let nested = vec![vec![vec![2, 1], vec![0, 2]], vec![vec![0, 1], vec![4, 0]]];
        let split = Split::from_nested(&nested).unwrap();
        assert_eq!((split.sources(), split.experts(), split.ranks()), (2, 2, 2));
        assert_eq!(split.cell(1, 0), &[0, 1]);
        assert_eq!(split.get(1, 1), Some(&[4, 0][..]));
        assert_eq!(split.get(2, 0), None);
        assert_eq!(split.get(0, 2), None);
        assert_eq!(split[(1, 1, 0)], 4);
        assert_eq!(split.counts(), &[2, 1, 0, 2, 0, 1, 4, 0]);
        assert_eq!(split.loads(), vec![6, 4]);
        assert_eq!(split.to_nested(), nested);
        assert_eq!(split.row(0).collect::<Vec<_>>(), vec![&[2, 1], &[0, 2]]);
        // Expert 0 on both ranks, expert 1 on rank 1 only: source 0 sends
        // none of expert 1's rows to rank 0, source 1 sends it 4.
        let away = [0, 0, u32::MAX, 0];
        assert!(!split.astray(0, &away));
        assert!(split.astray(1, &away));
        let mut z = Split::zeros(2, 2, 2);
        z[(1, 1, 0)] = 4;
        z.cell_mut(0, 0).copy_from_slice(&[2, 1]);
        assert_eq!(z.loads(), vec![6, 1]);
        assert!(matches!(
            Split::from_nested(&[vec![vec![1, 2]], vec![vec![1]]]),
            Err(PackError::Shape {
                what: "ranks of the split",
                ..
            })
        ));
        assert!(matches!(
            Split::from_nested(&[vec![vec![1]], vec![]]),
            Err(PackError::Shape {
                what: "experts of the split",
                ..
            })
        ));
        assert_eq!(Split::from_nested(&[]).unwrap(), Split::zeros(0, 0, 0));
        assert_eq!(Split::zeros(3, 2, 0).loads(), Vec::<u64>::new());
        assert_eq!(Split::zeros(3, 2, 0).row(2).count(), 2);
    }

    #[test]
    fn instance_layouts_cut_experts_over_their_instances() {
        // Two ranks, two experts; expert 0 (owner 0) has a replica on rank 1.
        let instances = vec![vec![0, 1], vec![1]];
        let local = local_experts(&instances, 2);
        assert_eq!(local, vec![vec![0], vec![0, 1]]);
        // Source 0: 3 pairs of e0 (2 → rank 0, 1 → rank 1), 2 of e1.
        // Source 1: 1 pair of e0 (→ rank 1), 1 of e1.
        let split =
            Split::from_nested(&[vec![vec![2, 1], vec![0, 2]], vec![vec![0, 1], vec![0, 1]]])
                .unwrap();
        let l0 = instance_layout(&split, &local, 0).unwrap();
        assert_eq!(l0.send, vec![2, 3]);
        assert_eq!(l0.send_order.expand(), vec![0, 1, 2, 3, 4]);
        assert!(l0.send_order.is_identity());
        assert_eq!(l0.recv.from, vec![2, 0]);
        let l1 = instance_layout(&split, &local, 1).unwrap();
        assert_eq!(l1.send, vec![0, 2]);
        // Rank 1 receives s0: [e0, e1, e1], s1: [e0, e1]; regrouped e0 then e1.
        assert_eq!(l1.recv.from, vec![3, 2]);
        assert_eq!(l1.recv.perm.expand(), vec![0, 3, 1, 2, 4]);
        assert_eq!(l1.recv.offsets, vec![0, 2, 5]);
        // A split of another shape is refused.
        assert!(matches!(
            instance_layout(&Split::zeros(2, 2, 3), &local, 0),
            Err(PackError::Shape {
                what: "ranks of the split",
                ..
            })
        ));
        assert!(matches!(
            instance_layout(&Split::zeros(3, 2, 2), &local, 0),
            Err(PackError::Shape {
                what: "sources of the split",
                ..
            })
        ));
        assert!(matches!(
            instance_layout(&Split::zeros(2, 1, 2), &local, 0),
            Err(PackError::Shape {
                what: "ascending local experts",
                ..
            })
        ));
        // A split to a rank without the expert is refused.
        let bad = Split::from_nested(&[vec![vec![0, 0], vec![1, 0]], vec![vec![0, 0], vec![0, 0]]])
            .unwrap();
        assert!(matches!(
            instance_layout(&bad, &local, 0),
            Err(PackError::NoInstance {
                from: 0,
                expert: 1,
                rank: 0
            })
        ));
    }

    proptest! {
        /// Every source's rows reach the instance the split names, exactly
        /// once, and the instance regroups them expert by expert with
        /// sources ascending; with one instance per expert it is the owner
        /// layout.
        #[test]
        fn instance_layouts_deliver_every_row_where_the_split_says(
            (world, per_rank, counts, reps, seed) in (1usize..4, 1usize..3).prop_flat_map(|(w, el)| {
                (Just(w), Just(el),
                 prop::collection::vec(prop::collection::vec(0u32..5, w * el), w),
                 prop::collection::vec(0usize..4, w * el),
                 any::<u64>())
            }),
        ) {
            let experts = world * per_rank;
            let instances: Vec<Vec<usize>> = (0..experts)
                .map(|e| {
                    let owner = e / per_rank;
                    let mut v = vec![owner];
                    let r = reps[e] % world;
                    if r != owner { v.push(r); }
                    v
                })
                .collect();
            let local = local_experts(&instances, world);
            let mut state = seed | 1;
            let nested: Vec<Vec<Vec<u32>>> = counts.iter().map(|row| {
                row.iter().enumerate().map(|(e, &n)| {
                    let mut cell = vec![0u32; world];
                    let mut left = n;
                    for (i, &r) in instances[e].iter().enumerate() {
                        state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                        let take = if i + 1 == instances[e].len() { left } else { (state % (u64::from(left) + 1)) as u32 };
                        cell[r] += take;
                        left -= take;
                    }
                    cell
                }).collect()
            }).collect();
            let split = Split::from_nested(&nested).unwrap();
            prop_assert_eq!(split.to_nested(), nested);
            // What each rank receives, as (source, expert, expert-major row).
            let mut got: Vec<Vec<(usize, usize, u32)>> = vec![Vec::new(); world];
            for (s, row_counts) in counts.iter().enumerate() {
                let l = instance_layout(&split, &local, s).unwrap();
                let n: usize = row_counts.iter().map(|&c| c as usize).sum();
                let (send_order, send_inv) = (l.send_order.expand(), l.send_inv.expand());
                prop_assert_eq!(send_order.len(), n);
                for (i, &j) in send_inv.iter().enumerate() {
                    prop_assert_eq!(send_order[j as usize] as usize, i);
                }
                let mut at = 0;
                for (d, &c) in l.send.iter().enumerate() {
                    for &row in &send_order[at..at + c] {
                        // The expert of an expert-major row.
                        let mut e = 0; let mut acc = row_counts[0];
                        while row >= acc { e += 1; acc += row_counts[e]; }
                        got[d].push((s, e, row));
                    }
                    at += c;
                }
            }
            for me in 0..world {
                let l = instance_layout(&split, &local, me).unwrap();
                let recv = &got[me];
                prop_assert_eq!(l.recv.from.iter().sum::<usize>(), recv.len());
                // Regrouped: experts ascending, sources ascending within.
                let regrouped: Vec<(usize, usize)> =
                    l.recv.perm.expand().iter().map(|&i| (recv[i as usize].1, recv[i as usize].0)).collect();
                let mut sorted = regrouped.clone();
                sorted.sort();
                prop_assert_eq!(&regrouped, &sorted);
                for (li, &e) in local[me].iter().enumerate() {
                    let want: u32 = (0..world).map(|s| split[(s, e, me)]).sum();
                    prop_assert_eq!(l.recv.per_expert[li], want);
                }
                // Each source's chunk, read by its own offsets, holds that
                // source's rows of each local instance in arrival order.
                let mut start = 0usize;
                for s in 0..world {
                    let c = &l.recv.chunks[s];
                    prop_assert_eq!(c.len(), local[me].len() + 1);
                    prop_assert_eq!(c[local[me].len()] as usize, l.recv.from[s]);
                    for (li, &e) in local[me].iter().enumerate() {
                        for i in c[li]..c[li + 1] {
                            let (src, ex, _) = recv[start + i as usize];
                            prop_assert_eq!((src, ex), (s, e));
                        }
                    }
                    start += l.recv.from[s];
                }
                if instances.iter().all(|i| i.len() == 1) {
                    let o = owner_layout(&counts, me, per_rank).unwrap();
                    prop_assert_eq!(&l.recv, &o);
                }
            }
        }
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
                let (perm, inv) = (l.perm.expand(), l.inv.expand());
                let n = perm.len();
                let mut seen = vec![false; n];
                for &p in &perm {
                    prop_assert!(!seen[p as usize]);
                    seen[p as usize] = true;
                }
                for (i, &j) in inv.iter().enumerate() {
                    prop_assert_eq!(perm[j as usize] as usize, i);
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
                prop_assert_eq!(&perm, &want);
                prop_assert_eq!(*l.offsets.last().unwrap() as usize, n);
                prop_assert_eq!(l.from.iter().sum::<usize>(), n);
            }
        }
    }
    #[test]
    fn the_global_order_lists_every_pair_once_expert_major() {
        // Two sources of 3 pairs, three experts.
        let counts = vec![vec![2, 0, 1], vec![1, 2, 0]];
        let g = global_order(&counts, 1, 3).unwrap();
        assert_eq!(g.offsets, vec![0, 3, 5, 6]);
        // Expert 0: source 0 rows 0, 1, then source 1 row 0 (at 3 + 0).
        assert_eq!(g.perm.expand(), vec![0, 1, 3, 4, 5, 2]);
        // Source 1's expert-major rows 0, 1, 2 sit at 2, 3, 4.
        assert_eq!(g.mine.expand(), vec![2, 3, 4]);
        assert!(global_order(&counts, 1, 2).is_err());
        assert!(global_order(&counts, 2, 3).is_err());
        assert!(global_order(&[vec![1, 0], vec![1]], 0, 3).is_err());
    }

    #[test]
    fn runs_merge_expand_and_invert() {
        let mut r = Runs::new(1);
        r.push(3, 2);
        r.push(5, 1);
        r.push(0, 3);
        r.push(9, 0);
        assert_eq!(r.runs, vec![[0, 3, 3], [3, 0, 3]]);
        assert_eq!(r.expand(), vec![3, 4, 5, 0, 1, 2]);
        assert_eq!(r.inverse().unwrap().expand(), vec![3, 4, 5, 0, 1, 2]);
        assert!(!r.is_identity());
        assert!(Runs::identity(5).is_identity() && Runs::identity(0).is_identity());
        assert_eq!(Runs::identity(4).runs, vec![[0, 0, 4]]);
        let keys = Runs::segments([2, 0, 1]);
        assert_eq!(keys.expand(), vec![0, 0, 2]);
        assert!(Runs::segments([]).expand().is_empty());
        assert!(keys.inverse().is_err());
        let mut gap = Runs::new(1);
        gap.push(1, 2);
        assert!(gap.inverse().is_err());
        assert_eq!(r.flat(), vec![0, 3, 3, 3, 0, 3]);
    }

    proptest! {
        /// A shuffled block permutation's runs expand to it, invert to its
        /// inverse and are canonical (equal maps, equal runs).
        #[test]
        fn runs_of_block_permutations_invert(
            sizes in prop::collection::vec(0usize..6, 0..8),
            seed in any::<u64>(),
        ) {
            let mut order: Vec<usize> = (0..sizes.len()).collect();
            let mut state = seed | 1;
            for i in (1..order.len()).rev() {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                order.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let starts = group_offsets(sizes.iter().copied());
            let mut r = Runs::new(1);
            let mut dense = Vec::new();
            for &b in &order {
                r.push(starts[b], sizes[b]);
                dense.extend(starts[b]..starts[b] + sizes[b] as u32);
            }
            prop_assert_eq!(&r.expand(), &dense);
            prop_assert_eq!(&r, &runs_of(&dense));
            let inv = r.inverse().unwrap();
            prop_assert_eq!(inv.expand(), invert(&dense, dense.len()).unwrap());
            prop_assert_eq!(r.is_identity(), dense.iter().enumerate().all(|(i, &x)| x as usize == i));
        }
    }

    #[test]
    fn replica_routes_follow_owners_not_blocks() {
        // Expert 0 owned by rank 2 with replicas on 0 and 1; expert 1 owned
        // by 0 with a replica on 2; expert 2 owned by 1, no replica.
        let instances = vec![vec![2, 0, 1], vec![0, 2], vec![1]];
        let r0 = replica_routes(&instances, 0, 3);
        assert_eq!(r0.send, vec![vec![], vec![], vec![1]]);
        assert_eq!(r0.recv, vec![vec![], vec![], vec![0]]);
        let r2 = replica_routes(&instances, 2, 3);
        assert_eq!(r2.send, vec![vec![0], vec![0], vec![]]);
        assert_eq!(r2.recv, vec![vec![1], vec![], vec![]]);
        // Every route seen from both ends.
        for a in 0..3 {
            for b in 0..3 {
                let (ra, rb) = (
                    replica_routes(&instances, a, 3),
                    replica_routes(&instances, b, 3),
                );
                assert_eq!(ra.send[b], rb.recv[a]);
            }
        }
    }

    #[test]
    fn replica_traffic_sends_each_replicated_block_to_its_replica() {
        // 4 experts on 2 ranks (blocks of 2); expert 0 replicated on rank
        // 1, expert 3 on rank 0.
        let instances = vec![vec![0, 1], vec![0], vec![1], vec![1, 0]];
        let local = local_experts(&instances, 2);
        assert_eq!(local, vec![vec![0, 1, 3], vec![0, 2, 3]]);
        let r0 = replica_traffic(&instances, &local, 0, 2);
        assert_eq!(r0.weights_out, vec![0]);
        assert_eq!(
            (r0.weights_send.clone(), r0.weights_recv.clone()),
            (vec![0, 1], vec![0, 1])
        );
        assert_eq!(r0.below, 0);
        assert_eq!(r0.grads_out, vec![2]);
        assert_eq!(r0.grads_in, vec![0]);
        let r1 = replica_traffic(&instances, &local, 1, 2);
        assert_eq!(r1.weights_out, vec![1]);
        assert_eq!((r1.weights_send, r1.weights_recv), (vec![1, 0], vec![1, 0]));
        assert_eq!(r1.below, 1);
        assert_eq!(r1.grads_out, vec![0]);
        assert_eq!(r1.grads_in, vec![1]);
    }

    proptest! {
        /// Every rank's global order is a permutation of all W·p score
        /// slots that are routed, grouped by expert, and maps this
        /// source's rows onto the slots that hold them.
        #[test]
        fn global_orders_agree_and_cover_every_pair(
            counts in prop::collection::vec(prop::collection::vec(0u32..5, 4), 1..4),
        ) {
            let p = counts.iter().map(|c| c.iter().sum::<u32>()).max().unwrap_or(0) as usize;
            let first = global_order(&counts, 0, p).unwrap();
            for r in 0..counts.len() {
                let g = global_order(&counts, r, p).unwrap();
                prop_assert_eq!(&g.perm, &first.perm);
                prop_assert_eq!(&g.offsets, &first.offsets);
                let perm = g.perm.expand();
                for (row, &at) in g.mine.expand().iter().enumerate() {
                    prop_assert_eq!(perm[at as usize] as usize, r * p + row);
                }
            }
            let fp = first.perm.expand();
            let mut seen = fp.clone();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), fp.len());
            for e in 0..4 {
                let (lo, hi) = (first.offsets[e] as usize, first.offsets[e + 1] as usize);
                let routed: u32 = counts.iter().map(|c| c[e]).sum();
                prop_assert_eq!(hi - lo, routed as usize);
                prop_assert!(fp[lo..hi].windows(2).all(|w| w[0] < w[1]));
            }
        }

        /// Weights sent and received balance over ranks, and the gradient
        /// lists mirror them.
        #[test]
        fn replica_traffic_balances(
            world in 1usize..5,
            per_rank in 1usize..4,
            extra in prop::collection::vec((0usize..16, 0usize..5), 0..8),
        ) {
            let e = world * per_rank;
            let mut instances: Vec<Vec<usize>> = (0..e).map(|x| vec![x / per_rank]).collect();
            for (x, r) in extra {
                let (x, r) = (x % e, r % world);
                if !instances[x].contains(&r) {
                    instances[x].push(r);
                }
            }
            let local = local_experts(&instances, world);
            let all: Vec<ReplicaTraffic> =
                (0..world).map(|r| replica_traffic(&instances, &local, r, per_rank)).collect();
            for (r, t) in all.iter().enumerate() {
                prop_assert_eq!(t, &traffic_by_blocks(&instances, &local, r, per_rank));
            }
            for a in 0..world {
                prop_assert_eq!(all[a].weights_out.len(), all[a].weights_send.iter().sum::<usize>());
                prop_assert_eq!(all[a].grads_out.len(), all[a].weights_recv.iter().sum::<usize>());
                prop_assert_eq!(all[a].grads_in.len(), all[a].weights_send.iter().sum::<usize>());
                for b in 0..world {
                    prop_assert_eq!(all[a].weights_send[b], all[b].weights_recv[a]);
                }
            }
        }
    }
}
