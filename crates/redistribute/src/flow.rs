//! Dinic's maximum flow on a small directed graph with integer capacities.
//!
//! The graph is built once and re-solved many times with different
//! capacities (the exact solver's search over the peak, the quota
//! controller's search over the retention ratio), so capacities can be reset
//! and edges can be frozen without rebuilding.
//!
//! Those searches are *cut-guided*: after a max-flow falls short,
//! [`FlowGraph::source_side`] gives a minimum cut, and the cut's capacity as
//! a function of the searched parameter says how far the parameter must move
//! before that cut stops binding — a necessary condition, so the search
//! jumps there instead of bisecting (a Newton step on the parametric cut; a
//! few flows where a bisection takes twenty).

/// Handle of an edge returned by [`FlowGraph::add_edge`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeId(u32);

impl EdgeId {
    /// The edge's position among the edges added: `0, 1, 2, …`.
    pub fn index(self) -> usize {
        self.0 as usize / 2
    }
}

const NONE: u32 = u32::MAX;

/// A flow network. Edge `2k` is the `k`-th added edge, `2k + 1` its residual.
#[derive(Debug, Clone, Default)]
pub struct FlowGraph {
    head: Vec<u32>,
    next: Vec<u32>,
    to: Vec<u32>,
    cap: Vec<u64>,
    capacity: Vec<u64>,
    blocked: Vec<bool>,
    level: Vec<u32>,
    iter: Vec<u32>,
    queue: Vec<u32>,
    stack: Vec<u32>,
}

impl FlowGraph {
    /// A graph with `n_nodes` nodes and no edges.
    pub fn new(n_nodes: usize) -> Self {
        Self {
            head: vec![NONE; n_nodes],
            level: vec![0; n_nodes],
            iter: vec![0; n_nodes],
            ..Self::default()
        }
    }

    /// [`Self::new`] with room for `n_edges` edges (each with its
    /// reverse), so that adding them does not reallocate.
    pub fn with_capacity(n_nodes: usize, n_edges: usize) -> Self {
        let arcs = 2 * n_edges;
        Self {
            next: Vec::with_capacity(arcs),
            to: Vec::with_capacity(arcs),
            cap: Vec::with_capacity(arcs),
            capacity: Vec::with_capacity(arcs),
            blocked: Vec::with_capacity(arcs),
            ..Self::new(n_nodes)
        }
    }

    /// Adds `from → to` with capacity `cap` (zero flow).
    pub fn add_edge(&mut self, from: usize, to: usize, cap: u64) -> EdgeId {
        let id = self.to.len() as u32;
        for (u, v, c) in [(from, to, cap), (to, from, 0)] {
            self.to.push(v as u32);
            self.cap.push(c);
            self.capacity.push(c);
            self.blocked.push(false);
            self.next.push(self.head[u]);
            self.head[u] = self.to.len() as u32 - 1;
        }
        EdgeId(id)
    }

    /// Sets an edge's capacity; its current flow must not exceed it.
    pub fn set_capacity(&mut self, e: EdgeId, cap: u64) {
        let i = e.0 as usize;
        let flow = self.capacity[i] - self.cap[i];
        debug_assert!(flow <= cap, "invariant: capacity below current flow");
        self.capacity[i] = cap;
        self.cap[i] = cap - flow.min(cap);
    }

    /// Removes all flow (capacities stay) and unfreezes every edge.
    pub fn clear_flow(&mut self) {
        for i in (0..self.cap.len()).step_by(2) {
            self.cap[i] = self.capacity[i];
            self.cap[i + 1] = 0;
            self.blocked[i + 1] = false;
        }
    }

    /// Forbids later augmentations from reducing this edge's current flow.
    pub fn freeze(&mut self, e: EdgeId) {
        self.blocked[e.0 as usize + 1] = true;
    }

    /// Saves the residual state (flows and capacities) for [`Self::restore`].
    pub fn snapshot(&self) -> (Vec<u64>, Vec<u64>) {
        (self.cap.clone(), self.capacity.clone())
    }

    /// Returns to a state saved by [`Self::snapshot`] of this graph.
    pub fn restore(&mut self, state: &(Vec<u64>, Vec<u64>)) {
        self.cap.copy_from_slice(&state.0);
        self.capacity.copy_from_slice(&state.1);
    }

    /// Current flow on an edge.
    pub fn flow(&self, e: EdgeId) -> u64 {
        let i = e.0 as usize;
        self.capacity[i] - self.cap[i]
    }

    /// An edge's capacity.
    pub fn capacity(&self, e: EdgeId) -> u64 {
        self.capacity[e.0 as usize]
    }

