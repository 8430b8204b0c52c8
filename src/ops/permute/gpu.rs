//! Permute on a GPU: the declaration of kernels/permute.cu, its checked launches, the op's
//! GPU form (which chooses a move from one sample's reduced plan, as the CPU does), and the
//! check of the kernels on the host against the CPU's.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::cpu::Plan;
use super::Permute;
use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, MAX_BLOCKS};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};

crate::cuda::declare::kernels! {
    "permute.cu" {
        permute {
            fwd(x: In, y: Out, n: Size, per: Size, rank: I32, geom: InU32);
            bwd(dy: In, dx: Out, n: Size, per: Size, rank: I32, geom: InU32);
        }
        permute_tiled {
            fwd(x: In, y: Out, batches: Size, rows: I32, cols: I32);
            bwd(dy: In, dx: Out, batches: Size, rows: I32, cols: I32);
        }
    }
}

/// The side of the tiled kernels' tile: PERMUTE_TILE in kernels/permute.cu.
const TILE: usize = 32;

/// The tiled kernels' launch: (32, 8) threads, one block a tile (at most MAX_BLOCKS; each
/// block then takes every gridDim-th tile).
fn tiled_cfg(batches: usize, rows: usize, cols: usize) -> LaunchConfig {
    let tiles = batches * rows.div_ceil(TILE) * cols.div_ceil(TILE);
    let blocks = tiles.clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (TILE as u32, 8, 1), shared_mem_bytes: 0 }
}

/// One sample's reduced plan on the device, as the gathers read it: its output dimensions,
/// then each output axis's stride in the sample. Made only from a [`Plan`], kept beside
/// it, so that a launch's bounds can be checked against the plan it reads.
pub struct PlanOnDevice {
    plan: Plan,
    geom: CudaSlice<u32>,
}

impl PlanOnDevice {
    /// `plan` copied to the device, or an error where a sample's size does not fit the
    /// kernels' unsigned.
    pub fn new(gpu: &Gpu, plan: &Plan) -> Result<PlanOnDevice> {
        let host = geometry(plan)?;
        Ok(PlanOnDevice { plan: plan.clone(), geom: gpu.stream().clone_htod(&host)? })
    }
}

/// What the gathers read of `plan`: (rank) output dimensions, then (rank) strides.
fn geometry(plan: &Plan) -> Result<Vec<u32>> {
    let big = |v: usize| {
        u32::try_from(v).map_err(|_| Error::shape("permute", format!("a sample of {} values: above 2^32", plan.len())))
    };
    big(plan.len())?;
    plan.out_dims().into_iter().chain(plan.src_strides()).map(big).collect()
}

/// How one sample's plan is moved: as it is (the identity), as a batch of transposes, or by
/// the gather.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    Copy,
    /// Each sample is `lead` matrices (rows, cols), transposed.
    Tiled {
        lead: usize,
        rows: usize,
        cols: usize,
    },
    Gather,
}

impl Move {
    fn of(plan: &Plan) -> Move {
        match (&plan.dims[..], &plan.perm[..]) {
            (_, [] | [_]) => Move::Copy,
            (&[rows, cols], [1, 0]) => Move::Tiled { lead: 1, rows, cols },
            (&[lead, rows, cols], [0, 2, 1]) => Move::Tiled { lead, rows, cols },
            _ => Move::Gather,
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x permuted by `plan`, sample by sample. x: (n, per) → y: (n, per), per the
    /// plan's size. Backward: the inverse plan's, dy → dx (`backward` true).
    pub fn permute_gather(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        n: usize,
        plan: &PlanOnDevice,
        backward: bool,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = if backward { "permute_bwd" } else { "permute_fwd" };
        let per = plan.plan.len();
        let rank = dim(op, "rank", plan.plan.perm.len())?;
        check_len(op, "x", x, n * per)?;
        check_len(op, "y", y, n * per)?;
        check_len(op, "geom", &plan.geom, 2 * plan.plan.perm.len())?;
        if n * per == 0 {
            return Ok(());
        }
        let geom = &plan.geom.as_view();
        // SAFETY: permute_{fwd,bwd}_f32(const float*, float*, size_t, size_t, int, const
        // unsigned*); x and y hold n·per floats and geom 2·rank values (checked), geom made
        // from a Plan of `per` values (PlanOnDevice::new): every output place's offset in its
        // sample is below per, so the kernel reads x and writes y below n·per.
        unsafe {
            if backward {
                permute::bwd(self, elem_cfg(n * per), x, y, n, per, rank, geom)
            } else {
                permute::fwd(self, elem_cfg(n * per), x, y, n, per, rank, geom)
            }
        }
    }

    /// y = each (rows, cols) matrix of x transposed. x: (batches, rows, cols) → y:
    /// (batches, cols, rows). The backward (`backward` true) runs the kernel of the backward,
    /// given dy's (rows, cols): the forward's (cols, rows).
    pub fn permute_tiled(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        (batches, rows, cols): (usize, usize, usize),
        backward: bool,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = if backward { "permute_tiled_bwd" } else { "permute_tiled_fwd" };
        let (r, c) = (dim(op, "rows", rows)?, dim(op, "cols", cols)?);
        let len = batches * rows * cols;
        check_len(op, "x", x, len)?;
        check_len(op, "y", y, len)?;
        if len == 0 {
            return Ok(());
        }
        let cfg = tiled_cfg(batches, rows, cols);
        // SAFETY: permute_tiled_{fwd,bwd}_f32(const float*, float*, size_t, int, int); x and
        // y hold batches·rows·cols floats (checked), and the kernel reads and writes only
        // places (b, r, c) with r < rows, c < cols of its tiles, b < batches.
        unsafe {
            if backward {
                permute_tiled::bwd(self, cfg, x, y, batches, r, c)
            } else {
                permute_tiled::fwd(self, cfg, x, y, batches, r, c)
            }
        }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Permute) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(PermuteGpu { perm: layer.sample_perm(), plans: None }))
}

/// Permute on a GPU: one sample's plan and its inverse, reduced as the CPU reduces them,
/// moved by `permute_tiled` where they are a batch of transposes, else by `permute_gather`
/// (the identity by a copy).
struct PermuteGpu {
    /// The per-sample permutation, 0-based.
    perm: Vec<usize>,
    /// The forward's and the backward's plans on the device, made by the first `reserve`
    /// (they do not depend on the batch).
    plans: Option<(PlanOnDevice, PlanOnDevice)>,
}

impl PermuteGpu {
    fn pass(&self, gpu: &Gpu, x: &impl DevIn, y: &mut impl DevOut, n: usize, backward: bool) -> Result<()> {
        let (fwd, bwd) = self.plans.as_ref().expect("reserved before the pass");
        let plan = if backward { bwd } else { fwd };
        match Move::of(&plan.plan) {
            Move::Copy => Ok(gpu.stream().memcpy_dtod(&x.view(), &mut y.view_mut())?),
            Move::Tiled { lead, rows, cols } => gpu.permute_tiled(x, y, (n * lead, rows, cols), backward),
            Move::Gather => gpu.permute_gather(x, y, n, plan, backward),
        }
    }
}

impl GpuLayer for PermuteGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, _n: usize) -> Result<()> {
        if self.plans.is_none() {
            let plan = Plan::new(place.input.dims(), &self.perm);
            self.plans = Some((PlanOnDevice::new(gpu, &plan)?, PlanOnDevice::new(gpu, &plan.inverse())?));
        }
        Ok(())
    }

    // x: (N, ...) → y: (N, ...) permuted
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        self.pass(f.gpu, f.x, f.y, f.n, false)
    }

    // dy: (N, ...) permuted → dx: (N, ...)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        self.pass(b.gpu, &b.dy, &mut dx, b.n, true)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/permute.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (moves): the gathers on plans of 2 to 4 axes with ragged sizes (through the
