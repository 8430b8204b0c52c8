//! `lockstep bench`: the shared-memory all-reduce (nccl-tests style), whole training
//! steps, and the per-layer time of one device's share of a step. Timings are medians
//! after a warm-up, measured between barriers, never asserted anywhere.

use std::io::Write;

use super::features::FeatureArgs;
use super::timing::median;
use super::*;

#[derive(Args, Debug)]
pub(crate) struct BenchAllreduceArgs {
    /// One member per device: cpu:N (shared memory), or GPUs cuda:I,J,... (NCCL where it
    /// serves; device copies when an ordinal repeats, e.g. cuda:0,0).
    #[arg(long, default_value = "cpu:2", value_name = "SPEC")]
    devices: String,
    /// Buffer sizes in bytes, comma-separated, with K/M/G suffixes (powers of 1024).
    #[arg(long, default_value = "4K,256K,4M,64M")]
    sizes: String,
    /// Timed iterations per size (after warm-up); the median is reported.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed iterations before the timed ones.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// How the values travel: f32, or 16-bit codes summed in f32 (on GPUs, through the
    /// GPU exchange's codec). Sizes and bandwidths stay in f32-equivalent bytes, so the
    /// figures compare with the f32 table.
    #[arg(long, value_enum, default_value = "none")]
    grad_compression: CompressionName,
}

#[derive(Args, Debug)]
pub(crate) struct BenchStepArgs {
    #[arg(long, value_enum, default_value = "convnet")]
    model: ModelName,
    /// GLOBAL batch size [default: toy 64, gpt and llama 12, the image models 128].
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Timed steps (after warm-up).
    #[arg(long, default_value_t = 20, value_name = "K")]
    steps: u64,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// The step's features, as `train` takes them.
    #[command(flatten)]
    features: FeatureArgs,
}

#[derive(Args, Debug)]
pub(crate) struct BenchLayersArgs {
    #[arg(long, value_enum, default_value = "convnet")]
    model: ModelName,
    /// Samples per forward/backward (one device's share of a step) [default: toy 64, gpt and llama 12, convnet 256].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Threads of the device's pool [default: every core].
    #[arg(long)]
    threads: Option<usize>,
    /// Timed passes (after one untimed).
    #[arg(long, default_value_t = 10)]
    steps: u32,
}

// ---------------------------------------------------------------------------------------
// bench

/// The most timed (or warm-up) iterations, steps or passes a benchmark runs: a million
/// is minutes of the smallest all-reduce, and each timing is kept in memory.
const MAX_ITERS: u64 = 1_000_000;
/// The most buffer sizes one `bench allreduce` times.
const MAX_SIZES: usize = 64;
/// The most threads `bench layers` starts per core (as `--devices` allows).
const MAX_THREADS_PER_CORE: usize = 64;

/// `value` of `flag` within 1..=MAX_ITERS (0 too, when `zero_ok`: a warm-up may be skipped).
fn check_count(flag: &str, value: u64, zero_ok: bool) -> CliResult {
    if value == 0 && !zero_ok {
        return Err(Failure::usage(anyhow!("{flag} must be at least 1")));
    }
    if value > MAX_ITERS {
        return Err(Failure::usage(anyhow!("{flag} {value} is more than the {MAX_ITERS} a benchmark runs at most")));
    }
    Ok(())
}

/// Parses `4K,256K,4M` into byte counts (K/M/G are powers of 1024).
fn parse_sizes(text: &str) -> CliResult<Vec<usize>> {
    if text.split(',').count() > MAX_SIZES {
        return Err(Failure::usage(anyhow!("--sizes: more than {MAX_SIZES} sizes")));
    }
    text.split(',')
        .map(|t| {
            let t = t.trim();
            let (num, mult) = match t.char_indices().last() {
                Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
                Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
                Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
                _ => (t, 1),
            };
            let bytes = num
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| Failure::usage(anyhow!("--sizes: '{t}' is not a size (e.g. 4K, 256K, 4M, 64M)")))?;
            if bytes == 0 || bytes % 4 != 0 {
                return Err(Failure::usage(anyhow!("--sizes: {t} is not a positive multiple of 4 bytes (f32 values)")));
            }
            Ok(bytes)
        })
        .collect()
}

/// Which collective a timing loop runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AllreducePath {
    /// Fill the shard buffers once, then reduce-scatter again and again: what a training
    /// step pays (every member reading the reduced chunks in place belongs to its update).
    Trainer,
    /// Classic in-place all-reduce: copy in, reduce-scatter, all-gather.
    Classic,
}

/// What one timing loop runs: how many members, over how many values, how many times, by
/// which path, encoded by which codec.
#[derive(Clone, Copy)]
struct AllreduceRun {
    members: usize,
    count: usize,
    iters: usize,
    warmup: usize,
    path: AllreducePath,
    codec: Option<crate::exchange::codec::Codec>,
}

