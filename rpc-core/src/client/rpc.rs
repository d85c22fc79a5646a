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

    /// Waits until the inner service can take `request`, within the
    /// request's timeout: a connection whose queue stays full (a peer that
    /// stopped reading, a link that died quietly) ends the call with
    /// `DeadlineExceeded` when its deadline passes, as everywhere else. What
    /// the wait took comes off the timeout the call goes on with.
    async fn ready_within_deadline<M>(&mut self, request: &mut Request<M>) -> Result<(), Status> {
        let Some(timeout) = request.timeout() else {
            return self.ready().await;
        };
        let started = tokio::time::Instant::now();
        let exceeded = || {
            Status::deadline_exceeded(format!(
                "deadline of {timeout:?} exceeded waiting for the connection to take the call"
            ))
        };
        match tokio::time::timeout(timeout, self.ready()).await {
            Ok(ready) => ready?,
            Err(_) => return Err(exceeded()),
        }
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(exceeded());
        }
        request.set_timeout(left);
        Ok(())
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
        self.ready_within_deadline(&mut request).await?;
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
        let messages = inbound.decoded_with(move |bytes| codec.decode(bytes));
        Ok(Response::from_parts(metadata, messages))
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll};
    use std::time::Duration;

    use super::*;
    use crate::Code;
    use crate::codec::BincodeCodec;

    /// A service that never becomes ready: a connection whose outbound
    /// queue stays full (a peer that stopped reading, a link that died
    /// without a word).
    #[derive(Clone)]
    struct NeverReady;

    impl Service<Request<Payload>> for NeverReady {
        type Response = Response<Bytes>;
        type Error = Status;
        type Future = std::future::Ready<Result<Response<Bytes>, Status>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Pending
        }

        fn call(&mut self, _: Request<Payload>) -> Self::Future {
            unreachable!("never ready")
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_waiting_for_a_full_connection_ends_at_its_deadline() {
        let mut client = RpcClient::new(NeverReady);
        let mut request = Request::new(7u32);
        request.set_timeout(Duration::from_millis(300));
        let started = tokio::time::Instant::now();
        let call = client.unary(
            request,
            "/test.Never/Ready",
            BincodeCodec::<u32, u32>::default(),
        );
        // (Without the deadline on the wait, the call would wait forever.)
        let outcome = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("the call ended by its deadline");
        let status = outcome.expect_err("the service never took the call");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert!(
            status.message().contains("waiting for the connection"),
            "{status}"
        );
    }
}
