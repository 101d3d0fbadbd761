//! Bounded fuzzing of every parser, in CI: the plan problem, the training
//! TOML, the Hugging Face `config.json` reader, the replay traces (EPLB,
//! Megatron, metrics), checkpoints and tensor files. Each target mutates the seed files under
//! `tests/fuzz-corpus/<target>/` and asserts: no panic, and either an error
//! or an output whose invariants hold (pairs conserved, routes only to an
//! expert's instances, kept ≤ routed, kept fraction ≤ 1, ranks within
//! their budgets).

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(target)
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!seeds.is_empty(), "no seeds for {target}");
    seeds
}

/// One edit of a seed.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Delete(usize, usize),
    Insert(usize, Vec<u8>),
    Truncate(usize),
    /// Replace the n-th run of digits with a hostile number.
    Number(usize, &'static str),
}

const HOSTILE: &[&str] = &[
    "0",
    "-1",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "1e308",
    "-1e308",
    "1e-320",
    "nan",
    "inf",
    "0.5",
    "3",
    "100000000",
];

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Edit::Flip(p, b)),
        (any::<usize>(), 1usize..16).prop_map(|(p, n)| Edit::Delete(p, n)),
        (
            any::<usize>(),
            prop::collection::vec(
                prop_oneof![
                    Just(b'['),
                    Just(b']'),
                    Just(b'{'),
                    Just(b'}'),
                    Just(b','),
                    Just(b'"'),
                    Just(b'\n'),
                    Just(b'-'),
                    any::<u8>()
                ],
                1..6
            )
        )
            .prop_map(|(p, b)| Edit::Insert(p, b)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), prop::sample::select(HOSTILE)).prop_map(|(n, v)| Edit::Number(n, v)),
        (any::<usize>(), prop::sample::select(HOSTILE)).prop_map(|(n, v)| Edit::Number(n, v)),
    ]
}

fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let len = b.len().max(1);
        match e {
            Edit::Flip(p, x) => {
                if !b.is_empty() {
                    let i = p % b.len();
                    b[i] ^= x | 1;
                }
            }
            Edit::Delete(p, n) => {
                let i = p % len;
                let j = (i + n).min(b.len());
                if i < j {
                    b.drain(i..j);
                }
            }
            Edit::Insert(p, x) => {
                let i = p % (b.len() + 1);
                b.splice(i..i, x.iter().copied());
            }
            Edit::Truncate(p) => b.truncate(p % len),
            Edit::Number(n, v) => {
                let runs = digit_runs(&b);
                if !runs.is_empty() {
                    let (i, j) = runs[n % runs.len()];
                    b.splice(i..j, v.bytes());
                }
            }
        }
    }
    b
}

fn digit_runs(b: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let j = (i..b.len())
                .find(|&j| !b[j].is_ascii_digit())
                .unwrap_or(b.len());
            runs.push((i, j));
            i = j;
        } else {
            i += 1;
        }
    }
    runs
}

/// (seed index, edits): a mutated input of `target`.
fn input(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds(target).len();
    (0..n, prop::collection::vec(edit(), 0..4)).prop_map(move |(i, edits)| {
        static SEEDS: OnceLock<std::collections::HashMap<&'static str, Vec<Vec<u8>>>> =
            OnceLock::new();
        let all = SEEDS.get_or_init(|| {
            [
                "plan",
                "train-toml",
                "eplb",
                "megatron",
                "metrics",
                "checkpoint",
                "hf-config",
            ]
            .into_iter()
            .map(|t| (t, seeds(t)))
            .collect()
        });
        apply(&all[target][i], &edits)
    })
}

