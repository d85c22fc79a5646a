//! The client side: [`Channel`] (connection, multiplexing, deadlines,
//! cancellation, reconnect), [`RpcClient`] (typed calls through any tower
//! stack over a channel) and [`DeadlineLayer`] (a tower timeout the server
//! sees as the call's deadline).

mod balance;
mod channel;
mod connection;
mod deadline;
pub mod front_end;
mod reader;
mod retry;
mod rpc;

pub use balance::{
    BalancedChannel, Discovered, EJECT_BASE, EJECT_MAX, LoadSignal, Resolve, SystemResolver,
};
pub use channel::{Backoff, Channel, ChannelBuilder, ResponseFuture};
pub use connection::Keepalive;
pub use deadline::{Deadline, DeadlineLayer};
pub use retry::{AsStatus, RetryPolicy};
pub use rpc::RpcClient;
