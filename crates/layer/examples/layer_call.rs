//! One MoE layer call (forward + LRMoE backward keeping half the pairs) on
//! two in-process expert-parallel ranks.

use std::time::Duration;

use layer::{
    backward, forward, run_local, CallConfig, LayerError, MoeConfig, MoeParams, Retention,
};
use quota::Placement;

fn main() -> Result<(), LayerError> {
    let cfg = MoeConfig {
        hidden: 32,
        ffn: 64,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let params = MoeParams::<f32>::init(&cfg, 1);
    let placement = Placement {
        owner: (0..8).map(|e| e / 4).collect(),
        replicas: vec![],
    };
    let call = CallConfig {
        retention: Retention::Ratio(0.5),
        ..CallConfig::default()
    };
    let results = run_local(2, Duration::from_secs(60), |comm| {
        let x: Vec<f32> = (0..256 * cfg.hidden)
            .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
            .collect();
        let (y, saved) = forward(comm, &cfg, &call, &params, &placement, &x)?;
        let (_dx, _grads, stats) = backward(comm, &cfg, &call, &params, &saved, &y)?;
        Ok::<_, LayerError>((stats.kept_pairs, stats.routed_pairs, stats.bytes_sent))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (kept, routed, bytes) = r?;
        println!("rank {rank}: kept {kept} of {routed} pairs, sent {bytes} bytes in the backward");
    }
    Ok(())
}
