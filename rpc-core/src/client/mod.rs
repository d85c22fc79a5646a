//! The client side: [`Channel`] (connection, multiplexing, deadlines,
//! cancellation, reconnect), [`RpcClient`] (typed calls through any tower
//! stack over a channel) and [`DeadlineLayer`] (a tower timeout the server
//! sees as the call's deadline).

mod channel;
mod connection;
mod deadline;
mod rpc;

pub use channel::{Backoff, Channel, ChannelBuilder, ResponseFuture};
pub use connection::Keepalive;
pub use deadline::{Deadline, DeadlineLayer};
pub use rpc::RpcClient;
