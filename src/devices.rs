//! Device specifications: what `--devices` accepts and what it resolves to.
//!
//! `auto` (every GPU when a CUDA driver and GPUs are present, else one CPU device with
//! every core), `cpu` (= `cpu:1`), `cpu:N` (N CPU devices, cores/N threads each, at
//! least 1), `cpu:NxT` (N devices of T threads), `cuda` (every GPU), `cuda:0,1`
//! (those ordinals). Parsing is pure; [`DeviceSpec::resolve`] asks the machine, and in a
//! lockstep built without the `cuda` feature refuses every GPU, naming the feature.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::tensor::Device;

const ACCEPTED: &str = "accepted: auto, cpu, cpu:N, cpu:NxT (N devices of T threads), cuda, cuda:I[,J...]";

/// A parsed `--devices` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu { count: usize, threads: Option<usize> },
    CudaAll,
    Cuda(Vec<usize>),
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |detail: &str| Error::DeviceSpec { spec: s.to_string(), detail: format!("{detail}; {ACCEPTED}") };
        let positive = |t: &str, what: &str| -> Result<usize> {
            match t.parse::<usize>() {
                Ok(0) => Err(bad(&format!("{what} must be at least 1"))),
                Ok(n) => Ok(n),
                Err(_) => Err(bad(&format!("'{t}' is not a {what}"))),
            }
        };
        match s.trim() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu { count: 1, threads: None }),
            "cuda" => Ok(DeviceSpec::CudaAll),
            t if t.starts_with("cpu:") => {
                let rest = &t[4..];
                match rest.split_once('x') {
                    Some((n, th)) if !n.is_empty() && !th.is_empty() => Ok(DeviceSpec::Cpu {
                        count: positive(n, "device count")?,
                        threads: Some(positive(th, "thread count")?),
                    }),
                    _ => Ok(DeviceSpec::Cpu { count: positive(rest, "device count")?, threads: None }),
                }
            }
            t if t.starts_with("cuda:") => {
                let ords = t[5..]
                    .split(',')
                    .map(|o| o.trim().parse::<usize>().map_err(|_| bad(&format!("'{o}' is not a GPU ordinal"))))
                    .collect::<Result<Vec<_>>>()?;
                Ok(DeviceSpec::Cuda(ords))
            }
            _ => Err(bad("unknown device kind")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu { count, threads: None } => write!(f, "cpu:{count}"),
            DeviceSpec::Cpu { count, threads: Some(t) } => write!(f, "cpu:{count}x{t}"),
            DeviceSpec::CudaAll => write!(f, "cuda"),
            DeviceSpec::Cuda(o) => {
                write!(f, "cuda:{}", o.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","))
            }
        }
    }
}

/// Resolved devices: what the trainer runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Devices {
    devices: Vec<Device>,
    /// Threads of each CPU device's pool.
    threads_per_device: usize,
}

impl Devices {
    /// `n` CPU devices of `threads` threads each.
    pub fn cpu(n: usize, threads: usize) -> Result<Devices> {
        if n == 0 || threads == 0 {
            return Err(Error::DeviceSpec {
                spec: format!("cpu:{n}x{threads}"),
                detail: "device and thread counts must be at least 1".into(),
            });
        }
        let limit = 64 * available_cores();
        if n.saturating_mul(threads) > limit {
            return Err(Error::DeviceSpec {
                spec: format!("cpu:{n}x{threads}"),
                detail: format!("{} threads in all is more than 64 per core ({limit} here)", n.saturating_mul(threads)),
            });
        }
        Ok(Devices { devices: (0..n).map(Device::Cpu).collect(), threads_per_device: threads })
    }

    /// The GPUs `ordinals`, one replica each, in that order. An ordinal may repeat
    /// (`cuda:0,0`): several replicas then share one GPU, exchanging gradients by device
    /// copies instead of NCCL. Fails, naming the GPUs that exist, when one does not.
    pub fn cuda(ordinals: &[usize]) -> Result<Devices> {
        if ordinals.is_empty() {
            return Err(Error::config("devices", "no GPU named"));
        }
        let n = gpus::count(&DeviceSpec::Cuda(ordinals.to_vec()))?;
        if let Some(bad) = ordinals.iter().find(|&&o| o >= n) {
            return Err(Error::CudaUnavailable(if n == 0 {
                format!("GPU {bad} does not exist; the CUDA driver sees no GPU")
            } else {
                format!("GPU {bad} does not exist; this machine has {n} GPU(s): cuda:0..{}", n - 1)
            }));
        }
        Ok(Devices { devices: ordinals.iter().map(|&o| Device::Cuda(o)).collect(), threads_per_device: 1 })
    }

