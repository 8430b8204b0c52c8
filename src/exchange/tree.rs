//! The canonical summation tree over shard indices, cut where shards meet different
//! owners: what makes a sum over several processes bitwise the sum of one.
//!
//! Owns the shape of the tree (`split`) and its one evaluation (`node_block`), which
//! every f32 sum of the crate's exchanges runs: [`tree_sum`] over whole shards (the
//! shared-memory exchange, the codec's reduce, each process's part under MPI) and
//! [`sum_leaves`] over partial sums. The tree over shards `lo..hi` splits at `lo + p`,
//! `p` the largest power of two below `hi - lo`: for 2 shards a+b, for 3 (a+b)+c, for 4
//! (a+b)+(c+d). When the
//! shards are owned by several processes (contiguous ranges, one per process), every node
//! of the tree that lies wholly inside one owner's range can be summed by that owner
//! alone — with `tree_sum` over its shards, which splits the same way — and only the
//! nodes above those ([`leaves`]) need the values of several owners. [`sum_leaves`]
//! evaluates that top part of the tree over the leaves' partial sums, node for node as the
//! whole tree would, so the result is bitwise `tree_sum` over every shard: the association
//! of every addition is a function of the shard indices alone, never of who owns them.
//!
//! Example, 6 shards on 2 processes (0..3 and 3..6): the tree is
//! `((s0 + s1) + (s2 + s3)) + (s4 + s5)`; the leaves are `0..2`, `2..3` (process 0) and
//! `3..4`, `4..6` (process 1), and the top is `((L0 + L1) + L2) + L3` — not the canonical
//! tree over 4 leaves, `(L0 + L1) + (L2 + L3)`, which would round differently.

use std::ops::Range;

/// Where the canonical tree over `lo..hi` (at least 2 shards) splits.
fn split(lo: usize, hi: usize) -> usize {
    lo + (1usize << (hi - lo - 1).ilog2())
}

/// The maximal nodes of the canonical tree over `0..n` that lie wholly inside one of
/// `owners` (a partition of `0..n` into consecutive ranges, in order), in shard order.
/// Each owner's range is covered by its own leaves. (Only the exchange between processes
/// cuts the tree, hence the `mpi` feature.)
#[cfg(any(test, feature = "mpi"))]
pub fn leaves(n: usize, owners: &[Range<usize>]) -> Vec<Range<usize>> {
    assert!(
        owners.first().is_some_and(|r| r.start == 0)
            && owners.last().is_some_and(|r| r.end == n)
            && owners.windows(2).all(|w| w[0].end == w[1].start),
        "owners {owners:?} do not partition 0..{n}"
    );
    let mut out = Vec::new();
    if n > 0 {
        collect(0..n, owners, &mut out);
    }
    out
}

#[cfg(any(test, feature = "mpi"))]
fn collect(node: Range<usize>, owners: &[Range<usize>], out: &mut Vec<Range<usize>>) {
    let owner = owners.iter().find(|o| o.contains(&node.start)).expect("owners cover the node");
    if node.end <= owner.end {
        out.push(node);
        return;
    }
    let mid = split(node.start, node.end);
    collect(node.start..mid, owners, out);
    collect(mid..node.end, owners, out);
}

/// Elements summed per pass, so that the partial sums of a pass stay in L1.
const BLOCK: usize = 1024;

/// Sums `bufs[i]` for every i (each as long as `out`) in the canonical tree over
/// `0..bufs.len()` into `out`; zeros for no buffers.
pub fn tree_sum(bufs: &[&[f32]], out: &mut [f32]) {
    match bufs {
        [] => out.fill(0.0),
        [a] => out.copy_from_slice(a),
        [a, b] => {
            for ((o, x), y) in out.iter_mut().zip(*a).zip(*b) {
                *o = x + y;
            }
        }
        _ => {
            // Each level of the tree holds its right child's block while its left one is
            // summed; the canonical tree over n is ilog2(n) right children deep.
            let shard = |node: &Range<usize>| (node.len() == 1).then(|| bufs[node.start]);
            let mut scratch = vec![0.0f32; BLOCK * bufs.len().ilog2() as usize];
            for start in (0..out.len()).step_by(BLOCK) {
                let end = (start + BLOCK).min(out.len());
                node_block(0..bufs.len(), &shard, start..end, &mut out[start..end], &mut scratch);
            }
        }
    }
}