/// Median time of one collective over `members` threads; member 0 times between barriers.
fn time_allreduce(run: AllreduceRun) -> CliResult<Duration> {
    let AllreduceRun { members, count, iters, warmup, path, codec } = run;
    let ex = ShmGroup::with_codec(members, members, count, crate::exchange::WaitPolicy::for_threads(members), codec)?;
    let warm = std::sync::atomic::AtomicBool::new(false);
    let times = std::thread::scope(|s| -> crate::Result<Vec<Duration>> {
        let handles: Vec<_> = (0..members)
            .map(|r| {
                let (ex, warm) = (&ex, &warm);
                s.spawn(move || -> crate::Result<Vec<Duration>> {
                    let mut me = ex.member(r);
                    let mut run = || -> crate::Result<Vec<Duration>> {
                        let mut buf = vec![(r + 1) as f32; count];
                        me.with_slot(0, |slot| slot.fill((r + 1) as f32));
                        let mut times = Vec::with_capacity(iters);
                        // Warm up for at least `warmup` iterations and 50 ms, so that the
                        // scheduler has spread the members over the cores before timing.
                        // Member 0 decides; the others read its decision after the same
                        // barrier.
                        let start = Instant::now();
                        let mut i = 0usize;
                        let mut timed = 0usize;
                        while timed < iters {
                            if r == 0 && i >= warmup && start.elapsed() >= Duration::from_millis(50) {
                                warm.store(true, std::sync::atomic::Ordering::Release);
                            }
                            me.barrier()?;
                            let measuring = warm.load(std::sync::atomic::Ordering::Acquire);
                            me.barrier()?;
                            i += 1;
                            let t0 = Instant::now();
                            match path {
                                AllreducePath::Trainer => me.sum()?,
                                AllreducePath::Classic => {
                                    crate::exchange::all_reduce_in_place(&mut me, &mut buf)?;
                                    me.barrier()?;
                                }
                            }
                            if measuring {
                                times.push(t0.elapsed());
                                timed += 1;
                            }
                        }
                        Ok(times)
                    };
                    let out = run();
                    if out.is_err() {
                        ex.abort();
                    }
                    out
                })
            })
            .collect();
        let mut member0 = Vec::new();
        for (r, h) in handles.into_iter().enumerate() {
            let t = h.join().map_err(|_| crate::Error::Worker {
                device: format!("cpu:{r}"),
                step: 0,
                cause: "benchmark member panicked".into(),
            })??;
            if r == 0 {
                member0 = t;
            }
        }
        Ok(member0)
    })
    .map_err(Failure::runtime)?;
    Ok(median(times))
}

pub(crate) fn cmd_bench_allreduce(a: BenchAllreduceArgs) -> CliResult {
    let spec: DeviceSpec = a.devices.parse().map_err(Failure::usage)?;
    let sizes = parse_sizes(&a.sizes)?;
    check_count("--iters", a.iters as u64, false)?;
    check_count("--warmup", a.warmup as u64, true)?;
    let members = match spec {
        #[cfg(feature = "mpi")]
        DeviceSpec::Cpu { count, .. } if crate::world::current().is_ok_and(|w| w.size() > 1) => {
            let world = crate::world::current().map_err(Failure::usage)?;
            return super::bench_mpi::mpi_allreduce(
                world,
                count,
                &sizes,
                (a.iters, a.warmup),
                a.grad_compression.compression(),
            );
        }
        DeviceSpec::Cpu { count, .. } => {
            // One thread per member: the bound of `--devices cpu:N` (64 threads per core).
            Devices::cpu(count, 1).map_err(Failure::usage)?;
            // Each member's slot and its own buffer, plus the reduced chunks.
            let largest = sizes.iter().copied().max().unwrap_or(0) as u64;
            let bytes = largest.saturating_mul(2 * count as u64 + 1);
            crate::memory::check_bytes(
                &format!("bench allreduce of {largest} bytes on {count} members"),
                bytes,
                format!(
                    "{} buffers of the largest size: a slot and a buffer per member, and the reduced chunks",
                    2 * count + 1
                ),
            )
            .map_err(Failure::usage)?;
            count
        }
        DeviceSpec::Auto => {
            return Err(Failure::usage(anyhow!(
                "--devices auto: name the members of bench allreduce (cpu:N or cuda:I,J,...)"
            )))
        }
        DeviceSpec::CudaAll | DeviceSpec::Cuda(_) => {
            let devices = resolve_devices(&a.devices)?;
            let ordinals: Vec<usize> = devices
                .list()
                .iter()
                .filter_map(|d| if let crate::Device::Cuda(o) = d { Some(*o) } else { None })
                .collect();
            return bench_gpu_allreduce(&ordinals, &sizes, (a.iters, a.warmup), a.grad_compression.compression());
        }
    };
    cpu_allreduce(&mut std::io::stdout(), members, &sizes, (a.iters, a.warmup), a.grad_compression.compression())
}

