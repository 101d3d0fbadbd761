//! Whether the run fits the machine's memory, before it starts.

use crate::model::ModelConfig;

use super::config::TrainConfig;
use super::TrainError;

/// Bytes of host memory one training run needs, roughly and from above:
/// every rank's copy of the weights, AdamW moments and gradients, and one
/// step's activations (attention probabilities, the MoE rows, the logits).
/// `None` when the figure overflows `u64` (then it fits nowhere).
pub fn memory_estimate(cfg: &TrainConfig, mcfg: &ModelConfig) -> Option<u64> {
    let ranks = cfg.moe.ranks as u64;
    let seq = cfg.data.seq_len as u64;
    let n_seq = (cfg.data.batch_size as u64).checked_div(ranks)?;
    let n = n_seq.checked_mul(seq)?;
    let (d, f, v) = (mcfg.d_model as u64, mcfg.ffn as u64, mcfg.vocab as u64);
    let (e, k, l) = (
        mcfg.n_experts as u64,
        mcfg.top_k as u64,
        mcfg.n_layers as u64,
    );
    let heads = mcfg.n_heads as u64;
    let dh = mcfg.head_width() as u64;
    let (qd, kd) = (
        heads.checked_mul(dh)?,
        (mcfg.kv_heads() as u64).checked_mul(dh)?,
    );
    let per_layer_params = d
        .checked_mul(qd.checked_add(kd)?.checked_mul(2)?)?
        .checked_add(
            e.checked_mul(3)?
                .checked_mul(d)?
                .checked_mul(f)?
                .checked_add(d.checked_mul(e)?)?,
        )?;
    let params = per_layer_params
        .checked_mul(l)?
        .checked_add(v.checked_mul(d)?.checked_mul(2)?)?
        .checked_add(seq.checked_mul(d)?)?;
    let attn = n_seq
        .checked_mul(heads)?
        .checked_mul(seq)?
        .checked_mul(seq)?
        .checked_mul(2)?;
    let attn_rows = d
        .checked_mul(8)?
        .checked_add(qd.checked_mul(4)?)?
        .checked_add(kd.checked_mul(4)?)?;
    let rows = n.checked_mul(attn_rows.checked_add(k.checked_mul(d + 4 * f)?)?)?;
    let activations = attn
        .checked_add(rows)?
        .checked_mul(l)?
        .checked_add(n.checked_mul(v)?.checked_mul(2)?)?;
    let elems = params
        .checked_mul(5)?
        .checked_add(activations.checked_mul(2)?)?
        .checked_mul(ranks)?;
    elems.checked_mul(4)
}

/// The machine's memory, bytes (`None` where it cannot be read). Total,
/// not available: memory in use by others may be freed, and some VMs grow
/// their memory as it is used, so only a run that cannot fit at all is
/// refused.
pub(super) fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a configuration whose buffers cannot be allocated here, before
/// any allocation aborts the process.
pub(super) fn check_memory(cfg: &TrainConfig, mcfg: &ModelConfig) -> Result<(), TrainError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let hint = "lower data.seq_len, data.batch_size or the model's sizes";
    match (memory_estimate(cfg, mcfg), machine_memory()) {
        (None, _) => Err(TrainError::Config(format!(
            "the configured sizes overflow any memory ({hint})"
        ))),
        (Some(need), Some(have)) if need > have => Err(TrainError::Config(format!(
            "this run needs about {:.1} GiB of memory, this machine has {:.1} GiB ({hint})",
            gib(need),
            gib(have)
        ))),
        _ => Ok(()),
    }
}
