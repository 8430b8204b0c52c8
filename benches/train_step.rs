//! Training throughput (samples/s) of whole data-parallel steps: scatter, forward,
//! backward, all-reduce, update. The toy MLP at B = 64 and the convnet at B = 64 and
//! 256, on one CPU device with every core and on one device per core. Data: the
//! embedded digits for the convnet, the lesson's enlarged toy set for the MLP.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::{toy, Dataset};
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::Graph;
use lockstep::optim::OptimizerConfig;
use lockstep::train::{with_trainer, Batch, TrainConfig};

/// mimalloc keeps freed pages for reuse: each step allocates activations of megabytes,
/// which the system allocator would return to the kernel and fault back in every step
/// (measured: ~20% of a convnet step).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench_model(c: &mut Criterion, name: &str, model: &Graph, data: &Dataset, batch: usize, opt: OptimizerConfig) {
    let cores = lockstep::devices::available_cores();
    let mut group = c.benchmark_group(format!("step/{name}/B{batch}"));
    group.throughput(Throughput::Elements(batch as u64));
    let rows: Vec<usize> = (0..batch).map(|i| i % data.len()).collect();
    let global = Batch::gather(data, &rows);
    let mut layouts = vec![(format!("cpu:1x{cores}"), Devices::cpu(1, cores).unwrap())];
    if cores > 1 {
        layouts.push((format!("cpu:{cores}x1"), Devices::cpu(cores, 1).unwrap()));
    }
    for (label, devices) in layouts {
        let cfg =
            TrainConfig { batch_size: batch, optimizer: opt, check_replicas_every: None, ..TrainConfig::default() };
        group.bench_function(BenchmarkId::from_parameter(&label), |b| {
            with_trainer(model, &devices, &cfg, |t| {
                b.iter(|| t.step(global.clone()).unwrap());
                Ok(())
            })
            .unwrap()
        });
    }
    group.finish();
}

fn bench(c: &mut Criterion) {
    let toy_data = toy::toy_enlarged(400, 0).unwrap().train;
    let toy_model = models::toy_mlp(2, 2).unwrap();
    bench_model(c, "toy-mlp", &toy_model, &toy_data, 64, OptimizerConfig::sgd(0.5));
    let digits = load_digits(DigitsLayout::Image28).unwrap().train;
    let convnet = models::convnet(ConvnetOptions::default()).unwrap();
    for batch in [64, 256] {
        bench_model(c, "convnet", &convnet, &digits, batch, OptimizerConfig::adam(1e-3));
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