/// Times the shared-memory all-reduce of `members` threads at every size and prints the
/// table to `out`, a row as soon as it is measured; `(iters, warmup)` per size. With a
/// compression, the whole buffer is a gradient (encoded), and a comment line per size
/// gives the time one member takes to encode its buffer when it hands it over (in training,
/// right after its backward, counted in the compute time), beside the f32 path's time
/// for the same size.
fn cpu_allreduce(
    out: &mut dyn Write,
    members: usize,
    sizes: &[usize],
    (iters, warmup): (usize, usize),
    compression: crate::exchange::codec::Compression,
) -> CliResult {
    use crate::exchange::codec::{Codec, Compression};
    cpu_table_header(out, members, iters, warmup);
    if compression != Compression::None {
        let _ = writeln!(
            out,
            "# grad-compression {}: 16-bit codes cross between members, sums in f32; sizes and bandwidths in f32-equivalent bytes",
            compression.name()
        );
    }
    for &bytes in sizes {
        let count = bytes / 4;
        let codec = Codec::new(compression, count);
        let run = AllreduceRun { members, count, iters, warmup, path: AllreducePath::Trainer, codec };
        let trainer = time_allreduce(run)?;
        let classic = time_allreduce(AllreduceRun { path: AllreducePath::Classic, ..run })?;
        if let Some(codec) = codec {
            let f32_trainer = time_allreduce(AllreduceRun { codec: None, ..run })?;
            let encode = time_encode(&codec, count, iters);
            let _ = writeln!(
                out,
                "# {bytes} B: {} B on the wire per member's buffer; encode of one member's buffer {:.1} us; f32 trainer path {:.1} us; {} trainer path {:.1} us ({:.2}x)",
                codec.wire(0..count).bytes(),
                encode.as_secs_f64() * 1e6,
                f32_trainer.as_secs_f64() * 1e6,
                compression.name(),
                trainer.as_secs_f64() * 1e6,
                f32_trainer.as_secs_f64() / trainer.as_secs_f64().max(1e-12)
            );
        }
        cpu_table_row(out, members, bytes, [trainer, classic]);
    }
    Ok(())
}

/// Median time of encoding one buffer of `count` values (one member's hand-over).
fn time_encode(codec: &crate::exchange::codec::Codec, count: usize, iters: usize) -> Duration {
    let src: Vec<f32> = (0..count).map(|i| (i as f32 * 1e-3).sin()).collect();
    let mut wire = codec.wire(0..count);
    let times = (0..iters.max(3))
        .map(|_| {
            let t0 = Instant::now();
            codec.encode(&src, &mut wire, 0..count);
            t0.elapsed()
        })
        .collect();
    median(times)
}

/// The CPU table's header: size, count | trainer time, algbw, busbw | classic time,
/// algbw, busbw (scripts/bench_tables.py reads it; its `cpu` parser counts on these
/// columns).
fn cpu_table_header(out: &mut dyn Write, members: usize, iters: usize, warmup: usize) {
    let _ = writeln!(
        out,
        "# lockstep bench allreduce: {members} member(s) (threads, cpu:0..{}), shared memory, f32 sum, median of {iters} iterations after {warmup} warm-up",
        members - 1
    );
    let _ = writeln!(
        out,
        "# trainer: buffers filled once, then reduce-scatter (the trainer's path; members read the result in place)"
    );
    let _ = writeln!(out, "# classic: in-place all_reduce_sum (copy in + reduce-scatter + all-gather)");
    let _ = writeln!(out, "# algbw = size / time; busbw = algbw * 2(n-1)/n");
    let _ = writeln!(
        out,
        "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11}",
        "", "", "trainer", "", "", "classic", "", ""
    );
    let _ = writeln!(
        out,
        "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11}",
        "size(B)", "count(f32)", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
    );
}

/// One row of the CPU table: `bytes` moved in `times` (trainer path, classic path).
fn cpu_table_row(out: &mut dyn Write, members: usize, bytes: usize, times: [Duration; 2]) {
    let bus = 2.0 * (members as f64 - 1.0) / members as f64;
    let mut cells = String::new();
    for t in times {
        let secs = t.as_secs_f64().max(1e-9);
        let algbw = bytes as f64 / secs / 1e9;
        let _ = write!(cells, " | {:>10.1} {:>11.2} {:>11.2}", secs * 1e6, algbw, algbw * bus);
    }
    let _ = writeln!(out, "  {bytes:>12} {:>12}{cells}", bytes / 4);
}

