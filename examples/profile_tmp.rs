use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::{Ctx, loss::softmax_cross_entropy};
use lockstep::tensor::{Device, Tensor};
use lockstep::train::Batch;
fn main() {
    let threads: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1);
    let b: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(256);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    let mut m = models::convnet(ConvnetOptions::default()).unwrap();
    let mut st = m.init(0);
    let batch = Batch::gather(&d, &(0..b).collect::<Vec<_>>());
    let mut grads = vec![0.0; m.num_params()];
    pool.install(|| {
        for it in 0..6 {
            if it == 1 { m.start_profile(); }
            let t = std::time::Instant::now();
            let x = Tensor::from_vec(batch.x.clone(), [b, 1, 28, 28]).unwrap();
            let ctx = Ctx::train(0, it, 0, Device::Cpu(0));
            let y = m.forward(x, &st.params, &mut st.buffers, &ctx).unwrap();
            let (_, dl) = softmax_cross_entropy(&y, &batch.y).unwrap();
            m.backward(dl, &st.params, &mut grads, &ctx).unwrap();
            if it > 0 { eprintln!("step {:?}", t.elapsed()); }
        }
    });
    for (n, f, bw) in m.profile() { println!("{n:<12} fwd {:>8.2} ms  bwd {:>8.2} ms", f.as_secs_f64()*200.0, bw.as_secs_f64()*200.0); }
}
