//! `lrmoe layer-grad`: one MoE layer's forward and LRMoE backward from
//! tensors in safetensors files, so a user can check this layer against
//! their own (tensor names in `docs/formats.md`).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use layer::{CallConfig, MoeConfig, MoeParams, Retention};
use quota::Placement;

use crate::tensorfile::{self, TensorFileError};

/// Errors of the command.
#[derive(Debug, thiserror::Error)]
pub enum LayerGradError {
    /// A file could not be read, parsed or written.
    #[error(transparent)]
    File(#[from] TensorFileError),
    /// The tensors do not describe one consistent layer.
    #[error("{0}")]
    Inconsistent(String),
    /// The layer rejected its inputs.
    #[error(transparent)]
    Layer(#[from] layer::LayerError),
}

/// Settings of the command.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k weights.
    pub renormalize: bool,
    /// Kept share of each expert's pairs in the backward (1.0: exact).
    pub retention: f64,
}

fn dims2(shape: &[usize], name: &str) -> Result<(usize, usize), LayerGradError> {
    match shape {
        [a, b] => Ok((*a, *b)),
        _ => Err(LayerGradError::Inconsistent(format!(
            "tensor {name} has shape {shape:?}, expected 2 dimensions"
        ))),
    }
}

/// A layer parameter's shape by its name: the router `hidden × E`, a down
/// projection `ffn × hidden`, gate and up `hidden × ffn`.
fn param_shape(name: &str, hidden: usize, ffn: usize, n_experts: usize) -> Vec<usize> {
    match name.rsplit('.').next() {
        Some("router") => vec![hidden, n_experts],
        Some("down") => vec![ffn, hidden],
        _ => vec![hidden, ffn],
    }
}

/// The layer's shape and parameters from `weights`, and `x` and `dy` from
/// `inputs`, every tensor checked against the shape the router and the
/// first expert give.
#[allow(clippy::type_complexity)]
fn read_inputs(
    weights: &Path,
    inputs: &Path,
    opts: &Options,
) -> Result<(MoeConfig, MoeParams<f32>, Vec<f32>, Vec<f32>), LayerGradError> {
    let mut w = tensorfile::load(weights)?;
    let mut x = tensorfile::load(inputs)?;
    let (hidden, n_experts) = dims2(w.shape("router")?, "router")?;
    let (_, ffn) = dims2(w.shape("experts.0.gate")?, "experts.0.gate")?;
    let (n_tok, xh) = dims2(x.shape("x")?, "x")?;
    if xh != hidden {
        return Err(LayerGradError::Inconsistent(format!(
            "x has width {xh}, the router expects {hidden}"
        )));
    }
    let cfg = MoeConfig {
        hidden,
        ffn,
        n_experts,
        top_k: opts.top_k,
        renormalize: opts.renormalize,
    };
    cfg.validate()?;
    let mut params = MoeParams::<f32>::zeros(&cfg);
    for (name, t) in params.tensors_mut() {
        *t = w.take(&name, &param_shape(&name, hidden, ffn, n_experts))?;
    }
    let xs = x.take("x", &[n_tok, hidden])?;
    let dy = x.take("dy", &[n_tok, hidden])?;
    Ok((cfg, params, xs, dy))
}

/// Runs the command.
pub fn run(
    weights: &Path,
    inputs: &Path,
    out: &Path,
    opts: &Options,
) -> Result<(), LayerGradError> {
    let (cfg, params, xs, dy) = read_inputs(weights, inputs, opts)?;
    let (hidden, ffn, n_experts) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    let n_tok = xs.len() / hidden;
    let retention = if opts.retention >= 1.0 {
        Retention::Full
    } else {
        Retention::Ratio(opts.retention)
    };
    let call = CallConfig {
        retention,
        ..CallConfig::default()
    };
    let placement = Placement {
        owner: vec![0; n_experts],
        replicas: vec![],
    };
    let mut res = layer::run_local(1, Duration::from_secs(600), |t| {
        let (y, saved) = layer::forward(t, &cfg, &call, &params, &placement, &xs)?;
        let (dx, grads, stats) = layer::backward(t, &cfg, &call, &params, &saved, &dy)?;
        Ok::<_, layer::LayerError>((
            y,
            dx,
            grads,
            stats,
            saved.expert_of_pair().to_vec(),
            saved.gate().to_vec(),
        ))
    });
    let (y, dx, grads, stats, experts, gates) = res.remove(0)?;
    let k = opts.top_k;
    let experts: Vec<f32> = experts.iter().map(|&e| e as f32).collect();
    let kept: Vec<f32> = stats.kept.iter().map(|&b| f32::from(u8::from(b))).collect();
    let mut tensors = vec![
        ("y".to_string(), vec![n_tok, hidden], y.as_slice()),
        ("dx".to_string(), vec![n_tok, hidden], dx.as_slice()),
        ("experts".to_string(), vec![n_tok, k], experts.as_slice()),
        ("gates".to_string(), vec![n_tok, k], gates.as_slice()),
        (
            "scores".to_string(),
            vec![n_tok, k],
            stats.scores.as_slice(),
        ),
        ("kept".to_string(), vec![n_tok, k], kept.as_slice()),
    ];
    for (name, t) in grads.tensors() {
        let shape = param_shape(&name, hidden, ffn, n_experts);
        tensors.push((format!("grad.{name}"), shape, t.as_slice()));
    }
    let mut meta = HashMap::new();
    meta.insert("top_k".into(), k.to_string());
    meta.insert("renormalize".into(), opts.renormalize.to_string());
    meta.insert("retention".into(), opts.retention.to_string());
    meta.insert("kept_pairs".into(), stats.kept_pairs.to_string());
    tensorfile::save(out, &tensors, meta)?;
    Ok(())
}