/// The GPU collective over `ordinals` (one member and thread each), nccl-tests style:
/// after the warm-up each member queues `iters` all-reduces and synchronises once; member
/// 0's mean time per all-reduce is reported with busbw, beside the device-to-device copy bandwidth of GPU 0 at the same
/// size (read + write of `size` bytes), the memory bound busbw is compared with. With a
/// compression, each member's buffer is one gradient slot of the GPU exchange with the
/// codec (`GpuExchange::with_codec`: encoded, the 16-bit wires all-gathered, reduced and
/// decoded on every member), timed per sum, its busbw in f32-equivalent bytes as the CPU
/// table's.
fn bench_gpu_allreduce(
    ordinals: &[usize],
    sizes: &[usize],
    (iters, warmup): (usize, usize),
    compression: crate::exchange::codec::Compression,
) -> CliResult {
    let transport = crate::exchange::RunTransport::from(crate::exchange::gpu::transport_for(ordinals)).name();
    let out = &mut std::io::stdout();
    let sum = match compression {
        crate::exchange::codec::Compression::None => "f32 sum".to_string(),
        c => format!("{} codec sum (16-bit wires all-gathered, decoded and summed on every member)", c.name()),
    };
    gpu_table_header(out, ordinals, transport, &sum, iters, warmup);
    for &bytes in sizes {
        let count = (bytes / 4).max(1);
        let t = time_gpu_allreduce(ordinals, count, (iters, warmup), compression).map_err(Failure::runtime)?;
        let c = time_gpu_copy(ordinals[0], count, iters, warmup).map_err(Failure::runtime)?;
        gpu_table_row(out, ordinals.len(), bytes, t, c);
    }
    Ok(())
}

/// The GPU table's header: size, count | time, algbw, busbw | copy, busbw/copy. Two
/// columns where the CPU table has three after the second bar: scripts/bench_tables.py
/// has a `gpu` parser for it.
fn gpu_table_header(out: &mut dyn Write, ordinals: &[usize], transport: &str, sum: &str, iters: usize, warmup: usize) {
    let names: Vec<String> = ordinals.iter().map(|o| o.to_string()).collect();
    let _ = writeln!(
        out,
        "# lockstep bench allreduce: {} member(s) on cuda:{} ({transport}), {sum}, mean of {iters} iterations after {warmup} warm-up",
        ordinals.len(),
        names.join(",")
    );
    let _ = writeln!(
        out,
        "# algbw = size / time; busbw = algbw * 2(n-1)/n; copy = device-to-device copy of the same size on GPU {} (size / time)",
        ordinals[0]
    );
    let _ = writeln!(
        out,
        "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>11} {:>10}",
        "size(B)", "count(f32)", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "copy(GB/s)", "busbw/copy"
    );
}

/// One row of the GPU table: one all-reduce of `bytes` over `members` took `t`, one
/// device-to-device copy of as many bytes took `copy`.
fn gpu_table_row(out: &mut dyn Write, members: usize, bytes: usize, t: Duration, copy: Duration) {
    let bus = 2.0 * (members as f64 - 1.0) / members as f64;
    let secs = t.as_secs_f64().max(1e-9);
    let algbw = bytes as f64 / secs / 1e9;
    let copy_bw = bytes as f64 / copy.as_secs_f64().max(1e-9) / 1e9;
    let _ = writeln!(
        out,
        "  {bytes:>12} {:>12} | {:>10.1} {:>11.2} {:>11.2} | {:>11.2} {:>10.2}",
        (bytes / 4).max(1),
        secs * 1e6,
        algbw,
        algbw * bus,
        copy_bw,
        algbw * bus / copy_bw
    );
}

fn time_gpu_allreduce(
    ordinals: &[usize],
    count: usize,
    rounds: (usize, usize),
    compression: crate::exchange::codec::Compression,
) -> crate::Result<Duration> {
    use crate::exchange::gpu::{transport_for, GpuGroup};
    let codec = crate::exchange::codec::Codec::new(compression, count);
    let group = GpuGroup::new(transport_for(ordinals), ordinals, count)?;
    time_gpu_members(ordinals, count, rounds, codec, &group, |r, s| group.join(r, s))
}

