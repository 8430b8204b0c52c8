//! Optimisers over flat parameter buffers: SGD (momentum, weight decay) and Adam, with
//! PyTorch's semantics op for op.
//!
//! An optimiser never sees layers: parameters, gradients and its state are flat buffers
//! laid out by `nn::Sequential`, so one step is one elementwise loop. The loop can run
//! over the whole buffer or over the chunks of it that the all-reduce hands out; the
//! result is the same, element by element. Gradients arrive SUMMED over the global batch;
//! `grad_divisor` (the real size of that batch) turns them into the mean's gradient.
//!
//! Sharded (ZeRO stage 1, [`Sharding::Sharded`]): an optimiser may hold the state of one
//! range of the flat parameters only ([`Optimizer::part`]) and update only there; the
//! update of an element is the same function of the same values wherever it runs, so
//! the parameters are bitwise those of the whole optimiser. [`Optimizer::merge`] puts the
//! parts back together (checkpoints hold the whole state).

use std::ops::Range;

use crate::error::{Error, Result};

mod gpu;

/// Which optimiser, with its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// p ← p − lr·buf, buf = momentum·buf + (g + wd·p) (buf = g when momentum is 0).
    Sgd { lr: f32, momentum: f32, weight_decay: f32 },
    /// Adam, PyTorch form: bias-corrected, eps added after the square root.
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
}

impl OptimizerConfig {
    /// Plain SGD.
    pub fn sgd(lr: f32) -> Self {
        OptimizerConfig::Sgd { lr, momentum: 0.0, weight_decay: 0.0 }
    }

    /// Adam with PyTorch's defaults β = (0.9, 0.999), eps = 1e-8.
    pub fn adam(lr: f32) -> Self {
        OptimizerConfig::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    /// The state this configuration keeps, by name in checkpoint order, one value per
    /// parameter each: SGD with momentum its buffer `m`, Adam its moments `m` and `v`,
    /// plain SGD nothing. Every place that holds, saves, sizes or moves optimiser state —
    /// [`Optimizer`], the GPU network, the memory estimate — reads it here.
    pub fn state_names(&self) -> &'static [&'static str] {
        match *self {
            OptimizerConfig::Sgd { momentum, .. } if momentum > 0.0 => &["m"],
            OptimizerConfig::Sgd { .. } => &[],
            OptimizerConfig::Adam { .. } => &["m", "v"],
        }
    }

    /// [`OptimizerConfig::state_names`] in words, for estimates: "Adam's m and v".
    pub fn state_description(&self) -> &'static str {
        match self.state_names() {
            [] => "none",
            [_] => "SGD's momentum",
            _ => "Adam's m and v",
        }
    }

    /// Checks every hyper-parameter's range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &'static str, v: f32| Err(Error::config(what, format!("{v} is out of range")));
        let (lr, wd) = match *self {
            OptimizerConfig::Sgd { lr, momentum, weight_decay } => {
                if !(0.0..1.0).contains(&momentum) {
                    return bad("momentum (expected 0 <= m < 1)", momentum);
                }
                (lr, weight_decay)
            }
            OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay } => {
                if !(0.0..1.0).contains(&beta1) {
                    return bad("adam beta1 (expected 0 <= b1 < 1)", beta1);
                }
                if !(0.0..1.0).contains(&beta2) {
                    return bad("adam beta2 (expected 0 <= b2 < 1)", beta2);
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return bad("adam eps (expected > 0)", eps);
                }
                (lr, weight_decay)
            }
        };
        if !(lr > 0.0 && lr.is_finite()) {
            return bad("learning rate (expected > 0)", lr);
        }
        if !(wd >= 0.0 && wd.is_finite()) {
            return bad("weight decay (expected >= 0)", wd);
        }
        Ok(())
    }

    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adam { lr, .. } => lr,
        }
    }

    /// The scalars of the optimiser step number `t` (1-based) at `lr_scale` times the
    /// learning rate, for gradients summed over a global batch of `grad_divisor` samples.
    pub fn scalars(&self, t: u64, lr_scale: f32, grad_divisor: f32) -> StepScalars {
        let lr = self.lr() * lr_scale;
        let (step_size, bc2_sqrt) = match *self {
            OptimizerConfig::Sgd { .. } => (lr, 1.0),
            OptimizerConfig::Adam { beta1, beta2, .. } => {
                // Bias corrections in f64, as PyTorch computes them (Python floats).
                let t = t.min(i32::MAX as u64) as i32;
                let bc1 = 1.0 - (beta1 as f64).powi(t);
                let bc2 = 1.0 - (beta2 as f64).powi(t);
                ((lr as f64 / bc1) as f32, bc2.sqrt() as f32)
            }
        };
        StepScalars { t, grad_divisor, step_size, bc2_sqrt }
    }
}

