//! [`Status`] and [`Code`]: how a call fails.
//!
//! The codes and their numbers are gRPC's, so that `code as i32` and
//! [`Code::from`] agree with every other gRPC-speaking system.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use crate::metadata::Metadata;

/// A boxed error, the error type tower middleware deals in.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The outcome class of a call: the 17 gRPC status codes with their numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    /// The call succeeded.
    Ok = 0,
    /// The call was cancelled, typically by the caller.
    Cancelled = 1,
    /// An unknown error; also what unrecognised codes map to.
    Unknown = 2,
    /// The client sent an invalid argument.
    InvalidArgument = 3,
    /// The deadline expired before the call could complete.
    DeadlineExceeded = 4,
    /// A requested entity was not found.
    NotFound = 5,
    /// The entity a client tried to create already exists.
    AlreadyExists = 6,
    /// The caller may not execute the operation.
    PermissionDenied = 7,
    /// A resource (memory, a per-connection call limit, quota) is exhausted.
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation.
    FailedPrecondition = 9,
    /// The operation was aborted, typically because of a concurrency conflict.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The operation is not implemented or not supported (unknown method).
    Unimplemented = 12,
    /// An invariant the system relies on was broken (a handler panic, a bad message).
    Internal = 13,
    /// The service is currently unavailable (connection lost, peer gone); usually transient.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The request lacks valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// Every code, in numeric order.
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// A short human description of the code.
    pub fn description(self) -> &'static str {
        match self {
            Code::Ok => "the operation completed successfully",
            Code::Cancelled => "the operation was cancelled",
            Code::Unknown => "unknown error",
            Code::InvalidArgument => "client specified an invalid argument",
            Code::DeadlineExceeded => "deadline expired before operation could complete",
            Code::NotFound => "some requested entity was not found",
            Code::AlreadyExists => "some entity that we attempted to create already exists",
            Code::PermissionDenied => {
                "the caller does not have permission to execute the operation"
            }
            Code::ResourceExhausted => "some resource has been exhausted",
            Code::FailedPrecondition => "the system is not in a state required for the operation",
            Code::Aborted => "the operation was aborted",
            Code::OutOfRange => "operation was attempted past the valid range",
            Code::Unimplemented => "operation is not implemented or not supported",
            Code::Internal => "internal error",
            Code::Unavailable => "the service is currently unavailable",
            Code::DataLoss => "unrecoverable data loss or corruption",
            Code::Unauthenticated => "the request does not have valid authentication credentials",
        }
    }
}

impl From<i32> for Code {
    /// Maps a wire number to its code; numbers outside 0..=16 become [`Code::Unknown`].
    fn from(value: i32) -> Self {
        usize::try_from(value)
            .ok()
            .and_then(|index| Code::ALL.get(index).copied())
            .unwrap_or(Code::Unknown)
    }
}

