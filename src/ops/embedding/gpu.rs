//! The token embedding on a GPU: the declaration of kernels/embedding.cu, its checked
//! launches (the backward one method over its four kernels, so that the sort the last one
//! follows is always the one the first three made from the same ids), and the op's GPU form.
//! Which ids are valid is `super::check_ids`, made on the host before the ids are copied; the
//! kernels never index with an id outside the table whatever they are given.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, REDUCE_BLOCK};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig};

use super::*;

crate::cuda::declare::kernels! {
    "embedding.cu" {
        embedding {
            fwd(ids: In, weight: In, y: Out, m: Size, vocab: I32, c: I32);
            bwd(dy: In, offsets: InU32, order: InU32, dweight: Out, m: Size, vocab: I32, c: I32);
        }
        embedding_count {
            bwd(ids: In, offsets: OutU32, m: Size, vocab: I32);
        }
        embedding_offsets {
            bwd(offsets: OutU32, vocab: I32);
        }
        embedding_sort {
            bwd(ids: In, offsets: InU32, order: OutU32, m: Size, vocab: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// The largest vocabulary the kernels serve: ids arrive as f32, which holds every integer
/// below 2^24 exactly (`ops::embedding::MAX_VOCAB`).
const MAX_VOCAB: usize = 1 << 24;

impl Gpu {
    /// y = `weight[ids]`: row `ids[i]` of the table for each token (NaN for an id that is
    /// not a row, which the host's check refuses first).
    /// ids: (m) as f32, weight: (vocab, c) -> y: (m, c)
    pub fn embedding_fwd(
        &self,
        ids: &impl DevIn,
        weight: &impl DevIn,
        y: &mut impl DevOut,
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        let (ids, weight, y) = (&ids.view(), &weight.view(), &mut y.view_mut());
        let op = "embedding_fwd";
        let m = ids.len();
        if vocab > MAX_VOCAB {
            return Err(Error::shape(op, format!("a vocabulary of {vocab} is above the 2^24 ids f32 holds exactly")));
        }
        check_len(op, "weight", weight, vocab * c)?;
        check_len(op, "y", y, m * c)?;
        if m * c == 0 {
            return Ok(());
        }
        let (vi, ci) = (dim(op, "vocab", vocab)?, dim(op, "C", c)?);
        // SAFETY: embedding_fwd_f32(const float* ids, const float* weight, float* y, size_t m,
        // int vocab, int c); ids hold m floats, weight vocab*c, y m*c (checked); the kernel
        // reads weight only at rows of ids in [0, vocab) and writes y below m*c.
        unsafe { embedding::fwd(self, elem_cfg(m * c), ids, weight, y, m, vi, ci) }
    }

    /// `dweight[ids[i]] += dy[i]`, for every token i in order: a counting sort of the token
    /// positions by id into `order` (its offsets per id in `offsets`), then one thread per
    /// (row, column) adding its tokens' dy in token order into the gradient. Tokens whose
    /// id is not a row are skipped (the host's check refuses them first).
    /// ids: (m) as f32, dy: (m, c), offsets: (vocab + 1) u32 and order: (m) u32 (workspace,
    /// overwritten) -> dweight: (vocab, c), accumulated
    // The kernels' own buffers, one by one, as every checked launch takes them.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_bwd(
        &self,
        ids: &impl DevIn,
        dy: &impl DevIn,
        dweight: &mut impl DevOut,
        offsets: &mut CudaSlice<u32>,
        order: &mut CudaSlice<u32>,
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        let (ids, dy, dweight) = (&ids.view(), &dy.view(), &mut dweight.view_mut());
        let op = "embedding_bwd";
        let m = ids.len();
        if vocab > MAX_VOCAB {
            return Err(Error::shape(op, format!("a vocabulary of {vocab} is above the 2^24 ids f32 holds exactly")));
        }
        if u32::try_from(m).is_err() {
            return Err(Error::shape(op, format!("{m} tokens do not fit the sort's u32 positions")));
        }
        check_len(op, "dy", dy, m * c)?;
        check_len(op, "dweight", dweight, vocab * c)?;
        check_len(op, "offsets", offsets, vocab + 1)?;
        check_len(op, "order", order, m)?;
        if m == 0 || vocab * c == 0 {
            return Ok(());
        }
        let (vi, ci) = (dim(op, "vocab", vocab)?, dim(op, "C", c)?);
        let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (REDUCE_BLOCK, 1, 1), shared_mem_bytes: 0 };
        let offsets: &mut CudaViewMut<'_, u32> = &mut offsets.as_view_mut();
        let order: &mut CudaViewMut<'_, u32> = &mut order.as_view_mut();
        // SAFETY: embedding_count_bwd_f32(const float* ids, unsigned* offsets, size_t m, int
        // vocab); ids hold m floats and offsets vocab + 1 (checked); the kernel writes
        // offsets[v + 1] for v < vocab only.
        unsafe { embedding_count::bwd(self, elem_cfg(vocab), ids, offsets, m, vi) }?;
        // SAFETY: embedding_offsets_bwd_f32(unsigned* offsets, int vocab); one block of
        // REDUCE_BLOCK threads as the kernel requires; offsets hold vocab + 1 (checked).
        unsafe { embedding_offsets::bwd(self, one_block, offsets, vi) }?;
        let offsets = &offsets.as_view();
        // SAFETY: embedding_sort_bwd_f32(const float* ids, const unsigned* offsets, unsigned*
        // order, size_t m, int vocab); lengths checked; the kernel writes order below
        // min(offsets[v + 1], m) only.
        unsafe { embedding_sort::bwd(self, elem_cfg(vocab), ids, offsets, order, m, vi) }?;
        let order = &order.as_view();
        // SAFETY: embedding_bwd_f32(const float* dy, const unsigned* offsets, const unsigned*
        // order, float* dweight, size_t m, int vocab, int c); lengths checked; the kernel
        // reads order below min(offsets[v + 1], m), dy only at tokens below m, and writes
        // dweight below vocab*c.
        unsafe { embedding::bwd(self, elem_cfg(vocab * c), dy, offsets, order, dweight, m, vi, ci) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Embedding) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(EmbeddingGpu { vocab: layer.vocab, width: layer.width, offsets: None, order: None }))
}

/// The embedding on a GPU: `embedding_fwd` gathers the rows; the backward sorts the
/// token positions by id (counting sort, stable) into `order`, with each id's span in
/// `offsets`, then adds each row's tokens in token order, as the CPU layer does.
pub(super) struct EmbeddingGpu {
    vocab: usize,
    width: usize,
    /// offsets: (V + 1) u32, each id's span in `order`.
    offsets: Option<CudaSlice<u32>>,
    /// order: (N·T) u32, the token positions sorted by id.
    order: Option<CudaSlice<u32>>,
}

impl GpuLayer for EmbeddingGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        self.order = None;
        self.order = Some(gpu.stream().alloc_zeros::<u32>((n * place.input.numel()).max(1))?);
        if self.offsets.is_none() {
            self.offsets = Some(gpu.stream().alloc_zeros::<u32>(self.vocab + 1)?);
        }
        Ok(())
    }

    // ids: (N, T) → y: (N, T, C)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.embedding_fwd(f.x, &f.param(0), f.y, self.vocab, self.width)
    }

    // dy: (N, T, C) → dweight (V, C) += dy at the ids, in token order; no dx
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Backward { gpu, place, n, x, dy, dx, grads, .. } = b;
        if dx.is_some() {
            return Err(needs_input_grad());
        }
        if n * place.input.numel() == 0 {
            return Ok(());
        }
        let offsets = self.offsets.as_mut().expect("reserved before the pass");
        let order = self.order.as_mut().expect("reserved before the pass");
        gpu.embedding_bwd(x, &dy, &mut grads.slice_mut(place.params[0].clone()), offsets, order, self.vocab, self.width)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// As `Gpu::embedding_bwd` runs its four kernels, on `cfg` (None: the launch's own shapes;
