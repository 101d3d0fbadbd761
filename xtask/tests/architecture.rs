//! ARCHITECTURE.md against the workspace: its crate graph equals the
//! dependencies `cargo metadata` reports between workspace packages, and
//! its code map has one `### crates/<name>` heading per crate in `crates/`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

type Graph = BTreeMap<String, BTreeSet<String>>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The graph `cargo metadata` gives: each workspace package's normal
/// dependencies on other workspace packages.
fn metadata_graph() -> Graph {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let name = |v: &serde_json::Value| v["name"].as_str().expect("a name").to_string();
    let names: BTreeSet<String> = packages.iter().map(name).collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(name)
                .filter(|n| names.contains(n))
                .collect();
            (name(p), deps)
        })
        .collect()
}

fn architecture() -> String {
    std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md")
}

/// The crate graph block of ARCHITECTURE.md.
fn documented_graph(doc: &str) -> Graph {
    let section = &doc[doc.find("## Crate graph").expect("a crate graph section")..];
    let block = &section[section.find("```text\n").expect("a text block") + 8..];
    let block = &block[..block.find("```").expect("the block ends")];
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (name, deps) = l.split_once(':').expect("`name: deps` lines");
            (
                name.trim().to_string(),
                deps.split_whitespace().map(str::to_string).collect(),
            )
        })
        .collect()
}

#[test]
fn the_crate_graph_is_the_workspace_s() {
    let doc = documented_graph(&architecture());
    let real = metadata_graph();
    assert_eq!(
        doc, real,
        "ARCHITECTURE.md's crate graph (left) differs from cargo metadata (right)"
    );
}

#[test]
fn every_crate_has_its_heading_in_the_code_map() {
    let doc = architecture();
    let headings: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("### crates/"))
        .map(|s| s.trim().to_string())
        .collect();
    let crates: BTreeSet<String> = std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .filter_map(Result::ok)
        .filter(|e| e.path().join("Cargo.toml").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        headings, crates,
        "code map headings (left) against crates/ (right)"
    );
}
