//! The write half shared by client and server connections.

use bytes::Bytes;
use futures_util::SinkExt;
use tokio::sync::mpsc;

use crate::transport::{FrameSink, TransportError};

/// Most frames written before one flush.
pub(crate) const WRITE_BATCH: usize = 64;

/// Writes queued frames, a batch per flush, until every sender is gone; then
/// closes the sink. Batching lets concurrent calls share one system call (or
/// one doorbell) without delaying a lone call.
pub(crate) async fn write_frames(
    mut sink: FrameSink,
    mut outbound: mpsc::UnboundedReceiver<Bytes>,
) -> Result<(), TransportError> {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while outbound.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        for frame in batch.drain(..) {
            sink.feed(frame).await?;
        }
        sink.flush().await?;
    }
    sink.close().await
}
