//! The protocol core (`kvpush::proto`) from outside, with no engine, thread or clock: the P/D pair on
//! virtual time, the planner against a reference, the codec's byte-exact encodings and its
//! malformed-input corpus. One test binary (tests/README.md maps features to tests).

mod codec_corpus;
mod codec_golden;
mod plan_props;
mod sim;
mod sim_layerwise;
mod sim_staging;
