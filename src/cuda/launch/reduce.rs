//! The checked launch of kernels/reduce.cu: the ordered, scaled sum of K equal buffers,
//! the device-copy exchange's reduction (`exchange::gpu::copies`).
//!
//! Owns: that one safe method, checking src against (K, n) before the typed launch of
//! `cuda::kernels::reduce`. The order of the sum (left to right) is the kernel's.

use super::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::cuda::kernels::reduce;
use crate::Result;

impl Gpu {
    /// `dst = scale * (src[0] + ... + src[K-1])`, left to right. src: (K, n) -> dst: (n)
    pub fn reduce_sum(&self, src: &impl DevIn, dst: &mut impl DevOut, k: usize, scale: f32) -> Result<()> {
        let src = &src.view();
        let dst = &mut dst.view_mut();
        let n = dst.len();
        check_len("reduce_sum", "src", src, k * n)?;
        if n == 0 {
            return Ok(());
        }
        let ki = dim("reduce_sum", "K", k)?;
        // SAFETY: reduce_sum_f32(const float*, float*, int, float, size_t); src holds K*n
        // floats and dst n (checked); two CudaSlices never alias.
        unsafe { reduce::reduce_sum::plain(self, elem_cfg(n), src, dst, ki, scale, n) }
    }
}
