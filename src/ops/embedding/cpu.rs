//! The token embedding on the CPU: the gather of table rows by id, and its gradient, the
//! rows of dout added into the table's gradient in token order. The reference every other
//! backend is checked against (kernels/embedding.cu, bit for bit: a copy, and the same f32
//! additions in the same order).
//!
//! Both take ids that are rows of the table: which ids are valid, and the error that names
//! a bad one, is the layer's (`super::check_ids`), checked before anything is read. The
//! ids have no gradient.

/// y = weight[ids]: row `ids[i]` of the table for each token i, WRITTEN.
/// ids: (m), integers in [0, V) as f32; weight: (V, C) → y: (m, C)
pub fn embedding_forward(ids: &[f32], weight: &[f32], c: usize, y: &mut [f32]) {
    assert_eq!(y.len(), ids.len() * c, "embedding_forward: y of {} for {} ids of width {c}", y.len(), ids.len());
    for (row, &id) in y.chunks_exact_mut(c).zip(ids) {
        let r = id as usize;
        row.copy_from_slice(&weight[r * c..(r + 1) * c]);
    }
}

/// dweight[ids[i]] += dout[i] for every token i in token order, one f32 addition at a
/// time: the order of every addition is fixed, so the gradient is the same bits on any
/// run and any thread count. dweight is ACCUMULATED.
/// ids: (m) rows of the table; dout: (m, C) → dweight: (V, C)
pub fn embedding_backward(ids: &[u32], dout: &[f32], c: usize, dweight: &mut [f32]) {
    assert_eq!(dout.len(), ids.len() * c, "embedding_backward: dout of {} for {} ids", dout.len(), ids.len());
    for (&id, d) in ids.iter().zip(dout.chunks_exact(c)) {
        let r = id as usize;
        for (g, v) in dweight[r * c..(r + 1) * c].iter_mut().zip(d) {
            *g += v;
        }
    }
}
