//! The residual block's own arithmetic on the CPU: the add of its branches in the forward
//! (y = body + shortcut) and the fan-in of their input gradients in the backward
//! (dx = dbody + dshortcut), one f32 addition a value either way, so its order cannot
//! differ. kernels/residual.cu's `residual_add_fwd_f32` does both on a GPU and is held
//! to these bit for bit. What the branches compute is their layers' own; the ReLU after
//! the add is the ReLU op's (`Relu::forward_sum` fuses the two on the CPU).

use crate::backend::simd::widest;

/// y = body + shortcut, in place over body: (n); shortcut: (n).
pub fn residual_forward(body: &mut [f32], shortcut: &[f32]) {
    assert_eq!(body.len(), shortcut.len(), "residual_forward: {} + {} values", body.len(), shortcut.len());
    add_in_place(body, shortcut);
}

/// dx = dbody + dshortcut, in place over dbody: (n); dshortcut: (n). Written: it is the
/// block's input gradient.
pub fn residual_backward(dbody: &mut [f32], dshortcut: &[f32]) {
    assert_eq!(dbody.len(), dshortcut.len(), "residual_backward: {} + {} values", dbody.len(), dshortcut.len());
    add_in_place(dbody, dshortcut);
}

widest! {
    /// `a += b`, elementwise.
    fn add_in_place(a: &mut [f32], b: &[f32]) {
        for (x, &y) in a.iter_mut().zip(b) {
            *x += y;
        }
    }
}
