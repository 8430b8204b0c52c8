//! Global average pooling on the CPU: the mean of each (H, W) plane, and its gradient
//! spread evenly over the plane. The reference kernels/global_avg_pool.cu is held to, bit
//! for bit: the same sum in the same order, multiplied by the same f32 1/(H·W).

/// y: (N·C) = the mean of each plane of x: (N, C, H, W), as N·C planes of `hw` = H·W
/// values: the plane's values added in order, from −0 (std's f32 sum), then multiplied by
/// 1/(H·W) rounded to f32.
pub fn global_avg_pool_forward(x: &[f32], y: &mut [f32], hw: usize) {
    assert_eq!(x.len(), y.len() * hw, "global_avg_pool_forward: {} values for {} planes of {hw}", x.len(), y.len());
    let inv = 1.0 / hw as f32;
    for (y, plane) in y.iter_mut().zip(x.chunks_exact(hw)) {
        *y = plane.iter().fold(-0.0, |acc, &v| acc + v) * inv;
    }
}

/// dx: (N, C, H, W), written: each plane of `hw` = H·W values filled with
/// dout[n, c]·(1/(H·W)), dout: (N·C).
pub fn global_avg_pool_backward(dout: &[f32], dx: &mut [f32], hw: usize) {
    assert_eq!(
        dx.len(),
        dout.len() * hw,
        "global_avg_pool_backward: {} values for {} planes of {hw}",
        dx.len(),
        dout.len()
    );
    let inv = 1.0 / hw as f32;
    for (&d, plane) in dout.iter().zip(dx.chunks_exact_mut(hw)) {
        plane.fill(d * inv);
    }
}
