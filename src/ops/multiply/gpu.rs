//! Multiply on a GPU: the declaration of kernels/multiply.cu, its checked launches, and the
//! op's GPU form (the product in input order; each input's gradient dy times the others,
//! in order, by the same two kernels).

use cudarc::driver::CudaSlice;

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::{Error, Result};

use super::*;

crate::cuda::declare::kernels! {
    "multiply.cu" {
        multiply {
            fwd(a: In, b: In, y: Out, n: Size);
        }
        multiply_into {
            plain(x: In, y: Out, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = a · b. a, b, y: (n)
    pub fn multiply_fwd(&self, a: &impl DevIn, b: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let (a, b) = (&a.view(), &b.view());
        let y = &mut y.view_mut();
        let n = a.len();
        check_len("multiply_fwd", "b", b, n)?;
        check_len("multiply_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: multiply_fwd_f32(const float*, const float*, float*, size_t); a, b and y
        // hold n floats each (checked above); y is borrowed mutably, so it aliases neither
        // input; a grid-stride loop over indices < n, any grid.
        unsafe { multiply::fwd(self, elem_cfg(n), a, b, y, n) }
    }

    /// y ·= x, in place. x, y: (n)
    pub fn multiply_into(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("multiply_into", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: multiply_into_f32(const float*, float*, size_t); x and y hold n floats
        // each (checked above), and y, borrowed mutably, does not alias x; a grid-stride
        // loop over indices < n, any grid.
        unsafe { multiply_into::plain(self, elem_cfg(n), x, y, n) }
    }

    /// y = ((first · factors[0]) · factors[1]) · ...: `multiply_fwd` then `multiply_into`
    /// of each further factor (at least one factor). first, each factor, y: (n)
    fn product_to(&self, first: &impl DevIn, factors: &[&CudaSlice<f32>], y: &mut impl DevOut) -> Result<()> {
        let Some((second, rest)) = factors.split_first() else {
            return Err(Error::shape("multiply", "a product of one factor"));
        };
        self.multiply_fwd(first, *second, y)?;
        for f in rest {
            self.multiply_into(*f, y)?;
        }
        Ok(())
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &Multiply) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(MultiplyGpu))
}

/// Multiply on a GPU: the product of the inputs in order; each gradient asked for the
/// product of dy and the other inputs in order, read from the network's activations (the
/// forward's inputs, which it keeps for the backward: nothing of the op's own).
pub(super) struct MultiplyGpu;

impl GpuLayer for MultiplyGpu {
    // x, others: K tensors (N, ...) → y: (N, ...), ((x · o0) · o1) · ...
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        if f.others.is_empty() {
            return Err(Error::config("Multiply", format!("{}: takes 2 or more inputs, given 1", f.place.name)));
        }
        f.gpu.product_to(f.x, f.others, f.y)
    }

    // dy: (N, ...) → dx_i = ((dy · x_a) · x_b) · ..., a < b < ... ≠ i, for each asked for
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Backward { gpu, x, others, dy, dx, d_others, .. } = b;
        let inputs: Vec<&CudaSlice<f32>> = std::iter::once(x).chain(others.iter().copied()).collect();
        for (i, d) in std::iter::once(dx).chain(d_others).enumerate() {
            if let Some(mut d) = d {
                let factors: Vec<&CudaSlice<f32>> =
                    inputs.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, &x)| x).collect();
                gpu.product_to(&dy, &factors, &mut d)?;
            }
        }
        Ok(())
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/multiply.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (one rounded product per value, in the CPU's order): three inputs multiplied as
/// the GPU form multiplies them (a forward, and a gradient's dy times the other two), with
/// the values where the two could part (±0, NaN, ±∞, overflow, underflow), under the
/// launch shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_same, uniform};
    let n = 3000;
    let (mut a, mut b, c) = (uniform(1, n), uniform(2, n), uniform(3, n));
    a[..7].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, 1e30, 1e-30, -0.0]);
    b[..7].copy_from_slice(&[-0.0, 5.0, 1.0, 0.0, 1e30, 1e-30, f32::INFINITY]);
    let mut want = vec![0.0; n];
    super::cpu::product_to(&a, &[&b, &c], &mut want);
    for cfg in elem_cfgs(n) {
        let mut y = vec![f32::NAN; n];
        // As Gpu::multiply_fwd pushes them: a, b, y, n; Gpu::multiply_into: x, y, n.
        k.launch(&multiply::FWD, cfg, &mut [In(&a), In(&b), Out(&mut y), U64(n as u64)]);
        k.launch(&multiply_into::PLAIN, cfg, &mut [In(&c), Out(&mut y), U64(n as u64)]);
        // NaN's sign and payload are the operands' order's (0 · ∞ and a NaN input): any NaN
        // matches a NaN.
        assert_same(&format!("multiply y {cfg:?}"), &y, &want);
    }
}
