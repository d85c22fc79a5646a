//! [`DeadlineLayer`]: a client-side timeout that the server sees.
//!
//! tower's `Timeout` only stops waiting on the client: the server goes on
//! working for a caller that has given up. This layer instead gives each
//! request a deadline (`Request::set_timeout`, or keeps a sooner one the
//! caller set), which the [`Channel`](crate::Channel) sends with the call, so
//! the server aborts its handler when it passes; the layer also stops waiting
//! itself at that point, whatever sits below it.
//!
//! Placed below a retry layer, each attempt gets the whole timeout; placed
//! above it, the timeout bounds all attempts together (each attempt then
//! tells the server the full timeout, an upper bound of what is left).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tower_layer::Layer;
use tower_service::Service;

use crate::request::Request;
use crate::status::{BoxError, Status};

/// Gives every call a deadline of `timeout` that the server sees (see the
/// module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlineLayer {
    timeout: Duration,
}

impl DeadlineLayer {
    /// Calls get at most `timeout`.
    pub fn new(timeout: Duration) -> DeadlineLayer {
        DeadlineLayer { timeout }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            timeout: self.timeout,
        }
    }
}

/// The service [`DeadlineLayer`] makes.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    timeout: Duration,
}

impl<S, B> Service<Request<B>> for Deadline<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, Status>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner
            .poll_ready(cx)
            .map_err(|error| Status::from_error(error.into()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let timeout = request
            .timeout()
            .map_or(self.timeout, |set| set.min(self.timeout));
        request.set_timeout(timeout);
        let call = self.inner.call(request);
        Box::pin(async move {
            match tokio::time::timeout(timeout, call).await {
                Ok(result) => result.map_err(|error| Status::from_error(error.into())),
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "deadline of {timeout:?} exceeded"
                ))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inner service that reports the timeout its request carried, or
    /// never answers.
    #[derive(Clone)]
    struct Seen {
        hang: bool,
    }

    impl Service<Request<()>> for Seen {
        type Response = Option<Duration>;
        type Error = Status;
        type Future = Pin<Box<dyn Future<Output = Result<Option<Duration>, Status>> + Send>>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<()>) -> Self::Future {
            let timeout = request.timeout();
            let hang = self.hang;
            Box::pin(async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(timeout)
            })
        }
    }

    #[tokio::test]
    async fn sets_the_deadline_keeps_a_sooner_one_and_stops_waiting() {
        use tower::ServiceExt;
        let layer = DeadlineLayer::new(Duration::from_millis(200));
        let seen = layer
            .layer(Seen { hang: false })
            .oneshot(Request::new(()))
            .await
            .unwrap();
        assert_eq!(seen, Some(Duration::from_millis(200)));
        let mut sooner = Request::new(());
        sooner.set_timeout(Duration::from_millis(50));
        let seen = layer
            .layer(Seen { hang: false })
            .oneshot(sooner)
            .await
            .unwrap();
        assert_eq!(
            seen,
            Some(Duration::from_millis(50)),
            "a sooner deadline stays"
        );
        let mut later = Request::new(());
        later.set_timeout(Duration::from_secs(60));
        let status = DeadlineLayer::new(Duration::from_millis(20))
            .layer(Seen { hang: true })
            .oneshot(later)
            .await
            .unwrap_err();
        assert_eq!(status.code(), crate::Code::DeadlineExceeded);
    }
}
