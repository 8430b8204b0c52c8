//! Permute on the CPU: a tensor's axes put in another order, every value moved once and
//! none computed, so any two ways of moving them give the same bits. The reference
//! kernels/permute.cu is checked against.
//!
//! A permutation is first reduced to its fewest axes ([`Plan`]): axes of size 1 dropped,
//! and input axes that stay neighbours, in order, in the output merged into one (a
//! (N, T, H, D) → (N, H, T, D) permutation is (N, T, H, D) with its middle pair swapped, but
//! (N, C, H, W) → (N, H, W, C) is the transpose of (N, C, H·W)). Then one of two moves:
//! - the input's last axis stays last: the output is runs of that axis's values, each one
//!   copy out of the input ([`permute`]'s rows: attention's (T, H, D) → (H, T, D) moves
//!   runs of D);
//! - it moves: the output's last axis and the input's last axis are two axes of a 2-D
//!   transpose, done by the backend's register-tiled transpose
//!   (`backend::cpu::transpose_strided`), once for every place of the other axes.
//!
//! Work is split among the pool's threads by runs of the output ([`CHUNK`] values or more
//! a task), each task writing its own part of the output.

use rayon::prelude::*;

use crate::backend::cpu::transpose_strided;
use crate::backend::par;

/// Values a parallel task moves at least: large enough that a task costs more than
/// handing it over.
pub const CHUNK: usize = 1 << 15;

/// The fewest runs of the input's last axis that a transposing task takes, where the
/// output has that many: the transpose's register tiles are 16 wide.
const TILE: usize = 16;

/// A permutation reduced to its fewest axes: the input's dimensions `dims` (row-major),
/// and `perm[j]`, the input axis that output axis j is. No axis has size 1, and no two
/// input axes that are neighbours stay neighbours in the output (those are merged), so
/// the identity is `perm` = [0] or [] (a tensor of one value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub dims: Vec<usize>,
    pub perm: Vec<usize>,
}

impl Plan {
    /// The plan of permuting a tensor of `dims` by `perm` (output axis j is input axis
    /// `perm[j]`), which must be a permutation of 0..dims.len().
    pub fn new(dims: &[usize], perm: &[usize]) -> Plan {
        let mut seen = vec![false; dims.len()];
        for &p in perm {
            assert!(p < dims.len() && !seen[p], "Plan::new: {perm:?} is not a permutation of {} axes", dims.len());
            seen[p] = true;
        }
        assert_eq!(perm.len(), dims.len(), "Plan::new: {perm:?} for {} axes", dims.len());
        // The axes of more than one value, renumbered in input order.
        let kept: Vec<usize> = (0..dims.len()).filter(|&i| dims[i] != 1).collect();
        let renumber = |i: usize| kept.iter().position(|&k| k == i).expect("a kept axis");
        let perm: Vec<usize> = perm.iter().copied().filter(|&p| dims[p] != 1).map(renumber).collect();
        let dims: Vec<usize> = kept.iter().map(|&i| dims[i]).collect();
        // Runs of output axes that are consecutive input axes, each (first input axis, size).
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let mut j = 0;
        while j < perm.len() {
            let (first, mut size) = (perm[j], dims[perm[j]]);
            j += 1;
            while j < perm.len() && perm[j] == perm[j - 1] + 1 {
                size *= dims[perm[j]];
                j += 1;
            }
            groups.push((first, size));
        }
        // The groups tile the input's axes; in input order they are the plan's axes.
        let mut order: Vec<usize> = (0..groups.len()).collect();
        order.sort_by_key(|&g| groups[g].0);
        let mut plan = Plan { dims: order.iter().map(|&g| groups[g].1).collect(), perm: vec![0; groups.len()] };
        for (i, &g) in order.iter().enumerate() {
            plan.perm[g] = i;
        }
        plan
    }

    /// Whether the output is the input's values in their order.
    pub fn is_identity(&self) -> bool {
        self.perm.len() <= 1
    }

    /// The output's dimensions.
    pub fn out_dims(&self) -> Vec<usize> {
        self.perm.iter().map(|&p| self.dims[p]).collect()
    }

    /// The values of the tensor.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Whether the tensor has no values (never: sizes are positive).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each output axis's stride in the input.
    pub fn src_strides(&self) -> Vec<usize> {
        let input = strides(&self.dims);
        self.perm.iter().map(|&p| input[p]).collect()
    }

