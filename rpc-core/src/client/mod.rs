//! The client side: [`Channel`] (connection, multiplexing, deadlines,
//! cancellation, reconnect) and [`RpcClient`] (typed calls through any tower
//! stack over a channel).

mod channel;
mod connection;
mod rpc;

pub use channel::{Backoff, Channel, ChannelBuilder, ResponseFuture};
pub use connection::Keepalive;
pub use rpc::RpcClient;
