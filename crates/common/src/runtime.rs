//! The controller runtime: the run loop, work queue, write window, leader election, shutdown, and
//! the decision state a warm standby keeps.

pub mod backoff;
pub mod driver;
pub mod inflight;
pub mod leader;
pub mod owed;
pub mod queue;
pub mod shutdown;
pub mod standby;
