//! The skeleton both of the agent's whole-state loops run (the volume manager and the attacher).
//! A pass reads the stores whatever changed, so between passes a loop only waits for a reason to
//! look again, folds in the write tasks that ended, and takes in at once every change already
//! announced, so a burst becomes one pass. The feeds are merged as the controllers' driver merges
//! them (`stowage_common::runtime::driver::Inputs`).

use std::future::Future;

use stowage_common::runtime::driver::Inputs;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Why a wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Woke {
    /// Something changed, a task ended or the deadline passed: run a pass.
    Look,
    /// The agent is stopping.
    Stop,
}

/// Waits for the first of: a change on any feed, a write task's outcome (`fold` takes it in),
/// `also`, the deadline `wake`, or `stop`; then folds in every outcome and change already
/// announced. A feed whose watch ended is an error: the loop must stop rather than decide on a
/// frozen store.
pub(crate) async fn wait<D>(
    inputs: &mut Inputs<()>,
    done: &mut mpsc::UnboundedReceiver<D>,
    mut fold: impl FnMut(D),
    also: impl Future<Output = ()>,
    wake: Instant,
    stop: &mut watch::Receiver<bool>,
) -> anyhow::Result<Woke> {
    tokio::select! {
        r = inputs.next() => r?,
        Some(d) = done.recv() => fold(d),
        () = also => {}
        _ = tokio::time::sleep_until(wake) => {}
        _ = stop.changed() => return Ok(Woke::Stop),
    }
    while let Ok(d) = done.try_recv() {
        fold(d);
    }
    while inputs.ready()?.is_some() {}
    Ok(Woke::Look)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use stowage_common::store::informer::{Change, Feed};
    use tokio::sync::broadcast;

    use super::*;

    fn feed() -> (broadcast::Sender<Change<String>>, Inputs<()>) {
        let (tx, rx) = broadcast::channel(16);
        let inputs = Inputs::new().feed(Feed::new(rx, "thing"), |_| ());
        (tx, inputs)
    }

    #[tokio::test]
    async fn a_burst_of_changes_and_outcomes_is_one_wake_up() {
        let (tx, mut inputs) = feed();
        let (done_tx, mut done) = mpsc::unbounded_channel::<u32>();
        let (_stop_tx, mut stop) = watch::channel(false);
        for i in 0..3 {
            tx.send(Change::Applied(Arc::new(format!("t{i}")))).unwrap();
            done_tx.send(i).unwrap();
        }
        let mut folded = vec![];
        let far = Instant::now() + Duration::from_secs(60);
        let woke = wait(
            &mut inputs,
            &mut done,
            |d| folded.push(d),
            std::future::pending(),
            far,
            &mut stop,
        )
        .await
        .unwrap();
        assert_eq!(woke, Woke::Look);
        assert_eq!(folded, vec![0, 1, 2], "every outcome folded in the one wake-up");
        assert!(
            inputs.ready().unwrap().is_none(),
            "every announced change taken in"
        );
    }

    #[tokio::test]
    async fn the_deadline_wakes_stop_stops_and_an_ended_feed_is_an_error() {
        let (tx, mut inputs) = feed();
        let (_done_tx, mut done) = mpsc::unbounded_channel::<u32>();
        let (stop_tx, mut stop) = watch::channel(false);
        // Waits with nothing to fold and nothing else to wait for, until `after` from now.
        let mut idle = async |inputs: &mut Inputs<()>, after: Duration| {
            let wake = Instant::now() + after;
            wait(inputs, &mut done, |_| {}, std::future::pending(), wake, &mut stop).await
        };
        assert_eq!(
            idle(&mut inputs, Duration::from_millis(10)).await.unwrap(),
            Woke::Look
        );

        stop_tx.send(true).unwrap();
        let far = Duration::from_secs(60);
        assert_eq!(idle(&mut inputs, far).await.unwrap(), Woke::Stop);

        drop(tx);
        let err = idle(&mut inputs, far).await.unwrap_err();
        assert!(err.to_string().contains("thing"), "{err}");
    }
}
