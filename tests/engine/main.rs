//! Real engines (writer threads, control link) on host memory: the TP x block-size matrix, stress and
//! fault injection, fail-closed windows, and the TCP side channel. One test binary (tests/README.md
//! maps features to tests).

mod engine_matrix;
mod engine_stress;
mod fail_closed;
mod kernel_pull;
mod layerwise;
mod lifecycle;
mod side_channel;
mod topology;
