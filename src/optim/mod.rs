//! Optimisers over flat parameter buffers — SGD (momentum, Nesterov, coupled weight decay),
//! Adam and AdamW — with PyTorch's semantics op for op, the recipes around them (warm-up,
//! the parameters weight decay applies to, clipping by the global gradient norm), and
//! their GPU launch (`gpu.rs`, the kernels of kernels/optim.cu).
//!
//! An optimiser never sees layers: parameters, gradients and its state are flat buffers
//! laid out by `nn::Sequential`, so one step is one elementwise loop. The loop can run
//! over the whole buffer or over the chunks of it that the all-reduce hands out; the
//! result is the same, element by element. Gradients arrive SUMMED over the global batch;
//! `grad_divisor` (the real size of that batch) turns them into the mean's gradient.
//!
//! What the optimiser needs of the model comes in plain terms, never as layers: which
//! flat ranges weight decay applies to ([`DecayMask`], made by the trainer from the
//! tensors' shapes) and the norm of the whole summed gradient ([`GradNorm`], read by every
//! replica from the exchange's sum in one fixed order, so that it is bitwise the same on
//! every replica and for every device count).
//!
//! Sharded (ZeRO stage 1, [`Sharding::Sharded`]): an optimiser may hold the state of one
//! range of the flat parameters only ([`Optimizer::part`]) and update only there; the
//! update of an element is the same function of the same values wherever it runs, so
//! the parameters are bitwise those of the whole optimiser. [`Optimizer::merge`] puts the
//! parts back together (checkpoints hold the whole state). The gradient norm is still the
//! whole gradient's: every device reads every piece of the sum for it.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::backend::simd::widest;
use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
pub(crate) mod gpu;

/// How SGD's momentum enters the step (PyTorch's `nesterov=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MomentumKind {
    /// p ← p − lr·buf (PyTorch's default).
    Classic,
    /// Nesterov: p ← p − lr·(g + momentum·buf) (`nesterov=True`; needs momentum > 0).
    Nesterov,
}

/// Which optimiser, with its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerConfig {
    /// `torch.optim.SGD(dampening=0)`: g = grad + wd·p (coupled L2, on the parameters that
    /// decay); buf = g at the first step, else momentum·buf + g; p ← p − lr·buf, or with
    /// Nesterov p ← p − lr·(g + momentum·buf) (buf is g itself when momentum is 0).
    Sgd { lr: f32, momentum: f32, momentum_kind: MomentumKind, weight_decay: f32 },
    /// `torch.optim.Adam`: bias-corrected, eps added after the square root; weight decay
    /// is the coupled L2 (g = grad + wd·p).
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// `torch.optim.AdamW`: Adam's step after the decoupled decay p ← p·(1 − lr·wd).
    AdamW { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
}

impl OptimizerConfig {
    /// Plain SGD.
    pub fn sgd(lr: f32) -> Self {
        OptimizerConfig::Sgd { lr, momentum: 0.0, momentum_kind: MomentumKind::Classic, weight_decay: 0.0 }
    }

    /// SGD with `momentum` of `kind`, no weight decay.
    pub fn sgd_momentum(lr: f32, momentum: f32, kind: MomentumKind) -> Self {
        OptimizerConfig::Sgd { lr, momentum, momentum_kind: kind, weight_decay: 0.0 }
    }