    /// The plan of the inverse permutation (the backward's: the output's axes back in the
    /// input's order), over the output's dimensions.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn inverse(&self) -> Plan {
        let mut inv = vec![0; self.perm.len()];
        for (j, &p) in self.perm.iter().enumerate() {
            inv[p] = j;
        }
        Plan::new(&self.out_dims(), &inv)
    }
}

/// The strides of row-major `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The offset in the input of output place `index` of `axes` (row-major over `dims`,
/// each axis `src` apart in the input).
fn src_offset(mut index: usize, dims: &[usize], src: &[usize]) -> usize {
    let mut at = 0;
    for (&d, &s) in dims.iter().zip(src).rev() {
        at += index % d * s;
        index /= d;
    }
    at
}

/// y = x with its axes permuted as `plan` says. x: (plan.dims), y: (plan.out_dims()).
pub fn permute(x: &[f32], plan: &Plan, y: &mut [f32]) {
    let n = plan.len();
    assert_eq!(x.len(), n, "permute: {} values for dims {:?}", x.len(), plan.dims);
    assert_eq!(y.len(), n, "permute: an output of {} for {n} values", y.len());
    let k = plan.perm.len();
    if plan.is_identity() {
        y.copy_from_slice(x);
    } else if plan.perm[k - 1] == k - 1 {
        runs(x, plan, y);
    } else {
        transposes(x, plan, y);
    }
}

/// The input's last axis stays last: every output row (the last axis's L values) is one
/// copy out of the input. A task takes whole rows; the rows' places in the input follow
/// an odometer over the output's other axes.
fn runs(x: &[f32], plan: &Plan, y: &mut [f32]) {
    let k = plan.perm.len();
    let (od, src) = (plan.out_dims(), plan.src_strides());
    let l = od[k - 1];
    let (od, src) = (&od[..k - 1], &src[..k - 1]);
    let rows_per_task = (CHUNK / l).max(1);
    par::for_each(y.par_chunks_mut(rows_per_task * l).enumerate(), |(t, ys)| {
        let first = t * rows_per_task;
        let mut at = src_offset(first, od, src);
        let mut coords = vec![0; od.len()];
        let mut index = first;
        for (c, &d) in coords.iter_mut().zip(od).rev() {
            *c = index % d;
            index /= d;
        }
        let rows = ys.len() / l;
        for (r, row) in ys.chunks_exact_mut(l).enumerate() {
            row.copy_from_slice(&x[at..at + l]);
            if r + 1 == rows {
                break;
            }
            // The next output row: the odometer's last axis moves, carrying leftwards.
            let mut j = od.len() - 1;
            coords[j] += 1;
            at += src[j];
            while coords[j] == od[j] {
                at -= od[j] * src[j];
                coords[j] = 0;
                j -= 1;
                coords[j] += 1;
                at += src[j];
            }
        }
    });
}