/// One thread per member of `group` (joined by `join`): after the warm-up each queues
/// `iters` all-reduces (with a codec, sums of the GPU exchange over one slot) and
/// synchronises once; member 0's mean time per all-reduce.
fn time_gpu_members<C: crate::exchange::gpu::DeviceAllReduce>(
    ordinals: &[usize],
    count: usize,
    (iters, warmup): (usize, usize),
    codec: Option<crate::exchange::codec::Codec>,
    group: &dyn crate::exchange::Abort,
    join: impl Fn(usize, &std::sync::Arc<cudarc::driver::CudaStream>) -> crate::Result<C> + Sync,
) -> crate::Result<Duration> {
    use cudarc::driver::CudaContext;
    let time = std::thread::scope(|s| -> crate::Result<Duration> {
        let handles: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(r, &ordinal)| {
                let join = &join;
                s.spawn(move || -> crate::Result<Duration> {
                    // No host barrier: the collective itself paces the members, and an
                    // abort releases every one of them.
                    let run = || -> crate::Result<Duration> {
                        let ctx = CudaContext::new(ordinal)?;
                        let stream = ctx.new_stream()?;
                        let mut buf = stream.clone_htod(&vec![(r + 1) as f32; count])?;
                        let mut me = join(r, &stream)?;
                        if codec.is_some() {
                            use crate::exchange::Exchange;
                            let mut ex = crate::exchange::gpu::GpuExchange::new(me, count, 1)?.with_codec(codec)?;
                            ex.with_slot(0, |mut slot| stream.memcpy_dtod(&buf, &mut slot))?;
                            for _ in 0..warmup {
                                ex.sum()?;
                            }
                            stream.synchronize()?;
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                ex.sum()?;
                            }
                            stream.synchronize()?;
                            return Ok(t0.elapsed() / iters as u32);
                        }
                        for _ in 0..warmup {
                            me.all_reduce_sum(&mut buf.as_view_mut())?;
                        }
                        stream.synchronize()?;
                        let t0 = Instant::now();
                        for _ in 0..iters {
                            me.all_reduce_sum(&mut buf.as_view_mut())?;
                        }
                        stream.synchronize()?;
                        Ok(t0.elapsed() / iters as u32)
                    };
                    let out = run();
                    if out.is_err() {
                        group.abort();
                    }
                    out
                })
            })
            .collect();
        let mut member0 = Duration::ZERO;
        let mut first_error = None;
        for (r, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(Ok(t)) if r == 0 => member0 = t,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert(crate::Error::Worker {
                        device: format!("cuda:{}", ordinals[r]),
                        step: 0,
                        cause: "benchmark member panicked".into(),
                    });
                }
            }
        }
        first_error.map_or(Ok(member0), Err)
    })?;
    Ok(time)
}

