//! MaxPool2d: the maximum of each window of an NCHW tensor, Keras's `MaxPooling2D`
//! (pool size, strides, `valid`/`same` padding) with PyTorch's `MaxPool2d` semantics.
//!
//! Owns: the layer and its CPU arithmetic, forward and backward side by side, written per
//! H×W plane ([`maxpool2d_plane_fwd`], [`maxpool2d_plane_bwd`]) so that the host-run
//! kernel test holds `kernels/maxpool2d.cu` to these very functions. Where a window sits is
//! `ops::window`'s (shared with the convolution and the GPU); padded positions are not
//! candidates at all, so they never win (TensorFlow's `SAME` max pooling, and PyTorch's
//! −∞ padding, behave alike).
//!
//! # Ties and NaN, as PyTorch's CPU kernel
//! Each window is scanned in row-major order and a value replaces the running maximum when
//! `v > max || isnan(v)`: among equal maxima the first wins, a NaN beats every number (so
//! it propagates), and of several NaNs the last wins. The winner's index in its plane
//! (`h·W + w`) is kept, as PyTorch's `return_indices` gives it.
//!
//! # Backward
//! `dout` is routed to each window's winner; where windows overlap (stride < pool size)
//! one input may win several, and its gradient is the sum of their `dout`, added in
//! row-major order of the outputs, starting from 0. The kernel sums in that same order
//! (one thread per input element, no atomics), so the two backends agree bit for bit.
//! Planes run in parallel on the device's pool; each plane is computed alone, so nothing
//! depends on the thread count.
//!
//! Owns also its spec entry (`max_pooling2d`), its spec form and what it keeps for
//! backward.

#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;

use super::window::{Geometry2d, Padding, Window2d};
use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut};
use crate::backend::par;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Input values per parallel task, at least one plane: enough work to be worth a hand-off.
const TASK: usize = 1 << 16;

/// Max pooling over the spatial dimensions.
#[derive(Clone, Debug)]
pub struct MaxPool2d {
    window: Window2d,
    /// From the training forward: x's shape (N, C, H, W) and, per output (N, C, OH, OW),
    /// the index in its plane of the input that won.
    cache: Option<(Shape, Vec<u32>)>,
}

impl MaxPool2d {
    /// Windows of `pool_size` (KH, KW) moved by `strides` (SH, SW), with `padding`
    /// (Keras's defaults: `(2, 2)`, strides = pool size, valid).
    pub fn new(pool_size: (usize, usize), strides: (usize, usize), padding: Padding) -> Result<MaxPool2d> {
        if pool_size.0 == 0 || pool_size.1 == 0 || strides.0 == 0 || strides.1 == 0 {
            return Err(Error::config(
                "MaxPool2d",
                format!("pool size and strides must be positive (got {pool_size:?}, {strides:?})"),
            ));
        }
        padding.check(pool_size).map_err(|e| Error::config("MaxPool2d", e))?;
        Ok(MaxPool2d { window: Window2d::new(pool_size, strides, padding), cache: None })
    }

    /// The pooling window.
    pub fn window(&self) -> Window2d {
        self.window
    }

