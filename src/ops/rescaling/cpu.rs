//! Rescaling on the CPU: y = x·scale + offset, and its gradient dx = dy·scale. The
//! reference kernels/rescaling.cu is held to, bit for bit: a multiply rounded, then an add
//! rounded, never contracted into one fused multiply-add on either side.

/// y = x·scale + offset, in place over x: (n).
pub fn rescaling_forward(x: &mut [f32], scale: f32, offset: f32) {
    for v in x {
        *v = *v * scale + offset;
    }
}

/// dx = dout·scale, in place over dout: (n).
pub fn rescaling_backward(dout: &mut [f32], scale: f32) {
    for v in dout {
        *v *= scale;
    }
}
