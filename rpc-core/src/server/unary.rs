//! Glue for generated servers: decode a request, run a handler, encode its response.

use std::future::Future;

use bytes::Bytes;

use crate::codec::Codec;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::Status;
use crate::stream::{ServerStream, WholeStream};

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
    if crate::stream::is_streaming(&request) {
        if crate::stream::is_kind_unknown(&request) {
            return as_stream(codec, request, handler).await;
        }
        return Err(Status::unimplemented(format!(
            "{} is a unary method: call it as one, not as a stream",
            request.method().unwrap_or_default()
        )));
    }
    let request = request
        .try_map(|payload| codec.decode(payload))
        .map_err(|status| Status::invalid_argument(status.message()))?;
    let (metadata, message) = handler(request).await?.into_parts();
    let payload = codec.encode_payload(message)?;
    Ok(Response::from_parts(metadata, payload))
}

/// Runs a unary call that came as a stream because its client did not know
/// the method's kind (a gRPC client through the `grpc://` gateway): exactly
/// one message in, then one final response that carries the message.
async fn as_stream<C, F, Fut>(
    mut codec: C,
    mut request: Request<Bytes>,
    handler: F,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    F: FnOnce(Request<C::Decode>) -> Fut,
    Fut: Future<Output = Result<Response<C::Encode>, Status>>,
{
    let not_one = |request: &Request<Bytes>, sent: &str| {
        Status::invalid_argument(format!(
            "{} is a unary method: it takes one request message, the client sent {sent}",
            request.method().unwrap_or_default()
        ))
    };
    let message = match request.extensions_mut().remove::<WholeStream>() {
        // The client's whole stream came with the request: no need to read it.
        Some(whole) => whole
            .into_single()
            .map_err(|sent| not_one(&request, sent))?,
        None => {
            let ServerStream { mut messages, sink } =
                ServerStream::take(&mut request).ok_or_else(|| {
                    Status::internal("the call's stream was taken before its handler")
                })?;
            let Some(message) = messages.message().await? else {
                return Err(not_one(&request, "none"));
            };
            if messages.message().await?.is_some() {
                return Err(not_one(&request, "more"));
            }
            drop(sink);
            message
        }
    };
    let message = codec
        .decode(message)
        .map_err(|status| Status::invalid_argument(status.message()))?;
    let (metadata, response) = handler(request.map(|_| message)).await?.into_parts();
    // One final response with the message: the unary answer a call of
    // unknown kind allows (docs/wire-format.md, "Kind unknown").
    let mut answer = Response::from_parts(metadata, codec.encode_payload(response)?);
    answer.extensions_mut().insert(crate::stream::UnaryAnswer);
    Ok(answer)
}
