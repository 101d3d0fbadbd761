//! # lrmoe-py — lrmoe for Python (`import lrmoe`)
//!
//! The native half of the `lrmoe` Python package, built by maturin on
//! CPython's stable ABI (one wheel for every CPython ≥ 3.9). It holds no
//! MoE logic of its own: every entry point calls the Rust crates.
//!
//! * [`plan_json`]: a planning problem (the `lrmoe plan` JSON schema,
//!   `docs/formats.md`) in, the same report `lrmoe plan` prints out. The
//!   Python wrapper `lrmoe.plan` builds the problem from NumPy arrays.
//! * [`Layer`]: the MoE layer's host executor on one rank, forward and the
//!   LRMoE backward, over little-endian `f32` buffers (bytes) — the CPU
//!   path of `lrmoe.torch.MoE`. Settings are an `[moe]` section of
//!   `lrmoe train`'s TOML as JSON (`lrmoe::train::MoeSection`), made into a
//!   layer call's settings exactly as the trainer does
//!   (`lrmoe::train::layer_call_config`).
//!
//! * `DeviceLayer` (feature `cuda`, `device.rs`): the device executor on
//!   one GPU over torch's CUDA tensors, zero-copy both ways — the CUDA
//!   path of `lrmoe.torch.MoE`. `lrmoe._lrmoe.cuda` says whether it was
//!   built in.
//!
//! Errors: every library error becomes a Python `ValueError` whose message
//! is the library's one-line error; nothing here panics on bad input.
//!
//! Layouts (row-major `f32`): router `hidden × n_experts`; each expert's
//! `gate` and `up` `hidden × ffn`, `down` `ffn × hidden`, stacked over the
//! experts; tokens `n × hidden`.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use layer::{ExpertWeights, MoeConfig, MoeParams};
use lrmoe::train::MoeSection;
use quota::Placement;

/// A library error as a Python `ValueError` carrying its one line.
fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Plans one layer call: `problem` is the JSON `lrmoe plan --input` reads,
/// `solver` one of `exact`, `ilp`, `greedy`, `policy` (overriding the
/// problem's) `uniform` or `maxmin`. Returns the report `lrmoe plan` prints
/// (JSON).
#[pyfunction]
#[pyo3(signature = (problem, solver = "exact", policy = None, ilp_time_limit_ms = 2000))]
fn plan_json(
    py: Python<'_>,
    problem: &str,
    solver: &str,
    policy: Option<&str>,
    ilp_time_limit_ms: u64,
) -> PyResult<String> {
    let solver = match solver {
        "exact" => redistribute::Solver::Exact,
        "ilp" => redistribute::Solver::Ilp,
        "greedy" => redistribute::Solver::Greedy,
        other => {
            return Err(value_error(format!(
                "solver: unknown '{other}' (exact, ilp or greedy)"
            )))
        }
    };
    let policy = match policy {
        None => None,
        Some("uniform") => Some(quota::Policy::Uniform),
        Some("maxmin") => Some(quota::Policy::Maxmin),
        Some(other) => {
            return Err(value_error(format!(
                "policy: unknown '{other}' (uniform or maxmin)"
            )))
        }
    };
    if ilp_time_limit_ms == 0 {
        return Err(value_error("ilp_time_limit_ms: must be at least 1"));
    }
    let problem = lrmoe::plan::parse_problem(problem).map_err(value_error)?;
    let opts = lrmoe::plan::Options {
        solver,
        policy,
        ilp_time_limit: Duration::from_millis(ilp_time_limit_ms),
    };
    let report = py
        .detach(|| lrmoe::plan::run(&problem, &opts))
        .map_err(value_error)?;
    serde_json::to_string(&report).map_err(value_error)
}

