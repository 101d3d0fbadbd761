//! A rank's weights on its device ([`DeviceWeights`]): upload, borrowing
//! another library's buffers, the router biases, and the replica weights
//! a call sends out.

use kernels::cpu::{fan_in_scaled, random_bf16};
use kernels::gpu::{CudaSlice, Gpu};

use crate::config::shape;
use crate::config::{Experts, MoeConfig};
use crate::stages::common::world_of;
use crate::stages::Weights;
use crate::LayerError;

use super::backend::{Cuda, Device};
use super::DeviceComm;

/// One finite value per expert, uploaded.
fn per_expert(
    gpu: &Gpu,
    cfg: &MoeConfig,
    v: &[f32],
    what: &'static str,
) -> Result<CudaSlice<f32>, LayerError> {
    shape(format!("{what} (one per expert)"), cfg.n_experts, v.len())?;
    if v.iter().any(|b| !b.is_finite()) {
        return Err(LayerError::NonFinite(what));
    }
    Ok(gpu.upload(v)?)
}

/// One rank's weights on its device, bf16: the router `H × E` (every rank
/// holds it) and the rank's own experts, `E_l × H × F` (gate, up) and
/// `E_l × F × H` (down).
pub type DeviceWeights = Weights<Cuda>;

/// Uploads one rank's weights (bf16 bits): the full router and the
/// rank's block of experts.
pub fn weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: &[u16],
    (gate, up, down): (&[u16], &[u16], &[u16]),
) -> Result<DeviceWeights, LayerError> {
    let (_, _, el) = world_of(&Device::new(gpu, comm), cfg)?;
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    shape("router", h * e, router.len())?;
    shape("gate (this rank's experts)", el * h * f, gate.len())?;
    shape("up (this rank's experts)", el * h * f, up.len())?;
    shape("down (this rank's experts)", el * f * h, down.len())?;
    Ok(DeviceWeights {
        router: gpu.upload(router)?,
        bias: None,
        sel_bias: None,
        experts: Experts {
            gate: gpu.upload(gate)?,
            up: gpu.upload(up)?,
            down: gpu.upload(down)?,
        },
    })
}

/// Weights whose buffers another library owns (the Python package's
/// torch parameters), borrowed for one call ([`borrow_weights`]):
/// dropping them frees nothing but the biases set on them.
pub struct BorrowedWeights(std::mem::ManuallyDrop<DeviceWeights>);

impl std::ops::Deref for BorrowedWeights {
    type Target = DeviceWeights;
    fn deref(&self) -> &DeviceWeights {
        &self.0
    }
}

impl std::ops::DerefMut for BorrowedWeights {
    fn deref_mut(&mut self) -> &mut DeviceWeights {
        &mut self.0
    }
}

impl Drop for BorrowedWeights {
    fn drop(&mut self) {
        // SAFETY: taken once, here.
        let w = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        // The borrowed buffers go back to their owner unfreed; the biases
        // are this crate's.
        let (gate, up, down) = w.experts.into_tuple();
        for b in [w.router, gate, up, down] {
            let _ = b.leak();
        }
        drop((w.bias, w.sel_bias));
    }
}

/// One rank's weights in device buffers another library owns, by address
/// (bf16): the router `H × E` and the rank's experts' gate, up
/// (`E_l × H × F`) and down (`E_l × F × H`). No copy is made.
///
/// # Safety
///
/// Each address is a live allocation of `gpu`'s context holding at least
/// the stated number of bf16 values, alive and written by no one else while
/// the returned weights, or work queued on them, are in use.
pub unsafe fn borrow_weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: u64,
    (gate, up, down): (u64, u64, u64),
) -> Result<BorrowedWeights, LayerError> {
    let (_, _, el) = world_of(&Device::new(gpu, comm), cfg)?;
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    // SAFETY: the caller's contract, per buffer.
    let take = |p: u64, n: usize| unsafe { gpu.borrow::<u16>(p, n) };
    // Every address checked before any buffer leaves its guard.
    let (router, gate, up, down) = (
        take(router, h * e)?,
        take(gate, el * h * f)?,
        take(up, el * h * f)?,
        take(down, el * f * h)?,
    );
    Ok(BorrowedWeights(std::mem::ManuallyDrop::new(
        DeviceWeights {
            router: router.into_inner(),
            bias: None,
            sel_bias: None,
            experts: Experts {
                gate: gate.into_inner(),
                up: up.into_inner(),
                down: down.into_inner(),
            },
        },
    )))
}

impl Weights<Cuda> {
    /// Zeroed weights of this rank (the router and its block of experts),
    /// for a device-resident optimizer to write in place
    /// ([`DeviceWeights::buffers_mut`]).
    pub fn zeros(gpu: &Gpu, comm: DeviceComm<'_>, cfg: &MoeConfig) -> Result<Self, LayerError> {
        let (_, _, el) = world_of(&Device::new(gpu, comm), cfg)?;
        let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
        Ok(Self {
            router: gpu.zeros::<u16>(h * e)?,
            bias: None,
            sel_bias: None,
            experts: Experts {
                gate: gpu.zeros::<u16>(el * h * f)?,
                up: gpu.zeros::<u16>(el * h * f)?,
                down: gpu.zeros::<u16>(el * f * h)?,
            },
        })
    }

    /// The bf16 router (`H × E`) and this rank's experts' gate, up
    /// (`E_l × H × F`) and down (`E_l × F × H`), writable in place.
    pub fn buffers_mut(&mut self) -> [&mut CudaSlice<u16>; 4] {
        [
            &mut self.router,
            &mut self.experts.gate,
            &mut self.experts.up,
            &mut self.experts.down,
        ]
    }
}

/// Adds `bias[e]` to every token's router logit of expert `e` (one finite
/// value per expert; a constant, so every gradient formula holds): the
/// forced hot-expert workload of `CallConfig::hot_experts`.
pub fn set_logit_bias(
    gpu: &Gpu,
    cfg: &MoeConfig,
    w: &mut DeviceWeights,
    bias: &[f32],
) -> Result<(), LayerError> {
    w.bias = Some(per_expert(gpu, cfg, bias, "router logit bias")?);
    Ok(())
}

/// Adds `bias[e]` to expert `e`'s router probability for the top-k choice
/// only (one finite value per expert; the gates stay unbiased): the
/// auxiliary-loss-free balancing bias of `CallConfig::expert_bias`.
pub fn set_selection_bias(
    gpu: &Gpu,
    cfg: &MoeConfig,
    w: &mut DeviceWeights,
    bias: &[f32],
) -> Result<(), LayerError> {
    w.sel_bias = Some(per_expert(gpu, cfg, bias, "expert selection bias")?);
    Ok(())
}

/// This rank's random weights of the benchmarks (fan-in scaled bf16; the
/// router the same on every rank, each rank's experts its own).
pub fn random_weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
) -> Result<DeviceWeights, LayerError> {
    let (_, _, el) = world_of(&Device::new(gpu, comm), cfg)?;
    let (h, f, e, r) = (cfg.hidden, cfg.ffn, cfg.n_experts, comm.rank() as u64);
    let scale = fan_in_scaled;
    weights(
        gpu,
        comm,
        cfg,
        &scale(random_bf16(h * e, 31), h),
        (
            &scale(random_bf16(el * h * f, 32 + 8 * r), h),
            &scale(random_bf16(el * h * f, 33 + 8 * r), h),
            &scale(random_bf16(el * f * h, 34 + 8 * r), f),
        ),
    )
}
