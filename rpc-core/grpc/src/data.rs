//! Writing gRPC messages into an HTTP/2 stream under HTTP/2's flow control:
//! the gateway never hands h2 more than the peer's window lets it send, so
//! what it holds for a slow peer stays bounded by the call's window.

use bytes::{Bytes, BytesMut};
use h2::SendStream;

use crate::wire::{self, Encoding, MESSAGE_PREFIX};

/// A message at least this long goes after its own prefix rather than
/// copied behind it.
const COPY_BELOW: usize = 16 << 10;

/// Writes `messages`, each with its gRPC prefix (compressed with
/// `encoding` if given), waiting for window.
pub(crate) async fn write_messages(
    stream: &mut SendStream<Bytes>,
    messages: &[Bytes],
    encoding: Option<Encoding>,
) -> Result<(), h2::Error> {
    let mut batch = BytesMut::new();
    for message in messages {
        let compressed = encoding.map(|encoding| wire::compress(encoding, message));
        let message = compressed.as_ref().unwrap_or(message);
        if message.len() < COPY_BELOW {
            wire::frame_message_flagged(message, encoding.is_some(), &mut batch);
            continue;
        }
        let mut prefix = BytesMut::with_capacity(MESSAGE_PREFIX);
        wire::frame_message_flagged(&[], encoding.is_some(), &mut prefix);
        prefix[1..MESSAGE_PREFIX].copy_from_slice(&(message.len() as u32).to_be_bytes());
        batch.extend_from_slice(&prefix);
        write(stream, batch.split().freeze()).await?;
        write(stream, message.clone()).await?;
    }
    if !batch.is_empty() {
        write(stream, batch.freeze()).await?;
    }
    Ok(())
}

/// Sends `data` as the peer's window allows, in as many pieces as it takes.
pub(crate) async fn write(
    stream: &mut SendStream<Bytes>,
    mut data: Bytes,
) -> Result<(), h2::Error> {
    while !data.is_empty() {
        stream.reserve_capacity(data.len());
        let granted = std::future::poll_fn(|cx| stream.poll_capacity(cx)).await;
        let capacity = match granted {
            Some(Ok(capacity)) => capacity,
            Some(Err(error)) => return Err(error),
            None => return Err(h2::Error::from(h2::Reason::STREAM_CLOSED)),
        };
        if capacity == 0 {
            continue;
        }
        let piece = data.split_to(capacity.min(data.len()));
        stream.send_data(piece, false)?;
    }
    Ok(())
}