/// Sums the leaves' partial sums into `out` in the canonical tree over `0..n`: `leaves`
/// are the ranges [`leaves`] returned, in order, each with its values (as long as `out`),
/// and the result is bitwise `tree_sum` over the `n` shards the leaves summed.
#[cfg(any(test, feature = "mpi"))]
pub fn sum_leaves(n: usize, leaves: &[(Range<usize>, &[f32])], out: &mut [f32]) {
    assert!(
        leaves.first().is_some_and(|l| l.0.start == 0)
            && leaves.last().is_some_and(|l| l.0.end == n)
            && leaves.windows(2).all(|w| w[0].0.end == w[1].0.start)
            && leaves.iter().all(|l| l.1.len() == out.len()),
        "leaves {:?} do not cover 0..{n} with {} values each",
        leaves.iter().map(|l| l.0.clone()).collect::<Vec<_>>(),
        out.len()
    );
    match leaves {
        [(_, a)] => out.copy_from_slice(a),
        // The top of two leaves is one addition (P = 2, each process's shards one node).
        [(_, a), (_, b)] => {
            for ((o, x), y) in out.iter_mut().zip(*a).zip(*b) {
                *o = x + y;
            }
        }
        _ => {
            let leaf = |node: &Range<usize>| match leaves.binary_search_by(|l| l.0.start.cmp(&node.start)) {
                Ok(i) if leaves[i].0.end == node.end => Some(leaves[i].1),
                _ => None,
            };
            let mut scratch = vec![0.0f32; BLOCK * leaves.len()];
            for start in (0..out.len()).step_by(BLOCK) {
                let end = (start + BLOCK).min(out.len());
                node_block(0..n, &leaf, start..end, &mut out[start..end], &mut scratch);
            }
        }
    }
}

