//! Client front ends: connections that take whole calls (gRPC's HTTP/2)
//! rather than rpc-core's frames, as the server's
//! [`front_end`](crate::server::front_end) brings whole calls to its routes.
//!
//! A transport whose connections speak another protocol says so from
//! [`Transport::call_connector`](crate::transport::Transport::call_connector);
//! a [`crate::Channel`] to its scheme then connects through the
//! [`CallConnector`] and hands each call to the [`CallConnection`] as it is:
//! the method, the time left of its deadline, its metadata and its encoded
//! message (or its request messages, [`OutgoingMessages`]). The connection
//! answers with the response, or the response metadata and its messages
//! ([`Streaming::from_response`]). No rpc-core frame is made, and the call
//! runs in the caller's task, as tonic's calls do.
//!
//! The channel keeps doing what it does on every transport around the
//! call: connecting and reconnecting with backoff, the deadline (also given
//! to the connection, to send to the server), sending again a call the
//! server never saw ([`CallFailure::unprocessed`]), metrics and tracing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::metadata::Metadata;
use crate::payload::Payload;
use crate::request::Response;
use crate::stream::Streaming;
use crate::transport::{Endpoint, TransportError};

pub use super::connection::{CallFailure, Keepalive};
pub use crate::stream::{MessageTarget, OutgoingMessages};

/// A transport's way to open call-taking connections (see the module docs).
pub trait CallConnector: Send + Sync + 'static {
    /// Opens a connection to `endpoint`.
    fn connect(
        &self,
        endpoint: &Endpoint,
        settings: &CallSettings,
    ) -> BoxFuture<'static, Result<Arc<dyn CallConnection>, TransportError>>;
}

/// What a channel asks of its front end's connections.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CallSettings {
    /// Largest message sent or taken (the channel's `max_frame_len`): a
    /// larger response message fails its call with `ResourceExhausted`.
    pub max_message_len: usize,
    /// How to probe a silent connection ([`crate::client::ChannelBuilder::keepalive`]).
    pub keepalive: Option<Keepalive>,
}

impl CallSettings {
    /// Settings with a message limit and no keepalive.
    pub fn new(max_message_len: usize) -> CallSettings {
        CallSettings {
            max_message_len,
            keepalive: None,
        }
    }
}

/// One call as a channel hands it to a [`CallConnection`].
#[derive(Debug)]
#[non_exhaustive]
pub struct OutgoingCall<B> {
    /// The method path (`/package.Service/Method`).
    pub path: String,
    /// Time left of the call's deadline, if it has one: the server should
    /// hear of it (the channel enforces it too).
    pub timeout: Option<Duration>,
    /// The request metadata.
    pub metadata: Metadata,
    /// The encoded request message, or the request messages.
    pub body: B,
}

impl<B> OutgoingCall<B> {
    /// A call of `path` with `body`, no deadline and no metadata.
    pub fn new(path: impl Into<String>, body: B) -> OutgoingCall<B> {
        OutgoingCall {
            path: path.into(),
            timeout: None,
            metadata: Metadata::new(),
            body,
        }
    }
}

/// A streaming call that failed before the connection took its messages:
/// the failure, and the messages back, so that a call the server never saw
/// can go again on another connection.
#[derive(Debug)]
pub struct StreamFailure {
    /// Why it failed.
    pub failure: CallFailure,
    /// The request messages, when the connection did not take them.
    pub unsent: Option<OutgoingMessages>,
}

impl From<CallFailure> for StreamFailure {
    fn from(failure: CallFailure) -> StreamFailure {
        StreamFailure {
            failure,
            unsent: None,
        }
    }
}

/// One connection of a client front end: it takes whole calls. Each call's
/// future runs in the caller's task; dropping it before it ends cancels the
/// call at the server (as does dropping a streaming call's [`Streaming`]).
pub trait CallConnection: Send + Sync + 'static {
    /// Whether new calls may start on it (not closed, not told to go away).
    fn is_usable(&self) -> bool;

    /// A unary call: the response (its metadata the server's headers and
    /// trailers together) and message, or the call's error.
    fn unary(
        &self,
        call: OutgoingCall<Payload>,
    ) -> BoxFuture<'static, Result<Response<Bytes>, CallFailure>>;

    /// A streaming call of any kind: resolves once the server sent its
    /// response metadata, with its messages ([`Streaming::from_response`]).
    fn streaming(
        &self,
        call: OutgoingCall<OutgoingMessages>,
    ) -> BoxFuture<'static, Result<Response<Streaming<Bytes>>, StreamFailure>>;
}
