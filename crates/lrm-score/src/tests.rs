use super::*;
use proptest::prelude::*;

/// Explicitly forms `g · δ · hᵀ` in f64 and returns its squared Frobenius norm.
fn explicit_score(h: &[f32], d: &[f32], g: f32) -> f64 {
    let g = f64::from(g);
    let mut s = 0.0f64;
    for &di in d {
        for &hj in h {
            let v = g * f64::from(di) * f64::from(hj);
            s += v * v;
        }
    }
    s
}

fn check_scores(h: &[f32], delta: &[f32], gate: &[f32], d_in: usize, d_out: usize) {
    let rows = PairRows {
        h,
        delta,
        gate,
        d_in,
        d_out,
    };
    for acc in [Accumulate::F32, Accumulate::F64] {
        let mut out = vec![f32::NAN; gate.len()];
        pair_scores(rows, acc, &mut out).expect("finite inputs");
        for i in 0..gate.len() {
            let want = explicit_score(
                &h[i * d_in..(i + 1) * d_in],
                &delta[i * d_out..(i + 1) * d_out],
                gate[i],
            );
            let got = f64::from(out[i]);
            let rel = (got - want).abs() / want.max(1e-30);
            assert!(rel <= 1e-5, "pair {i} ({acc:?}): got {got}, want {want}");
        }
    }
}

fn rows_strategy() -> impl Strategy<Value = (Vec<f32>, Vec<f32>, Vec<f32>, usize, usize)> {
    (0usize..12, 1usize..40, 1usize..40).prop_flat_map(|(n, d_in, d_out)| {
        (
            prop::collection::vec(-4.0f32..4.0, n * d_in),
            prop::collection::vec(-4.0f32..4.0, n * d_out),
            prop::collection::vec(0.0f32..1.0, n),
            Just(d_in),
            Just(d_out),
        )
    })
}