    /// Adam with PyTorch's defaults β = (0.9, 0.999), eps = 1e-8.
    pub fn adam(lr: f32) -> Self {
        OptimizerConfig::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    /// AdamW with PyTorch's defaults β = (0.9, 0.999), eps = 1e-8, weight decay 0.01.
    pub fn adamw(lr: f32) -> Self {
        OptimizerConfig::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }

    /// The state this configuration keeps, by name in checkpoint order, one value per
    /// parameter each: SGD with momentum its buffer `m`, Adam and AdamW their moments `m`
    /// and `v`, plain SGD nothing. Every place that holds, saves, sizes or moves optimiser
    /// state — [`Optimizer`], the GPU network, the memory estimate — reads it here.
    pub fn state_names(&self) -> &'static [&'static str] {
        match *self {
            OptimizerConfig::Sgd { momentum, .. } if momentum > 0.0 => &["m"],
            OptimizerConfig::Sgd { .. } => &[],
            OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. } => &["m", "v"],
        }
    }

    /// Bytes of the state it keeps for `params` parameters: each of its
    /// [`state_names`](Self::state_names), one f32 a parameter.
    pub fn state_bytes(&self, params: usize) -> usize {
        4 * self.state_names().len() * params
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
            OptimizerConfig::Sgd { lr, momentum, momentum_kind, weight_decay } => {
                if !(0.0..1.0).contains(&momentum) {
                    return bad("momentum (expected 0 <= m < 1)", momentum);
                }
                if momentum_kind == MomentumKind::Nesterov && momentum == 0.0 {
                    return Err(Error::config("nesterov", "Nesterov momentum needs a momentum above 0"));
                }
                (lr, weight_decay)
            }
            OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay }
            | OptimizerConfig::AdamW { lr, beta1, beta2, eps, weight_decay } => {
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
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adam { lr, .. } | OptimizerConfig::AdamW { lr, .. } => {
                lr
            }
        }
    }

    /// The weight decay (coupled for SGD and Adam, decoupled for AdamW).
    pub fn weight_decay(&self) -> f32 {
        match *self {
            OptimizerConfig::Sgd { weight_decay, .. }
            | OptimizerConfig::Adam { weight_decay, .. }
            | OptimizerConfig::AdamW { weight_decay, .. } => weight_decay,
        }
    }

    /// The scalars of the optimiser step number `t` (1-based) at `lr_scale` times the
    /// learning rate, for gradients summed over a global batch of `grad_divisor` samples,
    /// as they apply to the parameters that decay ([`StepScalars::without_decay`] for the
    /// others), without clipping (`clip` 1).
    pub fn scalars(&self, t: u64, lr_scale: f32, grad_divisor: f32) -> StepScalars {
        let lr = self.lr() * lr_scale;
        // Bias corrections in f64, as PyTorch computes them (Python floats).
        let adam = |beta1: f32, beta2: f32| {
            let t = t.min(i32::MAX as u64) as i32;
            let bc1 = 1.0 - (beta1 as f64).powi(t);
            let bc2 = 1.0 - (beta2 as f64).powi(t);
            ((lr as f64 / bc1) as f32, bc2.sqrt() as f32)
        };
        let (step_size, bc2_sqrt, weight_decay, shrink) = match *self {
            OptimizerConfig::Sgd { weight_decay, .. } => (lr, 1.0, weight_decay, 1.0),
            OptimizerConfig::Adam { beta1, beta2, weight_decay, .. } => {
                let (step_size, bc2_sqrt) = adam(beta1, beta2);
                (step_size, bc2_sqrt, weight_decay, 1.0)
            }
            OptimizerConfig::AdamW { beta1, beta2, weight_decay, .. } => {
                let (step_size, bc2_sqrt) = adam(beta1, beta2);
                // PyTorch: param.mul_(1 - lr * weight_decay), the factor a Python float.
                (step_size, bc2_sqrt, 0.0, (1.0 - lr as f64 * weight_decay as f64) as f32)
            }
        };
        StepScalars { t, grad_divisor, step_size, bc2_sqrt, weight_decay, shrink, clip: 1.0 }
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
    /// SGD: lr·schedule. Adam, AdamW: lr·schedule / (1 − β1^t), folded in f64.
    pub step_size: f32,
    /// Adam, AdamW: sqrt(1 − β2^t), from f64. SGD: 1.
    pub bc2_sqrt: f32,
    /// The coupled L2 coefficient (SGD, Adam: g += weight_decay·p); 0 for AdamW and for
    /// the parameters that do not decay.
    pub weight_decay: f32,
    /// AdamW's decoupled decay: p ← p·shrink before the step, shrink = 1 − lr·schedule·wd
    /// folded in f64; 1 for SGD, Adam and the parameters that do not decay.
    pub shrink: f32,
    /// Clipping by the global norm: every gradient value (after the division) is
    /// multiplied by this, [`clip_factor`] of the step's [`GradNorm`] (1: no clipping).
    /// The CPU update reads it here; a GPU computes the same factor on the device from
    /// the same sum (kernels/optim.cu's clip_factor_f32) and reads it there.
    pub clip: f32,
}