    /// `n` CPU devices sharing the machine's cores (cores / n threads each, at least 1).
    pub fn cpu_auto_threads(n: usize) -> Result<Devices> {
        Devices::cpu(n, (available_cores() / n.max(1)).max(1))
    }

    /// The first `n` devices (at least one), of the same kind and threads.
    pub fn first(&self, n: usize) -> Devices {
        let n = n.clamp(1, self.devices.len());
        Devices { devices: self.devices[..n].to_vec(), threads_per_device: self.threads_per_device }
    }

    /// The CUDA ordinals of the devices, in device order (empty for CPU devices: a list
    /// holds one kind of device, as its constructors make it).
    pub fn cuda_ordinals(&self) -> Vec<usize> {
        self.devices.iter().filter_map(|d| if let Device::Cuda(o) = d { Some(*o) } else { None }).collect()
    }

    /// A note for runs whose CPU device threads outnumber the cores: they then sleep
    /// between hand-offs instead of spinning, and every step pays for waking them. The
    /// same logical replicas on fewer devices give bitwise the same weights, faster.
    pub fn oversubscription_note(&self, replicas: usize) -> Option<String> {
        let cores = available_cores();
        let n = self.devices.len();
        let cpu = self.devices.iter().all(|d| matches!(d, Device::Cpu(_)));
        (cpu && n > cores).then(|| {
            format!(
                "{n} CPU devices share {cores} core(s): their threads sleep between hand-offs, and every step \
                 pays for waking them; --devices cpu:{cores} --replicas {replicas} gives bitwise the same weights faster"
            )
        })
    }

