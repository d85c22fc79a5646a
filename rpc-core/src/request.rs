//! [`Request`] and [`Response`]: a message with its metadata, shaped like tonic's.

use std::borrow::Cow;
use std::time::Duration;

use http::Extensions;

use crate::metadata::Metadata;

/// What the server knows about the peer that sent a request; found in
/// [`Request::extensions`] on the server side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's address as the transport describes it (`127.0.0.1:50123`, `mem://name#3`).
    pub addr: String,
}

/// A call's request: a message plus metadata, an optional timeout, the method
/// path and extensions.
#[derive(Debug, Clone, Default)]
pub struct Request<T> {
    metadata: Metadata,
    message: T,
    timeout: Option<Duration>,
    method: Option<Cow<'static, str>>,
    extensions: Extensions,
}

impl<T> Request<T> {
    /// A request with `message` and no metadata.
    pub fn new(message: T) -> Request<T> {
        Request {
            metadata: Metadata::new(),
            message,
            timeout: None,
            method: None,
            extensions: Extensions::new(),
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Consumes the request, returning the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The request metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The request metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets how long the call may take. The client fails the call with
    /// `DeadlineExceeded` when it passes, and the server is told the remaining
    /// time and aborts its handler at the same point.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// The timeout: set by the caller on the client side, the time remaining
    /// when the request arrived on the server side.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The method path (`/package.Service/Method`), set by the generated client
    /// before the request enters the tower stack, and by the server on arrival.
    pub fn method(&self) -> Option<&str> {
        self.method.as_deref()
    }

    /// Sets the method path.
    pub fn set_method(&mut self, path: impl Into<Cow<'static, str>>) {
        self.method = Some(path.into());
    }

    /// Extensions: typed values middleware attaches (e.g. [`PeerInfo`] on the server).
    pub fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    /// Extensions, mutably.
    pub fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }

    /// The peer's address, on the server side.
    pub fn remote_addr(&self) -> Option<&str> {
        self.extensions
            .get::<PeerInfo>()
            .map(|peer| peer.addr.as_str())
    }

    /// Maps the message with a fallible function, keeping everything else.
    pub fn try_map<U, E>(self, f: impl FnOnce(T) -> Result<U, E>) -> Result<Request<U>, E> {
        Ok(Request {
            metadata: self.metadata,
            message: f(self.message)?,
            timeout: self.timeout,
            method: self.method,
            extensions: self.extensions,
        })
    }

    /// Maps the message, keeping everything else.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Request<U> {
        Request {
            metadata: self.metadata,
            message: f(self.message),
            timeout: self.timeout,
            method: self.method,
            extensions: self.extensions,
        }
    }
}

/// Conversion into a [`Request`]: generated client methods take
/// `impl IntoRequest<Msg>`, so both `msg` and `Request::new(msg)` work.
pub trait IntoRequest<T> {
    /// Wraps or passes through.
    fn into_request(self) -> Request<T>;
}

impl<T> IntoRequest<T> for T {
    fn into_request(self) -> Request<T> {
        Request::new(self)
    }
}

impl<T> IntoRequest<T> for Request<T> {
    fn into_request(self) -> Request<T> {
        self
    }
}

/// A call's successful result: a message plus metadata.
#[derive(Debug, Clone, Default)]
pub struct Response<T> {
    metadata: Metadata,
    message: T,
    extensions: Extensions,
}

impl<T> Response<T> {
    /// A response with `message` and no metadata.
    pub fn new(message: T) -> Response<T> {
        Response {
            metadata: Metadata::new(),
            message,
            extensions: Extensions::new(),
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// Consumes the response, returning the message.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// The response metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The response metadata, mutably.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Extensions.
    pub fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    /// Extensions, mutably.
    pub fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }

    /// Maps the message, keeping the metadata.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Response<U> {
        Response {
            metadata: self.metadata,
            message: f(self.message),
            extensions: self.extensions,
        }
    }

    /// Splits into metadata and message (extensions are dropped).
    pub fn into_parts(self) -> (Metadata, T) {
        (self.metadata, self.message)
    }

    /// Builds a response from metadata and a message.
    pub fn from_parts(metadata: Metadata, message: T) -> Response<T> {
        Response {
            metadata,
            message,
            extensions: Extensions::new(),
        }
    }
}
