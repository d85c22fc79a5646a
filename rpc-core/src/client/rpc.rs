//! [`RpcClient`]: typed unary calls over any tower service of encoded requests.

use bytes::Bytes;
use futures_core::Stream;
use tower_service::Service;

use crate::codec::Codec;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Status};
use crate::stream::{Outbound, Streaming, into_streaming_request, take_inbound};

/// What generated clients wrap: encodes the request with a [`Codec`], sends it
/// through the inner service (a [`crate::Channel`] or any tower stack over
/// one), and decodes the response.
#[derive(Debug, Clone)]
pub struct RpcClient<T> {
    inner: T,
}

impl<T> RpcClient<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> RpcClient<T> {
        RpcClient { inner }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T> RpcClient<T>
where
    T: Service<Request<Payload>, Response = Response<Bytes>>,
    T::Error: Into<BoxError>,
{
    /// Waits until the inner service can take a call.
    pub async fn ready(&mut self) -> Result<(), Status> {
        std::future::poll_fn(|cx| self.inner.poll_ready(cx))
            .await
            .map_err(|error| Status::from_error(error.into()))
    }

    /// One unary call to `path` (`/package.Service/Method`).
    pub async fn unary<C: Codec>(
        &mut self,
        request: Request<C::Encode>,
        path: &'static str,
        mut codec: C,
    ) -> Result<Response<C::Decode>, Status> {
        let request = request.try_map(|message| codec.encode_payload(message))?;
        let response = self.send(request, path).await?;
        let (metadata, payload) = response.into_parts();
        let message = codec.decode(payload)?;
        Ok(Response::from_parts(metadata, message))
    }

    /// A server-streaming call: one request message, a stream of responses.
    pub async fn server_streaming<C: Codec>(
        &mut self,
        request: Request<C::Encode>,
        path: &'static str,
        mut codec: C,
    ) -> Result<Response<Streaming<C::Decode>>, Status> {
        let request = request.try_map(|message| codec.encode_payload(message))?;
        self.open_stream(request.map(Outbound::One), path, codec)
            .await
    }

    /// A client-streaming call: a stream of request messages, one response.
    pub async fn client_streaming<C, S>(
        &mut self,
        request: Request<S>,
        path: &'static str,
        codec: C,
    ) -> Result<Response<C::Decode>, Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let (metadata, mut messages) = self.streaming(request, path, codec).await?.into_parts();
        let Some(message) = messages.message().await? else {
            return Err(Status::internal(
                "the server ended a client-streaming call without a response message",
            ));
        };
        if messages.message().await?.is_some() {
            return Err(Status::internal(
                "the server sent more than one response message to a client-streaming call",
            ));
        }
        Ok(Response::from_parts(metadata, message))
    }

    /// A bidirectional-streaming call: a stream of requests, a stream of
    /// responses; either side may send while the other does.
    pub async fn streaming<C, S>(
        &mut self,
        request: Request<S>,
        path: &'static str,
        codec: C,
    ) -> Result<Response<Streaming<C::Decode>>, Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let request = request.map(|messages| Outbound::many(messages, C::default()));
        self.open_stream(request, path, codec).await
    }

    /// Sends an encoded request to `path` through the inner service, once it is ready.
    async fn send(
        &mut self,
        mut request: Request<Payload>,
        path: &'static str,
    ) -> Result<Response<Bytes>, Status> {
        request.set_method(path);
        self.ready().await?;
        self.inner
            .call(request)
            .await
            .map_err(|error| Status::from_error(error.into()))
    }

    async fn open_stream<C: Codec>(
        &mut self,
        request: Request<Outbound>,
        path: &'static str,
        mut codec: C,
    ) -> Result<Response<Streaming<C::Decode>>, Status> {
        let response = self.send(into_streaming_request(request), path).await?;
        let (metadata, inbound) = take_inbound(response)?;
        let messages = Streaming::new(inbound, move |bytes| codec.decode(bytes));
        Ok(Response::from_parts(metadata, messages))
    }
}
