//! `lrmoe plan` end to end: example files plan, bad input is one line.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `lrmoe plan` on `json` and returns (success, stdout, stderr).
fn plan(json: &str, extra: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!(
        "lrmoe-plan-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("problem.json");
    std::fs::write(&input, json).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .arg("plan")
        .arg("--input")
        .arg(&input)
        .args(extra)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Asserts a one-line error mentioning every `needle`.
fn check_error(json: &str, needles: &[&str]) {
    let (ok, stdout, stderr) = plan(json, &[]);
    assert!(!ok, "expected failure, got {stdout}");
    assert!(stdout.is_empty());
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{stderr:?} lacks {n:?}");
    }
}

const KEPT_OK: &str =
    r#"{"n_ranks": 2, "placement": {"owner": [0, 1]}, "kept_counts": [[3, 1], [2, 2]]}"#;

#[test]
fn example_problems_plan_and_conserve_pairs() {
    for (file, solver) in [
        ("plan-routed.json", "exact"),
        ("plan-kept.json", "ilp"),
        ("plan-kept.json", "greedy"),
    ] {
        let text = std::fs::read_to_string(root().join("examples").join(file)).unwrap();
        let (ok, stdout, stderr) = plan(&text, &["--solver", solver]);
        assert!(ok, "{file}: {stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let kept: Vec<Vec<u64>> = match v["controller"]["quotas_per_source"].as_array() {
            Some(_) => {
                serde_json::from_value(v["controller"]["quotas_per_source"].clone()).unwrap()
            }
            None => serde_json::from_str::<serde_json::Value>(&text)
                .map(|p| serde_json::from_value(p["kept_counts"].clone()).unwrap())
                .unwrap(),
        };
        let mut routed = vec![vec![0u64; kept[0].len()]; kept.len()];
        for r in v["assignment"].as_array().unwrap() {
            routed[r["source"].as_u64().unwrap() as usize]
                [r["expert"].as_u64().unwrap() as usize] += r["pairs"].as_u64().unwrap();
        }
        assert_eq!(routed, kept, "{file}");
        assert!(v["peak_load"].as_u64().unwrap() >= v["peak_lower_bound"].as_u64().unwrap());
        for r in v["ranks"].as_array().unwrap() {
            if let (Some(m), Some(b)) = (
                r["memory_bytes"].as_u64(),
                r["memory_budget_bytes"].as_u64(),
            ) {
                assert!(m <= b, "{file}: rank over memory budget");
            }
        }
    }
}

#[test]
fn plan_writes_atomically_to_out() {
    let dir = std::env::temp_dir().join(format!("lrmoe-plan-out-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let (ok, stdout, stderr) = plan(KEPT_OK, &["--out", out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.is_empty());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["peak_load"], 5);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "no temporary left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_json_names_the_line() {
    check_error(
        r#"{"n_ranks": 2, "placement": "#,
        &["problem.json", "line 1"],
    );
}

#[test]
fn negative_and_fractional_counts_name_the_field() {
    check_error(
        r#"{"n_ranks": 1, "placement": {"owner": [0]}, "kept_counts": [[-3]]}"#,
        &["kept_counts[0][0]"],
    );
    check_error(
        r#"{"n_ranks": 1, "placement": {"owner": [0]}, "kept_counts": [[1.5]]}"#,
        &["kept_counts[0][0]"],
    );
}

#[test]
fn empty_problems_are_refused() {
    check_error(
        r#"{"n_ranks":0,"placement":{"owner":[]},"kept_counts":[]}"#,
        &["n_ranks", "at least 1"],
    );
    check_error(
        r#"{"n_ranks":2,"placement":{"owner":[]},"kept_counts":[[],[]]}"#,
        &["placement.owner", "no expert"],
    );
}

#[test]
fn negative_limits_name_the_flag_and_range() {
    let (ok, _, stderr) = plan(KEPT_OK, &["--ilp-time-limit-ms", "-1"]);
    assert!(!ok);
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("--ilp-time-limit-ms") && stderr.contains("≥ 1"),
        "{stderr}"
    );
}

#[test]
fn an_expert_with_no_instance_is_named() {
    check_error(
        r#"{"n_ranks": 2, "placement": {"owner": [0, 7]}, "kept_counts": [[1, 1], [1, 1]]}"#,
        &["placement.owner[1]", "rank 7"],
    );
}

#[test]
fn missing_budget_fields_are_named() {
    let cost = r#""cost_model": {"act_row_bytes": 1, "grad_row_bytes": 1, "expert_weight_bytes": 1, "expert_grad_bytes": 1, "flops_per_pair": 1, "link_bytes_per_s": 1, "flops_per_s": 1}"#;
    check_error(
        &format!(
            r#"{{"n_ranks": 1, "placement": {{"owner": [0]}}, "routed_counts": [[1]], {cost}}}"#
        ),
        &["budgets", "required"],
    );
    check_error(
        &format!(
            r#"{{"n_ranks": 1, "placement": {{"owner": [0]}}, "routed_counts": [[1]], {cost}, "budgets": [{{"memory_bytes": 9}}]}}"#
        ),
        &["budgets[0]", "network_bytes"],
    );
    check_error(
        r#"{"n_ranks": 1, "placement": {"owner": [0]}, "routed_counts": [[1]], "budgets": []}"#,
        &["cost_model"],
    );
}

#[test]
fn mismatched_dimensions_are_named() {
    check_error(
        r#"{"n_ranks": 2, "placement": {"owner": [0, 1]}, "kept_counts": [[1, 1], [1]]}"#,
        &["kept_counts[1]", "expected 2 experts, got 1"],
    );
    check_error(
        r#"{"n_ranks": 3, "placement": {"owner": [0, 1]}, "kept_counts": [[1, 1], [1, 1]]}"#,
        &["kept_counts", "expected 3 source ranks"],
    );
    check_error(
        r#"{"n_ranks": 2, "placement": {"owner": [0, 1]}, "kept_counts": [[1, 1], [1, 1]], "base_load": [1]}"#,
        &["base_load"],
    );
}

#[test]
fn infeasible_budgets_are_one_line() {
    let json = r#"{"n_ranks": 1, "placement": {"owner": [0]}, "routed_counts": [[4]],
        "cost_model": {"act_row_bytes": 1, "grad_row_bytes": 1, "expert_weight_bytes": 100, "expert_grad_bytes": 100, "flops_per_pair": 1, "link_bytes_per_s": 1, "flops_per_s": 1},
        "budgets": [{"memory_bytes": 150, "network_bytes": 10}]}"#;
    check_error(json, &["rank 0", "short by 50 B"]);
}

#[test]
fn missing_file_is_one_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(["plan", "--input", "/nonexistent/problem.json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1);
    assert!(
        err.contains("cannot read /nonexistent/problem.json"),
        "{err}"
    );
}

#[test]
fn sums_past_u64_are_overflow_errors_not_wrong_plans() {
    check_error(
        r#"{"n_ranks": 2, "placement": {"owner": [0]}, "kept_counts": [[18446744073709551615], [1]]}"#,
        &["overflow"],
    );
    let near = 1u64 << 63;
    check_error(
        &format!(
            r#"{{"n_ranks": 2, "placement": {{"owner": [0, 1]}}, "routed_counts": [[{near}, 5], [{near}, 5]],
               "cost_model": {{"act_row_bytes": 8, "grad_row_bytes": 8, "expert_weight_bytes": 1, "expert_grad_bytes": 1,
                               "flops_per_pair": 1.0, "link_bytes_per_s": 1.0, "flops_per_s": 1.0}},
               "budgets": [{{"memory_bytes": 1000, "network_bytes": 1000}}, {{"memory_bytes": 1000, "network_bytes": 1000}}]}}"#
        ),
        &["overflows u64"],
    );
}

#[test]
fn strict_objects_unknown_fields_and_errors_said_once() {
    check_error(
        r#"{"n_ranks": 2, "placement": {"owner": [0, 1]}, "kept_counts": [[1, 1], [1, 1]],
            "load_model": {"compute_per_pair": 1, "network_per_pair": 0, "bogus": 1}}"#,
        &["load_model.bogus", "unknown field"],
    );
    check_error(
        r#"{"n_ranks": 2, "placement": [[0, 1]], "kept_counts": [[1, 1], [1, 1]]}"#,
        &["placement", "expected an object"],
    );
    check_error(
        r#"[2, {"owner": [0, 1]}, null, [[1, 1], [1, 1]]]"#,
        &["expected an object"],
    );
    let json = r#"{"n_ranks": 1, "placement": {"owner": [0]}, "routed_counts": [[4]],
        "cost_model": {"act_row_bytes": 8, "grad_row_bytes": 8, "expert_weight_bytes": 1, "expert_grad_bytes": 1,
                       "flops_per_pair": 1.0, "link_bytes_per_s": 1.0, "flops_per_s": 0.0},
        "budgets": [{"memory_bytes": 1000, "network_bytes": 1000}]}"#;
    let (ok, _, stderr) = plan(json, &[]);
    assert!(!ok);
    assert_eq!(stderr.matches("must be finite").count(), 1, "{stderr}");
    let (ok, _, stderr) = plan(KEPT_OK, &["--out", "/nonexistent-dir/plan.json"]);
    assert!(!ok);
    assert!(
        stderr.contains("cannot write") && !stderr.contains("cannot read"),
        "{stderr}"
    );
}
