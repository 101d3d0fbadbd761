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

/// The code of one source file with comments (line and doc comments) and
/// its `#[cfg(test)]` tail (a trailing test module) cut away.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("a source file");
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each top-level module of a crate's `src/` (a file `m.rs` or a folder
/// `m/`, with `m.rs` or `m/mod.rs`) and the top-level modules its code names
/// through `crate::`. The crate root, `tests.rs` and test modules aside.
fn module_graph(src: &Path) -> Graph {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).expect("a source folder").flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut all = Vec::new();
    files(src, &mut all);
    let module = |p: &Path| -> String {
        let rel = p.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a component");
        let s = first.as_os_str().to_string_lossy();
        s.strip_suffix(".rs").unwrap_or(&s).to_string()
    };
    let names: BTreeSet<String> = all
        .iter()
        .map(|p| module(p))
        .filter(|m| !matches!(m.as_str(), "lib" | "main" | "tests" | "bin"))
        .collect();
    let mut graph: Graph = names.iter().map(|n| (n.clone(), BTreeSet::new())).collect();
    for p in &all {
        let m = module(p);
        if !names.contains(&m) {
            continue;
        }
        let code = code_of(p);
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + 7..];
            let id: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if id != m && names.contains(&id) {
                graph.get_mut(&m).expect("a module").insert(id);
            }
        }
    }
    graph
}

/// A cycle of the graph, if it has one (depth-first search).
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        n: &str,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            match state.get(d.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = path.iter().position(|p| p == d).expect("on the path");
                    let mut cycle = path[at..].to_vec();
                    cycle.push(d.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(g, d, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(g, n, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_crate_s_modules_import_each_other_in_a_circle() {
    for e in std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .flatten()
    {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        let g = module_graph(&src);
        assert!(
            find_cycle(&g).is_none(),
            "{}: modules import each other in a circle: {}",
            e.file_name().to_string_lossy(),
            find_cycle(&g).unwrap_or_default().join(" → ")
        );
    }
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    let g: Graph = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(n, d)| (n.to_string(), d.into_iter().map(str::to_string).collect()))
    .collect();
    assert_eq!(
        find_cycle(&g),
        Some(
            vec!["a", "b", "c", "a"]
                .into_iter()
                .map(str::to_string)
                .collect()
        )
    );
    let mut acyclic = g.clone();
    acyclic.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&acyclic), None);
}