impl StepScalars {
    /// These scalars for the parameters weight decay leaves alone (PyTorch's parameter
    /// group of `weight_decay=0`).
    pub fn without_decay(&self) -> StepScalars {
        StepScalars { weight_decay: 0.0, shrink: 1.0, ..*self }
    }

    /// Whether weight decay changes anything at this step: without it the decayed and
    /// the other parameters take the same update, and a piece need not be cut.
    pub fn decays(&self) -> bool {
        self.weight_decay != 0.0 || self.shrink != 1.0
    }
}

/// Which parameters weight decay applies to (`--weight-decay-on`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayOn {
    /// Tensors of 2 or more dimensions (the weights of linear and convolution layers);
    /// BatchNorm's scale and shift and every bias do not decay: the parameter groups
    /// PyTorch users write for residual networks.
    #[default]
    Weights,
    /// Every parameter (`torch.optim`'s default with a single parameter group).
    All,
}

impl DecayOn {
    /// Whether a tensor of `ndim` dimensions decays.
    pub fn decays(self, ndim: usize) -> bool {
        match self {
            DecayOn::Weights => ndim >= 2,
            DecayOn::All => true,
        }
    }

    /// The name the command line and the checkpoints use.
    pub fn name(self) -> &'static str {
        match self {
            DecayOn::Weights => "weights",
            DecayOn::All => "all",
        }
    }
}

/// The flat parameters that weight decay applies to: sorted, disjoint, merged ranges
/// (the alignment gaps between tensors, which hold zeros, belong to no range).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecayMask {
    /// None: every parameter decays.
    decayed: Option<Vec<Range<usize>>>,
}

impl DecayMask {
    /// Every parameter decays.
    pub fn all() -> DecayMask {
        DecayMask { decayed: None }
    }

    /// The mask of tensors at `ranges` of the flat buffer with `ndim` dimensions each, in
    /// buffer order, under `on`.
    pub fn of_tensors(tensors: impl IntoIterator<Item = (Range<usize>, usize)>, on: DecayOn) -> DecayMask {
        if on == DecayOn::All {
            return DecayMask::all();
        }
        let mut tensors: Vec<_> = tensors.into_iter().collect();
        tensors.sort_by_key(|(r, _)| r.start);
        let mut decayed: Vec<Range<usize>> = Vec::new();
        for (r, ndim) in tensors {
            if !on.decays(ndim) || r.is_empty() {
                continue;
            }
            match decayed.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => decayed.push(r),
            }
        }
        DecayMask { decayed: Some(decayed) }
    }

    /// `range` cut into consecutive runs, each with the scalars its parameters take: `s`
    /// where they decay, [`StepScalars::without_decay`] elsewhere. A step without weight
    /// decay is one run.
    pub fn split(&self, range: Range<usize>, s: &StepScalars) -> Vec<(Range<usize>, StepScalars)> {
        if !s.decays() {
            return if range.is_empty() { Vec::new() } else { vec![(range, *s)] };
        }
        let undecayed = s.without_decay();
        self.runs(range).into_iter().map(|(r, decays)| (r, if decays { *s } else { undecayed })).collect()
    }

    /// `range` cut into consecutive runs, each with whether its parameters decay.
    pub fn runs(&self, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let Some(decayed) = &self.decayed else {
            return if range.is_empty() { Vec::new() } else { vec![(range, true)] };
        };
        let mut out = Vec::new();
        let mut at = range.start;
        for d in decayed {
            let (lo, hi) = (d.start.max(at), d.end.min(range.end));
            if lo >= hi {
                continue;
            }
            if at < lo {
                out.push((at..lo, false));
            }
            out.push((lo..hi, true));
            at = hi;
        }
        if at < range.end {
            out.push((at..range.end, false));
        }
        out
    }
}

