//! Score four pairs and keep the best half of each expert's.

use lrm_score::{pair_scores, select_top, Accumulate, Candidates, PairRows};

fn main() -> Result<(), lrm_score::ScoreError> {
    let (d_in, d_out) = (3, 2);
    let h: Vec<f32> = (0..4 * d_in).map(|i| i as f32 * 0.1).collect();
    let delta: Vec<f32> = (0..4 * d_out).map(|i| 1.0 - i as f32 * 0.1).collect();
    let gate = [0.9f32, 0.1, 0.6, 0.4];
    let mut scores = vec![0.0f32; 4];
    let rows = PairRows {
        h: &h,
        delta: &delta,
        gate: &gate,
        d_in,
        d_out,
    };
    pair_scores(rows, Accumulate::F32, &mut scores)?;
    let mut kept = vec![false; 4];
    let candidates = Candidates {
        expert: &[0, 0, 1, 1],
        id: &[0, 1, 2, 3],
        score: &scores,
    };
    let per_expert = select_top(candidates, &[1, 1], &mut kept)?;
    println!("scores {scores:?}\nkept {kept:?} ({per_expert:?} per expert)");
    Ok(())
}