    /// The devices, device d at `[d]`.
    pub fn list(&self) -> &[Device] {
        &self.devices
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Never true for a resolved set.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Threads in each CPU device's pool.
    pub fn threads_per_device(&self) -> usize {
        self.threads_per_device
    }
}

impl fmt::Display for Devices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        write!(f, "{}", names.join(", "))?;
        if matches!(self.devices.first(), Some(Device::Cpu(_))) {
            write!(
                f,
                " ({} thread{} each)",
                self.threads_per_device,
                if self.threads_per_device == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// Cores this process may use: its affinity mask's, or, for one of several processes a
/// launcher left unbound on this machine, its share of them (`world::launch`).
pub fn available_cores() -> usize {
    crate::world::launch::cores_for_this_process()
}

/// The GPUs this machine offers, as `cuda::probe` finds them. A lockstep built without
/// the `cuda` feature has no GPU code: it finds none, and naming one is an error that says
/// which feature is missing. The one place device discovery depends on the feature.
#[cfg(feature = "cuda")]
mod gpus {
    use crate::cuda::probe;
    use crate::error::Result;

    /// Number of GPUs the CUDA driver sees, for `_wanted` (`cuda`, `cuda:0`, ...).
    pub(super) fn count(_wanted: &dyn std::fmt::Display) -> Result<usize> {
        probe::gpu_count()
    }

    /// The GPUs `auto` takes: every GPU, when the driver sees one and the libraries the
    /// GPU replicas load (cuBLAS, NVRTC) are there; `lockstep devices` says which is
    /// missing otherwise.
    pub(super) fn trainable() -> usize {
        match probe::gpu_count() {
            Ok(n) if probe::cublas_available().is_ok() && probe::nvrtc_available().is_ok() => n,
            _ => 0,
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod gpus {
    use crate::error::Result;

    pub(super) fn count(wanted: &dyn std::fmt::Display) -> Result<usize> {
        Err(crate::devices::without_cuda(wanted))
    }

    pub(super) fn trainable() -> usize {
        0
    }
}

/// The refusal of GPUs `wanted` by a lockstep built without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn without_cuda(wanted: &dyn fmt::Display) -> Error {
    Error::CudaUnavailable(format!(
        "this lockstep was built without the `cuda` feature: {wanted} cannot be used (build it with \
         `--features cuda`, or name CPU devices: cpu:N)"
    ))
}

/// Written here, beside the discovery it asks, so that `tensor` needs nothing of `cuda`.
impl Device {
    /// A GPU if there is one, else the CPU: the portable default ("cuda:0" when a CUDA
    /// driver reports a GPU, "cpu:0" otherwise, including when no driver is installed or
    /// lockstep was built without the `cuda` feature).
    pub fn cuda_if_available() -> Device {
        match gpus::count(&"cuda:0") {
            Ok(n) if n > 0 => Device::Cuda(0),
            _ => Device::Cpu(0),
        }
    }
}

impl DeviceSpec {
    /// The devices this spec names on this machine.
    pub fn resolve(&self) -> Result<Devices> {
        // A refusal names this spec (`cpu:100000`), not the one it resolved to.
        let named = |e: Error| match e {
            Error::DeviceSpec { detail, .. } => Error::DeviceSpec { spec: self.to_string(), detail },
            e => e,
        };
        match self {
            DeviceSpec::Cpu { count, threads: Some(t) } => Devices::cpu(*count, *t).map_err(named),
            DeviceSpec::Cpu { count, threads: None } => Devices::cpu_auto_threads(*count).map_err(named),
            // GPUs only when they can train: the driver sees one, and the libraries the
            // GPU replicas load (cuBLAS, NVRTC) are there; `lockstep devices` says which
            // is missing otherwise.
            DeviceSpec::Auto => match gpus::trainable() {
                0 => Devices::cpu_auto_threads(1),
                n => Devices::cuda(&(0..n).collect::<Vec<_>>()),
            },
            DeviceSpec::CudaAll => {
                let n = gpus::count(self)?;
                if n == 0 {
                    return Err(Error::CudaUnavailable("the CUDA driver sees no GPU; use --devices cpu:N".into()));
                }
                Devices::cuda(&(0..n).collect::<Vec<_>>())
            }
            DeviceSpec::Cuda(ords) => Devices::cuda(ords),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_specs_parse() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu { count: 1, threads: None });
        assert_eq!("cpu:4".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu { count: 4, threads: None });
        assert_eq!("cpu:4x1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu { count: 4, threads: Some(1) });
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::CudaAll);
        assert_eq!("cuda:0,1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(vec![0, 1]));
        assert_eq!(DeviceSpec::Cpu { count: 3, threads: Some(2) }.to_string(), "cpu:3x2");
    }

    /// Too many threads in all: the refusal quotes the spec as typed, not `cpu:100000x1`
    /// (the threads it resolved to).
    #[test]
    fn a_refused_spec_is_quoted_as_given() {
        for spec in ["cpu:100000", "cpu:4x100000"] {
            let e = spec.parse::<DeviceSpec>().unwrap().resolve().unwrap_err().to_string();
            assert!(e.starts_with(&format!("invalid device spec '{spec}': ")), "{e}");
            assert!(e.contains("threads in all is more than 64 per core"), "{e}");
        }
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn without_the_cuda_feature_no_gpu_is_found_and_naming_one_names_the_feature() {
        for spec in ["cuda", "cuda:0", "cuda:0,1"] {
            let e = spec.parse::<DeviceSpec>().unwrap().resolve().unwrap_err();
            assert!(matches!(e, Error::CudaUnavailable(_)), "{spec}: {e:?}");
            let e = e.to_string();
            assert!(
                e.starts_with(&format!("this lockstep was built without the `cuda` feature: {spec} cannot")),
                "{e}"
            );
        }
        assert!(Devices::cuda(&[0]).unwrap_err().to_string().contains("`cuda` feature: cuda:0 cannot be used"));
        assert_eq!(DeviceSpec::Auto.resolve().unwrap().list(), &[Device::Cpu(0)]);
        assert_eq!(Device::cuda_if_available(), Device::Cpu(0));
    }

    #[test]
    fn bad_specs_say_what_is_accepted() {
        for (spec, why) in [
            ("cpu:0", "device count must be at least 1"),
            ("cpu:x", "'x' is not a device count"),
            ("gpu:1", "unknown device kind"),
            ("cpu:2x0", "thread count must be at least 1"),
            ("cuda:a", "'a' is not a GPU ordinal"),
            ("", "unknown device kind"),
        ] {
            let e = spec.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains(why), "{spec}: {e}");
            assert!(e.contains("accepted: auto, cpu, cpu:N"), "{spec}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn cpu_devices_share_the_cores() {
        let d = "cpu:2x3".parse::<DeviceSpec>().unwrap().resolve().unwrap();
        assert_eq!(d.list(), &[Device::Cpu(0), Device::Cpu(1)]);
        assert_eq!(d.threads_per_device(), 3);
        let auto = DeviceSpec::Cpu { count: 64, threads: None }.resolve().unwrap();
        assert_eq!(auto.threads_per_device(), 1);
        let e = "cpu:1x100000".parse::<DeviceSpec>().unwrap().resolve().unwrap_err().to_string();
        assert!(e.contains("more than 64 per core"), "{e}");
    }
}
