//! `lockstep inspect`, `lockstep devices` and `lockstep plot`: looking at files and at
//! the machine.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PlotX {
    Step,
    Epoch,
}

#[derive(Args, Debug)]
pub(crate) struct PlotArgs {
    /// A metrics CSV written by `train --metrics-out`.
    csv: PathBuf,
    /// The PNG to write (atomically).
    #[arg(short, long, value_name = "FILE.png")]
    out: PathBuf,
    /// What the horizontal axis counts.
    #[arg(long = "x", value_enum, default_value = "step")]
    x: PlotX,
}

// ---------------------------------------------------------------------------------------
// inspect, devices

pub(crate) fn cmd_inspect(file: &Path) -> CliResult {
    check_input_file("inspect", file)?;
    if file.extension().is_some_and(|e| e == "json") {
        // A model spec: its graph, node by node.
        let model = crate::spec::model_from_spec_file(file).map_err(Failure::usage)?;
        for line in model.summary().lines() {
            outln!("{line}");
        }
        return Ok(());
    }
    let rows = weights::inspect(file).map_err(Failure::usage)?;
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(4).max(4);
    outln!("{:<name_w$}  {:<5}  shape", "name", "dtype");
    let mut total = 0usize;
    for (name, dtype, shape) in &rows {
        total += shape.iter().product::<usize>();
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        outln!("{name:<name_w$}  {dtype:<5}  ({})", dims.join(", "));
    }
    outln!("{} tensors, {total} values", rows.len());
    Ok(())
}

pub(crate) fn cmd_devices() -> CliResult {
    use crate::cuda::probe;
    outln!("cpu: {} cores available (cpu:N makes N devices sharing them)", available_cores());
    match probe::gpus() {
        Ok(gpus) if gpus.is_empty() => outln!("cuda: the driver reports no GPU"),
        Ok(gpus) => {
            for g in &gpus {
                outln!(
                    "cuda:{}: {} | {:.1} GiB | compute capability {}.{} ({})",
                    g.ordinal,
                    g.name,
                    g.total_memory_bytes as f64 / (1u64 << 30) as f64,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.arch()
                );
            }
            for a in 0..gpus.len() {
                let peers: Vec<String> = (0..gpus.len())
                    .filter(|&b| b != a)
                    .map(|b| match probe::peer_access(a, b) {
                        Ok(true) => format!("cuda:{b} yes"),
                        Ok(false) => format!("cuda:{b} no (through the host)"),
                        Err(e) => format!("cuda:{b} unknown ({e})"),
                    })
                    .collect();
                if !peers.is_empty() {
                    outln!("cuda:{a}: peer access to {}", peers.join(", "));
                }
            }
        }
        Err(e) => outln!("cuda: none ({e})"),
    }
    for line in library_lines() {
        outln!("{line}");
    }
    match "auto".parse::<DeviceSpec>().and_then(|s| s.resolve()) {
        Ok(d) => outln!("--devices auto: {d}"),
        Err(e) => outln!("--devices auto: unavailable ({e})"),
    }
    // Whether MPI is built in, and the world this process sees (under mpirun, every
    // process prints its own listing).
    match crate::world::current() {
        Ok(w) => {
            for line in w.summary() {
                outln!("{line}");
            }
        }
        Err(e) => {
            let built =
                if crate::world::MPI_BUILT_IN { "built in" } else { "not built in (build with --features mpi)" };
            outln!("mpi: {built}");
            outln!("world: none: {e}");
        }
    }
    Ok(())
}

/// One line per CUDA library: the file it was loaded from (a system toolkit's unversioned
/// `libnvrtc.so` can shadow the CUDA 13 wheels; this shows which one won), with the
/// version where it is cheap to ask, or what is missing and how to fix it.
fn library_lines() -> Vec<String> {
    use crate::cuda::probe::{self, CudaLib};
    CudaLib::ALL
        .iter()
        .map(|&lib| {
            let name = lib.name();
            let missing = match lib {
                CudaLib::Driver => probe::driver_available().err().map(|e| e.to_string()),
                CudaLib::Nvrtc => probe::nvrtc_available().err().map(|e| e.to_string()),
                CudaLib::Cublas => probe::cublas_available().err().map(|e| e.to_string()),
                CudaLib::Nccl => match probe::nccl_status() {
                    probe::NcclStatus::Available => None,
                    other => Some(other.fix()),
                },
            };
            if let Some(why) = missing {
                return format!("{name}: {why}");
            }
            let version = match lib {
                CudaLib::Driver => probe::driver_cuda_version().ok().map(|(a, b)| format!("CUDA {a}.{b}")),
                CudaLib::Nvrtc => crate::cuda::kernels::nvrtc_version().ok().map(|(a, b)| {
                    let warn = if a == 13 { "" } else { "; not CUDA 13, the version lockstep is built for: put the CUDA 13 lib directory first on LD_LIBRARY_PATH" };
                    format!("NVRTC {a}.{b}{warn}")
                }),
                CudaLib::Cublas | CudaLib::Nccl => None,
            };
            match (probe::loaded_from(lib), version) {
                (Ok(path), Some(v)) => format!("{name}: {} ({v})", path.display()),
                (Ok(path), None) => format!("{name}: {}", path.display()),
                (Err(e), _) => format!("{name}: found, but its file is unknown ({e})"),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// plot

pub(crate) fn cmd_plot(a: PlotArgs) -> CliResult {
    let x = match a.x {
        PlotX::Step => crate::plot::XAxis::Step,
        PlotX::Epoch => crate::plot::XAxis::Epoch,
    };
    crate::plot::plot_metrics_csv(&a.csv, &a.out, x).map_err(Failure::usage)?;
    outln!("curves written to {}", a.out.display());
    Ok(())
}
