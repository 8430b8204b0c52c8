//! GEMM GFLOP/s at the convnet's shapes: the `gemm` crate (what lockstep uses, through
//! `backend::cpu::gemm`) against `matrixmultiply`, single-threaded (how the layers call
//! it: one group of samples per thread) and on the machine's cores. Criterion's
//! "elements" are FLOPs (2·m·k·n per product), so its Gelem/s read as GFLOP/s.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lockstep::backend::cpu::{gemm_with, Accumulate, Mat, Threads};

/// (name, m, k, n): the products the convnet's layers issue (see `ops::conv2d`): conv0
/// unfolds into channels-first columns, one sample at a time; conv1 and conv2 into
/// channels-last rows, 2 and 4 samples at a time (their `chunk_samples`).
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("conv0 fwd W·col 12x9x784", 12, 9, 784),
    ("conv0 dW dout·colT 12x784x9", 12, 784, 9),
    ("conv1 fwd rows·W 288x432x24", 288, 432, 24),
    ("conv1 dW rowsT·dout 432x288x24", 432, 288, 24),
    ("conv1 drows dout·WT 288x24x432", 288, 24, 432),
    ("conv2 fwd rows·W 144x864x32", 144, 864, 32),
    ("conv2 dW rowsT·dout 864x144x32", 864, 144, 32),
    ("dense0 fwd B256 256x32x256", 256, 32, 256),
    ("square 512 (reference)", 512, 512, 512),
];

fn data(len: usize) -> Vec<f32> {
    let mut g = lockstep::rng::SplitMix64::new(len as u64);
    (0..len).map(|_| g.next_f32() - 0.5).collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm");
    for &(name, m, k, n) in SHAPES {
        let (a, b) = (data(m * k), data(k * n));
        let mut out = vec![0.0f32; m * n];
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_with_input(BenchmarkId::new("gemm-crate/1-thread", name), &(), |bench, _| {
            bench.iter(|| {
                gemm_with(Mat::rows(&a, m, k), Mat::rows(&b, k, n), &mut out, n, Accumulate::Overwrite, Threads::Caller)
            })
        });
        group.bench_with_input(BenchmarkId::new("matrixmultiply/1-thread", name), &(), |bench, _| {
            bench.iter(|| {
                // SAFETY: a is m×k, b is k×n, out is m×n, all row-major and in bounds.
                unsafe {
                    matrixmultiply::sgemm(
                        m,
                        k,
                        n,
                        1.0,
                        a.as_ptr(),
                        k as isize,
                        1,
                        b.as_ptr(),
                        n as isize,
                        1,
                        0.0,
                        out.as_mut_ptr(),
                        n as isize,
                        1,
                    )
                }
            })
        });
        if m * k * n >= 1 << 20 {
            group.bench_with_input(BenchmarkId::new("gemm-crate/all-cores", name), &(), |bench, _| {
                bench.iter(|| {
                    gemm_with(
                        Mat::rows(&a, m, k),
                        Mat::rows(&b, k, n),
                        &mut out,
                        n,
                        Accumulate::Overwrite,
                        Threads::Pool,
                    )
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(1)).warm_up_time(std::time::Duration::from_millis(300));
    targets = bench
}
criterion_main!(benches);