/// the offsets kernel on its one block always): the counting sort's offsets (V + 1) and
/// order (m), and dweight accumulated.
#[cfg(test)]
fn embedding_bwd_on_host(
    k: &crate::cuda::host::Checker,
    cfg: Option<crate::cuda::host::Cfg>,
    ids: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
    vocab: usize,
    c: usize,
) -> (Vec<u32>, Vec<u32>) {
    use crate::cuda::host::{elem_cfg, Cfg, In, InU32, Out, OutU32, I32, U64};
    let m = ids.len();
    let (mut offsets, mut order) = (vec![u32::MAX; vocab + 1], vec![u32::MAX; m]);
    let (vi, ci) = (vocab as i32, c as i32);
    let one_block = Cfg { grid: (1, 1, 1), block: (REDUCE_BLOCK, 1, 1) };
    // As Gpu::embedding_bwd pushes them: ids, offsets, m, vocab; offsets, vocab; ids,
    // offsets, order, m, vocab; dy, offsets, order, dweight, m, vocab, c.
    let over_rows = cfg.unwrap_or(elem_cfg(vocab));
    k.launch(&embedding_count::BWD, over_rows, &mut [In(ids), OutU32(&mut offsets), U64(m as u64), I32(vi)]);
    k.launch(&embedding_offsets::BWD, one_block, &mut [OutU32(&mut offsets), I32(vi)]);
    k.launch(
        &embedding_sort::BWD,
        over_rows,
        &mut [In(ids), InU32(&offsets), OutU32(&mut order), U64(m as u64), I32(vi)],
    );
    k.launch(
        &embedding::BWD,
        cfg.unwrap_or(elem_cfg(vocab * c)),
        &mut [In(dy), InU32(&offsets), InU32(&order), Out(dweight), U64(m as u64), I32(vi), I32(ci)],
    );
    (offsets, order)
}

