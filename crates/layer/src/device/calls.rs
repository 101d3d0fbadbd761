//! The device executor's entry points: the layer's stages
//! (`crate::stages`) on the device backend ([`Device`]).

use kernels::gpu::{CudaSlice, Gpu};

use crate::config::MoeConfig;
use crate::plan::DevicePlanner;
use crate::stages::common::Held;
use crate::stages::Saved;
use crate::LayerError;

use super::backend::{Cuda, Device};
use super::weights::DeviceWeights;
use super::{DeviceComm, DeviceGrads};

/// Forward state kept for the backward on the device: the source's
/// routing, outputs and norms, and, in calls without replicas, the owner's
/// forward rows.
pub type DeviceSaved = Saved<Cuda>;

/// The forward on this rank's tokens `x` (`tokens × hidden`, bf16 on the
/// device); every rank calls it with the same layer, the same tokens per
/// rank and a planner that answers alike on every rank.
pub fn forward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    w: &DeviceWeights,
    x: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceSaved, LayerError> {
    crate::stages::forward::forward(&Device::new(gpu, comm), cfg, w, x, planner)
}

/// The LRMoE backward for `dy` (this rank's tokens, `tokens × hidden`):
/// expert `e` keeps `plan.quotas[e]` pairs over all sources by LRM score
/// (top-q, or priority sampling with the plan's seed); the planner splits
/// the kept pairs over the instances; only kept rows travel and are
/// multiplied. `sv` stays whole: the backward may run again on it.
pub fn backward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &DeviceSaved,
    dy: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceGrads, LayerError> {
    let own = sv.owned_rows.as_ref().map(Held::Borrowed);
    crate::stages::backward::backward(&Device::new(gpu, comm), w, (sv, own), dy, planner)
}

/// [`backward`], releasing the owner's forward rows (`hidden` values per
/// routed pair, the largest part of `sv`) as soon as the kept rows are
/// gathered from them, as autograd frees a saved tensor once its backward
/// has read it: at `r < 1` the backward's peak holds only the kept rows.
/// Equal results. Another backward of the same `sv` still runs (it takes
/// its `x` rows from the input, as a call with replicas does); on several
/// ranks every rank must call the same one of the two.
pub fn backward_releasing(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &mut DeviceSaved,
    dy: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceGrads, LayerError> {
    let own = sv.owned_rows.take().map(|r| Held::Taken(Box::new(r)));
    crate::stages::backward::backward(&Device::new(gpu, comm), w, (sv, own), dy, planner)
}
