//! `lockstep bench allreduce` under an MPI launcher (the `mpi` feature): the exchange
//! between processes beside a plain `MPI_Allreduce` of the same buffers, in the same
//! run, nccl-tests style.
//!
//! Each sample times `reps` back-to-back sums (many for small buffers, so that a sample
//! is long against the clock and the barriers' skew), after an MPI barrier; the two
//! collectives alternate sample by sample, so that whatever else runs on the machine
//! weighs on both alike. Process 0 prints; medians, never asserted here.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use lockstep::exchange::mpi::{plain_all_reduce, MpiGroup};
use lockstep::world::World;

use crate::cmd::bench::median;
use crate::*;

/// Back-to-back sums per sample: about 1 MiB moved, between 1 and 100.
fn reps(bytes: usize) -> usize {
    ((1usize << 20) / bytes).clamp(1, 100)
}

/// The value device `device` of process `rank` holds at element `i`: distinct per
/// process, so that a sum that dropped or doubled one would show.
fn value(rank: usize, device: usize, i: usize) -> f32 {
    (rank * 16 + device + 1) as f32 + (i % 7) as f32 * 0.125
}

/// Median times per sum of the exchange and of `MPI_Allreduce`, and whether their sums
/// agree bitwise (checked for two processes, where each element is one addition in
/// either order).
fn time_both(
    world: &World,
    devices: usize,
    count: usize,
    iters: usize,
    warmup: usize,
) -> lockstep::Result<(Duration, Duration, Option<bool>)> {
    let p = world.size();
    let group =
        MpiGroup::new(world, devices, p * devices, count, lockstep::exchange::Wait::for_threads(devices), None)?;
    let reps = reps(count * 4);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..devices)
            .map(|d| {
                let (group, failed) = (&group, &failed);
                s.spawn(move || -> lockstep::Result<(Vec<Duration>, Vec<Duration>, Option<bool>)> {
                    let mut me = group.rank(d);
                    let mut run = || -> lockstep::Result<_> {
                        me.with_slot(0, |slot| {
                            slot.iter_mut().enumerate().for_each(|(i, v)| *v = value(world.rank(), d, i))
                        });
                        let send: Vec<f32> = (0..count).map(|i| value(world.rank(), 0, i)).collect();
                        let mut recv = vec![0.0f32; count];
                        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
                        for sample in 0..warmup + iters {
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
                                if sample >= warmup {
                                    ours.push(t_ours);
                                    theirs.push(t0.elapsed() / reps as u32);
                                }
                            }
                            me.barrier()?;
                        }
                        // With one device per process both sums are of the same buffers.
                        let agree = (d == 0 && devices == 1 && p == 2).then(|| {
                            let mut same = true;
                            me.for_each_sum(|off, piece| {
                                same &= piece.iter().zip(&recv[off..]).all(|(a, b)| a.to_bits() == b.to_bits());
                                Ok(())
                            })
                            .map(|()| same)
                        });
                        Ok((ours, theirs, agree.transpose()?))
                    };
                    let out = run();
                    if out.is_err() {
                        failed.store(true, Ordering::SeqCst);
                        lockstep::exchange::Abort::abort(group);
                    }
                    out
                })
            })
            .collect();
        let mut first = None;
        for h in handles {
            let r = h.join().map_err(|_| lockstep::Error::Worker {
                device: format!("rank {}", world.rank()),
                step: 0,
                cause: "benchmark thread panicked".into(),
            })??;
            first.get_or_insert(r);
        }
        let (ours, theirs, agree) = first.expect("one device at least");
        Ok((median(ours), median(theirs), agree))
    })
}

/// The table, printed by process 0 a row at a time.
pub(crate) fn mpi_allreduce(world: &World, devices: usize, sizes: &[usize], iters: usize, warmup: usize) -> CliResult {
    let p = world.size();
    let mut out = std::io::stdout();
    let voice = world.is_voice();
    if voice {
        let _ = writeln!(
            out,
            "# lockstep bench allreduce: {p} processes x {devices} device thread(s), MPI between processes, f32 sum, median of {iters} samples after {warmup} warm-up"
        );
        let _ = writeln!(out, "# lockstep: the exchange between processes, summed in the canonical tree over shards (slots filled once, then summed; the trainer's path)");
        let _ = writeln!(out, "# MPI_Allreduce: a plain MPI_Allreduce (sum) of the same buffers, one per process, out of place; its order is MPI's");
        let _ = writeln!(out, "# algbw = size / time; busbw = algbw * 2(n-1)/n, n = {p} processes; ratio = lockstep busbw / MPI_Allreduce busbw");
        let _ = writeln!(
            out,
            "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11} | {:>6}",
            "size(B)",
            "count(f32)",
            "time(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "time(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "ratio"
        );
        let _ = writeln!(
            out,
            "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11} |",
            "", "", "lockstep", "", "", "MPI", "", ""
        );
    }
    let bus = 2.0 * (p as f64 - 1.0) / p as f64;
    let mut verdicts = Vec::new();
    for &bytes in sizes {
        let (ours, theirs, agree) = time_both(world, devices, bytes / 4, iters, warmup).map_err(Failure::runtime)?;
        verdicts.extend(agree);
        if voice {
            let mut cells = String::new();
            for t in [ours, theirs] {
                let secs = t.as_secs_f64().max(1e-9);
                let algbw = bytes as f64 / secs / 1e9;
                let _ = write!(cells, " | {:>10.2} {:>11.2} {:>11.2}", secs * 1e6, algbw, algbw * bus);
            }
            let ratio = theirs.as_secs_f64() / ours.as_secs_f64().max(1e-12);
            let _ = writeln!(out, "  {bytes:>12} {:>12}{cells} | {ratio:>6.2}", bytes / 4);
        }
    }
    if voice && !verdicts.is_empty() {
        let same = verdicts.iter().all(|&v| v);
        let _ = writeln!(
            out,
            "# sums: lockstep's and MPI_Allreduce's are {} at every size (2 processes: one addition per element)",
            if same { "bitwise equal" } else { "NOT bitwise equal" }
        );
    }
    Ok(())
}
