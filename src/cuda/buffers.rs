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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cuda::host::{checker_or_skip, elem_cfgs, In, Out, F32, I32, U64};
    use crate::testing::{assert_bits, uniform};

    /// The sum of K buffers (K, n) scaled, as its definition reads: buffer 0, 1, ..., K−1
    /// added in f32 in that order, then the scale (the fallback all-reduce relies on the
    /// order, which every replica follows alike).
    fn reduce_sum_ref(src: &[f32], k: usize, scale: f32) -> Vec<f32> {
        let n = src.len() / k;
        (0..n).map(|i| (0..k).fold(0.0f32, |acc, r| acc + src[r * n + i]) * scale).collect()
    }

    /// kernels/buffers.cu run on the host against the definitions, bit for bit: one f32
    /// operation per addition, per scaling, per value filled. K = 4, 1 and 3 buffers
    /// (scales 1/8, 1 and 1/3, the last inexact), a scale by a power of two (exact) and by
    /// 1/3 with a NaN, ±∞ and −0 among the values, a fill; under the launch shape and a grid
    /// too small to cover the values.
    #[test]
    fn the_kernels_run_on_the_host_as_their_definitions() {
        const TEST: &str = "the_kernels_run_on_the_host_as_their_definitions";
        let Some(k) = checker_or_skip(TEST, crate::train::kernel_files) else { return };
        let n = 1001;
        for (kk, scale) in [(4, 0.125f32), (1, 1.0), (3, 1.0 / 3.0)] {
            let src = uniform(9 + kk as u64, kk * n);
            let want = reduce_sum_ref(&src, kk, scale);
            for cfg in elem_cfgs(n) {
                let mut dst = vec![f32::NAN; n];
                // As Gpu::reduce_sum: src, dst, K (int), scale, n.
                k.launch(
                    &reduce_sum::PLAIN,
                    cfg,
                    &mut [In(&src), Out(&mut dst), I32(kk as i32), F32(scale), U64(n as u64)],
                );
                assert_bits(&format!("reduce_sum K = {kk} {cfg:?}"), &dst, &want);
            }
        }
        let mut x = uniform(20, n);
        x[..4].copy_from_slice(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0]);
        for s in [0.25f32, 1.0 / 3.0] {
            let want: Vec<f32> = x.iter().map(|&v| v * s).collect();
            for cfg in elem_cfgs(n) {
                let mut y = x.clone();
                // As Gpu::scale: x, s, n.
                k.launch(&scale::PLAIN, cfg, &mut [Out(&mut y), F32(s), U64(n as u64)]);
                assert_bits(&format!("scale by {s} {cfg:?}"), &y, &want);
                // As Gpu::fill: x, v, n.
                k.launch(&fill::PLAIN, cfg, &mut [Out(&mut y), F32(s), U64(n as u64)]);
                assert_bits(&format!("fill with {s} {cfg:?}"), &y, &vec![s; n]);
            }
        }
        let file: std::collections::BTreeSet<String> = KERNELS.kernels.iter().map(|k| k.name()).collect();
        assert_eq!(k.ran(), file, "the kernels run here vs those of {}", KERNELS.name);
    }

    /// `reduce_sum` on a GPU, bit for bit its definition: the order is fixed, and a sum
    /// of two values rounds once whatever the hardware.
    #[test]
    fn reduce_sum_adds_the_buffers_in_order_and_scales_on_a_gpu() {
        if !crate::ops::conformance::gpu_or_skip("reduce_sum_adds_the_buffers_in_order_and_scales_on_a_gpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let (k, n) = (4, 1001);
        let src = uniform(8, k * n);
        let s = gpu.stream();
        let mut dst = s.alloc_zeros::<f32>(n).unwrap();
        gpu.reduce_sum(&s.clone_htod(&src).unwrap(), &mut dst, k, 0.125).unwrap();
        assert_bits("reduce_sum on a GPU", &s.clone_dtoh(&dst).unwrap(), &reduce_sum_ref(&src, k, 0.125));
    }
}
