//! Checkpoint write speed, old against new in one run (issue 28): the same
//! tensors written (a) as before — `safetensors::serialize` into one buffer,
//! then an atomic write — (b) streamed by `tensorfile::save`, and (c) as
//! raw bytes in one `write_all` + fsync (the disk's speed for these bytes).
//! Rounds run the three in a rotating order (the disk here slows down
//! after a few GB in a row, so a fixed order would favour the first); the
//! table gives each round's MiB/s.
//!
//! `cargo run --release -p lrmoe --example checkpoint_write -- [DIR] [MiB] [ROUNDS]`

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use lrmoe::tensorfile;
use safetensors::tensor::{Dtype, TensorView};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(args.get(1).map_or("/tmp/lrmoe-ckpt-bench", String::as_str)).to_path_buf();
    let mib: usize = args.get(2).map_or(Ok(1024), |s| s.parse())?;
    let rounds: usize = args.get(3).map_or(Ok(3), |s| s.parse())?;
    std::fs::create_dir_all(&dir)?;
    // 48 tensors of equal size, values that do not compress.
    let per = mib * (1 << 20) / 4 / 48;
    let mut s = 0x9E37_79B9_u32;
    let data: Vec<Vec<f32>> = (0..48)
        .map(|_| {
            (0..per)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 17;
                    s ^= s << 5;
                    (s as f32) * 1e-9
                })
                .collect()
        })
        .collect();
    let named: Vec<tensorfile::NamedTensor<'_>> = data
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("t{i}"), vec![t.len()], t.as_slice()))
        .collect();
    let bytes = (48 * per * 4) as f64 / (1 << 20) as f64;
    println!("| round | old: serialize + write MiB/s | new: streamed MiB/s | raw write_all + fsync MiB/s | new / raw |");
    println!("|---|---|---|---|---|");
    for round in 1..=rounds {
        let write_old = || -> anyhow::Result<()> {
            let views: Vec<(String, TensorView<'_>)> = named
                .iter()
                .map(|(n, sh, d)| {
                    TensorView::new(Dtype::F32, sh.clone(), bytemuck::cast_slice(d))
                        .map(|v| (n.clone(), v))
                })
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let buf = safetensors::serialize(views, Some(HashMap::new()))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            lrmoe::fsutil::write_atomic(&dir.join("old.safetensors"), &buf)?;
            Ok(())
        };
        let write_new = || -> anyhow::Result<()> {
            tensorfile::save(&dir.join("new.safetensors"), &named, HashMap::new())?;
            Ok(())
        };
        let write_raw = || -> anyhow::Result<()> {
            let mut f = std::fs::File::create(dir.join("raw.bin"))?;
            for t in &data {
                f.write_all(bytemuck::cast_slice(t))?;
            }
            f.sync_all()?;
            Ok(())
        };
        let writers: [&dyn Fn() -> anyhow::Result<()>; 3] = [&write_old, &write_new, &write_raw];
        let mut secs = [0.0; 3];
        for i in 0..3 {
            let w = (i + round) % 3;
            secs[w] = timed(writers[w])?;
        }
        let [old, new, raw] = secs;
        for f in ["old.safetensors", "new.safetensors", "raw.bin"] {
            std::fs::remove_file(dir.join(f))?;
        }
        println!(
            "| {round} | {:.0} | {:.0} | {:.0} | {:.2} |",
            bytes / old,
            bytes / new,
            bytes / raw,
            raw / new
        );
    }
    Ok(())
}

fn timed(f: &dyn Fn() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}
