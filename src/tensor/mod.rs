//! Shapes and tensors.
//!
//! A [`Tensor`] is a shape, the CPU device it belongs to and its values in host memory:
//! the CPU layers' currency, the reference every GPU kernel is checked against. Images are NCHW,
//! row-major (C order), the layout PyTorch uses, so weights and data move between the
//! two without transposes. Shape legend used in comments across the crate:
//! N batch, C channels, H height, W width, K kernel size, O outputs (filters or units),
//! F features.
//!
//! A tensor never lives on a GPU: a GPU replica keeps its values in flat device buffers
//! of its own (`model::gpu`), and asking for a tensor on a GPU is an error naming that.
//! The tensor does not own parameters: those live in the flat buffers of
//! `nn::ParamStore`.
//!
//! Its values are shared, copied on write: a clone costs a reference count, and the
//! values are copied only when one of the holders asks to change them
//! ([`Tensor::host_mut`]) while another still holds them. A residual block hands the same
//! input to its body (whose first layer keeps it for the backward) and to its identity
//! shortcut without copying it.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Dimensions of a tensor, outermost first.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape from its dimensions, outermost first.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// The leading dimension (the batch for activations).
    pub fn batch(&self) -> usize {
        self.0.first().copied().unwrap_or(1)
    }

    /// Elements per sample: the product of every dimension after the first.
    pub fn per_sample(&self) -> usize {
        self.0.iter().skip(1).product()
    }

    /// The dimensions as `(N, C, H, W)`, or an error naming `op` if there are not 4.
    pub fn nchw(&self, op: &'static str) -> Result<(usize, usize, usize, usize)> {
        match self.0[..] {
            [n, c, h, w] => Ok((n, c, h, w)),
            _ => Err(Error::shape(op, format!("expected (N, C, H, W), got {self}"))),
        }
    }

    /// The dimensions as `(N, F)`, or an error naming `op` if there are not 2.
    pub fn nf(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.0[..] {
            [n, f] => Ok((n, f)),
            _ => Err(Error::shape(op, format!("expected (N, F), got {self}"))),
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, ")")
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}

impl<const K: usize> From<[usize; K]> for Shape {
    fn from(d: [usize; K]) -> Self {
        Shape(d.to_vec())
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Device {
    /// Host memory owned by CPU device `ordinal` (CPU devices stand in for GPUs).
    Cpu(usize),
    /// Memory of CUDA GPU `ordinal`.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(i) => write!(f, "cpu:{i}"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// An f32 tensor in host memory: shape, CPU device and values (row-major), shared by its
/// clones until one of them writes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Shape,
    device: Device,
    data: Arc<Vec<f32>>,
}

impl Tensor {
    /// A host tensor on `cpu:0` from values and a shape; errors if the sizes differ.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec_on(data, shape, Device::Cpu(0))
    }

    /// A tensor of these values on CPU device `device`; errors if the sizes differ, or on
    /// a GPU ([`Tensor`] is host memory: a GPU replica keeps its own device buffers).
    pub fn from_vec_on(data: Vec<f32>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape("Tensor::from_vec", format!("{} values do not fill shape {shape}", data.len())));
        }
        on_host(device)?;
        Ok(Tensor { shape, device, data: Arc::new(data) })
    }

    /// A tensor of zeros in the host memory of CPU device `device`.
    ///
    /// # Panics
    /// On a GPU device: the CPU layers, which make these, never run with one
    /// (`Sequential::forward` refuses a GPU context first).
    pub fn zeros(shape: impl Into<Shape>, device: Device) -> Tensor {
        assert!(matches!(device, Device::Cpu(_)), "Tensor::zeros makes host tensors, not tensors on {device}");
        let shape = shape.into();
        let n = shape.numel();
        Tensor { shape, device, data: Arc::new(vec![0.0; n]) }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The CPU device the tensor belongs to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The values.
    pub fn host(&self) -> &[f32] {
        &self.data
    }

    /// The values, mutably: this tensor's own, copied first if a clone still shares them.
    pub fn host_mut(&mut self) -> &mut [f32] {
        Arc::make_mut(&mut self.data).as_mut_slice()
    }

    /// Consumes the tensor and returns its values (a copy if a clone still shares them).
    pub fn into_vec(self) -> Vec<f32> {
        Arc::unwrap_or_clone(self.data)
    }

    /// Consumes the tensor and returns its values if no clone shares them, else gives
    /// the tensor back (nothing is copied): for a layer that reuses a buffer it would
    /// otherwise free.
    pub fn into_unshared_vec(self) -> std::result::Result<Vec<f32>, Tensor> {
        let Tensor { shape, device, data } = self;
        Arc::try_unwrap(data).map_err(|data| Tensor { shape, device, data })
    }

    /// A copy of the values.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        Ok(self.data.to_vec())
    }

    /// The same values seen with another shape of the same size.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.shape.numel() {
            return Err(Error::shape("reshape", format!("cannot view {} as {shape}", self.shape)));
        }
        Ok(Tensor { shape, ..self })
    }

    /// The tensor on CPU device `device` (the same values, shared until either writes); a
    /// GPU is an error: a model runs on a GPU as a GPU replica, whose values
    /// live in its own device buffers.
    pub fn to(&self, device: Device) -> Result<Tensor> {
        on_host(device)?;
        Ok(Tensor { shape: self.shape.clone(), device, data: self.data.clone() })
    }

    /// Errors with [`Error::DeviceMismatch`] unless `self` and `other` share a device.
    pub fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device != other.device {
            return Err(Error::DeviceMismatch { op, lhs: self.device.to_string(), rhs: other.device.to_string() });
        }
        Ok(())
    }
}

/// Errors unless `device` is a CPU device, whose memory a tensor can be.
fn on_host(device: Device) -> Result<()> {
    match device {
        Device::Cpu(_) => Ok(()),
        Device::Cuda(_) => Err(Error::config(
            "device",
            format!("a tensor lives in host memory, not on {device}: on a GPU a model runs as a GPU replica"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portable_default_is_the_cpu_without_a_gpu() {
        // This follows the machine: a GPU where the driver reports one, and never one
        // without the `cuda` feature.
        #[cfg(feature = "cuda")]
        let expected = match crate::cuda::probe::gpu_count() {
            Ok(n) if n > 0 => Device::Cuda(0),
            _ => Device::Cpu(0),
        };
        #[cfg(not(feature = "cuda"))]
        let expected = Device::Cpu(0);
        assert_eq!(Device::cuda_if_available(), expected);
        assert_eq!(Device::Cpu(3).to_string(), "cpu:3");
    }

    #[test]
    fn a_tensor_moves_between_cpu_devices_and_never_onto_a_gpu() {
        let t = Tensor::from_vec(vec![1.0, 2.0], [2]).unwrap();
        assert_eq!(t.to(Device::Cpu(1)).unwrap().device(), Device::Cpu(1));
        assert_eq!(t.to(Device::Cpu(1)).unwrap().host(), t.host());
        // An error, not a panic, nor host memory labelled with a GPU.
        for e in [t.to(Device::Cuda(0)).unwrap_err(), Tensor::from_vec_on(vec![1.0], [1], Device::Cuda(0)).unwrap_err()]
        {
            assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("GPU replica"), "{e}");
        }
    }
}