/// Threads per block of kernels/optim.cu's `grad_norm_f32`, and lanes of [`GradNorm`].
pub const NORM_LANES: usize = 256;
/// Values per partial sum of the gradient norm: one block of `grad_norm_f32`.
pub const NORM_CHUNK: usize = 16 * NORM_LANES;

/// The partial sums of the norm of a gradient of `n` values: one per chunk (what a GPU
/// keeps for kernels/optim.cu's `grad_norm_f32`).
pub fn norm_partials(n: usize) -> usize {
    n.div_ceil(NORM_CHUNK)
}

/// The L2 norm of the step's gradient (the sum ÷ `grad_divisor`), read piece by piece in
/// flat order, in ONE fixed association that depends on the flat index alone, never on
/// where a piece starts: the buffer is cut into chunks of [`NORM_CHUNK`] values; within
/// a chunk, lane t adds the squares of values t, t + 256, … in f64; the 256 lanes are
/// added pairwise (lane t += lane t + s for s = 128, 64, …, 1); the chunks' sums are added
/// in order. So the shared-memory exchange's pieces, whatever the device count, the MPI
/// exchange's one piece and a GPU's kernel (kernels/optim.cu's `grad_norm_f32` and
/// `clip_factor_f32`, which add in this very order, rounding each operation) give bitwise
/// the same norm.
#[derive(Clone, Debug)]
pub struct GradNorm {
    lanes: Box<[f64; NORM_LANES]>,
    /// The flat index the next piece must start at.
    next: usize,
    total: f64,
}

impl Default for GradNorm {
    fn default() -> Self {
        GradNorm { lanes: Box::new([0.0; NORM_LANES]), next: 0, total: 0.0 }
    }
}

impl GradNorm {
    /// Adds the piece `offset..offset + grad_sum.len()` of the gradient sum; pieces come
    /// in order from 0, each starting where the last ended.
    pub fn add(&mut self, offset: usize, grad_sum: &[f32], grad_divisor: f32) {
        assert_eq!(offset, self.next, "the gradient norm reads the sum in order");
        let mut i = 0;
        while i < grad_sum.len() {
            let at = offset + i;
            let chunk_end = (at / NORM_CHUNK + 1) * NORM_CHUNK;
            let n = (chunk_end - at).min(grad_sum.len() - i);
            // Row by row of the chunk's 256 lanes, so that each lane's run vectorises.
            let mut j = 0;
            while j < n {
                let lane = (at + j) % NORM_LANES;
                let m = (NORM_LANES - lane).min(n - j);
                add_squares(&mut self.lanes[lane..lane + m], &grad_sum[i + j..i + j + m], grad_divisor);
                j += m;
            }
            i += n;
            if at + n == chunk_end {
                self.close_chunk();
            }
        }
        self.next = offset + grad_sum.len();
    }

    /// The chunk's lanes added pairwise into the total.
    fn close_chunk(&mut self) {
        let mut stride = NORM_LANES / 2;
        while stride > 0 {
            for t in 0..stride {
                self.lanes[t] += self.lanes[t + stride];
            }
            stride /= 2;
        }
        self.total += self.lanes[0];
        self.lanes.fill(0.0);
    }

    /// The norm of every value added, rounded to f32.
    pub fn norm(mut self) -> f32 {
        if !self.next.is_multiple_of(NORM_CHUNK) {
            self.close_chunk();
        }
        self.total.sqrt() as f32
    }
}

widest! {
    /// lane_t += (g_t/divisor)², in f64, lane by lane: [`GradNorm`]'s inner loop.
    fn add_squares(lanes: &mut [f64], grad_sum: &[f32], grad_divisor: f32) {
        for (l, &gs) in lanes.iter_mut().zip(grad_sum) {
            let g = (gs / grad_divisor) as f64;
            *l += g * g;
        }
    }
}

