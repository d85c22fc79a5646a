//! [`RpcClient`]: typed unary calls over any tower service of encoded requests.

use bytes::Bytes;
use tower_service::Service;

use crate::codec::Codec;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Status};

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
        let mut request = request.try_map(|message| codec.encode_payload(message))?;
        request.set_method(path);
        self.ready().await?;
        let response = self
            .inner
            .call(request)
            .await
            .map_err(|error| Status::from_error(error.into()))?;
        let (metadata, payload) = response.into_parts();
        let message = codec.decode(payload)?;
        Ok(Response::from_parts(metadata, message))
    }
}
