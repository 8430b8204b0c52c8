//! Shapes and tensors.
//!
//! A [`Tensor`] is a shape, the device it lives on and its storage. Images are NCHW,
//! row-major (C order), the layout PyTorch uses, so weights and data move between the
//! two without transposes. Shape legend used in comments across the crate:
//! N batch, C channels, H height, W width, K kernel size, O outputs (filters or units),
//! F features.
//!
//! Storage is an enum so that device storage joins the host variant without changing
//! the layer code: layers ask for [`Tensor::host`] views through the op functions in
//! `backend`, and the op functions dispatch on the variant. The tensor does not own
//! parameters: those live in the flat buffers of `nn::ParamStore`.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

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
    pub fn rank(&self) -> usize {
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

    /// The dimensions as `(N, C, H, W)`, or an error naming `op` if the rank is not 4.
    pub fn nchw(&self, op: &'static str) -> Result<(usize, usize, usize, usize)> {
        match self.0[..] {
            [n, c, h, w] => Ok((n, c, h, w)),
            _ => Err(Error::shape(op, format!("expected (N, C, H, W), got {self}"))),
        }
    }

    /// The dimensions as `(N, F)`, or an error naming `op` if the rank is not 2.
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

impl Device {
    /// A GPU if there is one, else the CPU: the portable default ("cuda:0" when a CUDA
    /// driver reports a GPU, "cpu:0" otherwise, including when no driver is installed).
    pub fn cuda_if_available() -> Device {
        match crate::cuda::probe::gpu_count() {
            Ok(n) if n > 0 => Device::Cuda(0),
            _ => Device::Cpu(0),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(i) => write!(f, "cpu:{i}"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The memory behind a tensor.
#[derive(Clone, Debug)]
pub enum Storage {
    /// f32 values in host memory, row-major.
    Host(Vec<f32>),
    /// f32 values in the memory of a GPU, row-major, shared (tensors are values: nothing
    /// writes through a GPU tensor, so copies of it may share the allocation).
    Cuda(Arc<CudaSlice<f32>>),
}

impl PartialEq for Storage {
    /// Host values compare by value; GPU memory compares by identity (reading it back
    /// would make `==` a device transfer): copy to the host to compare values.
    fn eq(&self, other: &Storage) -> bool {
        match (self, other) {
            (Storage::Host(a), Storage::Host(b)) => a == b,
            (Storage::Cuda(a), Storage::Cuda(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// An f32 tensor: shape, device and storage.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Shape,
    device: Device,
    storage: Storage,
}

impl Tensor {
    /// A host tensor on `cpu:0` from values and a shape; errors if the sizes differ.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_vec_on(data, shape, Device::Cpu(0))
    }

    /// A tensor of these values on `device`: host memory for a CPU device, copied to the
    /// GPU for a CUDA one (host storage always belongs to a CPU device).
    pub fn from_vec_on(data: Vec<f32>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape("Tensor::from_vec", format!("{} values do not fill shape {shape}", data.len())));
        }
        match device {
            Device::Cpu(_) => Ok(Tensor { shape, device, storage: Storage::Host(data) }),
            Device::Cuda(_) => Tensor { shape, device: Device::Cpu(0), storage: Storage::Host(data) }.to(device),
        }
    }

    /// A tensor of zeros in the host memory of CPU device `device`.
    ///
    /// # Panics
    /// On a GPU device, whose memory cannot be had without a fallible copy: use
    /// [`Tensor::from_vec_on`] there.
    pub fn zeros(shape: impl Into<Shape>, device: Device) -> Tensor {
        assert!(matches!(device, Device::Cpu(_)), "Tensor::zeros makes host tensors; on {device} use from_vec_on");
        let shape = shape.into();
        let n = shape.numel();
        Tensor { shape, device, storage: Storage::Host(vec![0.0; n]) }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The values, when the tensor lives in host memory.
    ///
    /// # Panics
    /// On a GPU tensor: the CPU layers never receive one (`Sequential::forward` checks
    /// the input's device first); elsewhere, call [`Tensor::to`] or [`Tensor::to_vec`].
    pub fn host(&self) -> &[f32] {
        match &self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => panic!("{}", self.not_on_host()),
        }
    }

    /// The values, mutably, when the tensor lives in host memory.
    ///
    /// # Panics
    /// On a GPU tensor, as [`Tensor::host`].
    pub fn host_mut(&mut self) -> &mut [f32] {
        if matches!(self.storage, Storage::Cuda(_)) {
            panic!("{}", self.not_on_host());
        }
        match &mut self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => unreachable!("checked above"),
        }
    }

    /// Consumes the tensor and returns its host values.
    ///
    /// # Panics
    /// On a GPU tensor, as [`Tensor::host`].
    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => panic!("{}", self.not_on_host()),
        }
    }

    /// The values copied to the host, wherever the tensor lives.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::Host(v) => Ok(v.clone()),
            Storage::Cuda(_) if self.numel() == 0 => Ok(Vec::new()),
            Storage::Cuda(d) => Ok(d.stream().clone_dtoh(d.as_ref())?),
        }
    }

    fn not_on_host(&self) -> String {
        format!(
            "tensor {} lives on {}: copy it to the host first (`tensor.to(Device::Cpu(0))` or `to_vec()`)",
            self.shape, self.device
        )
    }

    /// The same values seen with another shape of the same size.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.shape.numel() {
            return Err(Error::shape("reshape", format!("cannot view {} as {shape}", self.shape)));
        }
        Ok(Tensor { shape, ..self })
    }

    /// The tensor on `device`: host ↔ GPU and GPU ↔ GPU moves copy the values (GPU to
    /// GPU directly, through peer access where the driver offers it); a move between CPU
    /// devices copies the host values; a tensor already on `device` is returned as is
    /// (sharing its memory). A GPU that does not exist, or no CUDA driver, is an error.
    ///
    /// The portable pattern: a GPU if there is one, else the CPU.
    /// ```
    /// use lockstep::{Device, Tensor};
    ///
    /// let device = Device::cuda_if_available(); // cuda:0, or cpu:0 without a GPU
    /// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], [3])?.to(device)?;
    /// assert_eq!(x.device(), device);
    /// assert_eq!(x.to(Device::Cpu(0))?.host(), &[1.0, 2.0, 3.0]);
    /// # Ok::<(), lockstep::Error>(())
    /// ```
    pub fn to(&self, device: Device) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        let storage = match (&self.storage, device) {
            (Storage::Host(v), Device::Cpu(_)) => Storage::Host(v.clone()),
            (Storage::Cuda(_), Device::Cpu(_)) => Storage::Host(self.to_vec()?),
            (storage, Device::Cuda(ordinal)) => {
                let stream = cuda_stream(ordinal)?;
                let slice = match storage {
                    // Some drivers refuse a zero-byte allocation: an empty tensor holds one
                    // unused element (its shape says it is empty).
                    _ if self.numel() == 0 => stream.alloc_zeros(1)?,
                    Storage::Host(v) => stream.clone_htod(v)?,
                    Storage::Cuda(d) => stream.clone_dtod(d.as_ref())?,
                };
                Storage::Cuda(Arc::new(slice))
            }
        };
        Ok(Tensor { shape: self.shape.clone(), device, storage })
    }

    /// Errors with [`Error::DeviceMismatch`] unless `self` and `other` share a device.
    pub fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device != other.device {
            return Err(Error::DeviceMismatch { op, lhs: self.device.to_string(), rhs: other.device.to_string() });
        }
        Ok(())
    }
}