/// The numbers of one optimiser step besides the tensors, made once on the host by
/// [`OptimizerConfig::scalars`]: every backend's update (the CPU loop below, the CUDA
/// kernel `kernels/optim.cu`) reads these very values, so none of them is computed twice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// The 1-based step number.
    pub t: u64,
    /// Gradients arrive SUMMED over the global batch; they are divided by this, the
    /// batch's real size.
    pub grad_divisor: f32,
    /// SGD: lr·schedule. Adam: lr·schedule / (1 − β1^t), folded in f64.
    pub step_size: f32,
    /// Adam: sqrt(1 − β2^t), from f64. SGD: 1.
    pub bc2_sqrt: f32,
}

/// Where a run's optimiser state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Every device holds the whole state and updates every parameter.
    Replicated,
    /// ZeRO stage 1: each device holds the state of its own part of the flat parameters
    /// (the exchange's `owned` range) and updates that part; the parameters are then
    /// all-gathered. Optimiser memory per device ÷ N; weights bitwise the replicated ones.
    Sharded,
}

/// How the learning rate changes over a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// The configured learning rate at every step.
    Constant,
    /// Cosine decay from the configured rate to `floor` times it over the run:
    /// scale(t) = floor + (1 − floor)·(1 + cos(π·t/T))/2 for step t of T.
    Cosine { floor: f32 },
}

impl LrSchedule {
    /// The learning-rate multiplier of step `step` (0-based) of `total`.
    pub fn scale(&self, step: u64, total: u64) -> f32 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::Cosine { floor } => {
                let frac = if total <= 1 { 0.0 } else { step.min(total - 1) as f64 / (total - 1) as f64 };
                let c = 0.5 * (1.0 + (std::f64::consts::PI * frac).cos());
                (floor as f64 + (1.0 - floor as f64) * c) as f32
            }
        }
    }
}

/// An optimiser and its state for one replica (or, sharded, for one range of it).
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer {
    config: OptimizerConfig,
    /// Steps taken (Adam's t after `begin_step`).
    t: u64,
    /// The flat parameters whose state this holds (`0..len` unsharded).
    range: Range<usize>,
    /// Length of the whole flat parameter buffer.
    len: usize,
    /// One device's part of a sharded optimiser ([`Optimizer::part`]), whatever its
    /// range: a part may hold every parameter (a small model whose first part takes
    /// all), and is still a part, which the others' complete.
    part: bool,
    /// SGD: the momentum buffer (empty without momentum). Adam: the first moment m.
    /// Both of `range.len()` values.
    m: Vec<f32>,
    /// Adam: the second moment v. SGD: empty.
    v: Vec<f32>,
}

impl Optimizer {
    /// Zero state for `num_params` values.
    pub fn new(config: OptimizerConfig, num_params: usize) -> Optimizer {
        let zeros = |name| if config.state_names().contains(&name) { vec![0.0; num_params] } else { Vec::new() };
        Optimizer { config, t: 0, range: 0..num_params, len: num_params, part: false, m: zeros("m"), v: zeros("v") }
    }

    /// The part of this optimiser for the parameters `range` (clipped to its own range):
    /// its state there and its step count. A part of a part is fine.
    pub fn part(&self, range: Range<usize>) -> Optimizer {
        let r = range.start.clamp(self.range.start, self.range.end)..range.end.clamp(self.range.start, self.range.end);
        let local = r.start - self.range.start..r.end - self.range.start;
        let cut = |v: &Vec<f32>| if v.is_empty() { Vec::new() } else { v[local.clone()].to_vec() };
        Optimizer {
            config: self.config,
            t: self.t,
            range: r,
            len: self.len,
            part: true,
            m: cut(&self.m),
            v: cut(&self.v),
        }
    }

