//! The staging protocol, sans I/O: its frames ([`frame`]), the receiving side's slots and grants
//! ([`recv`]) and the sending side's pieces and send slots ([`send`]). `transport::staged` carries
//! out what these decide (gathers, WRITEs, scatters, sending frames) and documents the protocol as
//! a whole; read its module docs first.
//!
//! Like the rest of `proto`: no I/O, no clock (time is an argument), no `unsafe`.

pub mod frame;
pub mod recv;
pub mod send;

pub use frame::{Frame, FrameError, MAGIC, MAX_NOTIF};
pub use recv::{Landed, Output, Phase, PieceNote, Receiver, RecvConfig, RecvCounts, Slot};
pub use send::{Action, Piece, Report, SendConfig, SendCounts, Sender};
