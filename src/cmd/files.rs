//! `lockstep inspect`, `lockstep devices` and `lockstep plot`: looking at files and at
//! the machine.

use crate::*;

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
    use lockstep::cuda::probe;
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
            for (lib, status) in [("nvrtc", probe::nvrtc_available()), ("cublas", probe::cublas_available())] {
                match status {
                    Ok(()) => outln!("{lib}: found"),
                    Err(e) => outln!("{lib}: {e}"),
                }
            }
            outln!("nccl: {}", probe::nccl_status().fix());
        }
        Err(e) => outln!("cuda: none ({e})"),
    }
    match "auto".parse::<DeviceSpec>().and_then(|s| s.resolve()) {
        Ok(d) => outln!("--devices auto: {d}"),
        Err(e) => outln!("--devices auto: unavailable ({e})"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// plot

pub(crate) fn cmd_plot(a: PlotArgs) -> CliResult {
    let x = match a.x {
        PlotX::Step => lockstep::plot::XAxis::Step,
        PlotX::Epoch => lockstep::plot::XAxis::Epoch,
    };
    lockstep::plot::plot_metrics_csv(&a.csv, &a.out, x).map_err(Failure::usage)?;
    outln!("curves written to {}", a.out.display());
    Ok(())
}
