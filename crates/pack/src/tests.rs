use super::*;
use half::bf16;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    expert: Vec<u32>,
    kept: Vec<bool>,
    routes: Vec<SendRoute>,
    n_ranks: usize,
    n_experts: usize,
}

/// Random pairs, and routes that deal each expert's kept pairs over random ranks.
fn case_strategy() -> impl Strategy<Value = Case> {
    (1usize..5, 1usize..6).prop_flat_map(|(n_ranks, n_experts)| {
        (
            prop::collection::vec((0..n_experts as u32, any::<bool>()), 0..80),
            prop::collection::vec(prop::collection::vec(0u64..4, n_ranks), n_experts),
        )
            .prop_map(move |(pairs, weights)| {
                let expert: Vec<u32> = pairs.iter().map(|p| p.0).collect();
                let kept: Vec<bool> = pairs.iter().map(|p| p.1).collect();
                let mut routes = vec![];
                for (e, w) in weights.iter().enumerate() {
                    let mut left = (0..expert.len())
                        .filter(|&i| kept[i] && expert[i] as usize == e)
                        .count() as u64;
                    for (r, &wr) in w.iter().enumerate() {
                        let take = if r + 1 == n_ranks { left } else { wr.min(left) };
                        routes.push(SendRoute {
                            expert: e,
                            rank: r,
                            pairs: take,
                        });
                        left -= take;
                    }
                }
                Case {
                    expert,
                    kept,
                    routes,
                    n_ranks,
                    n_experts,
                }
            })
    })
}

fn check(c: &Case) -> PackPlan {
    let p = plan(&c.expert, &c.kept, &c.routes, c.n_ranks, c.n_experts).expect("valid case");
    let n_kept = c.kept.iter().filter(|&&k| k).count();
    assert_eq!(
        p.packed_rows(),
        n_kept,
        "no padding: packed rows = kept rows"
    );
    for r in &c.routes {
        let routed: u64 = c
            .routes
            .iter()
            .filter(|x| x.rank == r.rank && x.expert == r.expert)
            .map(|x| x.pairs)
            .sum();
        assert_eq!(p.block_sizes[r.rank][r.expert] as u64, routed);
    }
    // Each block holds exactly rows of its expert, ascending.
    let mut at = 0;
    for d in 0..c.n_ranks {
        assert_eq!(p.send_offsets[d], at);
        for e in 0..c.n_experts {
            let block = &p.gather[at..at + p.block_sizes[d][e]];
            assert!(block
                .iter()
                .all(|&i| c.expert[i as usize] as usize == e && c.kept[i as usize]));
            assert!(block.windows(2).all(|w| w[0] < w[1]));
            at += p.block_sizes[d][e];
        }
    }
    p
}