fn scratch(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("lrmoe-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)))
}

/// Invariants of a plan report against its problem.
fn check_plan(p: &lrmoe::plan::Problem, r: &lrmoe::plan::PlanReport) -> Result<(), TestCaseError> {
    let n_e = p.placement.owner.len();
    let kept: Vec<Vec<u64>> = match (&r.controller, &p.kept_counts) {
        (Some(c), _) => c.quotas_per_source.clone(),
        (None, Some(k)) => k.clone(),
        (None, None) => return Err(TestCaseError::fail("a plan without counts")),
    };
    if let (Some(c), Some(routed)) = (&r.controller, &p.routed_counts) {
        prop_assert!(c.kept_fraction >= 0.0 && c.kept_fraction <= 1.0);
        for (s, row) in c.quotas_per_source.iter().enumerate() {
            for (e, &k) in row.iter().enumerate() {
                prop_assert!(k <= routed[s][e], "kept > routed at ({s}, {e})");
            }
        }
    }
    // Conservation: every kept pair of (source, expert) is routed once.
    let mut placed = vec![vec![0u64; n_e]; p.n_ranks];
    for route in &r.assignment {
        prop_assert!(
            r.instances[route.expert].contains(&route.rank),
            "route to a rank without an instance of expert {}",
            route.expert
        );
        placed[route.source][route.expert] += route.pairs;
    }
    prop_assert_eq!(&placed, &kept);
    for rank in &r.ranks {
        if let Some(cap) = rank.pair_capacity {
            prop_assert!(
                rank.pairs <= cap,
                "rank {} over its pair capacity",
                rank.rank
            );
        }
        if let (Some(m), Some(b), Some(_)) =
            (rank.memory_bytes, rank.memory_budget_bytes, &r.controller)
        {
            prop_assert!(m <= b, "rank {} over its memory budget", rank.rank);
        }
    }
    Ok(())
}

fn shakespeare() -> &'static lrmoe::data::Corpus {
    static C: OnceLock<lrmoe::data::Corpus> = OnceLock::new();
    C.get_or_init(|| lrmoe::data::load_corpus(None, 0.1).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn plan_problems(bytes in input("plan")) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(p) = lrmoe::plan::parse_problem(&text) {
            if let Ok(r) = lrmoe::plan::run(&p, &lrmoe::plan::Options::default()) {
                check_plan(&p, &r)?;
            }
        }
    }

    #[test]
    fn train_toml(bytes in input("train-toml")) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(cfg) = lrmoe::train::TrainConfig::from_toml(&text) {
            if cfg.validate().is_ok() {
                prop_assert!(cfg.moe.ranks > 0 && cfg.data.batch_size % cfg.moe.ranks == 0);
                prop_assert!(cfg.run.max_minutes.is_none_or(|m| m.is_finite() && m > 0.0));
                prop_assert!(cfg.data.val_fraction > 0.0 && cfg.data.val_fraction < 0.5);
            }
        }
    }

    #[test]
    fn hf_configs(bytes in input("hf-config")) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(hf) = lrmoe::hf_config::parse(&text) {
            // What it reads is a model section the trainer accepts or
            // refuses with an error, never a panic.
            let m = hf.model;
            prop_assert!(m.d_model > 0 && m.n_layers > 0 && m.n_heads > 0);
            prop_assert!(m.qk_norm && m.rope_theta.is_some_and(|t| t.is_finite() && t > 0.0));
            let cfg = lrmoe::train::TrainConfig {
                model: m,
                ..Default::default()
            };
            let _ = cfg.model_config(65);
            let _ = hf.warning();
        }
    }

    #[test]
    fn eplb_traces(bytes in input("eplb")) {
        let path = scratch("eplb.json");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(t) = lrmoe::replay::load_eplb(&path, 2) {
            check_trace(&t)?;
        }
    }

    #[test]
    fn megatron_traces(bytes in input("megatron")) {
        let path = scratch("mg.jsonl");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(t) = lrmoe::replay::load_megatron(&path, 4) {
            check_trace(&t)?;
        }
    }

    #[test]
    fn metrics_traces(bytes in input("metrics")) {
        let path = scratch("metrics.jsonl");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(t) = lrmoe::replay::load_lrmoe_metrics(&path, 2) {
            check_trace(&t)?;
        }
    }
}

