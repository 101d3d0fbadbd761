//! `lrmoe layer-grad` round trip through safetensors files.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::collections::HashMap;
use std::process::Command;

use lrmoe::tensorfile;

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

#[test]
fn layer_grad_writes_every_gradient_and_the_kept_mask() {
    let dir = std::env::temp_dir().join(format!("lrmoe-lg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (h, f, e, t) = (8usize, 6usize, 4usize, 20usize);
    let router = vals(h * e, 1);
    let mut w: Vec<(String, Vec<usize>, Vec<f32>)> = vec![("router".into(), vec![h, e], router)];
    for i in 0..e {
        w.push((
            format!("experts.{i}.gate"),
            vec![h, f],
            vals(h * f, 10 + i as u32),
        ));
        w.push((
            format!("experts.{i}.up"),
            vec![h, f],
            vals(h * f, 20 + i as u32),
        ));
        w.push((
            format!("experts.{i}.down"),
            vec![f, h],
            vals(f * h, 30 + i as u32),
        ));
    }
    let wv: Vec<_> = w
        .iter()
        .map(|(n, s, d)| (n.clone(), s.clone(), d.as_slice()))
        .collect();
    tensorfile::save(&dir.join("w.safetensors"), &wv, HashMap::new()).unwrap();
    let x = vals(t * h, 7);
    let dy = vals(t * h, 8);
    tensorfile::save(
        &dir.join("x.safetensors"),
        &[
            ("x".into(), vec![t, h], x.as_slice()),
            ("dy".into(), vec![t, h], dy.as_slice()),
        ],
        HashMap::new(),
    )
    .unwrap();
    let layer_grad = |weights: &str, inputs: &str, retention: &str, out: &str| {
        Command::new(env!("CARGO_BIN_EXE_lrmoe"))
            .args(["layer-grad", "--weights"])
            .arg(dir.join(weights))
            .arg("--inputs")
            .arg(dir.join(inputs))
            .arg("--out")
            .arg(dir.join(out))
            .args(["--retention", retention])
            .output()
            .unwrap()
    };
    let run =
        |retention: &str, out: &str| layer_grad("w.safetensors", "x.safetensors", retention, out);
    assert!(run("1.0", "full.safetensors").status.success());
    let mut full = tensorfile::load(&dir.join("full.safetensors")).unwrap();
    for e_i in 0..e {
        full.take(&format!("grad.experts.{e_i}.down"), &[f, h])
            .unwrap();
    }
    full.take("grad.router", &[h, e]).unwrap();
    full.take("y", &[t, h]).unwrap();
    full.take("dx", &[t, h]).unwrap();
    assert!(full
        .take("kept", &[t, 2])
        .unwrap()
        .iter()
        .all(|&k| k == 1.0));
    let scores = full.take("scores", &[t, 2]).unwrap();
    assert!(scores.iter().all(|&s| s.is_finite() && s >= 0.0));

    assert!(run("0.5", "half.safetensors").status.success());
    let mut half = tensorfile::load(&dir.join("half.safetensors")).unwrap();
    let kept = half
        .take("kept", &[t, 2])
        .unwrap()
        .iter()
        .filter(|&&k| k == 1.0)
        .count();
    assert!(
        (15..=25).contains(&kept),
        "kept {kept} of 40 at retention 0.5"
    );

    // A weights file without the router is a one-line error.
    tensorfile::save(&dir.join("bad.safetensors"), &wv[1..], HashMap::new()).unwrap();
    let out = layer_grad("bad.safetensors", "x.safetensors", "1.0", "o.safetensors");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let bad = dir.join("bad.safetensors").display().to_string();
    assert!(
        err.contains(&format!("{bad}: tensor router: missing")),
        "the missing tensor and its file are named: {err}"
    );

    // A NaN in the inputs names the file, the tensor and the element.
    let mut dy_nan = dy.clone();
    dy_nan[5] = f32::NAN;
    tensorfile::save(
        &dir.join("nan.safetensors"),
        &[
            ("x".into(), vec![t, h], x.as_slice()),
            ("dy".into(), vec![t, h], dy_nan.as_slice()),
        ],
        HashMap::new(),
    )
    .unwrap();
    let out = layer_grad("w.safetensors", "nan.safetensors", "1.0", "o.safetensors");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("nan.safetensors: tensor dy: non-finite value NaN at element 5"),
        "{err}"
    );

    // An output that cannot be written says write, not read.
    let blocker = dir.join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let out = run("1.0", "not-a-dir/o.safetensors");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot write") && !err.contains("cannot read"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
