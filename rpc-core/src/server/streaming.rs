//! Glue for generated servers' streaming methods: take the call's stream,
//! decode the client's messages, run the handler, and send its response
//! metadata and messages.

use std::future::Future;

use bytes::Bytes;
use futures_core::Stream;

use crate::codec::Codec;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::Status;
use crate::stream::{MessageSink, ServerStream, Streaming};

/// Runs a server-streaming call: one request message in, the handler's
/// stream of responses out.
pub async fn server_streaming<C, F, Fut, S>(
    mut codec: C,
    mut request: Request<Bytes>,
    handler: F,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    F: FnOnce(Request<C::Decode>) -> Fut,
    Fut: Future<Output = Result<Response<S>, Status>>,
    S: Stream<Item = Result<C::Encode, Status>>,
{
    let ServerStream { mut messages, sink } = take(&mut request)?;
    let Some(message) = messages.message().await? else {
        return Err(Status::invalid_argument(
            "a server-streaming call takes one request message; the client sent none",
        ));
    };
    let message = codec
        .decode(message)
        .map_err(|status| Status::invalid_argument(status.message()))?;
    let response = handler(request.map(|_| message)).await?;
    send_all(codec, sink, response).await
}

/// Runs a client-streaming call: the client's stream of messages in, one
/// response out.
pub async fn client_streaming<C, F, Fut>(
    mut codec: C,
    mut request: Request<Bytes>,
    handler: F,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    F: FnOnce(Request<Streaming<C::Decode>>) -> Fut,
    Fut: Future<Output = Result<Response<C::Encode>, Status>>,
{
    let ServerStream { messages, mut sink } = take(&mut request)?;
    let response = handler(request.map(|_| decoded::<C>(messages))).await?;
    let (metadata, message) = response.into_parts();
    sink.send_headers(metadata).await?;
    sink.send(codec.encode_payload(message)?).await?;
    Ok(Response::new(Payload::new()))
}

/// Runs a bidirectional-streaming call: the client's stream in, the
/// handler's stream out, both at once.
pub async fn streaming<C, F, Fut, S>(
    codec: C,
    mut request: Request<Bytes>,
    handler: F,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    F: FnOnce(Request<Streaming<C::Decode>>) -> Fut,
    Fut: Future<Output = Result<Response<S>, Status>>,
    S: Stream<Item = Result<C::Encode, Status>>,
{
    let ServerStream { messages, sink } = take(&mut request)?;
    let response = handler(request.map(|_| decoded::<C>(messages))).await?;
    send_all(codec, sink, response).await
}

fn take(request: &mut Request<Bytes>) -> Result<ServerStream, Status> {
    ServerStream::take(request).ok_or_else(|| {
        Status::unimplemented(format!(
            "{} is a streaming method: a unary call cannot reach it",
            request.method().unwrap_or_default()
        ))
    })
}

/// The client's messages, decoded; a message that does not decode is the
/// client's error (`InvalidArgument`).
fn decoded<C: Codec>(messages: Streaming<Bytes>) -> Streaming<C::Decode> {
    let mut codec = C::default();
    messages.map_decoder(move |bytes| {
        codec
            .decode(bytes)
            .map_err(|status| Status::invalid_argument(status.message()))
    })
}

/// Sends the response metadata, then every message of the handler's
/// stream; an error the stream yields ends the call with that status,
/// after the messages before it.
async fn send_all<C, S>(
    codec: C,
    mut sink: MessageSink,
    response: Response<S>,
) -> Result<Response<Payload>, Status>
where
    C: Codec,
    S: Stream<Item = Result<C::Encode, Status>>,
{
    let (metadata, messages) = response.into_parts();
    sink.send_headers(metadata).await?;
    sink.send_encoded(messages, codec, false).await?;
    Ok(Response::new(Payload::new()))
}