/// Little-endian `f32` values from `bytes`, `expected` of them (`what`
/// names the buffer in the error).
fn f32s(what: &str, bytes: &[u8], expected: usize) -> PyResult<Vec<f32>> {
    if bytes.len() != expected * 4 {
        return Err(value_error(format!(
            "{what}: {} bytes, expected {expected} float32 values ({} bytes)",
            bytes.len(),
            expected * 4
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// `values` as little-endian bytes.
fn to_bytes<'py>(py: Python<'py>, values: &[f32]) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    PyBytes::new(py, &out)
}

/// A one-rank layer's shape and `[moe]` settings (JSON), checked: what
/// `Layer` and `DeviceLayer` are made from.
fn layer_setup(
    (hidden, ffn, n_experts, top_k, renormalize): (usize, usize, usize, usize, bool),
    settings: &str,
) -> PyResult<(MoeConfig, MoeSection)> {
    let cfg = MoeConfig {
        hidden,
        ffn,
        n_experts,
        top_k,
        renormalize,
    };
    cfg.validate().map_err(value_error)?;
    if hidden == 0 || ffn == 0 {
        return Err(value_error("hidden and ffn must be at least 1"));
    }
    // The module is one rank: its experts all live here.
    let moe = lrmoe::train::moe_section_from_json(settings, n_experts).map_err(value_error)?;
    Ok((cfg, moe))
}

/// The forward's state, kept for the backward (opaque to Python).
#[pyclass(module = "lrmoe._lrmoe")]
struct Saved {
    inner: layer::Saved<f32>,
    call: layer::CallConfig,
    tokens: usize,
}

#[pymethods]
impl Saved {
    /// Pairs per expert of this call that reached it (a capacity
    /// factor's dropped pairs not counted).
    fn expert_load(&self) -> Vec<u64> {
        self.inner.expert_load()
    }

    /// The call's auxiliary load-balancing loss (0 when off).
    fn aux_loss(&self) -> f64 {
        self.inner.aux_loss()
    }

    /// Tokens of the call.
    #[getter]
    fn tokens(&self) -> usize {
        self.tokens
    }
}

/// The MoE layer on one rank, on the host executor.
#[pyclass(module = "lrmoe._lrmoe", frozen)]
struct Layer {
    cfg: MoeConfig,
    moe: MoeSection,
    seed: u64,
}

impl Layer {
    /// The weights from their buffers, checked against the shapes.
    fn params(&self, weights: [&[u8]; 4]) -> PyResult<MoeParams<f32>> {
        let (h, f, e) = (self.cfg.hidden, self.cfg.ffn, self.cfg.n_experts);
        let [router, gate, up, down] = weights;
        let router = f32s("router", router, h * e)?;
        let (gate, up, down) = (
            f32s("gate", gate, e * h * f)?,
            f32s("up", up, e * h * f)?,
            f32s("down", down, e * f * h)?,
        );
        let hf = h * f;
        let experts = (0..e)
            .map(|i| ExpertWeights {
                gate: gate[i * hf..(i + 1) * hf].to_vec(),
                up: up[i * hf..(i + 1) * hf].to_vec(),
                down: down[i * hf..(i + 1) * hf].to_vec(),
            })
            .collect();
        Ok(MoeParams { router, experts })
    }

    /// One rank owning every expert.
    fn placement(&self) -> Placement {
        Placement {
            owner: vec![0; self.cfg.n_experts],
            replicas: vec![],
        }
    }
}

#[pymethods]
impl Layer {
    /// A layer of the given shape; `settings` is a JSON object of `[moe]`
    /// keys (`mode`, `buffer_fraction`, `selection_rule`, `policy`,
    /// `capacity_factor`, `surplus_only`, `aux_loss_coeff`, `tile_trim`,
    /// …); `seed` seeds the random selection rules.
    #[new]
    #[pyo3(signature = (hidden, ffn, n_experts, top_k, renormalize, settings = "{}", seed = 0))]
    fn new(
        hidden: usize,
        ffn: usize,
        n_experts: usize,
        top_k: usize,
        renormalize: bool,
        settings: &str,
        seed: u64,
    ) -> PyResult<Self> {
        let (cfg, moe) = layer_setup((hidden, ffn, n_experts, top_k, renormalize), settings)?;
        Ok(Self { cfg, moe, seed })
    }

    /// The forward on `x` (`tokens × hidden`) with the weights `router`,
    /// `gate`, `up`, `down`: the output rows (bytes) and the state the
    /// backward needs. `expert_bias` (one per expert) is the
    /// auxiliary-loss-free balancing bias of this call, if any.
    #[pyo3(signature = (router, gate, up, down, x, expert_bias = None))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        router: &[u8],
        gate: &[u8],
        up: &[u8],
        down: &[u8],
        x: &[u8],
        expert_bias: Option<Vec<f64>>,
    ) -> PyResult<(Bound<'py, PyBytes>, Saved)> {
        let params = self.params([router, gate, up, down])?;
        if x.len() % (4 * self.cfg.hidden) != 0 {
            return Err(value_error(format!(
                "x: {} bytes is not a whole number of rows of {} float32 values",
                x.len(),
                self.cfg.hidden
            )));
        }
        let tokens = x.len() / 4 / self.cfg.hidden;
        let xs = f32s("x", x, tokens * self.cfg.hidden)?;
        let placement = self.placement();
        let pairs = (tokens * self.cfg.top_k) as f64;
        let shape = (self.cfg.hidden, self.cfg.ffn);
        let mut call =
            lrmoe::train::layer_call_config(&self.moe, shape, pairs, &placement, false, self.seed);
        if let Some(b) = expert_bias {
            call.expert_bias = b;
        }
        let cfg = self.cfg;
        let mut res = py.detach(|| {
            layer::run_local(1, Duration::from_secs(3600), |t| {
                layer::forward(t, &cfg, &call, &params, &placement, &xs)
            })
        });
        let (y, inner) = res
            .pop()
            .ok_or_else(|| value_error("the layer returned nothing"))?
            .map_err(value_error)?;
        Ok((
            to_bytes(py, &y),
            Saved {
                inner,
                call,
                tokens,
            },
        ))
    }

    /// The LRMoE backward of `saved` for the output gradient `dy`: the
    /// input gradient and the weights' gradients (bytes, the weights'
    /// layouts), and the call's statistics (JSON: routed and kept pairs,
    /// kept fraction, expert load, buffer bytes).
    #[allow(clippy::type_complexity)]
    fn backward<'py>(
        &self,
        py: Python<'py>,
        weights: (&[u8], &[u8], &[u8], &[u8]),
        saved: &Saved,
        dy: &[u8],
    ) -> PyResult<(Vec<Bound<'py, PyBytes>>, String)> {
        let params = self.params([weights.0, weights.1, weights.2, weights.3])?;
        let dy = f32s("dy", dy, saved.tokens * self.cfg.hidden)?;
        let cfg = self.cfg;
        let mut res = py.detach(|| {
            layer::run_local(1, Duration::from_secs(3600), |t| {
                layer::backward(t, &cfg, &saved.call, &params, &saved.inner, &dy)
            })
        });
        let (dx, grads, stats) = res
            .pop()
            .ok_or_else(|| value_error("the layer returned nothing"))?
            .map_err(value_error)?;
        let mut out = vec![to_bytes(py, &dx), to_bytes(py, &grads.router)];
        for pick in [
            |w: &ExpertWeights<f32>| w.gate.clone(),
            |w: &ExpertWeights<f32>| w.up.clone(),
            |w: &ExpertWeights<f32>| w.down.clone(),
        ] {
            let flat: Vec<f32> = grads.experts.iter().flat_map(pick).collect();
            out.push(to_bytes(py, &flat));
        }
        let stats = serde_json::json!({
            "routed_pairs": stats.routed_pairs,
            "kept_pairs": stats.kept_pairs,
            "kept_fraction": if stats.routed_pairs == 0 { 1.0 } else {
                stats.kept_pairs as f64 / stats.routed_pairs as f64
            },
            "expert_load": stats.expert_load,
            "buffer_bytes": stats.buffer_bytes,
            "kept": stats.kept,
        });
        Ok((out, stats.to_string()))
    }
}

#[cfg(feature = "cuda")]
mod device;

/// The native module `lrmoe._lrmoe`.
#[pymodule]
fn _lrmoe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_class::<Layer>()?;
    m.add_class::<Saved>()?;
    #[cfg(feature = "cuda")]
    {
        m.add_class::<device::DeviceLayer>()?;
        m.add_class::<device::DeviceSavedPy>()?;
    }
    m.add("cuda", cfg!(feature = "cuda"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