    /// Every added edge as `(id, from, to)`, in the order added (the
    /// `n`-th has [`EdgeId::index`] `n`).
    pub fn edges(&self) -> impl ExactSizeIterator<Item = (EdgeId, usize, usize)> + '_ {
        (0..self.to.len()).step_by(2).map(|i| {
            (
                EdgeId(i as u32),
                self.to[i + 1] as usize,
                self.to[i] as usize,
            )
        })
    }

    /// The nodes reachable from `s` in the residual graph. After
    /// [`Self::max_flow`] from `s` they are the source side of a minimum
    /// cut: every edge from this side to the other is saturated, and the
    /// flow's value is the sum of their capacities (frozen edges' reverse
    /// residuals count as absent, as in the search).
    pub fn source_side(&mut self, s: usize) -> Vec<bool> {
        self.bfs(s, s);
        self.level.iter().map(|&l| l != u32::MAX).collect()
    }

    /// The edges from the `side` nodes to the others (a cut's edges, with
    /// `side` from [`Self::source_side`]), as [`Self::edges`] gives them.
    pub fn cut_edges<'a>(
        &'a self,
        side: &'a [bool],
    ) -> impl Iterator<Item = (EdgeId, usize, usize)> + 'a {
        self.edges().filter(move |&(e, _, _)| self.crosses(e, side))
    }

    /// Whether edge `e` goes from the `side` nodes to the others.
    pub fn crosses(&self, e: EdgeId, side: &[bool]) -> bool {
        let i = e.0 as usize;
        side[self.to[i ^ 1] as usize] && !side[self.to[i] as usize]
    }

    fn residual(&self, i: usize) -> u64 {
        if self.blocked[i] {
            0
        } else {
            self.cap[i]
        }
    }

    fn bfs(&mut self, s: usize, t: usize) -> bool {
        self.level.fill(u32::MAX);
        self.queue.clear();
        self.level[s] = 0;
        self.queue.push(s as u32);
        let mut qi = 0;
        while qi < self.queue.len() {
            let u = self.queue[qi] as usize;
            qi += 1;
            let mut e = self.head[u];
            while e != NONE {
                let v = self.to[e as usize] as usize;
                if self.residual(e as usize) > 0 && self.level[v] == u32::MAX {
                    self.level[v] = self.level[u] + 1;
                    self.queue.push(v as u32);
                }
                e = self.next[e as usize];
            }
        }
        self.level[t] != u32::MAX
    }

    /// Finds one blocking-flow path from `s` to `t` iteratively and pushes
    /// its bottleneck; returns the amount pushed (0 when none is left).
    fn augment(&mut self, s: usize, t: usize) -> u64 {
        // `stack` holds edge indices along the current path.
        self.stack.clear();
        let mut u = s;
        loop {
            if u == t {
                let pushed = self
                    .stack
                    .iter()
                    .map(|&e| self.residual(e as usize))
                    .min()
                    .unwrap_or(0);
                for &e in &self.stack {
                    self.cap[e as usize] -= pushed;
                    self.cap[e as usize ^ 1] += pushed;
                }
                return pushed;
            }
            let mut advanced = false;
            while self.iter[u] != NONE {
                let e = self.iter[u] as usize;
                let v = self.to[e] as usize;
                if self.residual(e) > 0 && self.level[v] == self.level[u] + 1 {
                    self.stack.push(e as u32);
                    u = v;
                    advanced = true;
                    break;
                }
                self.iter[u] = self.next[e];
            }
            if !advanced {
                // Dead end: retreat one edge and skip it from now on.
                self.level[u] = u32::MAX;
                match self.stack.pop() {
                    None => return 0,
                    Some(e) => {
                        u = self.to[e as usize ^ 1] as usize;
                        self.iter[u] = self.next[self.iter[u] as usize];
                    }
                }
            }
        }
    }

    /// Augments the current flow to a maximum `s → t` flow; returns the
    /// amount added by this call.
    pub fn max_flow(&mut self, s: usize, t: usize) -> u64 {
        let mut total = 0;
        while self.bfs(s, t) {
            self.iter.copy_from_slice(&self.head);
            loop {
                let f = self.augment(s, t);
                if f == 0 {
                    break;
                }
                total += f;
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CLRS figure 26.1: source 0, sink 5, max flow 23.
    fn textbook() -> FlowGraph {
        let mut g = FlowGraph::new(6);
        for (u, v, c) in [
            (0, 1, 16),
            (0, 2, 13),
            (2, 1, 4),
            (1, 3, 12),
            (3, 2, 9),
            (2, 4, 14),
            (4, 3, 7),
            (3, 5, 20),
            (4, 5, 4),
        ] {
            g.add_edge(u, v, c);
        }
        g
    }

    #[test]
    fn textbook_network() {
        let mut g = textbook();
        assert_eq!(g.max_flow(0, 5), 23);
        g.clear_flow();
        assert_eq!(g.max_flow(0, 5), 23);
    }

    #[test]
    fn the_source_side_is_a_minimum_cut() {
        // The cut's capacity is the flow's value.
        let mut g = textbook();
        let value = g.max_flow(0, 5);
        let side = g.source_side(0);
        assert!(side[0] && !side[5]);
        let cut: u64 = g.cut_edges(&side).map(|(e, _, _)| g.capacity(e)).sum();
        assert_eq!(cut, value);
        for (e, u, v) in g.cut_edges(&side) {
            assert_eq!(g.flow(e), g.capacity(e), "{u}→{v} is saturated");
        }
        // Every edge from the side to the rest, and only those.
        let crossing = g.edges().filter(|&(_, u, v)| side[u] && !side[v]).count();
        assert_eq!(g.cut_edges(&side).count(), crossing);
    }

    #[test]
    fn frozen_edges_keep_their_flow_while_others_grow() {
        // s→a (frozen at 1) and s→b; both reach t through the shared x→t.
        let mut g = FlowGraph::new(5);
        let (s, a, b, x, t) = (0, 1, 2, 3, 4);
        let sa = g.add_edge(s, a, 1);
        let sb = g.add_edge(s, b, 0);
        g.add_edge(a, x, 5);
        g.add_edge(b, x, 5);
        g.add_edge(x, t, 3);
        assert_eq!(g.max_flow(s, t), 1);
        g.freeze(sa);
        g.set_capacity(sb, 5);
        assert_eq!(g.max_flow(s, t), 2);
        assert_eq!(g.flow(sa), 1);
        assert_eq!(g.flow(sb), 2);
    }
}
