//! Filled in by the data loaders.
