//! Host work of one device-executor call (Qwen3-30B-A3B shape, 16384
//! tokens per rank, top-8, 128 experts): the controller, the forward's
//! instance layout, the global selection order, the backward's
//! redistribution and layout at r = 0.25, medians of 20.
//!
//! `cargo run --release -p lrmoe-benches --example hostplan`

use std::time::Instant;

fn ms<T>(f: &mut dyn FnMut() -> anyhow::Result<T>) -> anyhow::Result<(f64, T)> {
    let mut v = Vec::new();
    let mut last = None;
    for _ in 0..20 {
        let t = Instant::now();
        last = Some(f()?);
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(f64::total_cmp);
    let out = last.ok_or_else(|| anyhow::anyhow!("no run"))?;
    Ok((v[v.len() / 2], out))
}

fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--keep-freed") {
        lrmoe::keep_freed_memory();
    }
    let cfg = layer::MoeConfig {
        hidden: 2048,
        ffn: 768,
        n_experts: 128,
        top_k: 8,
        renormalize: true,
    };
    let p = 16384 * 8;
    println!(
        "| ranks | controller | forward layout | global order | redistribution | backward layout |"
    );
    println!("|---|---|---|---|---|---|");
    for world in [1usize, 2, 4] {
        let counts: Vec<Vec<u32>> = (0..world)
            .map(|_| {
                let mut c = vec![(p / 128) as u32; 128];
                c[0] += (p % 128) as u32;
                c
            })
            .collect();
        let planner = layer::DevicePlanner::ratio(&cfg, 0.25);
        let (a, plan) = ms(&mut || Ok(planner.forward(&counts)?))?;
        let local = pack::ep::local_experts(&plan.instances, world);
        let (b, _) = ms(&mut || Ok(pack::ep::instance_layout(&plan.forward, &local, 0)?))?;
        let (c, _) = ms(&mut || Ok(pack::ep::global_order(&counts, 0, p)?))?;
        let kept: Vec<Vec<u32>> = counts
            .iter()
            .map(|c| c.iter().map(|&x| x / 4).collect())
            .collect();
        let (d, split) = ms(&mut || Ok(planner.backward(&plan, &kept)?))?;
        let (e, _) = ms(&mut || Ok(pack::ep::instance_layout(&split, &local, 0)?))?;
        println!("| {world} | {a:.3} | {b:.3} | {c:.3} | {d:.3} | {e:.3} |");
    }
    Ok(())
}
