//! The CPU all-reduce (the trainer's reduce-scatter, and the classic in-place all-reduce
//! over any host exchange, `exchange::all_reduce_in_place`) over 2, 3 and 4 members and
//! 4 KiB .. 64 MiB of f32. Criterion reports bytes/s of one member's buffer: that is
//! algbw; busbw, as nccl-tests defines it, is algbw·2(n−1)/n (`lockstep bench allreduce`
//! prints both).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lockstep::exchange::shm::ShmGroup;
use lockstep::exchange::{all_reduce_in_place, Exchange};

#[derive(Clone, Copy)]
enum Path {
    Trainer,
    Classic,
}

/// Runs `iters` collectives on `members` threads; returns member 0's time between the first
/// and the last barrier.
fn run(members: usize, count: usize, iters: u64, path: Path) -> Duration {
    let ex = ShmGroup::new(members, members, count, lockstep::exchange::Wait::for_threads(members)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..members)
            .map(|r| {
                let ex = &ex;
                s.spawn(move || {
                    let mut me = ex.member(r);
                    let mut buf = vec![1.0f32; count];
                    me.with_slot(0, |slot| slot.fill(1.0));
                    // settle the threads on their cores before the clock starts
                    for _ in 0..64 {
                        me.barrier().unwrap();
                    }
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        match path {
                            Path::Trainer => me.sum().unwrap(),
                            Path::Classic => all_reduce_in_place(&mut me, &mut buf).unwrap(),
                        }
                    }
                    me.barrier().unwrap();
                    t0.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).next().unwrap()
    })
}

fn bench(c: &mut Criterion) {
    let cores = lockstep::devices::available_cores();
    for (path, name) in [(Path::Trainer, "reduce-scatter"), (Path::Classic, "classic")] {
        let mut group = c.benchmark_group(format!("allreduce/{name}"));
        for members in [2, 3, 4].into_iter().filter(|&r| r <= cores.max(2)) {
            for bytes in [4usize << 10, 256 << 10, 4 << 20, 64 << 20] {
                group.throughput(Throughput::Bytes(bytes as u64));
                group.bench_with_input(BenchmarkId::new(format!("{members}-members"), bytes), &bytes, |b, &bytes| {
                    b.iter_custom(|iters| run(members, bytes / 4, iters, path))
                });
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    targets = bench
}
criterion_main!(benches);