    /// The spec entry: Keras's `MaxPooling2D(pool_size=(2, 2), strides=None,
    /// padding="valid")`, strides defaulting to the pool size.
    pub const SPEC: LayerType = LayerType {
        name: "max_pooling2d",
        fields: "`pool_size` (2; int or [kh, kw]), `strides` (the pool size; int or [sh, sw]), `padding` (\"valid\", \"same\", or pads: int or [ph, pw]; \"valid\")",
        example: (&[2, 7, 6], r#"{"type": "max_pooling2d", "pool_size": [3, 2], "strides": [2, 1], "padding": "same"}"#),
        parse: |f| {
            let pool_size = f.pair("pool_size", Some((2, 2)))?;
            let strides = f.pair("strides", Some(pool_size))?;
            let padding = f.padding()?;
            Ok(Build::layer(move |input| {
                expect_images(input)?;
                MaxPool2d::new(pool_size, strides, padding).map_err(|e| e.to_string())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Distinct,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };

    /// (N, C, the window on the H×W plane) for an input shape.
    fn geometry(&self, input: &Shape) -> Result<(usize, usize, Geometry2d)> {
        let (n, c, h, w) = input.nchw("MaxPool2d")?;
        let (kh, kw) = self.window.kernel;
        let g = self.window.over(h, w).ok_or_else(|| {
            Error::shape("MaxPool2d", format!("input {input} is empty or smaller than the {kh}x{kw} pool"))
        })?;
        if u32::try_from(h * w).is_err() {
            return Err(Error::shape("MaxPool2d", format!("input {input}: a plane's indices must fit in u32")));
        }
        Ok((n, c, g))
    }
}

/// Forward of one plane. x: (H, W) → y: (OH, OW), argmax: (OH, OW), each the index
/// `h·W + w` of the value y took.
pub fn maxpool2d_plane_fwd(x: &[f32], g: &Geometry2d, y: &mut [f32], argmax: &mut [u32]) {
    for oy in 0..g.oh {
        let rows = g.rows(oy);
        for ox in 0..g.ow {
            let cols = g.cols(ox);
            // Starting from the first candidate gives what PyTorch's start from −∞ does:
            // a first −∞ stays the winner of an all −∞ window, a first NaN wins at once.
            let first = rows.start * g.w + cols.start;
            let (mut best, mut at) = (x[first], first);
            for iy in rows.clone() {
                for ix in cols.clone() {
                    let i = iy * g.w + ix;
                    let v = x[i];
                    if v > best || v.is_nan() {
                        (best, at) = (v, i);
                    }
                }
            }
            y[oy * g.ow + ox] = best;
            argmax[oy * g.ow + ox] = at as u32;
        }
    }
}

/// Backward of one plane: `dx[i] = Σ dout[o]` over the outputs o whose winner is i, in
/// ascending o from 0. dout, argmax: (OH, OW) → dx: (H, W), written.
pub fn maxpool2d_plane_bwd(dout: &[f32], argmax: &[u32], dx: &mut [f32]) {
    dx.fill(0.0);
    for (&d, &i) in dout.iter().zip(argmax) {
        dx[i as usize] += d;
    }
}

impl Layer for MaxPool2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "maxpool"
    }

    fn spec(&self) -> Option<Value> {
        let w = self.window;
        Some(json!({
            "type": "max_pooling2d",
            "pool_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
        }))
    }

    /// The winners' indices, a u32 per output.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.output.numel() as u64).saturating_mul(4), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, c, g) = self.geometry(input)?;
        Ok(Shape::new([n, c, g.oh, g.ow]))
    }

    // x: (N, C, H, W) → y: (N, C, OH, OW)
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, g) = self.geometry(x.shape())?;
        let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
        let planes = (TASK / hw).max(1);
        let mut y = vec![0.0f32; n * c * ohw];
        let mut argmax = vec![0u32; n * c * ohw];
        let work = x.host().par_chunks(planes * hw).zip(y.par_chunks_mut(planes * ohw));
        par::for_each(work.zip(argmax.par_chunks_mut(planes * ohw)), |((xs, ys), is)| {
            for ((xp, yp), ip) in xs.chunks_exact(hw).zip(ys.chunks_exact_mut(ohw)).zip(is.chunks_exact_mut(ohw)) {
                maxpool2d_plane_fwd(xp, &g, yp, ip);
            }
        });
        self.cache = (ctx.mode == Mode::Train).then(|| (x.shape().clone(), argmax));
        Tensor::from_vec_on(y, [n, c, g.oh, g.ow], x.device())
    }

