//! `lockstep bench allreduce` under an MPI launcher (the `mpi` feature): the exchange
//! between processes beside a plain `MPI_Allreduce` of the same buffers, in the same
//! run, nccl-tests style; with `--grad-compression`, the exchange with 16-bit gradients
//! beside the same exchange in f32 and `MPI_Allreduce`.
//!
//! Each sample times `reps` back-to-back sums (many for small buffers, so that a sample
//! is long against the clock and the barriers' skew), after an MPI barrier; the
//! collectives alternate sample by sample, so that whatever else runs on the machine
//! weighs on all alike. Process 0 prints, with the bytes its exchanges handed MPI per
//! sum; medians, never asserted here.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::exchange::codec::{Codec, Compression};
use crate::exchange::mpi::{plain_all_reduce, MpiGroup, MpiMember};
use crate::exchange::Exchange;
use crate::world::World;

use super::timing::median;
use super::*;

/// Back-to-back sums per sample: about 1 MiB moved, between 1 and 100.
fn reps(bytes: usize) -> usize {
    ((1usize << 20) / bytes).clamp(1, 100)
}

/// The value device `device` of process `process` holds at element `i`: distinct per
/// process, so that a sum that dropped or doubled one would show, and of more
/// significant bits than 16-bit codes keep, so that rounding shows too.
fn value(process: usize, device: usize, i: usize) -> f32 {
    (process * 16 + device + 1) as f32 + (i % 7) as f32 * 0.1 + (i % 1031) as f32 * 1e-4
}

/// What one size measured: median times per sum, bytes process 0 handed MPI per sum,
/// and whether the sums are right (checked for two processes of one device each, where
/// each element is one addition in any order).
struct Timing {
    /// The exchange with the codec (with `--grad-compression`), then in f32.
    coded: Option<(Duration, u64)>,
    plain: (Duration, u64),
    mpi: Duration,
    /// f32: bitwise `MPI_Allreduce`'s sum; with the codec: bitwise the codec's sum of the
    /// two processes' values computed here, `round(round(a) + round(b))`.
    agree: Option<bool>,
}

/// `round(round(a) + round(b))` over the two processes' device-0 values: the codec's sum
/// of two shards, as the shared-memory exchange defines it.
fn coded_sum_of_two(codec: &Codec, count: usize) -> Vec<f32> {
    let round = |v: Vec<f32>| {
        let mut wire = codec.wire(0..count);
        codec.encode(&v, &mut wire, 0..count);
        let mut out = vec![0.0; count];
        codec.decode(&wire, 0..count, &mut out);
        out
    };
    let a = round((0..count).map(|i| value(0, 0, i)).collect());
    let b = round((0..count).map(|i| value(1, 0, i)).collect());
    round(a.iter().zip(&b).map(|(x, y)| x + y).collect())
}

/// Whether the sum `x` holds is bitwise `want`.
fn sum_is(x: &MpiMember<'_, '_>, want: &[f32]) -> crate::Result<bool> {
    let mut same = true;
    x.for_each_sum(|off, piece| {
        same &= piece.iter().zip(&want[off..]).all(|(a, b)| a.to_bits() == b.to_bits());
        Ok(())
    })?;
    Ok(same)
}