/// `torch.nn.utils.clip_grad_norm_`'s factor: C / (norm + 1e-6) when that is below 1,
/// else 1 (a NaN norm gives NaN, as PyTorch's clamp does).
pub fn clip_factor(norm: f32, max_norm: f32) -> f32 {
    let f = max_norm / (norm + 1e-6);
    if f > 1.0 {
        1.0
    } else {
        f
    }
}

/// Where a run's optimiser state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Every device holds the whole state and updates every parameter.
    Replicated,
    /// ZeRO stage 1: each device holds the state of its own part of the flat parameters
    /// (the exchange's `owned` range) and updates that part; the parameters are then
    /// all-gathered. Optimiser memory per device ÷ N; weights bitwise the replicated ones.
    Sharded,
}

/// How the learning rate changes over a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// The configured learning rate at every step.
    Constant,
    /// Cosine decay from the configured rate to `floor` times it over the run:
    /// scale(t) = floor + (1 − floor)·(1 + cos(π·t/(T − 1)))/2 for step t of T.
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

    /// The multiplier of step `step` of `total` after a linear warm-up of `warmup` steps:
    /// (step + 1)/warmup for step < warmup (the last warm-up step reaches the full rate),
    /// then this schedule over the remaining `total − warmup` steps, from its start.
    /// PyTorch: `SequentialLR([LinearLR(start_factor=1/N, total_iters=N−1), schedule],
    /// milestones=[N])`. A warm-up of 0 steps is none.
    pub fn scale_after_warmup(&self, warmup: u64, step: u64, total: u64) -> f32 {
        if step < warmup {
            return ((step + 1) as f64 / warmup as f64) as f32;
        }
        self.scale(step - warmup, total.saturating_sub(warmup))
    }
}

/// An optimiser and its state for one replica (or, sharded, for one range of it).
#[derive(Clone, PartialEq)]
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

/// The configuration, the step count and the range, and of each state tensor its length
/// and an FNV-1a digest rather than its values.
impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state: Vec<String> = self
            .state()
            .iter()
            .map(|(name, v)| format!("{name}: {} values, fnv1a {:016x}", v.len(), crate::digest::fnv1a_f32(v)))
            .collect();
        f.debug_struct("Optimizer")
            .field("config", &self.config)
            .field("steps", &self.t)
            .field("range", &self.range)
            .field("part", &self.part)
            .field("state", &state)
            .finish()
    }
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

    /// Bytes of optimiser state it holds: its configuration's state for its range.
    pub fn state_bytes(&self) -> usize {
        self.config.state_bytes(self.range.len())
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
    /// buffer) from `grad_sum`, the gradient summed over the global batch, with the
    /// scalars `s`: those of [`Optimizer::begin_step`] where the parameters decay, their
    /// [`StepScalars::without_decay`] where they do not ([`DecayMask::runs`] cuts a piece),
    /// and `s.clip` set from the step's [`GradNorm`] when clipping.
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
        match self.config {
            OptimizerConfig::Sgd { momentum, momentum_kind, .. } => {
                if momentum > 0.0 {
                    let nesterov = momentum_kind == MomentumKind::Nesterov;
                    sgd_momentum_values(params, grad_sum, &mut self.m[range], s, (momentum, nesterov))
                } else {
                    sgd_values(params, grad_sum, s)
                }
            }
            OptimizerConfig::Adam { beta1, beta2, eps, .. } | OptimizerConfig::AdamW { beta1, beta2, eps, .. } => {
                let (m, v) = (&mut self.m[range.clone()], &mut self.v[range]);
                adam_values(params, grad_sum, m, v, s, (beta1, beta2, eps))
            }
        }
    }
}

// The update's loops, one per rule, at the processor's widest vectors (`backend::simd`:
// each element's operations are the same IEEE ones at every width, so the same bits;
// kernels/optim.cu computes the same expressions in the same order).

