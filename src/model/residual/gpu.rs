//! The residual block on a GPU: the declaration of kernels/residual.cu (body + shortcut,
//! which is also the backward's fan-in), its checked launch, and the block's GPU form, which
//! runs its branches' own forms.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::Result;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use std::ops::Range;

use super::*;

crate::cuda::declare::kernels! {
    "residual.cu" {
        residual_add {
            fwd(a: In, b: In, y: Out, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = a + b: a residual block's add, and its backward's fan-in (dx = dbody +
    /// dshortcut). a, b, y: (n)
    pub fn residual_add(&self, a: &impl DevIn, b: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let a = &a.view();
        let b = &b.view();
        let y = &mut y.view_mut();
        let n = a.len();
        check_len("residual_add_fwd", "b", b, n)?;
        check_len("residual_add_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: residual_add_fwd_f32(const float*, const float*, float*, size_t); a, b
        // and y hold n floats each (checked above), and the kernel touches indices < n only.
        unsafe { residual_add::fwd(self, elem_cfg(n), a, b, y, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Residual) -> Option<Box<dyn GpuLayer>> {
    let branch = |s: &Graph| -> Option<Vec<Child>> {
        let mut children = Vec::new();
        for (j, ((layer, name), shapes)) in s.layers().iter().zip(s.layer_names()).zip(s.layer_shapes()).enumerate() {
            children.push(Child {
                name: name.clone(),
                position: j,
                shapes: shapes.clone(),
                params: layer.params().len(),
                buffers: layer.buffers().len(),
                op: layer.gpu()?,
                place: None,
            });
        }
        Some(children)
    };
    let shortcut = match &layer.shortcut {
        Some(s) => Some(branch(s)?),
        None => None,
    };
    Some(Box::new(ResidualGpu { body: branch(&layer.body)?, shortcut, relu: layer.relu.is_some(), bufs: None }))
}

/// One layer of a branch as the block's GPU form runs it.
struct Child {
    name: String,
    /// Its position in its branch.
    position: usize,
    shapes: LayerShapes,
    /// How many of the block's parameter and buffer tensors are its.
    params: usize,
    buffers: usize,
    op: Box<dyn GpuLayer>,
    /// Its place in the network, made from the block's at the first reserve.
    place: Option<Placement>,
}

/// The block's device buffers at one batch size.
struct Buffers {
    n: usize,
    /// Each body layer's output, then each shortcut layer's: (n, *its output).
    body: Vec<CudaSlice<f32>>,
    short: Vec<CudaSlice<f32>>,
    /// body + shortcut before the ReLU: (n, *output) (unused without one).
    sum: CudaSlice<f32>,
    /// The gradient after the ReLU's mask: (n, *output).
    d: CudaSlice<f32>,
    /// Two gradient buffers a branch's backward alternates between (its widest layer).
    grads: [CudaSlice<f32>; 2],
    /// The body's and the shortcut's input gradients: (n, *input).
    dbody: CudaSlice<f32>,
    dshort: CudaSlice<f32>,
}

/// The residual block on a GPU: the branches' layers through their own GPU forms, the add
/// (and the backward's fan-in) with `residual_add_fwd`, the ReLU with `relu_fwd`/`relu_bwd`
/// on the pre-activation sum.
pub(super) struct ResidualGpu {
    body: Vec<Child>,
    shortcut: Option<Vec<Child>>,
    relu: bool,
    bufs: Option<Buffers>,
}

/// The places of a branch's layers, inside block `block`: their ranges the
/// block's, cut in order (the body's first, from `param_at`/`buffer_at` on).
fn place_children(children: &mut [Child], block: &Placement, branch: u64, at: &mut (usize, usize)) {
    for c in children {
        c.place = Some(child_place(c, block, branch, at));
    }
}

/// The place of `c`, branch `branch`'s next layer inside block `block`, its
/// tensors the block's from `at` on (which it moves past them).
fn child_place(c: &Child, block: &Placement, branch: u64, at: &mut (usize, usize)) -> Placement {
    let params: Vec<Range<usize>> = block.params[at.0..at.0 + c.params].to_vec();
    let buffers: Vec<Range<usize>> = block.buffers[at.1..at.1 + c.buffers].to_vec();
    *at = (at.0 + c.params, at.1 + c.buffers);
    Placement {
        name: format!("{}.{}", block.name, c.name),
        index: Place::Branch(branch).index(block.index, c.position),
        input: c.shapes.input.clone(),
        output: c.shapes.output.clone(),
        other_inputs: Vec::new(),
        params,
        buffers,
    }
}

impl ResidualGpu {
    fn children(&self) -> impl Iterator<Item = &Child> {
        self.body.iter().chain(self.shortcut.iter().flatten())
    }

    fn place(&mut self, place: &Placement) {
        if self.body.first().is_some_and(|c| c.place.is_some()) {
            return;
        }
        let mut at = (0, 0);
        place_children(&mut self.body, place, BODY, &mut at);
        if let Some(s) = &mut self.shortcut {
            place_children(s, place, SHORTCUT, &mut at);
        }
    }
}

fn alloc(gpu: &Gpu, len: usize) -> Result<CudaSlice<f32>> {
    Ok(gpu.stream().alloc_zeros::<f32>(len.max(1))?)
}

impl GpuLayer for ResidualGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        self.place(place);
        for c in self.body.iter_mut().chain(self.shortcut.iter_mut().flatten()) {
            let child = c.place.as_ref().expect("placed above");
            c.op.reserve(gpu, child, n)?;
        }
        if self.bufs.as_ref().is_some_and(|b| b.n == n) {
            return Ok(());
        }
        let outputs =
            |cs: &[Child]| cs.iter().map(|c| alloc(gpu, n * c.shapes.output.numel())).collect::<Result<Vec<_>>>();
        let widest = self.children().map(|c| c.shapes.output.numel()).max().unwrap_or(0).max(place.input.numel());
        let (i, o) = (place.input.numel(), place.output.numel());
        self.bufs = Some(Buffers {
            n,
            body: outputs(&self.body)?,
            short: outputs(self.shortcut.as_deref().unwrap_or(&[]))?,
            sum: alloc(gpu, if self.relu { n * o } else { 0 })?,
            d: alloc(gpu, if self.relu { n * o } else { 0 })?,
            grads: [alloc(gpu, n * widest)?, alloc(gpu, n * widest)?],
            dbody: alloc(gpu, n * i)?,
            dshort: alloc(gpu, if self.shortcut.is_some() { n * i } else { 0 })?,
        });
        Ok(())
    }

    fn scratch(&self, place: &Placement, n: usize) -> Result<usize> {
        let mut most = 0;
        let mut at = (0, 0);
        let mut probe = |cs: &[Child], branch: u64| -> Result<()> {
            for c in cs {
                most = most.max(c.op.scratch(&child_place(c, place, branch, &mut at), n)?);
            }
            Ok(())
        };
        probe(&self.body, BODY)?;
        probe(self.shortcut.as_deref().unwrap_or(&[]), SHORTCUT)?;
        Ok(most)
    }

    // x: (n, *input) → y: (n, *output) = act(body(x) + shortcut(x))
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let Forward { gpu, blas, n, params, x, y, scratch, pass, sync, .. } = f;
        let bufs = self.bufs.as_mut().filter(|b| b.n == n).expect("the network reserves a block before its passes");
        for (children, acts) in
            [(&mut self.body, &mut bufs.body), (self.shortcut.as_mut().unwrap_or(&mut Vec::new()), &mut bufs.short)]
        {
            for j in 0..children.len() {
                let (done, rest) = acts.split_at_mut(j);
                let input = if j == 0 { x } else { &done[j - 1] };
                let c = &mut children[j];
                let place = c.place.as_ref().expect("placed at reserve");
                c.op.forward(Forward {
                    gpu,
                    blas,
                    place,
                    n,
                    params,
                    x: input,
                    others: &[],
                    y: &mut rest[0],
                    scratch: &mut *scratch,
                    pass: &mut *pass,
                    sync,
                })?;
            }
        }
        let body = bufs.body.last().expect("a body has a layer");
        let skip = bufs.short.last().unwrap_or(x);
        if self.relu {
            gpu.residual_add(body, skip, &mut bufs.sum)?;
            gpu.relu_fwd(&bufs.sum, y)
        } else {
            gpu.residual_add(body, skip, y)
        }
    }

    // dy: (n, *output) → dx: (n, *input) = dbody + dshortcut; the branches accumulate
    // their parameters' gradients.
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Backward { gpu, blas, n, params, x, dy, dx, grads, draw, scratch, sync, .. } = b;
        let bufs = self.bufs.as_mut().filter(|b| b.n == n).expect("the network reserves a block before its passes");
        let Buffers { body: body_acts, short: short_acts, sum, d, grads: alternate, dbody, dshort, .. } = bufs;
        let d: CudaView<'_, f32> = if self.relu {
            gpu.relu_bwd(&*sum, &dy, d)?;
            d.slice(0..dy.len())
        } else {
            dy
        };
        let needed = dx.is_some();
        // One branch's backward from `d` down to its first layer, whose input gradient
        // goes to `out` (when the block's is needed).
        let mut branch =
            |children: &mut [Child], acts: &[CudaSlice<f32>], out: Option<CudaViewMut<'_, f32>>| -> Result<()> {
                let mut out = out;
                let mut cur = 0;
                let last = children.len() - 1;
                for j in (0..=last).rev() {
                    let Child { op, place, .. } = &mut children[j];
                    let place = place.as_ref().expect("placed at reserve");
                    let [g0, g1] = &mut *alternate;
                    let (from, to) = if cur == 0 { (&*g0, g1) } else { (&*g1, g0) };
                    let dy = if j == last { d.slice(0..d.len()) } else { from.slice(0..n * place.output.numel()) };
                    let dx = if j == 0 { out.take() } else { Some(to.slice_mut(0..n * place.input.numel())) };
                    let input = if j == 0 { x } else { &acts[j - 1] };
                    op.backward(Backward {
                        gpu,
                        blas,
                        place,
                        n,
                        params,
                        x: input,
                        others: &[],
                        dy,
                        dx,
                        d_others: Vec::new(),
                        grads: &mut *grads,
                        draw,
                        scratch: &mut *scratch,
                        sync,
                    })?;
                    cur = 1 - cur;
                }
                Ok(())
            };
        let len = n * self.body.first().map_or(0, |c| c.shapes.input.numel());
        if let Some(short) = &mut self.shortcut {
            branch(short, short_acts, needed.then(|| dshort.slice_mut(0..len)))?;
        }
        branch(&mut self.body, body_acts, needed.then(|| dbody.slice_mut(0..len)))?;
        match dx {
            Some(mut dx) if self.shortcut.is_some() => gpu.residual_add(&*dbody, &*dshort, &mut dx),
            Some(mut dx) => gpu.residual_add(&*dbody, &d, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernel of kernels/residual.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (one f32 addition a value), as the forward's add and as the backward's fan-in:
/// with signed zeros, an infinity against its opposite (NaN) and a NaN passing through,
/// under the launch shape the launch uses and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_bits, uniform};
    let n = 3000;
    let (mut a, mut b) = (uniform(31, n), uniform(32, n));
    (a[0], b[0], a[1], b[1], a[2], b[2], a[3]) = (0.0, -0.0, -0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN);
    let (mut want_forward, mut want_fan_in) = (a.clone(), a.clone());
    super::cpu::residual_forward(&mut want_forward, &b);
    super::cpu::residual_backward(&mut want_fan_in, &b);
    assert_bits("the forward's add vs the backward's fan-in", &want_forward, &want_fan_in);
    for cfg in elem_cfgs(n) {
        let mut y = vec![f32::NAN; n];
        // As Gpu::residual_add pushes them: a, b, y, n.
        k.launch(&residual_add::FWD, cfg, &mut [In(&a), In(&b), Out(&mut y), U64(n as u64)]);
        assert_bits(&format!("residual add {cfg:?}"), &y, &want_forward);
    }
}
