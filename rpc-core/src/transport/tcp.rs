//! `tcp://host:port`: frames over TCP, each behind a 4-byte little-endian length.
//!
//! TCP_NODELAY is on (an RPC frame should leave now, not after Nagle's delay).
//! The length prefix is checked against the frame limit before the frame is
//! buffered, so an oversized announcement costs nothing but the close.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_core::Stream;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Decoder, Encoder, FramedRead, FramedWrite};

use super::{Connection, Endpoint, Listener, Transport, TransportConfig, TransportError};
use crate::frame::FrameError;

/// Size of the length prefix in front of every frame.
pub const LENGTH_PREFIX_LEN: usize = 4;

/// The TCP transport (registered as `tcp`).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpTransport;

/// Length-prefixed framing: `len: u32 LE` then `len` bytes of frame.
#[derive(Debug, Clone)]
pub struct LengthPrefixCodec {
    max_frame_len: usize,
}

impl LengthPrefixCodec {
    /// A codec that refuses frames longer than `max_frame_len`.
    pub fn new(max_frame_len: usize) -> LengthPrefixCodec {
        LengthPrefixCodec { max_frame_len }
    }
}

impl Decoder for LengthPrefixCodec {
    type Item = Bytes;
    type Error = TransportError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Bytes>, TransportError> {
        if src.len() < LENGTH_PREFIX_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if len > self.max_frame_len {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_len,
            }
            .into());
        }
        if src.len() < LENGTH_PREFIX_LEN + len {
            src.reserve(LENGTH_PREFIX_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(LENGTH_PREFIX_LEN);
        Ok(Some(src.split_to(len).freeze()))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Bytes>, TransportError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() => Ok(None),
            None => Err(TransportError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed inside a frame ({} bytes of it received)",
                    src.len()
                ),
            ))),
        }
    }
}

impl Encoder<Bytes> for LengthPrefixCodec {
    type Error = TransportError;

    fn encode(&mut self, frame: Bytes, dst: &mut BytesMut) -> Result<(), TransportError> {
        let len = u32::try_from(frame.len()).map_err(|_| FrameError::TooLarge {
            len: frame.len(),
            max: u32::MAX as usize,
        })?;
        dst.reserve(LENGTH_PREFIX_LEN + frame.len());
        dst.put_u32_le(len);
        dst.put_slice(&frame);
        Ok(())
    }
}

fn into_connection(stream: TcpStream, max_frame_len: usize) -> Result<Connection, TransportError> {
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?.to_string();
    let (read, write) = stream.into_split();
    let codec = LengthPrefixCodec::new(max_frame_len);
    Ok(Connection {
        sink: Box::pin(FramedWrite::new(write, codec.clone())),
        stream: Box::pin(FramedRead::new(read, codec)),
        peer,
    })
}

impl Transport for TcpTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max = config.max_frame_len;
        async move {
            let stream = TcpStream::connect(&authority).await?;
            into_connection(stream, max)
        }
        .boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        async move {
            let listener = TcpListener::bind(&authority).await?;
            let local = Endpoint::new("tcp", &listener.local_addr()?.to_string())?;
            Ok(Box::new(TcpFrameListener {
                listener,
                local,
                max_frame_len,
            }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

struct TcpFrameListener {
    listener: TcpListener,
    local: Endpoint,
    max_frame_len: usize,
}

impl Stream for TcpFrameListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.listener.poll_accept(cx) {
            Poll::Ready(Ok((stream, _))) => {
                Poll::Ready(Some(into_connection(stream, this.max_frame_len)))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Some(Err(error.into()))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Listener for TcpFrameListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_waits_for_whole_frames_and_rejects_oversize_announcements() {
        let mut codec = LengthPrefixCodec::new(8);
        let mut buf = BytesMut::new();
        codec.encode(Bytes::from_static(b"abc"), &mut buf).unwrap();
        let mut partial = buf.split_to(5);
        assert!(codec.decode(&mut partial).unwrap().is_none());
        partial.unsplit(buf);
        assert_eq!(
            codec.decode(&mut partial).unwrap().unwrap(),
            Bytes::from_static(b"abc")
        );

        let mut huge = BytesMut::new();
        huge.put_u32_le(9);
        assert!(matches!(
            codec.decode(&mut huge),
            Err(TransportError::Frame(FrameError::TooLarge {
                len: 9,
                max: 8
            }))
        ));

        let mut cut = BytesMut::new();
        cut.put_u32_le(4);
        cut.put_u8(1);
        assert!(codec.decode_eof(&mut cut).is_err());
    }
}