/// forward's plan and the inverse's), the tiled kernels on transposes with ragged edges and
/// several batches, each under its launch's shape and under a grid too small to cover the
/// data. The GPU form's choice of move is checked on the plans it sees.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use super::cpu::permute;
    use crate::cuda::host::{elem_cfg, In, InU32, Out, FEW, I32, U64};
    use crate::testing::{assert_bits, uniform};
    // The GPU form's moves: the reduced plans of common permutations of (N, ...) samples.
    assert_eq!(Move::of(&Plan::new(&[5, 4, 8], &[1, 0, 2])), Move::Gather, "(T, H, D) → (H, T, D)");
    assert_eq!(Move::of(&Plan::new(&[3, 5, 7], &[0, 2, 1])), Move::Tiled { lead: 3, rows: 5, cols: 7 });
    assert_eq!(Move::of(&Plan::new(&[3, 4, 5], &[1, 2, 0])), Move::Tiled { lead: 1, rows: 3, cols: 20 });
    assert_eq!(Move::of(&Plan::new(&[3, 1, 5], &[1, 0, 2])), Move::Copy);
    for (seed, (n, dims, perm)) in (61..).zip([
        (3, vec![5, 4, 8], vec![1, 0, 2]),
        (2, vec![3, 4, 5, 6], vec![3, 1, 0, 2]),
        (4, vec![7, 9], vec![1, 0]),
        (2, vec![2, 3, 5, 7], vec![2, 0, 3, 1]),
    ]) {
        let plan = Plan::new(&dims, &perm);
        let per = plan.len();
        let x = uniform(seed, n * per);
        for (what, plan, kernel) in [("fwd", plan.clone(), &permute::FWD), ("bwd", plan.inverse(), &permute::BWD)] {
            let mut want = vec![0.0; n * per];
            for (xs, ws) in x.chunks_exact(per).zip(want.chunks_exact_mut(per)) {
                permute(xs, &plan, ws);
            }
            let geom = geometry(&plan).unwrap();
            for cfg in [elem_cfg(n * per), FEW] {
                let mut y = vec![f32::NAN; n * per];
                // As Gpu::permute_gather pushes them: x, y, n, per, rank, geom.
                let rank = I32(plan.perm.len() as i32);
                k.launch(kernel, cfg, &mut [In(&x), Out(&mut y), U64(n as u64), U64(per as u64), rank, InU32(&geom)]);
                assert_bits(&format!("permute {what} {n} × {dims:?} by {perm:?} {cfg:?}"), &y, &want);
            }
        }
    }
    for (seed, (batches, rows, cols)) in (71..).zip([(3, 40, 70), (1, 5, 33), (2, 64, 32), (5, 1, 9)]) {
        let len = batches * rows * cols;
        let x = uniform(seed, len);
        for (what, (r, c), kernel) in
            [("fwd", (rows, cols), &permute_tiled::FWD), ("bwd", (cols, rows), &permute_tiled::BWD)]
        {
            let mut want = vec![0.0; len];
            let plan = Plan { dims: vec![batches, r, c], perm: vec![0, 2, 1] };
            permute(&x, &plan, &mut want);
            for cfg in [tiled_cfg(batches, r, c).into(), FEW] {
                let mut y = vec![f32::NAN; len];
                // As Gpu::permute_tiled pushes them: x, y, batches, rows, cols.
                k.launch(kernel, cfg, &mut [In(&x), Out(&mut y), U64(batches as u64), I32(r as i32), I32(c as i32)]);
                assert_bits(&format!("permute_tiled {what} {batches} × ({r}, {c}) {cfg:?}"), &y, &want);
            }
        }
    }
}