    // dout: (N, C, OH, OW) → dx: (N, C, H, W), dout routed to each window's winner
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let (shape, argmax) = self
            .cache
            .take()
            .ok_or_else(|| Error::config("MaxPool2d backward", "no training forward to differentiate"))?;
        let (n, c, g) = self.geometry(&shape)?;
        if dout.shape().dims() != [n, c, g.oh, g.ow] {
            return Err(Error::shape(
                "MaxPool2d backward",
                format!("dout {} for output ({n}, {c}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
        let planes = (TASK / hw).max(1);
        let mut dx = vec![0.0f32; n * c * hw];
        let work = dx.par_chunks_mut(planes * hw).zip(dout.host().par_chunks(planes * ohw));
        par::for_each(work.zip(argmax.par_chunks(planes * ohw)), |((dxs, ds), is)| {
            for ((dxp, dp), ip) in dxs.chunks_exact_mut(hw).zip(ds.chunks_exact(ohw)).zip(is.chunks_exact(ohw)) {
                maxpool2d_plane_bwd(dp, ip, dxp);
            }
        });
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(MaxPool2d { window: self.window, cache: None })
    }

    fn describe(&self) -> String {
        format!("MaxPool2d({})", self.window.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// The layer's forward in training mode, then its backward of `dout`: (y, dx).
    fn run(pool: &mut MaxPool2d, x: Vec<f32>, dims: [usize; 4], dout: Vec<f32>) -> (Tensor, Vec<f32>) {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(x, dims).unwrap();
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let d = Tensor::from_vec(dout, y.shape().clone()).unwrap();
        let dx = pool.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        (y, dx.unwrap().unwrap().into_vec())
    }

    #[test]
    fn overlapping_windows_route_every_dout_to_its_winner_and_add_up() {
        // x: (1, 1, 5, 5); pool 3, stride 2, valid: OH = OW = ⌊(5 − 3)/2⌋ + 1 = 2.
        #[rustfmt::skip]
        let x = vec![
            1.0, 2.0, 3.0, 2.0, 1.0,
            0.0, 9.0, 0.0, 0.0, 4.0,
            5.0, 0.0, 9.0, 0.0, 4.0,
            0.0, 0.0, 0.0, 9.0, 0.0,
            7.0, 0.0, 0.0, 0.0, 8.0,
        ];
        // Windows (rows × columns) and their winners, the first maximum in row-major order:
        //   (0, 0): rows 0..3 × cols 0..3, the 9s at (1, 1) and (2, 2) → (1, 1), index 6;
        //   (0, 1): rows 0..3 × cols 2..5, one 9 at (2, 2) → index 12;
        //   (1, 0): rows 2..5 × cols 0..3, one 9 at (2, 2) → index 12;
        //   (1, 1): rows 2..5 × cols 2..5, the 9s at (2, 2) and (3, 3) → (2, 2), index 12.
        let mut pool = MaxPool2d::new((3, 3), (2, 2), Padding::Valid).unwrap();
        let (y, dx) = run(&mut pool, x, [1, 1, 5, 5], vec![1.0, 2.0, 4.0, 8.0]);
        assert_eq!(y.shape().dims(), [1, 1, 2, 2]);
        assert_eq!(y.host(), [9.0, 9.0, 9.0, 9.0]);
        // dx[6] = dout(0, 0) = 1; dx[12] = 2 + 4 + 8 = 14 (it won three windows); the 9 at
        // (3, 3), index 18, lost its only window's tie: 0. Everything else never won: 0.
        let mut want = vec![0.0; 25];
        (want[6], want[12]) = (1.0, 14.0);
        assert_eq!(dx, want);
    }

    #[test]
    fn same_padding_pads_bottom_and_right_and_a_padded_position_never_wins() {
        // x: (1, 2, 3, 4), every value negative, so a padded 0 would win if it competed.
        // Pool (2, 2), strides (2, 1), same: OH = ⌈3/2⌉ = 2, pad_total = (2 − 1)·2 + 2 − 3 = 1
        // → 0 on top, 1 at the bottom; OW = ⌈4/1⌉ = 4, pad_total = 3 + 2 − 4 = 1 → 0 left,
        // 1 right. So the last output row sees input row 2 only, the last column input
        // column 3 only.
        let x: Vec<f32> = (1..=24).map(|v| -(v as f32)).collect();
        let mut pool = MaxPool2d::new((2, 2), (2, 1), Padding::Same).unwrap();
        let dout: Vec<f32> = (1..=16).map(|v| v as f32).collect();
        let (y, dx) = run(&mut pool, x, [1, 2, 3, 4], dout);
        assert_eq!(y.shape().dims(), [1, 2, 2, 4]);
        // Channel 0 is −[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]: each window's
        // maximum is its top-left value, −1, −2, −3, −4 on rows 0..2 and −9, −10, −11, −12
        // on row 2 alone. Channel 1 is the same minus 12.
        #[rustfmt::skip]
        let want_y = [
            -1.0, -2.0, -3.0, -4.0, -9.0, -10.0, -11.0, -12.0,
            -13.0, -14.0, -15.0, -16.0, -21.0, -22.0, -23.0, -24.0,
        ];
        assert_eq!(y.host(), want_y);
        // Each output won at a distinct input (its window's top-left), so dx there is that
        // output's dout: row 0 gets dout 1..4, row 2 gets 5..8, row 1 never wins.
        #[rustfmt::skip]
        let want_dx = [
            1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0, 7.0, 8.0,
            9.0, 10.0, 11.0, 12.0, 0.0, 0.0, 0.0, 0.0, 13.0, 14.0, 15.0, 16.0,
        ];
        assert_eq!(dx, want_dx);
    }

    #[test]
    fn a_nan_propagates_forward_and_takes_the_gradient() {
        // x: (1, 1, 2, 4), pool 2: windows [1, NaN, 3, 2] and [5, NaN, NaN, 8] (row-major).
        // The first has one NaN (index 1); the second two, at indices 3 and 7: the last
        // wins (PyTorch's `val > max || isnan(val)` replaces a NaN by a later NaN).
        let nan = f32::NAN;
        let x = vec![1.0, nan, 5.0, nan, 3.0, 2.0, nan, 8.0];
        let mut pool = MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap();
        let (y, dx) = run(&mut pool, x, [1, 1, 2, 4], vec![10.0, 20.0]);
        assert!(y.host().iter().all(|v| v.is_nan()), "{:?}", y.host());
        assert_eq!(dx, [0.0, 10.0, 0.0, 0.0, 0.0, 0.0, 20.0, 0.0]);
    }

    #[test]
    fn an_eval_forward_leaves_nothing_to_differentiate() {
        let mut pool = MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap();
        let x = Tensor::from_vec(vec![1.0; 4], [1, 1, 2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let e = pool.backward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"));
        assert!(MaxPool2d::new((0, 2), (1, 1), Padding::Valid).is_err());
        assert!(MaxPool2d::new((2, 2), (1, 0), Padding::Same).is_err());
    }

    #[test]
    fn the_first_maximum_wins_a_tie_and_a_nan_wins_everything() {
        // One 2×3 window (valid, the whole plane): values in row-major order
        // [1, 3, 3, 0, 3, 2]: the maximum 3 first appears at index 1.
        let g = Window2d::new((2, 3), (1, 1), Padding::Valid).over(2, 3).unwrap();
        let (mut y, mut at) = ([0.0f32], [0u32]);
        maxpool2d_plane_fwd(&[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], &g, &mut y, &mut at);
        assert_eq!((y[0], at[0]), (3.0, 1));
        // NaNs at 2 and 4: the last NaN wins (`isnan(v)` replaces an earlier NaN too).
        maxpool2d_plane_fwd(&[1.0, 3.0, f32::NAN, 0.0, f32::NAN, 2.0], &g, &mut y, &mut at);
        assert!(y[0].is_nan() && at[0] == 4, "{y:?} {at:?}");
        // All −∞: the first candidate keeps it.
        maxpool2d_plane_fwd(&[f32::NEG_INFINITY; 6], &g, &mut y, &mut at);
        assert_eq!((y[0], at[0]), (f32::NEG_INFINITY, 0));
    }
}