/// Mean time of one device-to-device copy of `count` f32 on GPU `ordinal`.
fn time_gpu_copy(ordinal: usize, count: usize, iters: usize, warmup: usize) -> crate::Result<Duration> {
    let ctx = cudarc::driver::CudaContext::new(ordinal)?;
    let stream = ctx.new_stream()?;
    let src = stream.alloc_zeros::<f32>(count)?;
    let mut dst = stream.alloc_zeros::<f32>(count)?;
    for _ in 0..warmup {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    Ok(t0.elapsed() / iters as u32)
}

/// The data a benchmark of `model` steps through: the toy's points, the language
/// models' windows of the fortunes (nanoGPT's CPU recipe's context), the digits for the
/// image models.
fn bench_data(model: ModelName) -> CliResult<Dataset> {
    match model {
        ModelName::Gpt | ModelName::Llama => {
            Ok(crate::data::text::load_fortunes(crate::models::GptConfig::default().context)
                .map_err(|e| Failure::usage(anyhow!("--model {} reads the fortunes: {e}", model.as_str())))?
                .train)
        }
        ModelName::Toy => Ok(load_data("toy-enlarged", true, 0, None, None)?.train),
        _ => Ok(load_data("digits", false, 0, None, None)?.train),
    }
}

pub(crate) fn cmd_bench_step(a: BenchStepArgs) -> CliResult {
    let toy = a.model == ModelName::Toy;
    let text = a.model.is_language_model();
    let batch_size = a.batch_size.unwrap_or(match a.model {
        ModelName::Toy => 64,
        ModelName::Gpt | ModelName::Llama => 12,
        _ => 128,
    });
    if batch_size == 0 {
        return Err(Failure::usage(anyhow!("--batch-size must be at least 1")));
    }
    check_count("--steps", a.steps, false)?;
    check_count("--warmup", a.warmup, true)?;
    let devices = resolve_devices(&a.devices)?;
    let data = bench_data(a.model)?;
    let dropout = if text { 0.0 } else { 0.5 };
    let model =
        build_model(&ModelSource::Builtin(a.model), data.sample_shape().dims(), data.num_classes(), dropout, 0.99)?;
    let model = a.features.model(model)?;
    let optimizer = if toy { OptimizerConfig::sgd(0.05) } else { OptimizerConfig::adam(1e-3) };
    let config =
        a.features.config(TrainConfig { batch_size, optimizer, check_replicas_every: None, ..TrainConfig::default() });
    let total = a.warmup + a.steps;
    let kept = total.min(8);
    let mut estimate = crate::train::memory::training(&model, &devices, &config);
    let per_batch = (batch_size as u64).saturating_mul(data.sample_shape().numel() as u64).saturating_mul(4);
    estimate.add("benchmark batches", kept.saturating_mul(per_batch), format!("{kept} batches of {batch_size}"));
    estimate.check("bench step").map_err(Failure::usage)?;
    let batches: Vec<Batch> = (0..kept as usize)
        .map(|s| {
            let idx: Vec<usize> = (0..batch_size).map(|i| (s * batch_size + i) % data.len()).collect();
            Batch::gather(&data, &idx)
        })
        .collect();
    // Under mpirun every process runs the steps; process 0 reports (the slowest
    // process's times are in every step's merged report).
    let world = crate::world::current().map_err(Failure::usage)?;
    let shown = match world.size() {
        1 => devices.to_string(),
        p => format!("{p} processes × {devices}"),
    };
    if world.is_voice() {
        outln!(
            "lockstep bench step: {} ({} parameters) | devices: {shown} | global batch {batch_size} | {} steps after {} warm-up{}",
            a.model.as_str(),
            model.num_params(),
            a.steps,
            a.warmup,
            bench_features(&a)
        );
    }
    let (walls, computes, reduces, optimizer_bytes) = with_trainer(&model, &devices, &config, |t| {
        let (mut walls, mut computes, mut reduces) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..total {
            let r = t.step(batches[s as usize % batches.len()].clone())?;
            if s >= a.warmup {
                walls.push(r.wall);
                computes.push(r.compute);
                reduces.push(r.reduce);
            }
        }
        Ok((walls, computes, reduces, t.optimizer_bytes()?))
    })
    .map_err(Failure::runtime)?;
    let sum: Duration = walls.iter().sum();
    let step = median(walls);
    if !world.is_voice() {
        return Ok(());
    }
    let samples_per_s = (batch_size as u64 * a.steps) as f64 / sum.as_secs_f64().max(1e-12);
    // A sequence's samples are windows of T tokens, each a prediction.
    let tokens = match data.targets_per_sample() {
        1 => String::new(),
        t => format!(" ({:.0} tokens/s)", samples_per_s * t as f64),
    };
    outln!(
        "{samples_per_s:.0} samples/s{tokens} | median step {:.3} ms (compute {:.3} ms, reduce {:.3} ms, slowest worker) | mean step {:.3} ms",
        step.as_secs_f64() * 1e3,
        median(computes).as_secs_f64() * 1e3,
        median(reduces).as_secs_f64() * 1e3,
        sum.as_secs_f64() * 1e3 / a.steps as f64
    );
    let bytes: Vec<String> = optimizer_bytes.iter().map(|b| b.to_string()).collect();
    outln!("optimizer state per device: {} bytes", bytes.join(", "));
    Ok(())
}

/// The features of issue 12 a `bench step` uses, as a suffix of its first line.
fn bench_features(a: &BenchStepArgs) -> String {
    a.features.described().iter().map(|p| format!(" | {p}")).collect()
}

// ---------------------------------------------------------------------------------------
// bench layers

/// Times forward, loss and backward of one device's share of a step, layer by layer, on
/// a pool of `--threads` threads (the optimiser and the all-reduce are `bench step`'s).
pub(crate) fn cmd_bench_layers(a: BenchLayersArgs) -> CliResult {
    let toy = a.model == ModelName::Toy;
    let text = a.model.is_language_model();
    let batch_size = a.batch_size.unwrap_or(if toy {
        64
    } else if text {
        12
    } else {
        256
    });
    let threads = a.threads.unwrap_or_else(available_cores);
    if batch_size == 0 || threads == 0 {
        return Err(Failure::usage(anyhow!("--batch-size and --threads must be at least 1")));
    }
    let max_threads = MAX_THREADS_PER_CORE * available_cores();
    if threads > max_threads {
        return Err(Failure::usage(anyhow!(
            "--threads {threads} is more than {MAX_THREADS_PER_CORE} per core ({max_threads} here)"
        )));
    }
    check_count("--steps", a.steps.into(), false)?;
    // The language models of nanoGPT's CPU recipe read windows of the fortunes.
    let data = bench_data(a.model)?;
    let source = ModelSource::Builtin(a.model);
    let mut model =
        build_model(&source, data.sample_shape().dims(), data.num_classes(), if text { 0.0 } else { 0.5 }, 0.99)?;
    let mut estimate = crate::memory::Estimate::default();
    let per_sample = data.sample_shape().numel() as u64 * 4;
    estimate
        .add(
            "activations",
            crate::memory::shard_activations(&model, batch_size, threads),
            format!("a pass of {batch_size} samples"),
        )
        .add(
            "batch",
            (batch_size as u64).saturating_mul(per_sample),
            "the gathered batch (its copy as a tensor is the pass's)",
        )
        .add("weights and gradients", model.params_len() as u64 * 8 + model.buffers_len() as u64 * 4, "one replica");
    estimate.check("bench layers").map_err(Failure::usage)?;
    let idx: Vec<usize> = (0..batch_size).map(|i| i % data.len()).collect();
    let batch = Batch::gather(&data, &idx);
    let mut store = model.init(0);
    let mut grads = vec![0.0f32; model.params_len()];
    let pool =
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| Failure::runtime(anyhow!(e)))?;
    let mut dims = vec![batch_size];
    dims.extend_from_slice(batch.sample_shape.dims());
    let mut total = Duration::ZERO;
    pool.install(|| -> crate::Result<()> {
        for pass in 0..=a.steps {
            if pass == 1 {
                model.start_profile();
            }
            let t0 = Instant::now();
            let x = crate::Tensor::from_vec(batch.x.clone(), dims.clone())?;
            let ctx = crate::nn::Ctx::train(0, pass as u64, 0, crate::Device::Cpu(0));
            let logits = model.forward(x, &store.params, &mut store.buffers, &ctx)?;
            let (_, dlogits) = crate::nn::loss::softmax_cross_entropy(&logits, &batch.y)?;
            grads.fill(0.0);
            model.backward(dlogits, &store.params, &mut grads, &ctx)?;
            if pass > 0 {
                total += t0.elapsed();
            }
        }
        Ok(())
    })
    .map_err(Failure::runtime)?;
    let per = |d: Duration| d.as_secs_f64() * 1e3 / a.steps as f64;
    outln!(
        "lockstep bench layers: {} | {batch_size} samples | {threads} thread(s) | mean of {} passes",
        a.model.as_str(),
        a.steps
    );
    // A container's layers follow its row, indented a level deeper; its time includes
    // theirs, so the shares of the network's own layers (depth 0) add up to the pass.
    let profile = model.profile();
    let label = |r: &crate::nn::ProfileRow| format!("{}{}", "  ".repeat(r.depth), r.name);
    let width = profile.iter().map(|r| label(r).chars().count()).max().unwrap_or(0).max(12);
    outln!("{:<width$} {:<52} {:>10} {:>10} {:>7}", "layer", "", "fwd (ms)", "bwd (ms)", "share");
    for r in &profile {
        outln!(
            "{:<width$} {:<52} {:>10.3} {:>10.3} {:>6.1}%",
            label(r),
            clipped(&r.description, 52),
            per(r.forward),
            per(r.backward),
            100.0 * (r.forward + r.backward).as_secs_f64() / total.as_secs_f64().max(1e-12)
        );
    }
    let layers: Duration = profile.iter().filter(|r| r.depth == 0).map(|r| r.forward + r.backward).sum();
    outln!(
        "{:<w$} {:>10.3} ms (loss and the rest: {:.3} ms)",
        "pass",
        per(total),
        per(total.saturating_sub(layers)),
        w = width + 53
    );
    outln!("{:.0} samples/s on this pass alone", batch_size as f64 * a.steps as f64 / total.as_secs_f64().max(1e-12));
    Ok(())
}