fn time_all(
    world: &World,
    devices: usize,
    count: usize,
    (iters, warmup): (usize, usize),
    compression: Compression,
) -> crate::Result<Timing> {
    let p = world.size();
    let wait = crate::exchange::WaitPolicy::for_threads(devices);
    let codec = Codec::new(compression, count);
    let coded = codec.map(|c| MpiGroup::new(world, devices, p * devices, count, wait, Some(c))).transpose()?;
    let plain = MpiGroup::new(world, devices, p * devices, count, wait, None)?;
    let reps = reps(count * 4);
    let sums = ((warmup + iters) * reps) as u64;
    let failed = AtomicBool::new(false);
    type Out = (Vec<Duration>, Vec<Duration>, Vec<Duration>, Option<bool>);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..devices)
            .map(|d| {
                let (coded, plain, failed) = (coded.as_ref(), &plain, &failed);
                s.spawn(move || -> crate::Result<Out> {
                    let mut me = plain.member(d);
                    let mut me_coded = coded.map(|g| g.member(d));
                    let mut run = || -> crate::Result<Out> {
                        let fill = |slot: &mut [f32]| {
                            slot.iter_mut().enumerate().for_each(|(i, v)| *v = value(world.process(), d, i))
                        };
                        me.with_slot(0, fill);
                        if let Some(c) = me_coded.as_mut() {
                            c.with_slot(0, fill);
                        }
                        let send: Vec<f32> = (0..count).map(|i| value(world.process(), 0, i)).collect();
                        let mut recv = vec![0.0f32; count];
                        let (mut t_coded, mut t_plain, mut t_mpi) = (Vec::new(), Vec::new(), Vec::new());
                        for sample in 0..warmup + iters {
                            let timed = sample >= warmup;
                            if let Some(c) = me_coded.as_mut() {
                                if d == 0 {
                                    world.barrier()?;
                                }
                                c.barrier()?;
                                let t0 = Instant::now();
                                for _ in 0..reps {
                                    c.sum()?;
                                }
                                if timed {
                                    t_coded.push(t0.elapsed() / reps as u32);
                                }
                            }
                            if d == 0 {
                                world.barrier()?;
                            }
                            me.barrier()?;
                            let t0 = Instant::now();
                            for _ in 0..reps {
                                me.sum()?;
                            }
                            let t_ours = t0.elapsed() / reps as u32;
                            if d == 0 {
                                world.barrier()?;
                                let t0 = Instant::now();
                                for _ in 0..reps {
                                    plain_all_reduce(world, &send, &mut recv)?;
                                }
                                if timed {
                                    t_plain.push(t_ours);
                                    t_mpi.push(t0.elapsed() / reps as u32);
                                }
                            }
                            me.barrier()?;
                        }
                        // With one device per process the sums are of the same buffers.
                        let agree = match (d == 0 && devices == 1 && p == 2, me_coded.as_ref(), codec) {
                            (false, _, _) => None,
                            (true, Some(c), Some(codec)) => Some(sum_is(c, &coded_sum_of_two(&codec, count))?),
                            (true, _, _) => Some(sum_is(&me, &recv)?),
                        };
                        Ok((t_coded, t_plain, t_mpi, agree))
                    };
                    let out = run();
                    if out.is_err() {
                        failed.store(true, Ordering::SeqCst);
                        crate::exchange::Abort::abort(plain);
                        if let Some(c) = coded {
                            crate::exchange::Abort::abort(c);
                        }
                    }
                    out
                })
            })
            .collect();
        let mut first = None;
        for h in handles {
            let r = h.join().map_err(|_| crate::Error::Worker {
                device: format!("process {}", world.process()),
                step: 0,
                cause: "benchmark thread panicked".into(),
            })??;
            first.get_or_insert(r);
        }
        let (t_coded, t_plain, t_mpi, agree) = first.expect("one device at least");
        Ok(Timing {
            coded: coded.as_ref().map(|g| (median(t_coded), g.bytes_sent() / sums)),
            plain: (median(t_plain), plain.bytes_sent() / sums),
            mpi: median(t_mpi),
            agree,
        })
    })
}

