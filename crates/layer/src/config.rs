//! The layer's shape and weights: [`MoeConfig`], [`MoeParams`] (the
//! router and every expert's [`ExpertWeights`], or their gradients), and
//! the shape check every stage uses. The other modules depend on this one;
//! it depends on none of them.

use kernels::cpu::Real;
use serde::Serialize;

use crate::LayerError;

/// Shape of the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct MoeConfig {
    /// Model width.
    pub hidden: usize,
    /// Expert FFN width.
    pub ffn: usize,
    /// Number of experts.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub renormalize: bool,
}

impl MoeConfig {
    /// Rejects shapes that cannot work.
    pub fn validate(&self) -> Result<(), LayerError> {
        if self.n_experts == 0 {
            return Err(LayerError::Config("n_experts must be at least 1".into()));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(LayerError::Config(format!(
                "top_k = {} must be in 1..={} (n_experts)",
                self.top_k, self.n_experts
            )));
        }
        if self.hidden == 0 || self.ffn == 0 {
            return Err(LayerError::Config(
                "hidden and ffn must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// The three SwiGLU projections of experts in buffers `B`, row-major:
/// one expert's on the host ([`ExpertWeights`]), a rank's block of experts
/// stacked in device buffers (`layer::device`), or their gradients. Per
/// expert, gate and up are `hidden × ffn`, down `ffn × hidden`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Experts<B> {
    /// Gate projections.
    pub gate: B,
    /// Up projections.
    pub up: B,
    /// Down projections.
    pub down: B,
}

impl<B> Experts<B> {
    /// The three buffers, borrowed.
    pub fn as_ref(&self) -> Experts<&B> {
        Experts {
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
        }
    }

    /// `(gate, up, down)`.
    pub fn into_tuple(self) -> (B, B, B) {
        (self.gate, self.up, self.down)
    }
}

/// One expert's SwiGLU weights on the host.
pub type ExpertWeights<T> = Experts<Vec<T>>;

/// All weights of the layer (or their gradients, same shapes).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeParams<T> {
    /// Router, `hidden × n_experts`.
    pub router: Vec<T>,
    /// Experts.
    pub experts: Vec<ExpertWeights<T>>,
}

impl<T: Real> MoeParams<T> {
    /// Zeros of the configured shapes.
    pub fn zeros(cfg: &MoeConfig) -> Self {
        let (h, f) = (cfg.hidden, cfg.ffn);
        Self {
            router: vec![T::zero(); h * cfg.n_experts],
            experts: (0..cfg.n_experts)
                .map(|_| ExpertWeights {
                    gate: vec![T::zero(); h * f],
                    up: vec![T::zero(); h * f],
                    down: vec![T::zero(); f * h],
                })
                .collect(),
        }
    }

    /// Seeded initialisation: uniform in `±1/√fan_in`.
    pub fn init(cfg: &MoeConfig, seed: u64) -> Self {
        let mut p = Self::zeros(cfg);
        let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut fill = |v: &mut [T], fan_in: usize| {
            let scale = 1.0 / (fan_in as f64).sqrt();
            for x in v.iter_mut() {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                *x = T::of((2.0 * u - 1.0) * scale);
            }
        };
        fill(&mut p.router, cfg.hidden);
        for e in &mut p.experts {
            fill(&mut e.gate, cfg.hidden);
            fill(&mut e.up, cfg.hidden);
            fill(&mut e.down, cfg.ffn);
        }
        p
    }

    /// Checks every tensor's length against `cfg`.
    pub fn validate(&self, cfg: &MoeConfig) -> Result<(), LayerError> {
        let (h, f) = (cfg.hidden, cfg.ffn);
        shape("router", h * cfg.n_experts, self.router.len())?;
        shape("experts", cfg.n_experts, self.experts.len())?;
        for (i, e) in self.experts.iter().enumerate() {
            shape(format!("experts[{i}].gate"), h * f, e.gate.len())?;
            shape(format!("experts[{i}].up"), h * f, e.up.len())?;
            shape(format!("experts[{i}].down"), f * h, e.down.len())?;
        }
        Ok(())
    }

    /// Every tensor with its name, mutably (for optimizers and checkpoints).
    pub fn tensors_mut(&mut self) -> Vec<(String, &mut Vec<T>)> {
        let mut v = vec![("router".to_string(), &mut self.router)];
        for (i, e) in self.experts.iter_mut().enumerate() {
            v.push((format!("experts.{i}.gate"), &mut e.gate));
            v.push((format!("experts.{i}.up"), &mut e.up));
            v.push((format!("experts.{i}.down"), &mut e.down));
        }
        v
    }

    /// Every tensor with its name.
    pub fn tensors(&self) -> Vec<(String, &Vec<T>)> {
        let mut v = vec![("router".to_string(), &self.router)];
        for (i, e) in self.experts.iter().enumerate() {
            v.push((format!("experts.{i}.gate"), &e.gate));
            v.push((format!("experts.{i}.up"), &e.up));
            v.push((format!("experts.{i}.down"), &e.down));
        }
        v
    }
}

/// `got == expected`, or the shape error naming `what`.
pub(crate) fn shape(
    what: impl Into<String>,
    expected: usize,
    got: usize,
) -> Result<(), LayerError> {
    if got == expected {
        Ok(())
    } else {
        Err(shape_error(what, expected, got))
    }
}

/// `got >= expected` (a buffer at least that long), or the shape error
/// naming `what` (the stages' buffers).
pub(crate) fn at_least(
    what: impl Into<String>,
    expected: usize,
    got: usize,
) -> Result<(), LayerError> {
    if got >= expected {
        Ok(())
    } else {
        Err(shape_error(what, expected, got))
    }
}

fn shape_error(what: impl Into<String>, expected: usize, got: usize) -> LayerError {
    LayerError::Shape {
        what: what.into(),
        expected,
        got,
    }
}
