//! Polling until the cluster reaches a state. The timeout is a bound that keeps a broken test from
//! hanging, never a claim about speed.

use std::future::Future;
use std::time::Duration;

/// Polls `check` until it returns `Ok`, and returns that value; panics after `timeout` with the
/// last reason `check` gave, so a failing test says what it was waiting for.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(why) => last = why,
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("condition not met within {timeout:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
