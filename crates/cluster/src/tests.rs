use proptest::prelude::*;

use super::*;

fn matrix(n: usize, mut f: impl FnMut(usize, usize) -> u64) -> Vec<Vec<u64>> {
    let mut m = vec![vec![0; n]; n];
    for (s, row) in m.iter_mut().enumerate() {
        for (d, v) in row.iter_mut().enumerate() {
            *v = f(s, d);
        }
    }
    m
}

#[test]
fn every_measured_exchange_is_predicted_within_15_percent() {
    let checks = check(&Cluster::default()).unwrap();
    assert_eq!(checks.len(), 18);
    for c in &checks {
        assert!(
            c.error().abs() <= 0.15,
            "{} on {} ranks: measured {:.3} ms, model {:.3} ms\n{}",
            c.what,
            c.ranks,
            c.measured_ms,
            c.predicted_ms,
            check_table(&checks)
        );
    }
}

#[test]
fn the_backward_exchanges_match_the_bench_bytes() {
    // lrmoe-dist-bench printed 1024.0 MiB of rows out per rank at r = 1
    // (all destinations, itself included) and 131 072 pairs per rank.
    let counts = zipf08_counts();
    assert_eq!(counts.iter().sum::<u64>(), 131_072);
    let ex = backward_exchanges(2, 1.0);
    assert_eq!(ex[0][0].iter().sum::<u64>(), 1024 << 20);
    // Rank 0 owns the popular half: it receives far more than it sends.
    let to0 = ex[0][1][0];
    let to1 = ex[0][0][1];
    assert!(to0 > 3 * to1, "{to0} {to1}");
    // dX rows are half as wide and go the other way.
    assert_eq!(ex[1][0][1], to0 / 2);
}

#[test]
fn an_exchange_is_latency_plus_the_busiest_rank_over_the_bandwidth() {
    let c = Cluster {
        gpus_per_node: 4,
        intra_gb_per_s: 100.0,
        intra_latency_us: 10.0,
        inter_gb_per_s: 10.0,
        inter_latency_us: 20.0,
        call_overhead_us: 0.0,
        layer_call_overhead_us: 0.0,
        ..Cluster::default()
    };
    // Two ranks on one node: rank 0 sends 1 GB, receives 0.5 GB.
    let b = vec![vec![7, 1_000_000_000], vec![500_000_000, 9]];
    let s = c.exchange_s(&b).unwrap();
    assert!((s - (10e-6 + 0.01)).abs() < 1e-12, "{s}");
    // Ranks 0 and 4 are on different nodes.
    let b = matrix(8, |s, d| if s == 0 && d == 4 { 1_000_000_000 } else { 0 });
    let s = c.exchange_s(&b).unwrap();
    assert!((s - (20e-6 + 0.1)).abs() < 1e-12, "{s}");
    // Both classes at once: the slower one.
    let b = matrix(8, |s, d| match (s, d) {
        (0, 4) => 100_000_000,
        (0, 1) => 2_000_000_000,
        _ => 0,
    });
    let s = c.exchange_s(&b).unwrap();
    assert!((s - (10e-6 + 0.02)).abs() < 1e-12, "{s}");
    // Nothing between ranks: free.
    assert_eq!(
        c.exchange_s(&matrix(3, |s, d| if s == d { 5 } else { 0 }))
            .unwrap(),
        0.0
    );
    assert_eq!(c.exchange_s(&[]).unwrap(), 0.0);
}

#[test]
fn collectives_follow_the_ring_model() {
    let c = Cluster {
        gpus_per_node: 8,
        intra_gb_per_s: 100.0,
        intra_latency_us: 5.0,
        inter_gb_per_s: 25.0,
        inter_latency_us: 10.0,
        call_overhead_us: 0.0,
        layer_call_overhead_us: 0.0,
        ..Cluster::default()
    };
    let s = c.all_reduce_s(800_000_000, 8).unwrap();
    assert!((s - (5e-6 + 14.0 / 8.0 * 0.008)).abs() < 1e-12, "{s}");
    let s = c.all_reduce_s(800_000_000, 16).unwrap();
    assert!((s - (10e-6 + 30.0 / 16.0 * 0.032)).abs() < 1e-12, "{s}");
    let s = c.all_gather_s(100_000_000, 4).unwrap();
    assert!((s - (5e-6 + 3.0 * 0.001)).abs() < 1e-12, "{s}");
    assert_eq!(c.all_reduce_s(1 << 30, 1).unwrap(), 0.0);
    assert_eq!(c.all_gather_s(0, 8).unwrap(), 0.0);
}

