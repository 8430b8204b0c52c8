//! Reshape on a GPU: the values do not move, so its GPU form is a device copy each way (the
//! GPU network gives every layer its own output buffer); it has no kernel file.

use crate::ops::gpu::{Backward, Forward, GpuLayer};

use super::*;

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &Reshape) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(ReshapeGpu))
}

/// Reshape on a GPU: the values do not move, so a copy each way.
pub(super) struct ReshapeGpu;

impl GpuLayer for ReshapeGpu {
    // x: (N, ...) → y: (N, *target), the same values
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        Ok(f.gpu.stream().memcpy_dtod(f.x, f.y)?)
    }

    // dy: (N, *target) → dx: (N, ...), the same values
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => Ok(b.gpu.stream().memcpy_dtod(&b.dy, &mut dx)?),
            None => Ok(()),
        }
    }
}