    /// The whole optimiser from parts that cover `0..len` without overlap (any order), all
    /// of one configuration and step count: what the devices of a sharded run hold.
    pub fn merge(parts: &[Optimizer]) -> Result<Optimizer> {
        let Some(first) = parts.first() else {
            return Err(Error::config("optimizer state", "no part to merge"));
        };
        let mut whole = Optimizer::new(first.config, first.len);
        whole.t = first.t;
        let mut covered = 0;
        for p in parts {
            if p.config != first.config || p.t != first.t || p.len != first.len {
                return Err(Error::config(
                    "optimizer state",
                    format!(
                        "parts of different optimisers (steps {} and {}, lengths {} and {})",
                        first.t, p.t, first.len, p.len
                    ),
                ));
            }
            for (dst, src) in [(&mut whole.m, &p.m), (&mut whole.v, &p.v)] {
                if !dst.is_empty() {
                    dst[p.range.clone()].copy_from_slice(src);
                }
            }
            covered += p.range.len();
        }
        if covered != first.len {
            return Err(Error::config("optimizer state", format!("the parts cover {covered} of {} values", first.len)));
        }
        Ok(whole)
    }

    /// This part as words, to move between processes (`train::processes`): the step
    /// count, the range, then m and v as f32 bits (their lengths follow from the range
    /// and the configuration).
    pub(crate) fn to_words(&self) -> Vec<u64> {
        let mut w = vec![self.t, self.range.start as u64, self.range.end as u64];
        w.extend(self.m.iter().chain(&self.v).map(|x| x.to_bits() as u64));
        w
    }

    /// The part [`Optimizer::to_words`] wrote, of an optimiser of `config` over `len`
    /// parameters; `None` when the words are not one.
    pub(crate) fn from_words(config: OptimizerConfig, len: usize, words: &[u64]) -> Option<Optimizer> {
        let (&[t, start, end], rest) = words.split_first_chunk::<3>()?;
        let range = usize::try_from(start).ok()?..usize::try_from(end).ok()?;
        if range.start > range.end || range.end > len {
            return None;
        }
        // Which of m and v the configuration keeps: those an optimiser of one value has.
        let one = Optimizer::new(config, 1);
        let (m_len, v_len) = (one.m.len() * range.len(), one.v.len() * range.len());
        if rest.len() != m_len + v_len {
            return None;
        }
        let f = |w: &[u64]| w.iter().map(|&b| f32::from_bits(b as u32)).collect::<Vec<_>>();
        Some(Optimizer { config, t, range, len, part: true, m: f(&rest[..m_len]), v: f(&rest[m_len..]) })
    }

    /// Length of the whole flat parameter buffer (a part's too).
    pub fn params_len(&self) -> usize {
        self.len
    }

    /// The parameters whose state this optimiser holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// True when it holds the state of every parameter (a part may too).
    pub fn is_whole(&self) -> bool {
        self.range == (0..self.len)
    }

    /// True for one device's part of a sharded optimiser, even one that holds every
    /// parameter: the replicas of a sharded run differ in their state by design.
    pub fn is_part(&self) -> bool {
        self.part
    }

