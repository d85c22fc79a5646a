//! [`Error`]: why a channel or a server could not be set up.

use std::convert::Infallible;

use crate::transport::TransportError;

/// Failure to connect, bind or serve (failures of individual calls are [`crate::Status`]).
///
/// Its `Debug` is its message and the chain of causes, not the enum's
/// structure: `fn main() -> Result<(), Box<dyn std::error::Error>>` prints
/// `Error: i/o error: cannot connect to tcp://…: Connection refused; is a
/// server listening there?`, not `Error: Transport(Io(Custom { … }))`.
#[derive(thiserror::Error)]
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

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_chain(self, f)
    }
}

/// An error's message, then each cause's that its message does not already
/// contain (as `main`'s error report and `unwrap` show it).
pub(crate) fn write_chain(
    error: &dyn std::error::Error,
    f: &mut std::fmt::Formatter<'_>,
) -> std::fmt::Result {
    let message = error.to_string();
    f.write_str(&message)?;
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            write!(f, "\n  caused by: {text}")?;
        }
        source = cause.source();
    }
    Ok(())
}

impl From<Infallible> for Error {
    fn from(never: Infallible) -> Error {
        match never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_returning_a_boxed_error_prints_its_message_not_its_structure() {
        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "cannot connect to tcp://127.0.0.1:1: refused; is a server listening there?",
        );
        let error: Box<dyn std::error::Error> = Box::new(Error::from(TransportError::Io(io)));
        let shown = format!("Error: {error:?}");
        assert_eq!(
            shown,
            "Error: i/o error: cannot connect to tcp://127.0.0.1:1: refused; is a server listening there?"
        );
        let timeout = Error::ConnectTimeout {
            endpoint: "rdma://10.0.0.1:5".into(),
            timeout: std::time::Duration::from_secs(2),
        };
        assert_eq!(
            format!("{timeout:?}"),
            "connecting to rdma://10.0.0.1:5 timed out after 2s"
        );
    }

    #[test]
    fn a_cause_the_message_does_not_name_is_added_below_it() {
        let inner = std::io::Error::other("the device went away");
        let io = std::io::Error::other(Wrapper(inner));
        let error = Error::from(TransportError::Io(io));
        assert_eq!(
            format!("{error:?}"),
            "i/o error: device failed\n  caused by: the device went away"
        );
    }

    #[derive(Debug)]
    struct Wrapper(std::io::Error);

    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("device failed")
        }
    }

    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}