widest! {
    /// Plain SGD: p −= step_size·g, g = gs/divisor·clip + wd·p.
    fn sgd_values(params: &mut [f32], grad_sum: &[f32], s: &StepScalars) {
        let StepScalars { grad_divisor, step_size, weight_decay, clip, .. } = *s;
        for (p, &gs) in params.iter_mut().zip(grad_sum) {
            let g = gs / grad_divisor * clip + weight_decay * *p;
            *p -= step_size * g;
        }
    }
}

widest! {
    /// SGD with momentum μ (PyTorch's: buf = g at step 1, μ·buf + g after), classic or
    /// Nesterov.
    fn sgd_momentum_values(params: &mut [f32], grad_sum: &[f32], bufs: &mut [f32], s: &StepScalars, rule: (f32, bool)) {
        let StepScalars { t, grad_divisor, step_size, weight_decay, clip, .. } = *s;
        let (momentum, nesterov) = rule;
        for ((p, &gs), buf) in params.iter_mut().zip(grad_sum).zip(bufs) {
            let g = gs / grad_divisor * clip + weight_decay * *p;
            *buf = if t == 1 { g } else { momentum * *buf + g };
            let d = if nesterov { g + momentum * *buf } else { *buf };
            *p -= step_size * d;
        }
    }
}