/// The kernels of kernels/embedding.cu run on the host against the CPU's [`super::cpu`],
/// bit for bit: the forward is a copy of rows, and each (row, column) of the backward adds
/// its tokens' dy in token order into the gradient's value, the CPU's very f32 additions.
/// The counting sort against its definition (each row's offset is the tokens of the rows
/// before it, its tokens listed in token order). Ids repeating many times over a small
/// vocabulary, and a vocabulary of 600, over the offsets kernel's 256 threads, so that they
/// scan chunks of 3 counts, with rows no token uses; under the launches' own shapes and a
/// grid too small to cover the data. Then ids the host refuses (`super::check_ids`), which
/// never index the table on the device: the forward writes NaN rows for them, the backward
/// skips them (the CPU on the good tokens alone, in their order, is the reference).
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, Out, FEW, I32, U64};
    use crate::testing::{assert_bits, uniform};
    let mut g = crate::rng::SplitMix64::new(21);
    for (vocab, c, m) in [(7usize, 5usize, 33usize), (600, 3, 200)] {
        let ids: Vec<f32> = (0..m).map(|_| (g.next_u64() % vocab as u64) as f32).collect();
        let rows: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
        let (weight, dy, dweight0) = (uniform(vocab as u64, vocab * c), uniform(2, m * c), uniform(3, vocab * c));
        let mut want_y = vec![f32::NAN; m * c];
        super::cpu::embedding_forward(&ids, &weight, c, &mut want_y);
        let mut want_dweight = dweight0.clone();
        super::cpu::embedding_backward(&rows, &dy, c, &mut want_dweight);
        let mut want_order: Vec<u32> = (0..m as u32).collect();
        want_order.sort_by_key(|&i| rows[i as usize]);
        let mut want_offsets = vec![0u32; vocab + 1];
        for &r in &rows {
            want_offsets[r as usize + 1] += 1;
        }
        for v in 0..vocab {
            want_offsets[v + 1] += want_offsets[v];
        }
        let case = format!("(V, C, m) = ({vocab}, {c}, {m})");
        for cfg in [None, Some(FEW)] {
            let mut y = vec![f32::NAN; m * c];
            // As Gpu::embedding_fwd pushes them: ids, weight, y, m, vocab, c.
            k.launch(
                &embedding::FWD,
                cfg.unwrap_or(elem_cfg(m * c)),
                &mut [In(&ids), In(&weight), Out(&mut y), U64(m as u64), I32(vocab as i32), I32(c as i32)],
            );
            assert_bits(&format!("embedding y {case} {cfg:?}"), &y, &want_y);
            let mut dweight = dweight0.clone();
            let (offsets, order) = embedding_bwd_on_host(k, cfg, &ids, &dy, &mut dweight, vocab, c);
            assert_eq!(offsets, want_offsets, "offsets {case} {cfg:?}");
            assert_eq!(order, want_order, "order {case} {cfg:?}");
            assert_bits(&format!("embedding dweight {case} {cfg:?}"), &dweight, &want_dweight);
        }
    }

    let (vocab, c, m) = (7, 4, 20);
    let mut ids: Vec<f32> = (0..m).map(|_| (g.next_u64() % vocab as u64) as f32).collect();
    let bad = [(0, 7.0), (5, -1.0), (9, 2.5), (12, f32::NAN), (13, 1e30), (19, f32::NEG_INFINITY)];
    for &(i, v) in &bad {
        ids[i] = v;
    }
    assert!(super::check_ids(&ids, m, vocab).is_err(), "the host refuses them");
    let good: Vec<usize> = (0..m).filter(|i| bad.iter().all(|&(b, _)| b != *i)).collect();
    let (weight, dy, dweight0) = (uniform(4, vocab * c), uniform(5, m * c), uniform(6, vocab * c));
    let good_ids: Vec<f32> = good.iter().map(|&i| ids[i]).collect();
    let good_rows: Vec<u32> = good_ids.iter().map(|&id| id as u32).collect();
    let good_dy: Vec<f32> = good.iter().flat_map(|&i| dy[i * c..(i + 1) * c].to_vec()).collect();
    let mut y_good = vec![0.0; good.len() * c];
    super::cpu::embedding_forward(&good_ids, &weight, c, &mut y_good);
    // A refused id's row is the kernel's NaN, CUDA's canonical quiet one.
    let mut want_y = vec![f32::from_bits(0x7FC0_0000); m * c];
    for (j, &i) in good.iter().enumerate() {
        want_y[i * c..(i + 1) * c].copy_from_slice(&y_good[j * c..(j + 1) * c]);
    }
    let mut want_dweight = dweight0.clone();
    super::cpu::embedding_backward(&good_rows, &good_dy, c, &mut want_dweight);
    let mut y = vec![0.0; m * c];
    k.launch(
        &embedding::FWD,
        elem_cfg(m * c),
        &mut [In(&ids), In(&weight), Out(&mut y), U64(m as u64), I32(vocab as i32), I32(c as i32)],
    );
    assert_bits("embedding y with bad ids", &y, &want_y);
    let mut dweight = dweight0;
    let (offsets, _) = embedding_bwd_on_host(k, None, &ids, &dy, &mut dweight, vocab, c);
    assert_eq!(offsets[vocab] as usize, good.len(), "bad ids are counted in no row");
    assert_bits("embedding dweight with bad ids", &dweight, &want_dweight);
}
