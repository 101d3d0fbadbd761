//! The device backend: the [`Backend`] contract on one GPU and its
//! [`DeviceComm`]. Every primitive is one `kernels::gpu::Gpu` operation or
//! one collective of `super::comm`.

use std::ops::Range;

use kernels::gpu::{CudaSlice, Download, ExpertsBackward, Gpu, Mark, Routed};
use pack::ep::Runs;

use crate::backend::{Backend, Buf, Elem, Family, Rows, Wts};
use crate::config::Experts;
use crate::LayerError;

use super::comm::{comm_sms, Flight};
use super::DeviceComm;

/// The device's memory: bf16 values in `CudaSlice`s.
pub struct Cuda;

impl Family for Cuda {
    type V = u16;
    type S = f32;
    type Buf<E: Elem> = CudaSlice<E>;
    type Routed = Routed;
    type Rest = ExpertsBackward;
    type Mark = Mark;
}

/// One rank of the device executor: its GPU and how it reaches the other
/// ranks.
#[derive(Clone, Copy)]
pub struct Device<'a> {
    /// The rank's GPU.
    pub gpu: &'a Gpu,
    /// Its communicator.
    pub comm: DeviceComm<'a>,
}

impl<'a> Device<'a> {
    /// The backend of `gpu` reaching its peers through `comm`.
    pub fn new(gpu: &'a Gpu, comm: DeviceComm<'a>) -> Self {
        Self { gpu, comm }
    }
}

fn w3<'a>(w: Wts<'a, Device<'_>>) -> (&'a CudaSlice<u16>, &'a CudaSlice<u16>, &'a CudaSlice<u16>) {
    w.into_tuple()
}

