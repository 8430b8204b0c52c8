//! Synchronized BatchNorm across a model: which of its layers exchange statistics with
//! the other logical replicas ([`has_synchronized_layers`]), the model with every
//! BatchNorm synchronized ([`convert_sync_batchnorm`], PyTorch's
//! `SyncBatchNorm.convert_sync_batchnorm`), and the exchange's calls a pass without rows
//! owes ([`join_without_rows`]). The statistics' arithmetic and their merge are the op's
//! (`ops::batchnorm`); this file only walks a model's layers.

use super::{Graph, GraphNode};
use crate::error::{Error, Result};
use crate::ops::batchnorm::Synchronized;

/// The synchronized BatchNorm layers of `model` in forward order: (index of the model's
/// layer that holds it, channels); a container's several share its index.
fn synchronized_layers(model: &Graph) -> Vec<(usize, usize)> {
    let layers = model.layers().iter().enumerate();
    layers.flat_map(|(i, l)| l.synchronized_channels().into_iter().map(move |c| (i, c))).collect()
}

/// True when `model` has a synchronized BatchNorm layer (its run needs a statistics
/// exchange).
pub fn has_synchronized_layers(model: &Graph) -> bool {
    !synchronized_layers(model).is_empty()
}

/// The calls a pass without rows owes: a count of 0 per synchronized layer in forward
/// order, then zero sums in backward order for the layers the backward reaches (those
/// that train: `Graph::trains`). When no replica has a row (every one of them is
/// then here), the first call shows it and all stop.
pub fn join_without_rows(sync: &Synchronized<'_>, model: &Graph) -> Result<()> {
    let (ex, shard) = (sync.stats, sync.shard);
    let layers = synchronized_layers(model);
    let mut all = Vec::new();
    for &(_, c) in &layers {
        ex.all_gather(shard, &vec![0.0; 1 + 2 * c], &mut all)?;
        let count: f64 = all.chunks_exact(1 + 2 * c).map(|p| p[0]).sum();
        if count == 0.0 {
            // No replica has a row (an accumulated step's last micro-batches, when the
            // shards are smaller than K): every one of them is here, and stops here.
            return Ok(());
        }
        if count < 2.0 {
            // Every replica fails alike on a global batch too small to normalise.
            return Err(Error::shape(
                "BatchNorm2d",
                "training needs more than one value per channel in the global batch",
            ));
        }
    }
    for &(_, c) in layers.iter().rev().filter(|&&(i, _)| model.trains(i)) {
        ex.all_gather(shard, &vec![0.0; 2 * c], &mut all)?;
    }
    Ok(())
}

/// `model` with every BatchNorm layer synchronized (PyTorch's
/// `SyncBatchNorm.convert_sync_batchnorm`; `--sync-batchnorm`): the same layers, names and
/// flat layout and the same graph (its nodes' context indices too), so weights move between the two unchanged.
pub fn convert_sync_batchnorm(model: &Graph) -> Result<Graph> {
    let nodes = model.layers().iter().zip(model.layer_names()).zip(model.sources()).enumerate();
    let nodes = nodes
        .map(|(j, ((l, n), s))| GraphNode {
            name: Some(n.clone()),
            layer: l.synchronized().unwrap_or_else(|| l.boxed_clone()),
            inputs: s.clone(),
            layer_index: Some(model.layer_index(j)),
        })
        .collect();
    Graph::build(model.inputs().to_vec(), nodes)
}