#[test]
fn bad_clusters_and_shapes_are_errors() {
    let bad = [
        Cluster {
            gpus_per_node: 0,
            ..Cluster::default()
        },
        Cluster {
            intra_gb_per_s: 0.0,
            ..Cluster::default()
        },
        Cluster {
            inter_gb_per_s: f64::NAN,
            ..Cluster::default()
        },
        Cluster {
            inter_latency_us: -1.0,
            ..Cluster::default()
        },
        Cluster {
            intra_latency_us: f64::INFINITY,
            ..Cluster::default()
        },
        Cluster {
            call_overhead_us: -0.5,
            ..Cluster::default()
        },
        Cluster {
            layer_call_overhead_us: f64::NAN,
            ..Cluster::default()
        },
        Cluster {
            overlap_work_factor: 0.9,
            ..Cluster::default()
        },
        Cluster {
            overlap_work_factor: f64::INFINITY,
            ..Cluster::default()
        },
    ];
    for c in bad {
        let e = c.validate().unwrap_err().to_string();
        assert!(e.starts_with("cluster."), "{e}");
        assert!(c.exchange_s(&equal_split(8, 2)).is_err());
        assert!(c.all_reduce_s(8, 2).is_err());
    }
    let e = Cluster::default()
        .exchange_s(&[vec![1, 2], vec![3]])
        .unwrap_err();
    assert_eq!(
        e,
        ClusterError::NotSquare {
            row: 1,
            got: 1,
            ranks: 2
        }
    );
}

#[test]
fn phases_end_with_their_slowest_rank() {
    assert_eq!(bulk_synchronous(&[1.0, 3.0, 2.0]), 3.0);
    assert_eq!(bulk_synchronous(&[]), 0.0);
    assert_eq!(overlapped(2.0, 5.0), 5.0);
}

proptest! {
    #[test]
    fn more_bytes_never_take_less_time(
        n in 1usize..12,
        per_node in 1usize..6,
        seed in any::<u64>(),
        extra in 1u64..1_000_000_000,
        at in any::<(usize, usize)>(),
    ) {
        let c = Cluster { gpus_per_node: per_node, ..Cluster::default() };
        let mut x = seed;
        let mut b = matrix(n, |_, _| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 40) % 50_000_000
        });
        let t0 = c.exchange_s(&b).unwrap();
        prop_assert!(t0 >= 0.0 && t0.is_finite());
        let (s, d) = (at.0 % n, at.1 % n);
        b[s][d] += extra;
        let t1 = c.exchange_s(&b).unwrap();
        prop_assert!(t1 >= t0);
        // The busiest rank bounds the time from below: its bytes split over
        // both links at best.
        let most = busiest_bytes(&b) as f64;
        prop_assert!(t1 + 1e-15 >= most / ((c.intra_gb_per_s + c.inter_gb_per_s) * 1e9));
    }

    #[test]
    fn the_transpose_takes_as_long(n in 1usize..10, seed in any::<u64>()) {
        // Sends and receives count alike, so reversing every message
        // changes nothing.
        let c = Cluster { gpus_per_node: 3, ..Cluster::default() };
        let mut x = seed;
        let b = matrix(n, |_, _| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            (x >> 33) % 10_000_000
        });
        let t = matrix(n, |s, d| b[d][s]);
        prop_assert_eq!(c.exchange_s(&b).unwrap(), c.exchange_s(&t).unwrap());
    }
}

#[test]
fn the_slowest_link_is_between_nodes_once_the_ranks_span_two() {
    let c = Cluster::default();
    assert_eq!(c.slowest_link_bytes_per_s(1), c.intra_gb_per_s * 1e9);
    assert_eq!(
        c.slowest_link_bytes_per_s(c.gpus_per_node),
        c.intra_gb_per_s * 1e9
    );
    assert_eq!(
        c.slowest_link_bytes_per_s(c.gpus_per_node + 1),
        c.inter_gb_per_s * 1e9
    );
}
