//! Which transport a run's replicas meet through, and what each one carries: the one
//! table that `with_trainer` wires a run by and checks a configuration's features against
//! (`train::trainer`'s `check_features`), and that `bench allreduce` names its GPU table by.
//!
//! Owns the choice (from the devices' kind, the number of processes and, for GPUs, what
//! [`gpu::transport_for`] finds) and the capabilities; the transports themselves are their
//! files' ([`super::shm`], `super::mpi`, [`super::gpu`]). A capability is stated here
//! once, per transport, so that a transport that learns a feature changes one line.

#[cfg(feature = "cuda")]
use super::gpu::{self, transport_for};
use crate::tensor::Device;

/// The transport of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunTransport {
    /// CPU devices of one process: shared memory between their threads (`exchange::shm`).
    SharedMemory,
    /// CPU devices of several processes: MPI between the processes (`exchange::mpi`, the
    /// `mpi` feature), shared memory within each.
    Mpi,
    /// The GPUs of one process through NCCL (which only the `cuda` feature can find).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Nccl,
    /// The GPUs of several processes as one NCCL clique (the only way GPUs of several
    /// processes meet).
    NcclClique,
    /// The GPUs of one process through device-to-device copies (no usable NCCL, one GPU,
    /// or a GPU named twice).
    DeviceCopies,
}

impl RunTransport {
    /// The transport of a run on `devices` (all of one kind; at least one) in a world of
    /// `processes` processes. For the GPUs of one process this asks [`transport_for`]
    /// (which may load NCCL to see whether it is usable).
    pub fn of(devices: &[Device], processes: usize) -> RunTransport {
        match devices[0] {
            Device::Cpu(_) if processes > 1 => RunTransport::Mpi,
            Device::Cpu(_) => RunTransport::SharedMemory,
            Device::Cuda(_) if processes > 1 => RunTransport::NcclClique,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let ordinals: Vec<usize> =
                    devices.iter().filter_map(|d| if let Device::Cuda(o) = d { Some(*o) } else { None }).collect();
                RunTransport::from(transport_for(&ordinals))
            }
            // Without the `cuda` feature no run gets here with a GPU (`Devices` refuses to
            // name one), and there is no NCCL to ask.
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => RunTransport::DeviceCopies,
        }
    }

    /// In words, as `bench allreduce` heads its tables: "nccl", "device copies", ...
    #[cfg(any(test, feature = "cli"))]
    pub fn name(self) -> &'static str {
        match self {
            RunTransport::SharedMemory => "shared memory",
            RunTransport::Mpi => "mpi",
            RunTransport::Nccl => "nccl",
            RunTransport::NcclClique => "nccl (one clique of every process's GPUs)",
            RunTransport::DeviceCopies => "device copies",
        }
    }

    /// Whether gradients may travel as 16-bit codes (`--grad-compression`). The GPUs of
    /// several processes cannot: their wires are all-gathered among one process's GPUs.
    pub fn carries_16_bit_gradients(self) -> bool {
        match self {
            RunTransport::SharedMemory | RunTransport::Mpi | RunTransport::Nccl | RunTransport::DeviceCopies => true,
            RunTransport::NcclClique => false,
        }
    }

    /// Whether synchronized BatchNorm's statistics can meet (`--sync-batchnorm`): CPU
    /// devices gather them through their exchange (shared memory, MPI), one process's GPUs
    /// through that process's shared memory, which the GPUs of several processes do not
    /// share.
    pub fn gathers_batchnorm_statistics(self) -> bool {
        match self {
            RunTransport::SharedMemory | RunTransport::Mpi | RunTransport::Nccl | RunTransport::DeviceCopies => true,
            RunTransport::NcclClique => false,
        }
    }
}

#[cfg(feature = "cuda")]
impl From<gpu::Transport> for RunTransport {
    /// The transport of one process's GPUs.
    fn from(t: gpu::Transport) -> RunTransport {
        match t {
            gpu::Transport::Nccl => RunTransport::Nccl,
            gpu::Transport::Copies => RunTransport::DeviceCopies,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transport_follows_the_devices_and_the_processes() {
        let cpus = [Device::Cpu(0), Device::Cpu(1)];
        assert_eq!(RunTransport::of(&cpus, 1), RunTransport::SharedMemory);
        assert_eq!(RunTransport::of(&cpus, 3), RunTransport::Mpi);
        // Several processes' GPUs meet in one clique, whatever this machine's NCCL.
        assert_eq!(RunTransport::of(&[Device::Cuda(0)], 2), RunTransport::NcclClique);
        // One GPU has nothing to exchange with: device copies (NCCL is not even loaded).
        assert_eq!(RunTransport::of(&[Device::Cuda(0)], 1), RunTransport::DeviceCopies);
        #[cfg(feature = "cuda")]
        assert_eq!(RunTransport::from(gpu::Transport::Nccl), RunTransport::Nccl);
    }

    #[test]
    fn only_the_gpus_of_several_processes_lack_a_feature() {
        use RunTransport::*;
        for t in [SharedMemory, Mpi, Nccl, DeviceCopies] {
            assert!(t.carries_16_bit_gradients() && t.gathers_batchnorm_statistics(), "{t:?}");
        }
        assert!(!NcclClique.carries_16_bit_gradients() && !NcclClique.gathers_batchnorm_statistics());
        assert_eq!((Nccl.name(), DeviceCopies.name()), ("nccl", "device copies"));
    }
}
