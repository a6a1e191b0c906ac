//! Ingest: the shared informers' change feeds, read so that a lagging subscriber re-reads the
//! stores instead of failing.

use anyhow::bail;
use stowage_common::informer::Change;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

pub(crate) enum Feed<K> {
    Change(Change<K>),
    Lagged,
}

pub(crate) fn feed<K>(r: Result<Change<K>, RecvError>) -> anyhow::Result<Feed<K>> {
    match r {
        Ok(c) => Ok(Feed::Change(c)),
        Err(RecvError::Lagged(_)) => Ok(Feed::Lagged),
        Err(RecvError::Closed) => bail!("change feed closed"),
    }
}

pub(crate) fn try_feed<K>(r: Result<Change<K>, TryRecvError>) -> anyhow::Result<Option<Feed<K>>> {
    match r {
        Ok(c) => Ok(Some(Feed::Change(c))),
        Err(TryRecvError::Empty) => Ok(None),
        Err(TryRecvError::Lagged(_)) => Ok(Some(Feed::Lagged)),
        Err(TryRecvError::Closed) => bail!("change feed closed"),
    }
}