impl From<Code> for i32 {
    fn from(code: Code) -> i32 {
        code as i32
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Why a call failed: a [`Code`], a message for humans, and metadata.
///
/// `Status` is what every fallible call returns as its error, on both sides. A
/// server handler returns one to fail a call; the client receives the same
/// code, message and metadata.
#[derive(Clone)]
pub struct Status {
    inner: Box<StatusInner>,
}

#[derive(Clone)]
struct StatusInner {
    code: Code,
    message: String,
    metadata: Metadata,
    source: Option<Arc<dyn StdError + Send + Sync + 'static>>,
}

macro_rules! status_constructors {
    ($($(#[$doc:meta])* $name:ident => $code:ident,)*) => {
        $(
            $(#[$doc])*
            pub fn $name(message: impl Into<String>) -> Status {
                Status::new(Code::$code, message)
            }
        )*
    };
}

impl Status {
    /// A status with `code` and `message` and no metadata.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            inner: Box::new(StatusInner {
                code,
                message: message.into(),
                metadata: Metadata::new(),
                source: None,
            }),
        }
    }

    /// A status with `code`, `message` and `metadata`.
    pub fn with_metadata(code: Code, message: impl Into<String>, metadata: Metadata) -> Status {
        let mut status = Status::new(code, message);
        status.inner.metadata = metadata;
        status
    }

    status_constructors! {
        /// [`Code::Cancelled`] with a message.
        cancelled => Cancelled,
        /// [`Code::Unknown`] with a message.
        unknown => Unknown,
        /// [`Code::InvalidArgument`] with a message.
        invalid_argument => InvalidArgument,
        /// [`Code::DeadlineExceeded`] with a message.
        deadline_exceeded => DeadlineExceeded,
        /// [`Code::NotFound`] with a message.
        not_found => NotFound,
        /// [`Code::AlreadyExists`] with a message.
        already_exists => AlreadyExists,
        /// [`Code::PermissionDenied`] with a message.
        permission_denied => PermissionDenied,
        /// [`Code::ResourceExhausted`] with a message.
        resource_exhausted => ResourceExhausted,
        /// [`Code::FailedPrecondition`] with a message.
        failed_precondition => FailedPrecondition,
        /// [`Code::Aborted`] with a message.
        aborted => Aborted,
        /// [`Code::OutOfRange`] with a message.
        out_of_range => OutOfRange,
        /// [`Code::Unimplemented`] with a message.
        unimplemented => Unimplemented,
        /// [`Code::Internal`] with a message.
        internal => Internal,
        /// [`Code::Unavailable`] with a message.
        unavailable => Unavailable,
        /// [`Code::DataLoss`] with a message.
        data_loss => DataLoss,
        /// [`Code::Unauthenticated`] with a message.
        unauthenticated => Unauthenticated,
    }

    /// The status code.
    pub fn code(&self) -> Code {
        self.inner.code
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.inner.message
    }

    /// The metadata sent with the status.
    pub fn metadata(&self) -> &Metadata {
        &self.inner.metadata
    }

    /// Mutable access to the metadata sent with the status.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.inner.metadata
    }

    /// Attaches the local error that caused this status (never sent on the wire).
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Status {
        self.inner.source = Some(Arc::new(source));
        self
    }

    /// Turns any error from a tower stack into a `Status`.
    ///
    /// A `Status` inside the box is returned as is; tower's timeout error becomes
    /// [`Code::DeadlineExceeded`], its load-shed error [`Code::ResourceExhausted`];
    /// anything else is [`Code::Unknown`] with the error's text.
    pub fn from_error(error: BoxError) -> Status {
        let error = match error.downcast::<Status>() {
            Ok(status) => return *status,
            Err(other) => other,
        };
        if error.is::<tower::timeout::error::Elapsed>() {
            return Status::deadline_exceeded(error.to_string());
        }
        if error.is::<tower::load_shed::error::Overloaded>() {
            return Status::resource_exhausted(error.to_string());
        }
        let message = error.to_string();
        Status {
            inner: Box::new(StatusInner {
                code: Code::Unknown,
                message,
                metadata: Metadata::new(),
                source: Some(Arc::from(error)),
            }),
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Status");
        debug.field("code", &self.inner.code);
        debug.field("message", &self.inner.message);
        if !self.inner.metadata.is_empty() {
            debug.field("metadata", &self.inner.metadata);
        }
        if let Some(source) = &self.inner.source {
            debug.field("source", source);
        }
        debug.finish()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "status: {:?}, message: {:?}",
            self.inner.code, self.inner.message
        )
    }
}

impl StdError for Status {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.inner
            .source
            .as_ref()
            .map(|source| &**source as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_numbers_match_grpc_and_round_trip() {
        for (number, code) in Code::ALL.iter().enumerate() {
            let number = number as i32;
            assert_eq!(*code as i32, number);
            assert_eq!(Code::from(number), *code);
        }
        assert_eq!(Code::Unavailable as i32, 14);
        assert_eq!(Code::Unauthenticated as i32, 16);
        assert_eq!(Code::from(17), Code::Unknown);
        assert_eq!(Code::from(-1), Code::Unknown);
    }

    #[test]
    fn from_error_keeps_a_boxed_status_and_maps_tower_errors() {
        let original = Status::not_found("no such key");
        let back = Status::from_error(Box::new(original));
        assert_eq!(back.code(), Code::NotFound);
        assert_eq!(back.message(), "no such key");

        let elapsed = Status::from_error(Box::new(tower::timeout::error::Elapsed::new()));
        assert_eq!(elapsed.code(), Code::DeadlineExceeded);

        let io = Status::from_error(Box::new(std::io::Error::other("boom")));
        assert_eq!(io.code(), Code::Unknown);
        assert!(io.message().contains("boom"));
        assert!(StdError::source(&io).is_some());
    }
}
