//! [`Error`]: why a channel or a server could not be set up.

use std::convert::Infallible;

use crate::transport::TransportError;

/// Failure to connect, bind or serve (failures of individual calls are [`crate::Status`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The transport failed (bad endpoint, unknown scheme, refused, I/O).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Connecting took longer than the configured connect timeout.
    #[error("connecting to {endpoint} timed out after {timeout:?}")]
    ConnectTimeout {
        /// Where.
        endpoint: String,
        /// The limit that passed.
        timeout: std::time::Duration,
    },
}

impl From<Infallible> for Error {
    fn from(never: Infallible) -> Error {
        match never {}
    }
}