/// The input's last axis moves. Say it is output axis b, and the output's last axis is
/// input axis a: for every place of the other axes, the (d_a, d_last) block of the input
/// (rows d_a apart by a's stride, columns contiguous) is the (d_last, d_a) block of the
/// output (rows b's stride apart, columns contiguous), one strided transpose. The output
/// is split among tasks by places of its axes 0..=b (each a contiguous run of b's stride);
/// a task transposes each of its stretches along b at once.
fn transposes(x: &[f32], plan: &Plan, y: &mut [f32]) {
    let k = plan.perm.len();
    let (od, src) = (plan.out_dims(), plan.src_strides());
    let os = strides(&od);
    let b = plan.perm.iter().position(|&p| p == k - 1).expect("the last input axis is an output axis");
    let (rows, row_stride) = (od[k - 1], src[k - 1]);
    let (unit, len_b) = (os[b], od[b]);
    // The axes between b and the last: each place of them is one transpose per stretch.
    let (mid_dims, mid_src, mid_dst) = (&od[b + 1..k - 1], &src[b + 1..k - 1], &os[b + 1..k - 1]);
    let mids: usize = mid_dims.iter().product();
    let units_per_task = (CHUNK / unit).max(TILE.min(len_b));
    par::for_each(y.par_chunks_mut(units_per_task * unit).enumerate(), |(t, ys)| {
        let (first, units) = (t * units_per_task, ys.len() / unit);
        let mut u = first;
        while u < first + units {
            // The stretch along b: places v..v + cols of b under one place of axes 0..b.
            let (prefix, v) = (u / len_b, u % len_b);
            let cols = (len_b - v).min(first + units - u);
            let base = src_offset(prefix, &od[..b], &src[..b]) + v;
            for m in 0..mids {
                let (from, to) =
                    (base + src_offset(m, mid_dims, mid_src), (u - first) * unit + src_offset(m, mid_dims, mid_dst));
                transpose_strided(&x[from..], rows, cols, row_stride, &mut ys[to..], unit);
            }
            u += cols;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The permutation by its definition, value by value: y[j0, j1, ...] = x[i] where
    /// i's coordinate along input axis perm[j] is j's coordinate along output axis j.
    pub(crate) fn permute_by_definition(x: &[f32], dims: &[usize], perm: &[usize]) -> Vec<f32> {
        let od: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let is = strides(dims);
        let src: Vec<usize> = perm.iter().map(|&p| is[p]).collect();
        (0..x.len()).map(|i| x[src_offset(i, &od, &src)]).collect()
    }

    #[test]
    fn plans_drop_single_axes_and_merge_neighbours() {
        let plan = |dims: &[usize], perm: &[usize]| {
            let p = Plan::new(dims, perm);
            (p.dims, p.perm)
        };
        // Attention's heads: (N, T, H, D) → (N, H, T, D) keeps N and D apart from the swap.
        assert_eq!(plan(&[2, 5, 4, 8], &[0, 2, 1, 3]), (vec![2, 5, 4, 8], vec![0, 2, 1, 3]));
        // Channels last: (N, C, H, W) → (N, H, W, C) is a transpose of (N, C, H·W).
        assert_eq!(plan(&[2, 3, 4, 5], &[0, 2, 3, 1]), (vec![2, 3, 20], vec![0, 2, 1]));
        // Leading axes that stay merge with the batch; a size-1 axis is dropped.
        assert_eq!(plan(&[2, 3, 1, 4, 5], &[0, 1, 2, 4, 3]), (vec![6, 4, 5], vec![0, 2, 1]));
        assert_eq!(plan(&[2, 1, 3], &[0, 2, 1]), (vec![6], vec![0]));
        assert!(Plan::new(&[2, 1, 3], &[0, 2, 1]).is_identity());
        assert_eq!(plan(&[1, 1], &[1, 0]), (vec![], vec![]));
        // The inverse of a merged plan is the transpose back.
        assert_eq!(Plan::new(&[2, 3, 4, 5], &[0, 2, 3, 1]).inverse(), Plan::new(&[2, 20, 3], &[0, 2, 1]));
    }

    /// Every permutation of 3 and 4 axes, on sizes that make both moves take ragged tiles
    /// and several tasks, against the definition, and back through the inverse.
    #[test]
    fn every_permutation_moves_each_value_to_its_place() {
        fn permutations(k: usize) -> Vec<Vec<usize>> {
            if k == 0 {
                return vec![vec![]];
            }
            let mut all = Vec::new();
            for p in permutations(k - 1) {
                for at in 0..=p.len() {
                    let mut q = p.clone();
                    q.insert(at, k - 1);
                    all.push(q);
                }
            }
            all
        }
        for dims in [vec![3, 17, 40], vec![2, 33, 1, 19], vec![5, 6, 7, 8], vec![1, 300, 130], vec![2, 3, 2, 9000]] {
            let x: Vec<f32> = (0..dims.iter().product::<usize>()).map(|i| i as f32).collect();
            for perm in permutations(dims.len()) {
                let plan = Plan::new(&dims, &perm);
                let mut y = vec![f32::NAN; x.len()];
                permute(&x, &plan, &mut y);
                assert_eq!(y, permute_by_definition(&x, &dims, &perm), "{dims:?} by {perm:?} ({plan:?})");
                let mut back = vec![f32::NAN; x.len()];
                permute(&y, &plan.inverse(), &mut back);
                assert_eq!(back, x, "{dims:?} by {perm:?} and back");
            }
        }
    }
}