impl Backend for Device<'_> {
    type F = Cuda;
    type Flight<E: Elem> = Flight<E>;
    type Later<'b, E: Elem>
        = Download<'b, E>
    where
        Self: 'b;

    fn check_layer(cfg: &crate::MoeConfig) -> Result<(), LayerError> {
        crate::plan::check_device_shape(cfg)
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn upload<E: Elem>(&self, v: &[E]) -> Result<CudaSlice<E>, LayerError> {
        Ok(self.gpu.upload(v)?)
    }
    fn download<E: Elem>(&self, b: &CudaSlice<E>, n: usize) -> Result<Vec<E>, LayerError> {
        Ok(self.gpu.download(b, n)?)
    }
    fn download_later<E: Elem>(
        &self,
        b: &CudaSlice<E>,
        n: usize,
    ) -> Result<Download<'_, E>, LayerError> {
        Ok(self.gpu.download_later(b, n)?)
    }
    fn wait<E: Elem>(&self, later: Download<'_, E>) -> Result<Vec<E>, LayerError> {
        Ok(later.wait()?)
    }
    fn zeros<E: Elem>(&self, n: usize) -> Result<CudaSlice<E>, LayerError> {
        Ok(self.gpu.zeros(n)?)
    }
    unsafe fn uninit<E: Elem>(&self, n: usize) -> Result<CudaSlice<E>, LayerError> {
        // SAFETY: the caller's contract.
        Ok(unsafe { self.gpu.uninit(n) }?)
    }
    fn len<E: Elem>(b: &CudaSlice<E>) -> usize {
        b.len()
    }
    fn copy<E: Elem>(
        &self,
        from: &CudaSlice<E>,
        a: usize,
        to: &mut CudaSlice<E>,
        at: usize,
        n: usize,
    ) -> Result<(), LayerError> {
        crate::config::at_least("elements to copy", a + n, from.len())?;
        crate::config::at_least("elements to copy into", at + n, to.len())?;
        let v = from.slice(a..a + n);
        let mut t = to.slice_mut(at..at + n);
        Ok(self.gpu.copy(&v, &mut t)?)
    }
    fn add_into(
        &self,
        to: &mut CudaSlice<u16>,
        at: usize,
        from: &CudaSlice<u16>,
        a: usize,
        n: usize,
    ) -> Result<(), LayerError> {
        crate::config::at_least("elements to add", a + n, from.len())?;
        crate::config::at_least("elements to add into", at + n, to.len())?;
        let sum = {
            let x = to.slice(at..at + n);
            let y = from.slice(a..a + n);
            self.gpu.add_views(&x, &y)?
        };
        let mut t = to.slice_mut(at..at + n);
        Ok(self.gpu.copy(&sum.slice(0..n), &mut t)?)
    }
    fn expand(&self, map: &Runs) -> Result<CudaSlice<u32>, LayerError> {
        Ok(self.gpu.expand_runs_dev(&map.flat(), map.step, map.len)?)
    }

    unsafe fn group(
        &self,
        expert: &CudaSlice<u32>,
        keep: Option<&CudaSlice<u8>>,
        seg: Option<&CudaSlice<u32>>,
        base: &[u32],
        n: usize,
        out: usize,
        groups: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>), LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.group(expert, keep, seg, base, n, out, groups) }?)
    }
    unsafe fn gather_rows(
        &self,
        src: &CudaSlice<u16>,
        pair: &CudaSlice<u32>,
        div: usize,
        scale: Option<&CudaSlice<f32>>,
        n_out: usize,
        width: usize,
    ) -> Result<CudaSlice<u16>, LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.gather_scaled(src, pair, div, scale, n_out, width) }?)
    }
    unsafe fn gather32<E: Elem>(
        &self,
        src: &CudaSlice<E>,
        idx: &CudaSlice<u32>,
        n: usize,
    ) -> Result<CudaSlice<E>, LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.gather32(src, idx, n) }?)
    }
    unsafe fn gather_flags(
        &self,
        src: &CudaSlice<u8>,
        idx: &CudaSlice<u32>,
        n: usize,
    ) -> Result<CudaSlice<u8>, LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.gather_u8_dev(src, idx, n) }?)
    }
    unsafe fn combine_rows(
        &self,
        o: &CudaSlice<u16>,
        row: &CudaSlice<u32>,
        gates: Option<&CudaSlice<f32>>,
        base: Option<&CudaSlice<u16>>,
        dims: (usize, usize, usize),
    ) -> Result<CudaSlice<u16>, LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.combine_rows(o, row, gates, base, dims) }?)
    }

    fn route(
        &self,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        bias: Option<&CudaSlice<f32>>,
        sel_bias: Option<&CudaSlice<f32>>,
        dims: (usize, usize, usize, usize),
        renormalize: bool,
    ) -> Result<Routed, LayerError> {
        Ok(self
            .gpu
            .route(router, x, bias, sel_bias, dims, renormalize)?)
    }
    fn routed_counts(r: &Routed) -> &[u32] {
        &r.counts
    }
    fn routed_experts(r: &Routed) -> &CudaSlice<u32> {
        &r.idx
    }
    fn routed_gates(r: &Routed) -> &CudaSlice<f32> {
        &r.gates
    }
    fn routed_probs(r: &Routed) -> &CudaSlice<f32> {
        &r.probs
    }
    fn routed_tokens(r: &Routed) -> usize {
        r.tokens
    }
    fn col_mean(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        e: usize,
    ) -> Result<CudaSlice<f32>, LayerError> {
        Ok(self.gpu.col_mean(x, t, e)?)
    }
    unsafe fn router_backward(
        &self,
        r: &Routed,
        aux_dp: Option<&CudaSlice<f32>>,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        dy: &CudaSlice<u16>,
        o: &CudaSlice<u16>,
        row: &CudaSlice<u32>,
        h: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u16>), LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe {
            self.gpu
                .router_backward(r, aux_dp, router, x, dy, o, row, h)
        }?)
    }

    fn row_sq(&self, x: &CudaSlice<u16>, n: usize, d: usize) -> Result<CudaSlice<f32>, LayerError> {
        Ok(self.gpu.row_sq(x, n, d)?)
    }
    unsafe fn scores_from_norms(
        &self,
        gates: &CudaSlice<f32>,
        dy_sq: &CudaSlice<f32>,
        h_sq: &CudaSlice<f32>,
        src: &CudaSlice<u32>,
        n: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, LayerError> {
        // SAFETY: the caller's contract is the operation's.
        Ok(unsafe { self.gpu.scores_from_norms(gates, dy_sq, h_sq, src, n, k) }?)
    }
    unsafe fn select(
        &self,
        scores: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        offsets: &[u32],
        quotas: &[u32],
        (rule, seed): (lrm_score::Rule, u64),
        err: &mut CudaSlice<u32>,
    ) -> Result<(CudaSlice<u8>, Option<CudaSlice<f32>>), LayerError> {
        let groups = quotas.len();
        crate::config::shape("selection offsets", groups + 1, offsets.len())?;
        if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) {
            return Err(LayerError::Config(
                "selection offsets must ascend from 0".into(),
            ));
        }
        let n = offsets[groups] as usize;
        let (god, qd) = (self.gpu.upload(offsets)?, self.gpu.upload(quotas)?);
        // Top-q by score, or priority sampling: top-q by key, weights from
        // the threshold (the key kept at q + 1 but not at q).
        let keys = match rule {
            lrm_score::Rule::TopQ => None,
            lrm_score::Rule::Priority => Some(self.gpu.priority_keys_dev(scores, ids, seed, n)?),
            other => {
                return Err(LayerError::Config(format!(
                    "the {} selection rule runs on the host executor only",
                    other.name()
                )))
            }
        };
        let by = keys.as_ref().unwrap_or(scores);
        let mut select = |q: &CudaSlice<u32>| -> Result<CudaSlice<u8>, LayerError> {
            // SAFETY: the selection writes a flag for every row.
            let mut kept = unsafe { self.gpu.uninit::<u8>(n) }?;
            // SAFETY: offsets has `groups + 1` ascending entries ending at
            // n (the caller's rows: scores, ids); q holds `groups`.
            unsafe { (self.gpu).launch_select(by, ids, &god, q, &mut kept, &mut *err, groups) }?;
            Ok(kept)
        };
        let kept = select(&qd)?;
        let weights = match &keys {
            Some(rho) => {
                let more: Vec<u32> = quotas.iter().map(|q| q.saturating_add(1)).collect();
                let kept1 = select(&self.gpu.upload(&more)?)?;
                // SAFETY: offsets ascends from 0 to n (checked above), the
                // rows every buffer holds.
                Some(unsafe {
                    (self.gpu).priority_weights_dev(rho, scores, (&kept, &kept1), &god, n, groups)
                }?)
            }
            None => None,
        };
        Ok((kept, weights))
    }
    fn mul(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, LayerError> {
        Ok(self.gpu.mul_f32_dev(a, b, n)?)
    }
    fn kept_counts(
        &self,
        key: &CudaSlice<u32>,
        keep: &CudaSlice<u8>,
        n: usize,
        groups: usize,
    ) -> Result<CudaSlice<u32>, LayerError> {
        Ok(self.gpu.kept_counts_dev(key, keep, n, groups)?)
    }

    #[allow(clippy::type_complexity)]
    fn experts_forward(
        &self,
        offsets: &[u32],
        x: &CudaSlice<u16>,
        rows: Range<usize>,
        w: Wts<'_, Self>,
        dims: (usize, usize),
        keep: bool,
    ) -> Result<(Rows<Self>, Buf<Self, f32>, Option<(Rows<Self>, Rows<Self>)>), LayerError> {
        crate::config::at_least("expert rows", rows.end, x.len())?;
        let v = x.slice(rows);
        Ok(if keep {
            let (o, h_sq, ab) = self.gpu.experts_forward_keep(offsets, &v, w3(w), dims)?;
            (o, h_sq, Some(ab))
        } else {
            let (o, h_sq) = self.gpu.experts_forward_dev(offsets, &v, w3(w), dims)?;
            (o, h_sq, None)
        })
    }
    fn experts_backward_data(
        &self,
        offsets: &[u32],
        x: &CudaSlice<u16>,
        ab: Option<(&CudaSlice<u16>, &CudaSlice<u16>)>,
        dd: &CudaSlice<u16>,
        w: Wts<'_, Self>,
        dims: (usize, usize),
    ) -> Result<(CudaSlice<u16>, ExpertsBackward), LayerError> {
        Ok(match ab {
            Some(ab) => self
                .gpu
                .experts_backward_data_from(offsets, ab, dd, w3(w), dims)?,
            None => self
                .gpu
                .experts_backward_data(offsets, x, dd, w3(w), dims)?,
        })
    }
    fn experts_backward_weights(
        &self,
        rest: ExpertsBackward,
        x: &CudaSlice<u16>,
        dd: &CudaSlice<u16>,
    ) -> Result<Experts<CudaSlice<u16>>, LayerError> {
        let (gate, up, down) = self.gpu.experts_backward_weights(rest, x, dd)?;
        Ok(Experts { gate, up, down })
    }

    fn all_gather_counts(&self, mine: &[u32]) -> Result<Vec<Vec<u32>>, LayerError> {
        self.comm.all_gather_counts(mine)
    }
    fn exchange<E: Elem>(
        &self,
        send: CudaSlice<E>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<CudaSlice<E>, LayerError> {
        Ok(self
            .comm
            .exchange(self.gpu, send, send_counts, recv_counts)?)
    }
    fn start<E: Elem>(
        &self,
        sends: Vec<CudaSlice<E>>,
        send_parts: &[(usize, usize, usize)],
        recv: CudaSlice<E>,
        recv_parts: &[(usize, usize)],
    ) -> Result<Flight<E>, LayerError> {
        Ok(self
            .comm
            .start(self.gpu, sends, send_parts, recv, recv_parts)?)
    }
    fn handed<E: Elem>(&self, recv: CudaSlice<E>, sends: Vec<CudaSlice<E>>) -> Flight<E> {
        Flight::Here(recv, sends)
    }
    fn outgoing<E: Elem>(f: &Flight<E>) -> Result<&CudaSlice<E>, LayerError> {
        Ok(f.outgoing()?)
    }
    fn flight_buffers<E: Elem>(
        f: &mut Flight<E>,
    ) -> Result<(&[CudaSlice<E>], &mut CudaSlice<E>), LayerError> {
        Ok(f.buffers_mut()?)
    }
    fn finish<E: Elem>(
        &self,
        f: Flight<E>,
    ) -> Result<(CudaSlice<E>, Vec<CudaSlice<E>>), LayerError> {
        Ok(f.finish()?)
    }
    fn start_sum(&self, buf: CudaSlice<f32>) -> Result<Flight<f32>, LayerError> {
        Ok(self.comm.start_sum(self.gpu, buf)?)
    }
    fn settle(&self) -> Result<(), LayerError> {
        Ok(self.comm.settle()?)
    }
    fn reserve_for_exchange(&self, on: bool) {
        self.gpu
            .set_gemm_sm_reserve(if on { comm_sms(self.comm) } else { 0 });
    }

    fn part(&self, name: &'static str) -> Result<(), LayerError> {
        self.comm.part(name)
    }
    fn joined(&self) -> Result<(), LayerError> {
        self.comm.joined()
    }
    fn mark(&self) -> Result<Mark, LayerError> {
        Ok(self.gpu.mark()?)
    }
    fn comm_mark(&self) -> Result<Option<Mark>, LayerError> {
        Ok(self.comm.mark()?)
    }
    fn ms_between(&self, earlier: &Mark, later: &Mark) -> Result<f64, LayerError> {
        Ok(later.ms_since(earlier)?)
    }
}