/// The default stream of GPU `ordinal`'s primary context, after checking that the
/// driver is present and the GPU exists (cudarc panics otherwise).
fn cuda_stream(ordinal: usize) -> Result<Arc<CudaStream>> {
    crate::cuda::probe::driver_available()?;
    let n = crate::cuda::probe::gpu_count()?;
    if ordinal >= n {
        return Err(Error::CudaUnavailable(format!("cuda:{ordinal} does not exist; this machine has {n} GPU(s)")));
    }
    Ok(CudaContext::new(ordinal)?.default_stream())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portable_default_is_the_cpu_without_a_gpu() {
        // This follows the machine: a GPU where the driver reports one.
        let expected = match crate::cuda::probe::gpu_count() {
            Ok(n) if n > 0 => Device::Cuda(0),
            _ => Device::Cpu(0),
        };
        assert_eq!(Device::cuda_if_available(), expected);
        assert_eq!(Device::Cpu(3).to_string(), "cpu:3");
    }

    #[test]
    fn moving_to_a_gpu_that_is_not_there_is_an_error_not_a_panic() {
        let t = Tensor::from_vec(vec![1.0, 2.0], [2]).unwrap();
        assert_eq!(t.to(Device::Cpu(1)).unwrap().device(), Device::Cpu(1));
        assert_eq!(t.to(Device::Cpu(1)).unwrap().host(), t.host());
        let gpus = crate::cuda::probe::gpu_count().unwrap_or(0);
        let e = t.to(Device::Cuda(gpus)).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
        // Values made for a GPU go to the GPU, or fail the same way: never host memory
        // labelled with a GPU.
        let e = Tensor::from_vec_on(vec![1.0], [1], Device::Cuda(gpus)).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
    }
}
