//! The device scripts run only on a GPU machine, where a syntax error costs
//! a device call: every `benches/*.sh` must parse (`bash -n`), and every
//! script and Python file here must be named in `benches/README.md`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bench_files(ext: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("benches/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    files.sort();
    files
}

#[test]
fn every_script_parses() {
    let scripts = bench_files("sh");
    assert!(scripts.len() > 10, "{scripts:?}");
    let mut bad = Vec::new();
    for s in &scripts {
        let out = Command::new("bash")
            .arg("-n")
            .arg(s)
            .output()
            .expect("bash runs");
        if !out.status.success() {
            bad.push(format!(
                "{}: {}",
                s.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "scripts that do not parse:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_script_is_in_the_readme() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("benches/README.md");
    let missing: Vec<String> = bench_files("sh")
        .into_iter()
        .chain(bench_files("py"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|name| !readme.contains(name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "not named in benches/README.md: {missing:?}"
    );
}
