//! Add on a GPU: the declaration of kernels/add.cu, its checked launches (among them
//! `Gpu::add_into`, y += x, which a graph sums a value's gradients with), and the op's GPU
//! form (the sum in input order; each input's gradient a device copy of dy).

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::{Error, Result};

use super::*;

crate::cuda::declare::kernels! {
    "add.cu" {
        add {
            fwd(a: In, b: In, y: Out, n: Size);
        }
        add_into {
            plain(x: In, y: Out, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = a + b. a, b, y: (n)
    pub fn add_fwd(&self, a: &impl DevIn, b: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let (a, b) = (&a.view(), &b.view());
        let y = &mut y.view_mut();
        let n = a.len();
        check_len("add_fwd", "b", b, n)?;
        check_len("add_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: add_fwd_f32(const float*, const float*, float*, size_t); a, b and y hold n
        // floats each (checked above); y is borrowed mutably, so it aliases neither input;
        // a grid-stride loop over indices < n, any grid.
        unsafe { add::fwd(self, elem_cfg(n), a, b, y, n) }
    }

    /// y += x: one buffer accumulated into another, in place (a value's gradients summed
    /// in a graph, in the graph's fixed order). x, y: (n)
    pub fn add_into(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("add_into", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: add_into_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and y, borrowed mutably, does not alias x; a grid-stride loop
        // over indices < n, any grid.
        unsafe { add_into::plain(self, elem_cfg(n), x, y, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &Add) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(AddGpu))
}

/// Add on a GPU: `add_fwd` of the first two inputs, then `add_into` of each further one;
/// the backward copies dy to every input's gradient asked for.
pub(super) struct AddGpu;

impl GpuLayer for AddGpu {
    // x, others: K tensors (N, ...) → y: (N, ...), ((x + o0) + o1) + ...
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let Some((second, rest)) = f.others.split_first() else {
            return Err(Error::config("Add", format!("{}: takes 2 or more inputs, given 1", f.place.name)));
        };
        f.gpu.add_fwd(f.x, *second, f.y)?;
        for x in rest {
            f.gpu.add_into(*x, f.y)?;
        }
        Ok(())
    }

    // dy: (N, ...) → dx and each of d_others: copies of dy
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Backward { gpu, dy, dx, d_others, .. } = b;
        for mut d in dx.into_iter().chain(d_others.into_iter().flatten()) {
            gpu.stream().memcpy_dtod(&dy, &mut d)?;
        }
        Ok(())
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/add.cu run on the host against the CPU's [`super::cpu`], bit for
/// bit (one rounded addition per value, in the CPU's order): three inputs summed as the GPU
/// form sums them, then y += x, with the values where the two could part (±0, NaN, ±∞, a
/// sum that cancels), under the launch shape the launches use and under a grid too small
/// to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_same, uniform};
    let n = 3000;
    let (mut a, mut b, c) = (uniform(1, n), uniform(2, n), uniform(3, n));
    a[..6].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, 1e8, -1e-30]);
    b[..6].copy_from_slice(&[-0.0, -0.0, 1.0, f32::NEG_INFINITY, -1e8, 1e-30]);
    let mut want = vec![0.0; n];
    super::cpu::sum_to(&a, &[&b, &c], &mut want);
    for cfg in elem_cfgs(n) {
        let mut y = vec![f32::NAN; n];
        // As Gpu::add_fwd pushes them: a, b, y, n; Gpu::add_into: x, y, n.
        k.launch(&add::FWD, cfg, &mut [In(&a), In(&b), Out(&mut y), U64(n as u64)]);
        k.launch(&add_into::PLAIN, cfg, &mut [In(&c), Out(&mut y), U64(n as u64)]);
        // NaN's payload is the operands' order's (the CPU's vector add and the host's
        // scalar one may differ there alone): any NaN matches a NaN.
        assert_same(&format!("add y {cfg:?}"), &y, &want);
        // y += x on its own, as a graph sums gradients with it: onto values of its own.
        let (mut y, mut want) = (b.clone(), b.clone());
        super::cpu::sum_into(&mut want, &[&a]);
        k.launch(&add_into::PLAIN, cfg, &mut [In(&a), Out(&mut y), U64(n as u64)]);
        assert_same(&format!("add_into {cfg:?}"), &y, &want);
    }
}