proptest! {
    #[test]
    fn score_equals_explicit_outer_product_norm((h, d, g, d_in, d_out) in rows_strategy()) {
        check_scores(&h, &d, &g, d_in, d_out);
    }

    #[test]
    fn bf16_scores_equal_f32_scores_of_the_rounded_inputs((h, d, g, d_in, d_out) in rows_strategy()) {
        let hb: Vec<bf16> = h.iter().map(|&x| bf16::from_f32(x)).collect();
        let db: Vec<bf16> = d.iter().map(|&x| bf16::from_f32(x)).collect();
        let hr: Vec<f32> = hb.iter().map(|x| x.to_f32()).collect();
        let dr: Vec<f32> = db.iter().map(|x| x.to_f32()).collect();
        let mut sb = vec![0.0; g.len()];
        let mut sr = vec![0.0; g.len()];
        pair_scores(PairRows { h: &hb, delta: &db, gate: &g, d_in, d_out }, Accumulate::F64, &mut sb).unwrap();
        pair_scores(PairRows { h: &hr, delta: &dr, gate: &g, d_in, d_out }, Accumulate::F64, &mut sr).unwrap();
        prop_assert_eq!(sb, sr);
    }

    #[test]
    fn selection_keeps_exactly_the_best_of_each_expert(
        pairs in prop::collection::vec((0u32..6, 0u32..8), 0..200),
        quotas in prop::collection::vec(0usize..40, 6),
        seed in any::<u64>(),
    ) {
        // Scores drawn from a small set so ties are frequent.
        let expert: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        let score: Vec<f32> = pairs.iter().map(|p| p.1 as f32 * 0.5).collect();
        let id: Vec<u64> = (0..pairs.len() as u64).map(|i| i.wrapping_mul(2654435761) ^ seed).collect();
        let kept = check_selection(&expert, &id, &score, &quotas);

        // Same pairs in a shuffled order keep the same ids.
        let mut perm: Vec<usize> = (0..pairs.len()).collect();
        let mut state = seed | 1;
        for i in (1..perm.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            perm.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let e2: Vec<u32> = perm.iter().map(|&i| expert[i]).collect();
        let s2: Vec<f32> = perm.iter().map(|&i| score[i]).collect();
        let i2: Vec<u64> = perm.iter().map(|&i| id[i]).collect();
        let kept2 = check_selection(&e2, &i2, &s2, &quotas);
        let mut ids1: Vec<u64> = (0..id.len()).filter(|&i| kept[i]).map(|i| id[i]).collect();
        let mut ids2: Vec<u64> = (0..i2.len()).filter(|&i| kept2[i]).map(|i| i2[i]).collect();
        ids1.sort_unstable();
        ids2.sort_unstable();
        prop_assert_eq!(ids1, ids2);
    }
}

/// Runs [`select_top`] and asserts the contract: counts, dominance, tie rule.
fn check_selection(expert: &[u32], id: &[u64], score: &[f32], quotas: &[usize]) -> Vec<bool> {
    let mut kept = vec![true; expert.len()];
    let counts =
        select_top(Candidates { expert, id, score }, quotas, &mut kept).expect("valid input");
    for (e, &q) in quotas.iter().enumerate() {
        let mine: Vec<usize> = (0..expert.len())
            .filter(|&i| expert[i] as usize == e)
            .collect();
        let n_kept = mine.iter().filter(|&&i| kept[i]).count();
        assert_eq!(n_kept, q.min(mine.len()), "expert {e}");
        assert_eq!(counts[e], n_kept);
        for &k in mine.iter().filter(|&&i| kept[i]) {
            for &d in mine.iter().filter(|&&i| !kept[i]) {
                assert!(
                    ranks_before(score[k], id[k], score[d], id[d]),
                    "expert {e}: kept pair {k} does not rank before dropped pair {d}"
                );
            }
        }
    }
    kept
}

#[test]
fn exhaustive_small_selection_matches_a_sort() {
    // Every quota for every assignment of 5 pairs to 2 experts with scores in {0,1,2}.
    for code in 0..(6u32.pow(5)) {
        let mut c = code;
        let mut expert = vec![];
        let mut score = vec![];
        for _ in 0..5 {
            expert.push(c % 2);
            score.push(((c / 2) % 3) as f32);
            c /= 6;
        }
        let id: Vec<u64> = (0..5).rev().collect();
        for q0 in 0..6 {
            for q1 in 0..6 {
                let quotas = [q0, q1];
                let kept = check_selection(&expert, &id, &score, &quotas);
                // Naive reference: sort each expert's pairs fully.
                for (e, &q) in quotas.iter().enumerate() {
                    let mut mine: Vec<usize> =
                        (0..5).filter(|&i| expert[i] as usize == e).collect();
                    mine.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(id[a].cmp(&id[b])));
                    for (rank, &i) in mine.iter().enumerate() {
                        assert_eq!(kept[i], rank < q, "code {code} quotas {quotas:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn non_finite_inputs_are_errors() {
    let h = [1.0, f32::NAN];
    let d = [1.0];
    let mut out = [0.0];
    let err = pair_scores(
        PairRows {
            h: &h,
            delta: &d,
            gate: &[1.0],
            d_in: 2,
            d_out: 1,
        },
        Accumulate::F32,
        &mut out,
    )
    .unwrap_err();
    assert!(
        matches!(err, ScoreError::NonFinite { pair: 0, .. }),
        "{err}"
    );

    let mut kept = [false; 2];
    let err = select_top(
        Candidates {
            expert: &[0, 0],
            id: &[0, 1],
            score: &[1.0, f32::INFINITY],
        },
        &[1],
        &mut kept,
    )
    .unwrap_err();
    assert_eq!(
        err,
        ScoreError::NonFinite {
            pair: 1,
            value: f32::INFINITY
        }
    );
}

#[test]
fn bad_shapes_and_experts_are_errors() {
    let mut out = [0.0; 2];
    let err = pair_scores(
        PairRows {
            h: &[1.0; 3],
            delta: &[1.0; 2],
            gate: &[1.0, 1.0],
            d_in: 2,
            d_out: 1,
        },
        Accumulate::F32,
        &mut out,
    )
    .unwrap_err();
    assert_eq!(
        err,
        ScoreError::Shape {
            what: "h",
            expected: 4,
            got: 3
        }
    );
    let mut kept = [false; 1];
    let err = select_top(
        Candidates {
            expert: &[3],
            id: &[0],
            score: &[1.0],
        },
        &[1, 1],
        &mut kept,
    )
    .unwrap_err();
    assert_eq!(
        err,
        ScoreError::ExpertOutOfRange {
            pair: 0,
            expert: 3,
            n_experts: 2
        }
    );
}

#[test]
fn empty_inputs_and_zero_quotas_are_ordinary() {
    let mut out: [f32; 0] = [];
    pair_scores(
        PairRows::<f32> {
            h: &[],
            delta: &[],
            gate: &[],
            d_in: 4,
            d_out: 4,
        },
        Accumulate::F32,
        &mut out,
    )
    .unwrap();
    let counts = select_top(
        Candidates {
            expert: &[],
            id: &[],
            score: &[],
        },
        &[0, 3],
        &mut [],
    )
    .unwrap();
    assert_eq!(counts, vec![0, 0]);
}

mod rules {
    use crate::{select, select_top, Candidates, Rule};
    use proptest::prelude::*;

    fn run(
        rule: Rule,
        seed: u64,
        expert: &[u32],
        id: &[u64],
        score: &[f32],
        q: &[usize],
    ) -> (Vec<bool>, Vec<f32>, Vec<usize>) {
        let n = score.len();
        let (mut kept, mut w) = (vec![false; n], vec![0f32; n]);
        let c = select(
            Candidates { expert, id, score },
            q,
            rule,
            seed,
            &mut kept,
            &mut w,
        )
        .unwrap();
        (kept, w, c)
    }

    #[test]
    fn top_q_is_select_top_with_unit_weights() {
        let score = [3.0f32, 1.0, 2.0, 2.0, 5.0, 0.0];
        let expert = [0u32, 0, 0, 1, 1, 1];
        let id: Vec<u64> = (0..6).collect();
        let (kept, w, c) = run(Rule::TopQ, 7, &expert, &id, &score, &[2, 1]);
        let mut want = vec![false; 6];
        select_top(
            Candidates {
                expert: &expert,
                id: &id,
                score: &score,
            },
            &[2, 1],
            &mut want,
        )
        .unwrap();
        assert_eq!(kept, want);
        assert_eq!(c, vec![2, 1]);
        assert!(kept
            .iter()
            .zip(&w)
            .all(|(&k, &x)| x == if k { 1.0 } else { 0.0 }));
    }

    #[test]
    fn bad_input_is_an_error_for_every_rule() {
        for rule in Rule::ALL {
            let (mut kept, mut w) = (vec![false; 2], vec![0f32; 2]);
            fn c<'a>(score: &'a [f32], expert: &'a [u32]) -> Candidates<'a> {
                Candidates {
                    expert,
                    id: &[0, 1],
                    score,
                }
            }
            assert!(select(
                c(&[1.0, f32::NAN], &[0, 0]),
                &[1],
                rule,
                0,
                &mut kept,
                &mut w
            )
            .is_err());
            assert!(select(c(&[1.0, 1.0], &[0, 3]), &[1], rule, 0, &mut kept, &mut w).is_err());
            assert!(select(
                c(&[1.0, 1.0], &[0, 0]),
                &[1],
                rule,
                0,
                &mut kept,
                &mut w[..1]
            )
            .is_err());
        }
        assert_eq!(Rule::from_name("priority"), Some(Rule::Priority));
        assert_eq!(Rule::from_name("top-q"), None);
    }

    /// The unbiased rules' weighted sums average to the true sum (4000
    /// seeds, 3% — about six standard errors of the mean here).
    #[test]
    fn proportional_and_priority_are_unbiased_for_sums() {
        let n = 60;
        let score: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 11) as f32 + 0.5).powi(3))
            .collect();
        let x: Vec<f64> = (0..n).map(|i| (i as f64 * 0.7).sin() + 1.5).collect();
        let expert = vec![0u32; n];
        let id: Vec<u64> = (0..n as u64).map(|i| i * 13 + 5).collect();
        let truth: f64 = x.iter().sum();
        for rule in [Rule::Proportional, Rule::Priority] {
            let (mut mean, mut counts) = (0.0, 0usize);
            let seeds = 4000;
            for seed in 0..seeds {
                let (kept, w, c) = run(rule, seed, &expert, &id, &score, &[15]);
                counts += c[0];
                mean += kept
                    .iter()
                    .zip(&w)
                    .zip(&x)
                    .filter(|((k, _), _)| **k)
                    .map(|((_, &w), &x)| f64::from(w) * x)
                    .sum::<f64>();
            }
            mean /= seeds as f64;
            assert!(
                (mean - truth).abs() / truth < 0.03,
                "{rule:?}: {mean} vs {truth}"
            );
            assert!(
                counts >= 15 * seeds as usize - seeds as usize / 100,
                "{rule:?} kept {counts}"
            );
        }
    }

    proptest! {
        /// Every rule keeps at most min(q, n) per expert, gives kept pairs
        /// a weight ≥ 1 and dropped ones 0, and chooses the same pairs (by
        /// id) whatever the candidates' order.
        #[test]
        fn rules_respect_quotas_and_do_not_depend_on_order(
            cells in prop::collection::vec((0u32..4, 0u32..1000), 0..80),
            q in prop::collection::vec(0usize..12, 4),
            seed in any::<u64>(),
            rot in 0usize..80,
        ) {
            let n = cells.len();
            let expert: Vec<u32> = cells.iter().map(|c| c.0).collect();
            let score: Vec<f32> = cells.iter().map(|c| (c.1 % 7) as f32 * 1.5).collect();
            let id: Vec<u64> = (0..n as u64).map(|i| i * 7919 % 100_003).collect();
            for rule in Rule::ALL {
                let (kept, w, c) = run(rule, seed, &expert, &id, &score, &q);
                for e in 0..4 {
                    let n_e = expert.iter().filter(|&&x| x == e as u32).count();
                    prop_assert!(c[e] <= q[e].min(n_e));
                    let k_e = kept.iter().zip(&expert).filter(|(k, x)| **k && **x == e as u32).count();
                    prop_assert_eq!(k_e, c[e]);
                    if q[e] >= n_e { prop_assert_eq!(c[e], n_e); }
                }
                for (k, &x) in kept.iter().zip(&w) {
                    if *k { prop_assert!(x >= 1.0 - 1e-6); } else { prop_assert_eq!(x, 0.0); }
                }
                if n > 0 {
                    let r = rot % n;
                    let rot_of = |v: &[u32]| [&v[r..], &v[..r]].concat();
                    let (e2, s2, i2) = (rot_of(&expert), [&score[r..], &score[..r]].concat(), [&id[r..], &id[..r]].concat());
                    let (k2, _, _) = run(rule, seed, &e2, &i2, &s2, &q);
                    let mut a: Vec<u64> = id.iter().zip(&kept).filter(|(_, k)| **k).map(|(i, _)| *i).collect();
                    let mut b: Vec<u64> = i2.iter().zip(&k2).filter(|(_, k)| **k).map(|(i, _)| *i).collect();
                    a.sort_unstable(); b.sort_unstable();
                    prop_assert_eq!(a, b, "{:?}", rule);
                }
            }
        }
    }
}
