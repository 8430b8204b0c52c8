//! Kernels on whole buffers, knowing no op: the declaration of kernels/buffers.cu (the
//! ordered sum of K buffers, scaling in place, filling) and their checked launches. The
//! fallback all-reduce and the GPU network's accumulation sum with `reduce_sum`.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::Result;

crate::cuda::declare::kernels! {
    "buffers.cu" {
        reduce_sum { plain(src: In, dst: Out, k: I32, scale: F32, n: Size); }
        scale { plain(x: Out, s: F32, n: Size); }
        fill { plain(x: Out, v: F32, n: Size); }
    }
}

// ---- checked launches ---------------------------------------------------------------

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
        unsafe { reduce_sum::plain(self, elem_cfg(n), src, dst, ki, scale, n) }
    }

    /// x *= s, in place. x: (n)
    pub fn scale(&self, x: &mut impl DevOut, s: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: scale_f32(float*, float, size_t); n is x's length.
        unsafe { scale::plain(self, elem_cfg(n), x, s, n) }
    }

    /// x = v everywhere. x: (n)
    pub fn fill(&self, x: &mut impl DevOut, v: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: fill_f32(float*, float, size_t); n is x's length.
        unsafe { fill::plain(self, elem_cfg(n), x, v, n) }
    }
}
