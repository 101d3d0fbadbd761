//! `lrmoe replay` refuses malformed traces and settings in one line that
//! names the file, the line and what is wrong.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::path::PathBuf;
use std::process::Command;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lrmoe-replay-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn replay(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .arg("replay")
        .args(args)
        .env("LRMOE_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn one_line(err: &str, needles: &[&str]) {
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{err:?} lacks {n:?}");
    }
}

#[test]
fn non_finite_settings_are_refused() {
    let dir = tmp("zipf");
    let out = dir.join("out");
    for z in ["NaN", "inf", "-1"] {
        let (ok, err) = replay(&[
            "--synthetic",
            "hot-experts",
            &format!("--zipf={z}"),
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(!ok, "{z}");
        one_line(&err, &["--zipf", "≥ 0"]);
    }
}

#[test]
fn negative_numbers_after_a_space_name_the_flag_and_range() {
    let out = tmp("negative").join("out");
    let o = out.to_str().unwrap();
    for (flag, value, range) in [
        ("--zipf", "-2", "≥ 0"),
        ("--budget-mib", "-1", "> 0"),
        ("--replica-memory-fraction", "-1", "in [0, 1]"),
        ("--steps", "-5", "≥ 1"),
    ] {
        let (ok, err) = replay(&["--synthetic", "hot-experts", flag, value, "--out", o]);
        assert!(!ok, "{flag} {value}");
        one_line(&err, &[flag, range]);
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_source_is_required() {
    let out = tmp("nosource").join("out");
    let (ok, err) = replay(&["--out", out.to_str().unwrap()]);
    assert!(!ok);
    one_line(
        &err,
        &["--eplb", "--megatron", "--lrmoe-metrics", "--synthetic"],
    );
    assert!(!out.exists(), "nothing written");
}

#[test]
fn the_device_is_checked_before_anything_is_written() {
    let out = tmp("nocuda").join("out");
    let (ok, err) = replay(&[
        "--synthetic",
        "hot-experts",
        "--steps",
        "2",
        "--device",
        "cuda",
        "--out",
        out.to_str().unwrap(),
    ]);
    if cfg!(feature = "cuda") {
        // A CUDA build on a machine with a GPU runs; without one it fails
        // the same way as below.
        if ok {
            return;
        }
    }
    assert!(!ok);
    one_line(&err, &["CUDA"]);
    assert!(!out.exists(), "no table or files before the device check");
}

#[test]
fn replica_share_and_element_size_are_checked() {
    let out = tmp("knobs").join("out");
    let o = out.to_str().unwrap();
    let base = ["--synthetic", "hot-experts", "--steps", "2", "--out", o];
    for (flag, needle) in [
        ("--replica-memory-fraction=1.5", "--replica-memory-fraction"),
        ("--replica-memory-fraction=NaN", "--replica-memory-fraction"),
        ("--element-bytes=0", "--element-bytes"),
    ] {
        let mut args = base.to_vec();
        args.push(flag);
        let (ok, err) = replay(&args);
        assert!(!ok, "{flag}");
        one_line(&err, &[needle]);
    }
    // Valid settings run.
    let mut args = base.to_vec();
    args.extend(["--element-bytes", "4", "--replica-memory-fraction", "1.0"]);
    let (ok, err) = replay(&args);
    assert!(ok, "{err}");
}

#[test]
fn ragged_megatron_rows_name_their_line() {
    let dir = tmp("mg");
    let f = dir.join("trace.jsonl");
    std::fs::write(
        &f,
        "{\"step\": 0, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0, 1], [1, 2]]}\n\
         {\"step\": 0, \"layer\": 0, \"rank\": 1, \"top_indices\": [[0, 1], [3]]}\n",
    )
    .unwrap();
    let (ok, err) = replay(&["--megatron", f.to_str().unwrap(), "--experts", "4"]);
    assert!(!ok);
    one_line(
        &err,
        &["trace.jsonl:2:", "row 1 has 1 experts, row 0 has 2"],
    );
    std::fs::write(
        &f,
        "{\"step\": 0, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0, 1]]}\n\
         {\"step\": 0, \"layer\": 0, \"rank\": 1, \"top_indices\": [[0, 1, 2]]}\n",
    )
    .unwrap();
    let (ok, err) = replay(&["--megatron", f.to_str().unwrap(), "--experts", "4"]);
    assert!(!ok);
    one_line(&err, &["trace.jsonl:2:", "line 1 has 2"]);
    // A record written as an array.
    std::fs::write(&f, "[0, 0, 0, [[1]]]\n").unwrap();
    let (ok, err) = replay(&["--megatron", f.to_str().unwrap(), "--experts", "4"]);
    assert!(!ok);
    one_line(&err, &["trace.jsonl:1:", "expected an object"]);
}

#[test]
fn eplb_files_of_the_wrong_shape_say_which_shape_is_expected() {
    let dir = tmp("eplb");
    let f = dir.join("eplb.json");
    for (doc, needle) in [
        ("{\"weights\": [[1, 2]]}", "unknown field `weights`"),
        ("{}", "missing field `weight`"),
        ("[[1, \"a\"]]", "[0][1]"),
        ("3", "got a number"),
        ("{\"weight\": [[1, 2], [3]]}", "layer 1 has 1 experts"),
    ] {
        std::fs::write(&f, doc).unwrap();
        let (ok, err) = replay(&["--eplb", f.to_str().unwrap(), "--ranks", "2"]);
        assert!(!ok, "{doc}");
        one_line(&err, &["eplb.json", needle]);
        assert!(!err.contains("untagged"), "{err}");
    }
}

#[test]
fn an_unwritable_output_folder_says_write() {
    let dir = tmp("ro");
    let blocker = dir.join("file");
    std::fs::write(&blocker, "x").unwrap();
    let out = blocker.join("sub");
    let (ok, err) = replay(&[
        "--synthetic",
        "balanced",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    one_line(&err, &["cannot write"]);
    assert!(!err.contains("cannot read"), "{err}");
}

#[test]
fn a_one_step_trace_draws_bars_per_strategy() {
    let dir = tmp("bars");
    let f = dir.join("eplb.json");
    std::fs::write(&f, "[[10, 200, 30, 40, 500, 60, 70, 80]]").unwrap();
    let out = dir.join("out");
    let (ok, err) = replay(&[
        "--eplb",
        f.to_str().unwrap(),
        "--ranks",
        "4",
        "--experts",
        "8",
        "--budget-mib",
        "100",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let svg = std::fs::read_to_string(out.join("memory.svg")).unwrap();
    for needle in [
        "Fixed",
        "Replication",
        "LRMoE",
        "placement",
        "replicas",
        "token buffers",
        "budget 100 MiB",
    ] {
        assert!(svg.contains(needle), "memory.svg lacks {needle}");
    }
    // No x axis of repeated zeros (the old chart's one-step failure).
    assert!(!svg.contains("0.00"), "{svg}");
    let png = std::fs::read(out.join("memory.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
}

#[test]
fn more_ranks_than_a_replay_models_are_refused_at_once() {
    // A trace of 100 001 ranks would keep the replay busy for hours (a
    // fuzzed trace once did); it is refused before any work.
    let out = tmp("many-ranks").join("out");
    let start = std::time::Instant::now();
    let (ok, err) = replay(&[
        "--synthetic",
        "hot-experts",
        "--ranks",
        "100001",
        "--experts",
        "16",
        "--steps",
        "1",
        "--layers",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    one_line(&err, &["100001 ranks", "100000"]);
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    assert!(!out.exists(), "nothing is written");
}