    /// Bytes of optimiser state it holds (m and v, f32).
    pub fn state_bytes(&self) -> usize {
        4 * (self.m.len() + self.v.len())
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// Named state tensors for checkpoints: (`"m"`, values), (`"v"`, values) as present,
    /// of the parameters [`Optimizer::range`].
    pub fn state(&self) -> Vec<(&'static str, &[f32])> {
        let mut s = Vec::new();
        if !self.m.is_empty() {
            s.push(("m", self.m.as_slice()));
        }
        if !self.v.is_empty() {
            s.push(("v", self.v.as_slice()));
        }
        s
    }

    /// Restores state saved by [`Optimizer::state`] and the step count.
    pub fn restore(&mut self, t: u64, state: &[(&str, Vec<f32>)]) -> Result<()> {
        for (name, values) in state {
            let dst = match *name {
                "m" => &mut self.m,
                "v" => &mut self.v,
                other => return Err(Error::config("optimizer state", format!("unknown tensor '{other}'"))),
            };
            if dst.len() != values.len() {
                return Err(Error::config(
                    "optimizer state",
                    format!("'{name}' has {} values, expected {}", values.len(), dst.len()),
                ));
            }
            dst.copy_from_slice(values);
        }
        self.t = t;
        Ok(())
    }

    /// Starts a step whose learning rate is `lr_scale` times the configured one, for
    /// gradients summed over `grad_divisor` samples: call once, before
    /// [`Optimizer::update`] on any chunk, with the scalars it returns.
    pub fn begin_step(&mut self, lr_scale: f32, grad_divisor: f32) -> StepScalars {
        self.t += 1;
        self.config.scalars(self.t, lr_scale, grad_divisor)
    }

    /// Updates `params` (the values at `offset..offset + params.len()` of the flat
    /// buffer) from `grad_sum`, the gradient summed over the global batch.
    ///
    /// The values must lie in [`Optimizer::range`] (a sharded optimiser updates its part).
    pub fn update(&mut self, offset: usize, params: &mut [f32], grad_sum: &[f32], s: &StepScalars) {
        debug_assert_eq!(params.len(), grad_sum.len());
        assert!(
            offset >= self.range.start && offset + params.len() <= self.range.end,
            "update of {}..{} by an optimiser of {:?}",
            offset,
            offset + params.len(),
            self.range
        );
        let range = offset - self.range.start..offset - self.range.start + params.len();
        let StepScalars { t, grad_divisor, step_size, bc2_sqrt } = *s;
        match self.config {
            OptimizerConfig::Sgd { momentum, weight_decay, .. } => {
                if momentum > 0.0 {
                    for ((p, &gs), buf) in params.iter_mut().zip(grad_sum).zip(&mut self.m[range]) {
                        let g = gs / grad_divisor + weight_decay * *p;
                        *buf = if t == 1 { g } else { momentum * *buf + g };
                        *p -= step_size * *buf;
                    }
                } else {
                    for (p, &gs) in params.iter_mut().zip(grad_sum) {
                        let g = gs / grad_divisor + weight_decay * *p;
                        *p -= step_size * g;
                    }
                }
            }
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. } => {
                let (m, v) = (&mut self.m[range.clone()], &mut self.v[range]);
                for (((p, &gs), m), v) in params.iter_mut().zip(grad_sum).zip(m).zip(v) {
                    let g = gs / grad_divisor + weight_decay * *p;
                    *m += (1.0 - beta1) * (g - *m);
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let denom = v.sqrt() / bc2_sqrt + eps;
                    *p -= step_size * (*m / denom);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_first_step_moves_each_weight_by_about_lr() {
        // With m = v = 0, step 1: m = 0.1 g, v = 0.001 g², m̂ = g, v̂ = g², so the update
        // is lr·g/(|g| + eps) = lr·sign(g) up to eps.
        let mut o = Optimizer::new(OptimizerConfig::adam(1e-3), 2);
        let mut p = [1.0f32, -1.0];
        let s = o.begin_step(1.0, 4.0);
        o.update(0, &mut p, &[0.5 * 4.0, -2.0 * 4.0], &s);
        assert!((p[0] - (1.0 - 1e-3)).abs() < 1e-7, "{}", p[0]);
        assert!((p[1] - (-1.0 + 1e-3)).abs() < 1e-7, "{}", p[1]);
    }

    #[test]
    fn sgd_momentum_follows_pytorch() {
        // PyTorch: buf₁ = g₁; buf₂ = μ·buf₁ + g₂; p -= lr·buf. With g = 1 both steps,
        // μ = 0.9, lr = 0.1: p = 0 − 0.1 − 0.19 = −0.29.
        let cfg = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
        let mut o = Optimizer::new(cfg, 1);
        let mut p = [0.0f32];
        for _ in 0..2 {
            let s = o.begin_step(1.0, 1.0);
            o.update(0, &mut p, &[1.0], &s);
        }
        assert!((p[0] + 0.29).abs() < 1e-7);
    }

    #[test]
    fn chunked_updates_equal_one_update() {
        let cfg = OptimizerConfig::Adam { lr: 0.01, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.01 };
        let g: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let (mut a, mut b) = (Optimizer::new(cfg, 10), Optimizer::new(cfg, 10));
        let (mut pa, mut pb) = (vec![0.3f32; 10], vec![0.3f32; 10]);
        for _ in 0..3 {
            let s = a.begin_step(1.0, 3.0);
            a.update(0, &mut pa, &g, &s);
            let s = b.begin_step(1.0, 3.0);
            b.update(0, &mut pb[..4], &g[..4], &s);
            b.update(4, &mut pb[4..], &g[4..], &s);
        }
        assert_eq!(pa, pb);
    }

    #[test]
    fn a_part_round_trips_through_words() {
        for config in [OptimizerConfig::adam(1e-3), OptimizerConfig::sgd(0.1)] {
            let mut whole = Optimizer::new(config, 10);
            whole.m.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 0.5 - 1.0);
            whole.v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 1e-3);
            whole.t = 7;
            let part = whole.part(3..8);
            let back = Optimizer::from_words(config, 10, &part.to_words()).unwrap();
            assert_eq!(back, part);
            // Words that are not a part of this optimiser: too few, a range past its end.
            assert!(Optimizer::from_words(config, 10, &part.to_words()[..2]).is_none());
            assert!(Optimizer::from_words(config, 6, &part.to_words()).is_none());
        }
    }

    #[test]
    fn sharded_updates_equal_one_update_and_the_parts_merge_back() {
        // Adam over 10 values, once whole and once as parts 0..3, 3..7, 7..10 updated
        // each on its own: the same parameters, and the parts put together are the whole.
        let cfg = OptimizerConfig::Adam { lr: 0.01, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.01 };
        let g: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let mut whole = Optimizer::new(cfg, 10);
        let mut parts: Vec<Optimizer> = [0..3, 3..7, 7..10].into_iter().map(|r| whole.part(r)).collect();
        let (mut pa, mut pb) = (vec![0.3f32; 10], vec![0.3f32; 10]);
        for _ in 0..3 {
            let s = whole.begin_step(1.0, 3.0);
            whole.update(0, &mut pa, &g, &s);
            for part in &mut parts {
                let s = part.begin_step(1.0, 3.0);
                let r = part.range();
                part.update(r.start, &mut pb[r.clone()], &g[r], &s);
            }
        }
        assert_eq!(pa, pb);
        assert_eq!(parts.iter().map(|p| p.state_bytes()).collect::<Vec<_>>(), vec![24, 32, 24]);
        assert!(!parts[0].is_whole());
        let merged = Optimizer::merge(&parts).unwrap();
        assert!(merged.is_whole());
        assert_eq!(merged, whole);
        let e = Optimizer::merge(&parts[..2]).unwrap_err().to_string();
        assert!(e.contains("cover 7 of 10"), "{e}");
    }

    #[test]
    fn cosine_schedule_runs_from_one_to_the_floor() {
        let s = LrSchedule::Cosine { floor: 0.1 };
        assert_eq!(s.scale(0, 11), 1.0);
        // halfway: 0.1 + 0.9 · (1 + cos(π/2))/2 = 0.55
        assert!((s.scale(5, 11) - 0.55).abs() < 1e-6);
        assert!((s.scale(10, 11) - 0.1).abs() < 1e-6);
        assert_eq!(LrSchedule::Constant.scale(3, 10), 1.0);
    }

    #[test]
    fn bad_hyper_parameters_are_named() {
        let e = OptimizerConfig::sgd(0.0).validate().unwrap_err().to_string();
        assert!(e.contains("learning rate"), "{e}");
        let e = OptimizerConfig::Sgd { lr: 0.1, momentum: 1.5, weight_decay: 0.0 }.validate().unwrap_err().to_string();
        assert!(e.contains("momentum"), "{e}");
    }
}