/// `out` = the values of tree node `node` for the elements `elems`: the node's own
/// values where `values` has them (a shard, or a leaf's partial sum), else its left child
/// into `out`, its right child into `scratch`, then `out += right`. The one evaluation of
/// the tree: [`tree_sum`] and [`sum_leaves`] differ only in which nodes have values.
fn node_block<'v>(
    node: Range<usize>,
    values: &impl Fn(&Range<usize>) -> Option<&'v [f32]>,
    elems: Range<usize>,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    if let Some(v) = values(&node) {
        out.copy_from_slice(&v[elems]);
        return;
    }
    let mid = split(node.start, node.end);
    node_block(node.start..mid, values, elems.clone(), out, scratch);
    let (tmp, rest) = scratch.split_at_mut(elems.len());
    node_block(mid..node.end, values, elems, tmp, rest);
    for (o, t) in out.iter_mut().zip(tmp.iter()) {
        *o += t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ShardPass i's values: magnitudes from 1e-3 to 1e5 and both signs, so that another
    /// association of the same additions rounds differently.
    fn shards(n: usize, len: usize) -> Vec<Vec<f32>> {
        (0..n)
            .map(|i| {
                (0..len)
                    .map(|e| {
                        let m = 10f32.powi(((i * 7 + e * 3) % 9) as i32 - 3);
                        let s = if (i + e) % 3 == 0 { -1.0 } else { 1.0 };
                        s * m * (1.0 + 0.123_457 * (i as f32 + 1.0) + 1e-3 * e as f32)
                    })
                    .collect()
            })
            .collect()
    }

    /// Every way of cutting `0..n` into `p` consecutive non-empty ranges of equal size.
    fn even(n: usize, p: usize) -> Vec<Range<usize>> {
        (0..p).map(|q| q * n / p..(q + 1) * n / p).collect()
    }

    #[test]
    fn tree_sum_follows_the_canonical_tree() {
        // Five shards of unequal magnitudes, so that a different association would round
        // differently; the result must equal the tree written out by hand.
        let v: Vec<Vec<f32>> = (0..5).map(|i| vec![0.1f32 * (i as f32 + 1.0).powi(7); 3000]).collect();
        let views: Vec<&[f32]> = v.iter().map(|b| b.as_slice()).collect();
        let mut out = vec![0.0; 3000];
        tree_sum(&views, &mut out);
        let (a, b, c, d, e) = (v[0][0], v[1][0], v[2][0], v[3][0], v[4][0]);
        let want = ((a + b) + (c + d)) + e;
        assert!(out.iter().all(|&x| x == want));
    }

    #[test]
    fn leaves_are_the_maximal_nodes_inside_one_owner() {
        // 4 on 2: (0+1) + (2+3), one node each.
        assert_eq!(leaves(4, &even(4, 2)), vec![0..2, 2..4]);
        // 6 on 2 (the module's example): ((0+1)+(2+3)) + (4+5).
        assert_eq!(leaves(6, &even(6, 2)), vec![0..2, 2..3, 3..4, 4..6]);
        // 12 on 3: (0..8 = 0..4 + 4..8) + 8..12.
        assert_eq!(leaves(12, &even(12, 3)), vec![0..4, 4..8, 8..12]);
        // One owner: the whole tree.
        let whole = std::iter::once(0..5).collect::<Vec<_>>();
        assert_eq!(leaves(5, &whole), whole);
        // One shard per owner: every shard.
        assert_eq!(leaves(3, &even(3, 3)), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn the_top_over_leaves_is_bitwise_the_whole_tree() {
        let len = 2500; // more than two blocks, not a multiple of one
        for n in 1..=12 {
            let v = shards(n, len);
            let all: Vec<&[f32]> = v.iter().map(|b| b.as_slice()).collect();
            let mut want = vec![0.0; len];
            tree_sum(&all, &mut want);
            for p in (1..=n).filter(|p| n % p == 0) {
                let owners = even(n, p);
                let cut = leaves(n, &owners);
                let partial = leaf_sums(&all, &cut, len);
                let with: Vec<(Range<usize>, &[f32])> =
                    cut.iter().cloned().zip(partial.iter().map(|s| s.as_slice())).collect();
                let mut got = vec![f32::NAN; len];
                sum_leaves(n, &with, &mut got);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n} shards on {p} owners (leaves {cut:?})");
            }
        }
    }

    /// Each leaf's sum, as its owner makes it: `tree_sum` over the leaf's shards.
    fn leaf_sums(all: &[&[f32]], cut: &[Range<usize>], len: usize) -> Vec<Vec<f32>> {
        cut.iter()
            .map(|l| {
                let mut s = vec![0.0; len];
                tree_sum(&all[l.clone()], &mut s);
                s
            })
            .collect()
    }

    #[test]
    fn another_association_would_round_differently() {
        // The module's example: the canonical tree over the 4 leaves of 6 shards on 2
        // owners is not the tree over the 6 shards, for these values. (Were it equal,
        // the test above would not show that the top is followed node for node.)
        let (n, len) = (6, 2500);
        let v = shards(n, len);
        let all: Vec<&[f32]> = v.iter().map(|b| b.as_slice()).collect();
        let mut want = vec![0.0; len];
        tree_sum(&all, &mut want);
        let cut = leaves(n, &even(n, 2));
        let partial = leaf_sums(&all, &cut, len);
        let views: Vec<&[f32]> = partial.iter().map(|s| s.as_slice()).collect();
        let mut naive = vec![0.0; len];
        tree_sum(&views, &mut naive);
        assert!(naive.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
    }
}
