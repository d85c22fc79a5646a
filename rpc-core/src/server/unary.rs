//! Glue for generated servers: decode a request, run a handler, encode its response.

use std::future::Future;

use bytes::Bytes;

use crate::codec::Codec;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::Status;

/// Runs one unary call: decodes the payload with `codec`, calls `handler`, and
/// encodes its response (large `Bytes` fields stay where they lie). A payload that does not decode is `InvalidArgument`
/// for the client (its message was wrong), not `Internal`.
pub async fn handle<C, F, Fut>(
    mut codec: C,
    request: Request<Bytes>,
    handler: F,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    F: FnOnce(Request<C::Decode>) -> Fut,
    Fut: Future<Output = Result<Response<C::Encode>, Status>>,
{
    let request = request
        .try_map(|payload| codec.decode(payload))
        .map_err(|status| Status::invalid_argument(status.message()))?;
    let (metadata, message) = handler(request).await?.into_parts();
    let payload = codec.encode_payload(message)?;
    Ok(Response::from_parts(metadata, payload))
}