proptest! {
    #[test]
    fn pack_then_unpack_is_identity_on_kept_rows_and_zero_elsewhere(c in case_strategy(), width in 0usize..9) {
        let p = check(&c);
        let n = c.expert.len();
        let src: Vec<f32> = (0..n * width).map(|i| i as f32 + 0.5).collect();
        let mut packed = vec![f32::NAN; p.packed_rows() * width];
        gather_rows(&src, width, &p.gather, &mut packed).unwrap();
        let mut back = vec![f32::NAN; n * width];
        unpack_rows(&packed, width, &p.inverse, 0.0, &mut back).unwrap();
        for i in 0..n {
            let want: &[f32] = if c.kept[i] { &src[i * width..(i + 1) * width] } else { &[] };
            let got = &back[i * width..(i + 1) * width];
            if c.kept[i] {
                prop_assert_eq!(got, want);
            } else {
                prop_assert!(got.iter().all(|&x| x == 0.0));
            }
        }
        // bf16 rows move bit-exactly too.
        let srcb: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut packedb = vec![bf16::NAN; packed.len()];
        gather_rows(&srcb, width, &p.gather, &mut packedb).unwrap();
        prop_assert!(packedb.iter().zip(&packed).all(|(b, f)| *b == bf16::from_f32(*f)));
    }

    #[test]
    fn split_gather_equals_gather_then_split(
        rows in 0usize..40,
        left in 0usize..6,
        right in 0usize..6,
        picks in prop::collection::vec(any::<u32>(), 0..60),
    ) {
        let width = left + right;
        let src: Vec<f32> = (0..rows * width).map(|i| i as f32 + 0.25).collect();
        let idx: Vec<u32> = if rows == 0 { vec![] } else { picks.iter().map(|&p| p % rows as u32).collect() };
        let mut whole = vec![f32::NAN; idx.len() * width];
        gather_rows(&src, width, &idx, &mut whole).unwrap();
        let (mut l, mut r) = (vec![f32::NAN; idx.len() * left], vec![f32::NAN; idx.len() * right]);
        gather_rows_split(&src, (left, right), &idx, &mut l, &mut r).unwrap();
        for j in 0..idx.len() {
            prop_assert_eq!(&l[j * left..(j + 1) * left], &whole[j * width..j * width + left]);
            prop_assert_eq!(&r[j * right..(j + 1) * right], &whole[j * width + left..(j + 1) * width]);
        }
        if rows > 0 && width > 0 {
            // An index past the rows is an error naming it; outputs of the
            // wrong length are shape errors.
            let mut bad = idx.clone();
            bad.push(rows as u32);
            let (mut l2, mut r2) = (vec![0.0; bad.len() * left], vec![0.0; bad.len() * right]);
            prop_assert_eq!(
                gather_rows_split(&src, (left, right), &bad, &mut l2, &mut r2),
                Err(PackError::IndexOutOfRange { position: idx.len(), index: rows as u32, rows })
            );
            let mut short = vec![0.0; (bad.len() * left).saturating_sub(1)];
            if left > 0 {
                let got = gather_rows_split(&src, (left, right), &bad, &mut short, &mut r2);
                let refused = matches!(got, Err(PackError::Shape { what: "out_left", .. }));
                prop_assert!(refused, "a short left output: {:?}", got);
            }
        }
    }

    #[test]
    fn plans_are_deterministic_and_receivers_regroup_by_expert(c in case_strategy()) {
        let p = check(&c);
        prop_assert_eq!(&p, &plan(&c.expert, &c.kept, &c.routes, c.n_ranks, c.n_experts).unwrap());
        // Every rank sends its plan's row `d` to rank d: use the same plan for all sources.
        let blocks_from: Vec<Vec<usize>> = (0..3).map(|_| p.block_sizes[0].clone()).collect();
        let rp = receive_plan(&blocks_from, c.n_experts).unwrap();
        prop_assert_eq!(rp.order.len(), 3 * p.send_counts[0]);
        let mut seen = rp.order.clone();
        seen.sort_unstable();
        prop_assert!(seen.iter().enumerate().all(|(i, &x)| i as u32 == x), "order is a permutation");
        let mut k = 0;
        for e in 0..c.n_experts {
            prop_assert_eq!(rp.group_sizes[e], 3 * p.block_sizes[0][e]);
            for _ in 0..rp.group_sizes[e] {
                let pos = rp.order[k] as usize;
                let s = (0..3).find(|&s| pos < rp.recv_offsets[s + 1]).unwrap();
                let row = p.gather[pos - rp.recv_offsets[s]];
                prop_assert_eq!(c.expert[row as usize] as usize, e);
                k += 1;
            }
        }
        let inv = invert(&rp.order, rp.order.len()).unwrap();
        prop_assert!(inv.iter().all(|&i| i != DROPPED));
    }
}

#[test]
fn routes_must_match_kept_pairs() {
    let err = plan(
        &[0, 0],
        &[true, true],
        &[SendRoute {
            expert: 0,
            rank: 0,
            pairs: 1,
        }],
        1,
        1,
    )
    .unwrap_err();
    assert_eq!(
        err,
        PackError::RouteMismatch {
            expert: 0,
            routed: 1,
            kept: 2
        }
    );
    let err = plan(
        &[0],
        &[true],
        &[SendRoute {
            expert: 0,
            rank: 2,
            pairs: 1,
        }],
        2,
        1,
    )
    .unwrap_err();
    assert_eq!(
        err,
        PackError::RankOutOfRange {
            rank: 2,
            n_ranks: 2
        }
    );
    let err = plan(&[4], &[false], &[], 1, 2).unwrap_err();
    assert_eq!(
        err,
        PackError::ExpertOutOfRange {
            expert: 4,
            n_experts: 2
        }
    );
}

#[test]
fn bad_indices_and_shapes_are_errors() {
    let mut out = [0.0f32; 2];
    assert_eq!(
        gather_rows(&[1.0, 2.0], 2, &[1], &mut out),
        Err(PackError::IndexOutOfRange {
            position: 0,
            index: 1,
            rows: 1
        })
    );
    assert!(matches!(
        gather_rows(&[1.0, 2.0], 2, &[0, 0], &mut out),
        Err(PackError::Shape { what: "out", .. })
    ));
    assert!(matches!(
        unpack_rows(&[1.0], 1, &[3], 0.0, &mut [0.0]),
        Err(PackError::IndexOutOfRange { .. })
    ));
}

#[test]
fn empty_sources_destinations_and_blocks_are_ordinary() {
    let p = plan(&[], &[], &[], 3, 2).unwrap();
    assert_eq!(p.send_counts, vec![0, 0, 0]);
    assert_eq!(p.send_offsets, vec![0, 0, 0, 0]);
    let rp = receive_plan(&[vec![0, 0], vec![0, 0]], 2).unwrap();
    assert_eq!(rp.group_sizes, vec![0, 0]);
    let rp = receive_plan(&[], 0).unwrap();
    assert!(rp.order.is_empty());
}
