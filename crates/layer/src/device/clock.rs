//! A rank's GPU as the clock of timed in-process ranks
//! ([`crate::timeline::Clock`]).

use std::sync::Arc;

use kernels::gpu::{Gpu, Mark};

use crate::timeline::{Clock, Tick};

/// Marks are CUDA events on the GPU's compute stream; memory is the
/// device's stream-ordered pool, which every device buffer here comes from.
#[derive(Clone)]
pub struct GpuClock(pub Arc<Gpu>);

fn mark_of(t: &Tick) -> Result<&Mark, String> {
    t.downcast_ref::<Mark>()
        .ok_or_else(|| "a timeline mark from another clock".to_string())
}

impl Clock for GpuClock {
    fn mark(&self) -> Result<Tick, String> {
        Ok(Box::new(self.0.mark().map_err(|e| e.to_string())?))
    }
    fn seconds(&self, earlier: &Tick, later: &Tick) -> Result<f64, String> {
        let ms = mark_of(later)?
            .ms_since(mark_of(earlier)?)
            .map_err(|e| e.to_string())?;
        Ok(ms * 1e-3)
    }
    fn wait(&self) -> Result<(), String> {
        self.0.sync().map_err(|e| e.to_string())
    }
    fn reset_peak(&self) -> Result<u64, String> {
        self.0.pool_reset_peak().map_err(|e| e.to_string())
    }
    fn usage(&self) -> Result<(u64, u64), String> {
        self.0.pool_usage().map_err(|e| e.to_string())
    }
}
