//! GEMM GFLOP/s at the convnet's shapes: the `gemm` crate (what lockstep's CPU backend
//! calls, with these arguments: row-major, overwrite) against `matrixmultiply`,
//! single-threaded (how the layers call it: one lot of samples per thread) and on the
//! machine's cores. Criterion's "elements" are FLOPs (2·m·k·n per product), so its
//! Gelem/s read as GFLOP/s.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gemm::Parallelism;

/// out (m × n) = a (m × k) · b (k × n), all row-major, as `backend::cpu::gemm` calls the
/// crate.
fn gemm_rows(a: &[f32], b: &[f32], out: &mut [f32], (m, k, n): (usize, usize, usize), par: Parallelism) {
    assert!(a.len() >= m * k && b.len() >= k * n && out.len() >= m * n);
    // SAFETY: a, b and out hold m×k, k×n and m×n values (asserted above), row-major with
    // the strides given; out is borrowed mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

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

/// `len` values in [−0.5, 0.5), from a SplitMix64 stream seeded by `len`.
fn data(len: usize) -> Vec<f32> {
    let mut state = len as u64;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm");
    for &(name, m, k, n) in SHAPES {
        let (a, b) = (data(m * k), data(k * n));
        let mut out = vec![0.0f32; m * n];
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_with_input(BenchmarkId::new("gemm-crate/1-thread", name), &(), |bench, _| {
            bench.iter(|| gemm_rows(&a, &b, &mut out, (m, k, n), Parallelism::None))
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
                bench.iter(|| gemm_rows(&a, &b, &mut out, (m, k, n), Parallelism::Rayon(0)))
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