/// The table, printed by process 0 a row at a time.
pub(crate) fn mpi_allreduce(
    world: &World,
    devices: usize,
    sizes: &[usize],
    (iters, warmup): (usize, usize),
    compression: Compression,
) -> CliResult {
    let p = world.size();
    // Processes given other sizes, counts or codecs would meet in collectives of other
    // lengths (MPI_ERR_TRUNCATE) or wait for ever: every process refuses at once.
    let sizes_words: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let settings = [
        ("--sizes".to_string(), sizes_words.join(",")),
        ("--iters".to_string(), iters.to_string()),
        ("--warmup".to_string(), warmup.to_string()),
        ("--grad-compression".to_string(), compression.name().to_string()),
        ("--devices".to_string(), format!("cpu:{devices}")),
    ];
    world.agree(&settings).map_err(Failure::usage)?;
    let mut out = std::io::stdout();
    let voice = world.is_voice();
    let coded = compression != Compression::None;
    let name = compression.name();
    if voice {
        let what = if coded { format!("grad-compression {name} beside f32") } else { "f32 sum".into() };
        let _ = writeln!(
            out,
            "# lockstep bench allreduce: {p} processes x {devices} device thread(s), MPI between processes, {what}, median of {iters} samples after {warmup} warm-up"
        );
        if coded {
            let _ = writeln!(out, "# lockstep {name}: the exchange with {name} gradients (16-bit codes between processes, sums in f32); sizes and bandwidths in f32-equivalent bytes");
        }
        let _ = writeln!(out, "# lockstep: the exchange between processes, summed in the canonical tree over shards (slots filled once, then summed; the trainer's path)");
        let _ = writeln!(out, "# MPI_Allreduce: a plain MPI_Allreduce (sum) of the same buffers, one per process, out of place; its order is MPI's");
        let _ = writeln!(out, "# algbw = size / time; busbw = algbw * 2(n-1)/n, n = {p} processes; ratio = lockstep busbw / MPI_Allreduce busbw");
        if coded {
            let _ = writeln!(
                out,
                "# {name}/f32 = lockstep {name} busbw / lockstep f32 busbw (the same f32-equivalent bytes)"
            );
        }
        let cols = |label: &str| match label.len() <= 10 {
            true => format!(" | {label:>10} {:>11} {:>11}", "", ""),
            false => format!(" | {label:<34}"),
        };
        let heads = format!(" | {:>10} {:>11} {:>11}", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
        let (n, ratio2) = if coded { (3, format!(" {:>8}", format!("{name}/f32"))) } else { (2, String::new()) };
        let labels: Vec<String> = if coded {
            vec![format!("lockstep {name}"), "lockstep".into(), "MPI".into()]
        } else {
            vec!["lockstep".into(), "MPI".into()]
        };
        let _ = writeln!(out, "# {:>12} {:>12}{} | {:>6}{ratio2}", "size(B)", "count(f32)", heads.repeat(n), "ratio");
        let _ = writeln!(out, "# {:>12} {:>12}{} |", "", "", labels.iter().map(|l| cols(l)).collect::<String>());
    }
    let bus = 2.0 * (p as f64 - 1.0) / p as f64;
    let mut verdicts = Vec::new();
    for &bytes in sizes {
        let t = time_all(world, devices, bytes / 4, (iters, warmup), compression).map_err(Failure::runtime)?;
        verdicts.extend(t.agree);
        if voice {
            let mut cells = String::new();
            for d in t.coded.iter().map(|c| c.0).chain([t.plain.0, t.mpi]) {
                let secs = d.as_secs_f64().max(1e-9);
                let algbw = bytes as f64 / secs / 1e9;
                let _ = write!(cells, " | {:>10.2} {:>11.2} {:>11.2}", secs * 1e6, algbw, algbw * bus);
            }
            let ratio = t.mpi.as_secs_f64() / t.plain.0.as_secs_f64().max(1e-12);
            let ratio2 = t
                .coded
                .map_or(String::new(), |c| format!(" {:>8.2}", t.plain.0.as_secs_f64() / c.0.as_secs_f64().max(1e-12)));
            let _ = writeln!(out, "  {bytes:>12} {:>12}{cells} | {ratio:>6.2}{ratio2}", bytes / 4);
            let sent = match t.coded {
                Some((_, c)) => format!(
                    "{c} B with {name}, {} B with f32 ({:.4} of it)",
                    t.plain.1,
                    c as f64 / t.plain.1.max(1) as f64
                ),
                None => format!("{} B", t.plain.1),
            };
            let _ = writeln!(out, "# {bytes} B: process 0 handed MPI {sent} per sum");
        }
    }
    if voice && !verdicts.is_empty() {
        let same = verdicts.iter().all(|&v| v);
        let verdict = if same { "bitwise equal" } else { "NOT bitwise equal" };
        let _ = match coded {
            false => writeln!(
                out,
                "# sums: lockstep's and MPI_Allreduce's are {verdict} at every size (2 processes: one addition per element)"
            ),
            true => writeln!(
                out,
                "# sums: lockstep {name}'s and {name}(round(a) + round(b)) computed in one process are {verdict} at every size"
            ),
        };
    }
    Ok(())
}