widest! {
    /// Adam and AdamW (their difference is in the scalars: coupled `weight_decay`, or
    /// the decoupled `shrink`), `hyper` = (β1, β2, ε).
    fn adam_values(params: &mut [f32], grad_sum: &[f32], m: &mut [f32], v: &mut [f32], s: &StepScalars, hyper: (f32, f32, f32)) {
        let StepScalars { grad_divisor, step_size, bc2_sqrt, weight_decay, shrink, clip, .. } = *s;
        let (beta1, beta2, eps) = hyper;
        for (((p, &gs), m), v) in params.iter_mut().zip(grad_sum).zip(m).zip(v) {
            let g = gs / grad_divisor * clip + weight_decay * *p;
            *m += (1.0 - beta1) * (g - *m);
            *v = beta2 * *v + (1.0 - beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p = *p * shrink - step_size * (*m / denom);
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
    fn the_state_bytes_are_those_of_the_state_held() {
        // The configuration's count (what the GPU replica and the estimate read) against
        // the vectors a host optimiser holds: whole, a part, and parts merged.
        let configs = [
            OptimizerConfig::sgd(0.1),
            OptimizerConfig::sgd_momentum(0.1, 0.9, MomentumKind::Classic),
            OptimizerConfig::adam(1e-3),
        ];
        for config in configs {
            let whole = Optimizer::new(config, 10);
            let (a, b) = (whole.part(0..3), whole.part(3..10));
            let merged = Optimizer::merge(&[b.clone(), a.clone()]).unwrap();
            for (o, n) in [(&whole, 10), (&a, 3), (&b, 7), (&merged, 10)] {
                assert_eq!(o.state_bytes(), 4 * (o.m.len() + o.v.len()), "{config:?}");
                assert_eq!(o.state_bytes(), config.state_bytes(n), "{config:?}");
            }
        }
    }

    #[test]
    fn sgd_momentum_follows_pytorch() {
        // PyTorch: buf₁ = g₁; buf₂ = μ·buf₁ + g₂; p -= lr·buf. With g = 1 both steps,
        // μ = 0.9, lr = 0.1: p = 0 − 0.1 − 0.19 = −0.29.
        let cfg = OptimizerConfig::sgd_momentum(0.1, 0.9, MomentumKind::Classic);
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
        let e = OptimizerConfig::sgd_momentum(0.1, 1.5, MomentumKind::Classic).validate().unwrap_err().to_string();
        assert!(e.contains("momentum"), "{e}");
        let e = OptimizerConfig::sgd_momentum(0.1, 0.0, MomentumKind::Nesterov).validate().unwrap_err().to_string();
        assert!(e.contains("Nesterov momentum needs a momentum above 0"), "{e}");
        let adamw = OptimizerConfig::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: -0.1 };
        let e = adamw.validate().unwrap_err().to_string();
        assert!(e.contains("weight decay"), "{e}");
    }

    #[test]
    fn nesterov_follows_pytorch() {
        // PyTorch, nesterov=True: buf₁ = g₁, d₁ = g₁ + μ·buf₁; buf₂ = μ·buf₁ + g₂,
        // d₂ = g₂ + μ·buf₂; p -= lr·d. With g = 1, μ = 0.5, lr = 0.1 (exact in binary):
        // d₁ = 1.5, buf₂ = 1.5, d₂ = 1.75, p = −0.15 − 0.175 = −0.325.
        let mut o = Optimizer::new(OptimizerConfig::sgd_momentum(0.1, 0.5, MomentumKind::Nesterov), 1);
        let mut p = [0.0f32];
        for _ in 0..2 {
            let s = o.begin_step(1.0, 1.0);
            o.update(0, &mut p, &[1.0], &s);
        }
        assert!((p[0] + 0.325).abs() < 1e-7, "{}", p[0]);
    }

    #[test]
    fn adamw_decays_before_the_step_and_adam_with_no_decay_is_adamw_with_none() {
        // Step 1 from m = v = 0: the Adam update is lr·g/(|g| + eps) ≈ lr·sign(g), after
        // p ← p·(1 − lr·wd): 2·(1 − 0.1·0.5) − 0.1 = 1.8.
        let cfg = OptimizerConfig::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.5 };
        let mut o = Optimizer::new(cfg, 1);
        let mut p = [2.0f32];
        let s = o.begin_step(1.0, 1.0);
        assert_eq!((s.weight_decay, s.shrink), (0.0, (1.0f64 - 0.1f32 as f64 * 0.5) as f32));
        o.update(0, &mut p, &[3.0], &s);
        assert!((p[0] - 1.8).abs() < 1e-6, "{}", p[0]);
        // A parameter outside the decayed group takes Adam's step alone.
        let mut q = [2.0f32];
        let mut o = Optimizer::new(cfg, 1);
        let s = o.begin_step(1.0, 1.0).without_decay();
        o.update(0, &mut q, &[3.0], &s);
        assert!((q[0] - 1.9).abs() < 1e-6, "{}", q[0]);
        // AdamW without weight decay is Adam, bitwise.
        let g: Vec<f32> = (0..6).map(|i| i as f32 * 0.3 - 0.7).collect();
        let (mut a, mut w) = (vec![0.5f32; 6], vec![0.5f32; 6]);
        let mut oa = Optimizer::new(OptimizerConfig::adam(1e-2), 6);
        let adamw = OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut ow = Optimizer::new(adamw, 6);
        for _ in 0..3 {
            let s = oa.begin_step(0.7, 2.0);
            oa.update(0, &mut a, &g, &s);
            let s = ow.begin_step(0.7, 2.0);
            ow.update(0, &mut w, &g, &s);
        }
        assert_eq!(a, w);
    }

    #[test]
    fn a_decay_mask_cuts_a_range_into_runs_of_the_weights_and_the_rest() {
        // conv weight (4-D) at 0..8, its bias 8..10, a gap 10..16, a linear weight 16..22,
        // its bias 22..24: weights decay, the biases and the gap do not.
        let tensors = [(0..8, 4), (8..10, 1), (16..22, 2), (22..24, 1)];
        let mask = DecayMask::of_tensors(tensors.clone(), DecayOn::Weights);
        assert_eq!(mask.runs(0..24), vec![(0..8, true), (8..16, false), (16..22, true), (22..24, false)]);
        assert_eq!(mask.runs(5..18), vec![(5..8, true), (8..16, false), (16..18, true)]);
        assert_eq!(mask.runs(9..12), vec![(9..12, false)]);
        assert_eq!(mask.runs(3..3), vec![]);
        assert_eq!(DecayMask::of_tensors(tensors.clone(), DecayOn::All).runs(5..18), vec![(5..18, true)]);
        // The runs' scalars: the step's where the weights are, none elsewhere; a step
        // without weight decay is not cut.
        let sgd =
            OptimizerConfig::Sgd { lr: 0.5, momentum: 0.0, momentum_kind: MomentumKind::Classic, weight_decay: 0.1 };
        let s = sgd.scalars(1, 1.0, 1.0);
        let split = mask.split(5..18, &s);
        let decays: Vec<f32> = split.iter().map(|(_, s)| s.weight_decay).collect();
        assert_eq!(decays, vec![0.1, 0.0, 0.1]);
        assert_eq!(split[1].0, 8..16);
        let plain = OptimizerConfig::sgd(0.5).scalars(1, 1.0, 1.0);
        assert_eq!(mask.split(5..18, &plain), vec![(5..18, plain)]);
        // Adjacent weights merge into one run.
        let merged = DecayMask::of_tensors([(0..4, 2), (4..8, 2)], DecayOn::Weights);
        assert_eq!(merged.runs(0..8), vec![(0..8, true)]);
    }

    #[test]
    fn the_gradient_norm_is_the_same_bits_however_the_sum_is_cut() {
        // 3 chunks and a bit, read whole, in pieces that end anywhere (as a reduce-scatter
        // among 1, 2 or 3 devices cuts them), and one value at a time.
        let n = 3 * NORM_CHUNK + 123;
        let mut rng = crate::rng::SplitMix64::new(5);
        let g: Vec<f32> = (0..n).map(|_| rng.next_f32() * 6.0 - 3.0).collect();
        let norm_of = |cuts: &[usize]| {
            let mut acc = GradNorm::default();
            let mut at = 0;
            for &end in cuts.iter().chain(std::iter::once(&n)) {
                acc.add(at, &g[at..end], 4.0);
                at = end;
            }
            acc.norm()
        };
        let whole = norm_of(&[]);
        for cuts in [vec![n / 2], vec![17, 4100, 9000], vec![NORM_CHUNK, 2 * NORM_CHUNK], vec![1, 2, 3, n - 1]] {
            assert_eq!(norm_of(&cuts).to_bits(), whole.to_bits(), "{cuts:?}");
        }
        let exact = g.iter().map(|&x| (x as f64 / 4.0).powi(2)).sum::<f64>().sqrt();
        assert!((whole as f64 - exact).abs() <= 1e-6 * exact, "{whole} against {exact}");
    }

    #[test]
    fn the_clip_factor_is_pytorchs() {
        // clip_grad_norm_(max_norm=1): norm 4 → 1/(4 + 1e-6); norm 0.5 → no clipping.
        assert_eq!(clip_factor(4.0, 1.0), 1.0 / (4.0 + 1e-6));
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert_eq!(clip_factor(1.0, 1.0), 1.0 / (1.0 + 1e-6));
        assert!(clip_factor(f32::NAN, 1.0).is_nan());
    }

    #[test]
    fn warm_up_ramps_to_the_rate_then_the_schedule_starts() {
        // 4 warm-up steps of 10: 0.25, 0.5, 0.75, 1; then the cosine over the 6 others.
        let cos = LrSchedule::Cosine { floor: 0.1 };
        let got: Vec<f32> = (0..10).map(|s| cos.scale_after_warmup(4, s, 10)).collect();
        assert_eq!(&got[..4], &[0.25, 0.5, 0.75, 1.0]);
        for s in 4..10 {
            assert_eq!(got[s as usize], cos.scale(s - 4, 6));
        }
        assert!((got[9] - 0.1).abs() < 1e-6);
        assert_eq!(LrSchedule::Constant.scale_after_warmup(2, 7, 10), 1.0);
        assert_eq!(LrSchedule::Constant.scale_after_warmup(0, 0, 10), 1.0);
        assert_eq!(cos.scale_after_warmup(0, 3, 10), cos.scale(3, 10));
    }
}
