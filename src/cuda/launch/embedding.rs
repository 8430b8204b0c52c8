//! The checked launches of kernels/embedding.cu: the token embedding's gather and its
//! deterministic backward (a counting sort of the tokens by id, then sums in token
//! order), the positional embedding's broadcast add and its sum over the batch.
//!
//! Owns: one safe method per pass, each checking its buffers' lengths before the typed
//! launches of `cuda::kernels::embedding`. The embedding backward is one method over its
//! four kernels, so that the sort the last one follows is always the one the first three
//! made from the same ids. Which ids are valid is `nn::embedding::check_ids`, made on the
//! host before the ids are copied; the kernels never index with an id outside the table
//! whatever they are given.

use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig};

use super::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu, REDUCE_BLOCK};
use crate::cuda::kernels::embedding;
use crate::{Error, Result};

/// The largest vocabulary the kernels serve: ids arrive as f32, which holds every integer
/// below 2^24 exactly (`nn::embedding::MAX_VOCAB`).
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
        unsafe { embedding::embedding::fwd(self, elem_cfg(m * c), ids, weight, y, m, vi, ci) }
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
        unsafe { embedding::embedding_count::bwd(self, elem_cfg(vocab), ids, offsets, m, vi) }?;
        // SAFETY: embedding_offsets_bwd_f32(unsigned* offsets, int vocab); one block of
        // REDUCE_BLOCK threads as the kernel requires; offsets hold vocab + 1 (checked).
        unsafe { embedding::embedding_offsets::bwd(self, one_block, offsets, vi) }?;
        let offsets = &offsets.as_view();
        // SAFETY: embedding_sort_bwd_f32(const float* ids, const unsigned* offsets, unsigned*
        // order, size_t m, int vocab); lengths checked; the kernel writes order below
        // min(offsets[v + 1], m) only.
        unsafe { embedding::embedding_sort::bwd(self, elem_cfg(vocab), ids, offsets, order, m, vi) }?;
        let order = &order.as_view();
        // SAFETY: embedding_bwd_f32(const float* dy, const unsigned* offsets, const unsigned*
        // order, float* dweight, size_t m, int vocab, int c); lengths checked; the kernel
        // reads order below min(offsets[v + 1], m), dy only at tokens below m, and writes
        // dweight below vocab*c.
        unsafe { embedding::embedding::bwd(self, elem_cfg(vocab * c), dy, offsets, order, dweight, m, vi, ci) }
    }

    /// y = x + weight, the table's first T rows broadcast over the batch. `weight` is those
    /// T rows (T*C values). x, y: (n, T, C) with tc = T*C; weight: (T, C)
    pub fn positional_embedding_fwd(
        &self,
        x: &impl DevIn,
        weight: &impl DevIn,
        y: &mut impl DevOut,
        n: usize,
        tc: usize,
    ) -> Result<()> {
        let (x, weight, y) = (&x.view(), &weight.view(), &mut y.view_mut());
        let op = "positional_embedding_fwd";
        let total = n * tc;
        check_len(op, "x", x, total)?;
        check_len(op, "weight", weight, tc)?;
        check_len(op, "y", y, total)?;
        if total == 0 {
            return Ok(());
        }
        // SAFETY: positional_embedding_fwd_f32(const float* x, const float* weight, float* y,
        // size_t tc, size_t total); x and y hold total floats, weight tc (checked), and
        // i % tc < tc.
        unsafe { embedding::positional_embedding::fwd(self, elem_cfg(total), x, weight, y, tc, total) }
    }

    /// dweight += `Σ_n dy[n]` (n ascending, into the gradient's value); dx = dy when given.
    /// dy, dx: (n, T, C) with tc = T*C; dweight: (T, C), the table's first T rows
    pub fn positional_embedding_bwd(
        &self,
        dy: &impl DevIn,
        dweight: &mut impl DevOut,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        n: usize,
        tc: usize,
    ) -> Result<()> {
        let (dy, dweight) = (&dy.view(), &mut dweight.view_mut());
        let op = "positional_embedding_bwd";
        check_len(op, "dy", dy, n * tc)?;
        check_len(op, "dweight", dweight, tc)?;
        if let Some(dx) = &dx {
            check_len(op, "dx", &**dx, n * tc)?;
        }
        if tc == 0 {
            return Ok(());
        }
        let ni = dim(op, "N", n)?;
        // SAFETY: positional_embedding_bwd_f32(const float* dy, float* dweight, float* dx, int
        // n, size_t tc); dy holds n*tc floats, dweight tc, dx n*tc when present (checked); an
        // absent dx is a 64-bit 0 the kernel tests for NULL before use.
        unsafe { embedding::positional_embedding::bwd(self, elem_cfg(tc), dy, dweight, dx, ni, tc) }
    }
}
