//! nantrace: kernel, GPU and system evidence around the moment a training run's loss turns NaN.
pub mod classify;
pub mod clock;
pub mod correlate;
pub mod decode;
pub mod event;
pub mod nanscan;
pub mod probes;
pub mod recorder;
pub mod stream;
pub mod tracefs;
pub mod watch;
pub mod doctor;