/// A loaded trace has the dimensions it claims, and replaying it either
/// fails cleanly or reports kept fractions in [0, 1].
fn check_trace(t: &lrmoe::replay::Trace) -> Result<(), TestCaseError> {
    for step in &t.steps {
        for layer in step {
            prop_assert_eq!(layer.len(), t.ranks);
            for row in layer {
                prop_assert_eq!(row.len(), t.experts);
            }
        }
    }
    let cfg = lrmoe::replay::ReplayConfig {
        hidden: 64,
        ffn: 32,
        element_bytes: 2,
        memory_budget_bytes: 1 << 20,
        link_bytes_per_s: lrmoe::quota::H200_LINK_BYTES_PER_S,
        flops_per_s: lrmoe::quota::H200_FLOPS_PER_S,
        replica_slots_per_rank: 1,
        replica_memory_fraction: 0.5,
        policy: lrmoe::quota::Policy::Maxmin,
        replica_rule: Default::default(),
        tile_trim: 0.0,
        cluster: Default::default(),
        slots_reserved: false,
        count_forward: false,
    };
    if let Ok(r) = lrmoe::replay::replay(t, &cfg) {
        for f in &r.steps {
            prop_assert!(
                f.kept_fraction >= 0.0 && f.kept_fraction <= 1.0,
                "kept fraction {}",
                f.kept_fraction
            );
            prop_assert_eq!(
                f.total_bytes,
                f.placement_bytes
                    .saturating_add(f.replica_bytes)
                    .saturating_add(f.buffer_bytes)
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn checkpoints_and_tensor_files(bytes in input("checkpoint")) {
        let path = scratch("ckpt.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(f) = lrmoe::tensorfile::load(&path) {
            for (name, (shape, data)) in &f.tensors {
                prop_assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor {}", name);
            }
        }
        let cfg = lrmoe::train::TrainConfig::from_toml(
            &std::fs::read_to_string(corpus_dir("train-toml").join("tiny.toml")).unwrap(),
        )
        .unwrap();
        if let Ok(step) = lrmoe::train::check_checkpoint(&path, &cfg, shakespeare()) {
            prop_assert!(step <= 1 << 40);
        }
    }
}

#[test]
fn every_seed_parses_cleanly() {
    for b in seeds("plan") {
        let p = lrmoe::plan::parse_problem(std::str::from_utf8(&b).unwrap()).unwrap();
        let r = lrmoe::plan::run(&p, &lrmoe::plan::Options::default()).unwrap();
        check_plan(&p, &r).unwrap();
    }
    for b in seeds("train-toml") {
        let cfg = lrmoe::train::TrainConfig::from_toml(std::str::from_utf8(&b).unwrap()).unwrap();
        cfg.validate().unwrap();
    }
    for b in seeds("hf-config") {
        let hf = lrmoe::hf_config::parse(std::str::from_utf8(&b).unwrap()).unwrap();
        let cfg = lrmoe::train::TrainConfig {
            model: hf.model,
            ..Default::default()
        };
        cfg.model_config(65).unwrap();
    }
    let cfg = lrmoe::train::TrainConfig::from_toml(
        &std::fs::read_to_string(corpus_dir("train-toml").join("tiny.toml")).unwrap(),
    )
    .unwrap();
    let ckpt = corpus_dir("checkpoint").join("tiny.safetensors");
    assert_eq!(
        lrmoe::train::check_checkpoint(&ckpt, &cfg, shakespeare()).unwrap(),
        3
    );
    let eplb = corpus_dir("eplb");
    for f in ["bare.json", "keyed.json"] {
        lrmoe::replay::load_eplb(&eplb.join(f), 2).unwrap();
    }
    lrmoe::replay::load_megatron(&corpus_dir("megatron").join("small.jsonl"), 4).unwrap();
    lrmoe::replay::load_lrmoe_metrics(&corpus_dir("metrics").join("tiny.jsonl"), 2).unwrap();
}