/// `text` cut to `width` characters, its last one `…` where it was longer (a residual
/// block describes all its layers; they have rows of their own).
fn clipped(text: &str, width: usize) -> String {
    match text.char_indices().nth(width.saturating_sub(1)) {
        Some((at, _)) if text.chars().count() > width => format!("{}…", &text[..at]),
        _ => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_description_is_clipped_to_its_column() {
        assert_eq!(clipped("Conv2d(16, 3x3)", 52), "Conv2d(16, 3x3)");
        assert_eq!(clipped("abcdef", 6), "abcdef");
        assert_eq!(clipped("abcdefg", 6), "abcde…");
        assert_eq!(clipped("ξξξξξξξ", 4).chars().count(), 4);
    }

    /// Runs `python3 scripts/bench_tables.py KIND FILE` on `table`: Ok(its line of figures),
    /// Err(its message) when it refuses the table. None, after a loud line, when there is
    /// no python3 (gpu-check.sh then prints n/a too).
    fn parse(kind: &str, table: &str, tag: &str) -> Option<Result<String, String>> {
        let file = std::env::temp_dir().join(format!("lockstep-bench-table-{}-{tag}.txt", std::process::id()));
        std::fs::write(&file, table).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_tables.py");
        let out = std::process::Command::new("python3").arg(script).arg(kind).arg(&file).output();
        let _ = std::fs::remove_file(&file);
        match out {
            Ok(o) if o.status.success() => Some(Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())),
            Ok(o) => Some(Err(String::from_utf8_lossy(&o.stderr).trim().to_string())),
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "\n!!!!!!!! bench table parsers: skipped: no python3 ({e})\n");
                None
            }
        }
    }

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    /// A GPU table as `bench allreduce --devices cuda:0,0` prints it, with made-up times.
    fn gpu_table() -> String {
        let mut out = Vec::new();
        gpu_table_header(&mut out, &[0, 0], "device copies", "f32 sum", 50, 5);
        // 64 MiB in 1 ms, copied in 400 us; 4 KiB in 20 us, copied in 5 us.
        gpu_table_row(&mut out, 2, 64 << 20, us(1000), us(400));
        gpu_table_row(&mut out, 2, 4 << 10, us(20), us(5));
        String::from_utf8(out).unwrap()
    }

    /// A CPU table as `bench allreduce --devices cpu:4` prints it, with made-up times.
    fn cpu_table() -> String {
        let mut out = Vec::new();
        cpu_table_header(&mut out, 4, 50, 5);
        cpu_table_row(&mut out, 4, 4 << 10, [us(10), us(25)]);
        cpu_table_row(&mut out, 4, 64 << 20, [us(8000), us(20_000)]);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_gpu_parser_reads_busbw_copy_and_their_ratio() {
        let Some(got) = parse("gpu", &gpu_table(), "gpu") else { return };
        // 2 members: busbw = algbw · 2(2−1)/2 = algbw = 67108864 B / 1 ms = 67.108864 GB/s;
        // copy = 67108864 B / 400 us = 167.77216 GB/s; ratio 67.108864 / 167.77216 = 0.4;
        // the smallest row's time, 20 us.
        assert_eq!(got.unwrap(), "67108864 67.11 167.77 0.40 | 4096 20.0");
    }

    #[test]
    fn the_cpu_parser_reads_both_paths() {
        let Some(got) = parse("cpu", &cpu_table(), "cpu") else { return };
        // 4 members: busbw = algbw · 2·3/4 = 1.5 algbw. Trainer: 67108864 B / 8 ms =
        // 8.388608 GB/s → 12.582912; classic: / 20 ms = 3.3554432 → 5.0331648. The
        // smallest row's times: 10 and 25 us.
        assert_eq!(got.unwrap(), "67108864 12.58 5.03 | 4096 10.0 25.0");
    }

    #[test]
    fn each_parser_refuses_the_other_table() {
        // The old bug: gpu-check read the GPU table with the CPU parser and got n/a.
        // Now a table of the wrong kind is an error naming the widths, never a figure.
        let Some(got) = parse("cpu", &gpu_table(), "gpu-as-cpu") else { return };
        let e = got.unwrap_err();
        assert!(e.contains("(3, 2)") && e.contains("a cpu table has 2, (3, 3)"), "{e}");
        let e = parse("gpu", &cpu_table(), "cpu-as-gpu").unwrap().unwrap_err();
        assert!(e.contains("(3, 3)") && e.contains("a gpu table has 2, (3, 2)"), "{e}");
    }

    #[test]
    fn the_cpu_parser_reads_a_real_run() {
        // The whole CPU path as `bench allreduce --devices cpu:2 --sizes 4K,64K` runs it.
        let mut out = Vec::new();
        cpu_allreduce(&mut out, 2, &[4 << 10, 64 << 10], (3, 1), crate::exchange::codec::Compression::None)
            .map_err(|f| format!("{f:?}"))
            .unwrap();
        let table = String::from_utf8(out).unwrap();
        let Some(got) = parse("cpu", &table, "cpu-real") else { return };
        let got = got.unwrap_or_else(|e| panic!("{e}\n{table}"));
        let fields: Vec<&str> = got.split_whitespace().collect();
        // BYTES busbw busbw | SMALL time time: the sizes asked for, and positive figures.
        assert_eq!((fields.len(), fields[0], fields[3], fields[4]), (7, "65536", "|", "4096"), "{got}\n{table}");
        for f in [1, 2, 5, 6] {
            let v: f64 = fields[f].parse().unwrap();
            assert!(v > 0.0 && v.is_finite(), "field {f} of {got}\n{table}");
        }
        // With bf16 on the wire the table keeps its columns (its extra lines are comments).
        let mut out = Vec::new();
        cpu_allreduce(&mut out, 2, &[4 << 10, 64 << 10], (3, 1), crate::exchange::codec::Compression::Bf16)
            .map_err(|f| format!("{f:?}"))
            .unwrap();
        let table = String::from_utf8(out).unwrap();
        assert!(
            table.contains("# grad-compression bf16") && table.contains("encode of one member's buffer"),
            "{table}"
        );
        let got = parse("cpu", &table, "cpu-real-bf16").unwrap().unwrap_or_else(|e| panic!("{e}\n{table}"));
        assert_eq!(got.split_whitespace().count(), 7, "{got}\n{table}");
    }
}
