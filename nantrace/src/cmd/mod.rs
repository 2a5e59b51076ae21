//! The commands that read bundles and write what is rendered from them (`nantrace report`,
//! `nantrace merge`): the top layer, above the analysis and the renderers, as `session/` is
//! for recording and `agent/` for the daemon. `main.rs` only parses and calls these.
pub mod machine;
pub mod merge;
pub mod report;
