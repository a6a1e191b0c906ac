//! The `Executor`: runs one claim's actions (status writes, growing a built-in image) inside the
//! shared in-flight window and records what it wrote in the `Outcome`.

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use stowage_common::api::writes::Writes;
use stowage_common::observe::events::{Events, Occurrence, Repeat, Subject};
use stowage_common::store::VolumeAttachment;
use stowage_loopdriver::{ImageError, ImageStore};
use tokio::time::Instant;

use crate::core::{self, Action, Size};
use crate::error::{Error, NOT_ALLOWED, infeasible};
use crate::metrics::Metrics;
use crate::results::Outcome;
use stowage_common::errors::MetricLabel;
use stowage_common::observe::storageops::{Attempt, EXPAND_VOLUME, csi_plugin};

/// Everything a write task needs. Shared behind one `Arc` (`Controller::executor`): a copy per
/// write task would clone the client handle and the image path, which allocate.
pub(crate) struct Executor {
    pub(crate) client: Client,
    pub(crate) events: Events,
    pub(crate) metrics: Metrics,
    pub(crate) image_dir: PathBuf,
    pub(crate) attachments: Store<VolumeAttachment>,
}

pub(crate) fn is_attached(store: &Store<VolumeAttachment>, pv: &str) -> bool {
    store
        .state()
        .iter()
        .any(|va| va.spec.source.persistent_volume_name.as_deref() == Some(pv))
}

impl Executor {
    pub(crate) fn writes(&self) -> Writes {
        Writes::new(self.client.clone(), self.metrics.writes.clone())
    }

    pub(crate) async fn replace_claim_status(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> Result<PersistentVolumeClaim, Error> {
        self.writes()
            .replace_claim_status(c, op)
            .await
            .map_err(Error::from)
    }

    pub(crate) async fn replace_pv(&self, v: &PersistentVolume, op: &str) -> Result<PersistentVolume, Error> {
        self.writes().replace_pv(v, op).await.map_err(Error::from)
    }

    /// An event the core decided on, with its metrics; sent once per (reason, note).
    pub(crate) fn report(
        &self,
        key: &str,
        claim: &PersistentVolumeClaim,
        warning: bool,
        reason: &str,
        note: &str,
    ) {
        if !self.event(key, claim, warning, reason, note.to_string(), true) {
            return;
        }
        let outcome = match reason {
            core::REASON_NOT_ALLOWED => {
                self.metrics.failures.with_label_values(&[NOT_ALLOWED]).inc();
                return;
            }
            core::REASON_RESIZE_CANCELED => "canceled",
            core::REASON_EXTERNAL_EXPANDING => "handed_off",
            _ => return,
        };
        self.metrics.expansions.with_label_values(&[outcome]).inc();
    }

    /// Publishes an event; with `once`, not again while the claim's last one is the same.
    /// Returns whether it was sent.
    pub(crate) fn event(
        &self,
        key: &str,
        on: &PersistentVolumeClaim,
        warning: bool,
        reason: &str,
        note: String,
        once: bool,
    ) -> bool {
        let repeat = if once { Repeat::OnChange } else { Repeat::Always };
        let e = Occurrence {
            warning,
            reason,
            action: "Resize",
            note,
        };
        self.events.report(&subject(key), repeat, &on.object_ref(&()), e)
    }

    pub(crate) async fn apply(
        &self,
        key: &str,
        action: &Action,
        claim: &Arc<PersistentVolumeClaim>,
        pv: Option<&PersistentVolume>,
        done: &mut Outcome,
    ) -> Result<(), Error> {
        match action {
            Action::Event {
                warning,
                reason,
                note,
            } => self.report(key, claim, *warning, reason, note),
            Action::ClaimStatus { claim: next, op } => {
                done.claims.push(self.replace_claim_status(next, op).await?);
            }
            Action::Volume { pv: next, op } => {
                done.pvs.push(self.replace_pv(next, op).await?);
            }
            Action::Expand {
                pv: pv_name,
                handle,
                size,
                mark,
                node_step,
                filesystem,
            } => {
                let Some(pv) = pv.filter(|v| v.name_any() == *pv_name) else {
                    return Ok(());
                };
                self.expand(key, claim, pv, handle, size, *mark, *node_step, *filesystem, done)
                    .await?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn expand(
        &self,
        key: &str,
        claim: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        handle: &str,
        size: &Size,
        mark: bool,
        mut node_step: bool,
        filesystem: bool,
        done: &mut Outcome,
    ) -> Result<(), Error> {
        let started = Instant::now();
        // KCM's `expand_volume`: this whole call is one attempt (KCM's in-tree expansion grows
        // the volume and marks the claim in one operation); any early return is a failure.
        let attempt = Attempt::start(csi_plugin(stowage_loopdriver::DRIVER), EXPAND_VOLUME);
        let mut c = claim.clone();
        let human = size.quantity.0.clone();
        if mark {
            c = self
                .replace_claim_status(
                    &core::mark_in_progress(&c, size, Timestamp::now()),
                    "mark_resizing",
                )
                .await?;
            done.claims.push(c.clone());
            done.started = Some(started);
            let note = format!("expanding volume {} to {human}", pv.name_any());
            self.event(key, &c, false, core::REASON_RESIZING, note, false);
        }

        let bytes = u64::try_from(size.bytes).unwrap_or(u64::MAX);
        let (dir, h) = (self.image_dir.clone(), handle.to_string());
        // A node-local volume's image is on its node only: the new size is recorded here and the
        // node grows the image with its file system (NodeExpandVolume, in local mode), as a CSI
        // driver that needs only node expansion does.
        let local = node_local(pv);
        node_step |= local;
        // Grow only: a missing image is an error to report, never a fresh empty volume.
        let grown = match local {
            true => Ok(bytes),
            false => tokio::task::spawn_blocking(move || ImageStore::new(dir).grow(&h, bytes))
                .await
                .unwrap_or_else(|e| {
                    Err(ImageError::Io {
                        path: PathBuf::new(),
                        source: std::io::Error::other(e),
                    })
                }),
        };
        if let Err(error) = grown {
            let infeasible = infeasible(&error);
            let msg = format!("failed to expand volume {} to {human}: {error}", pv.name_any());
            let err = Error::Image { error, infeasible };
            self.metrics
                .failures
                .with_label_values(&[err.metric_label()])
                .inc();
            self.metrics.expansions.with_label_values(&["failed"]).inc();
            if let Some(next) = core::mark_failed(&c, &msg, infeasible, Timestamp::now()) {
                c = self.replace_claim_status(&next, "mark_failed").await?;
                done.claims.push(c.clone());
            }
            self.event(key, &c, true, core::REASON_RESIZE_FAILED, msg, true);
            return Err(err);
        }

        // The volume may have been attached since the decision: then its device needs a refresh.
        if !node_step && is_attached(&self.attachments, &pv.name_any()) {
            node_step = true;
        }
        let pre_resize = if node_step { core::capacity(&c) } else { None };
        if let Some(next) = core::grown_pv(pv, size, pre_resize.as_ref()) {
            done.pvs.push(self.replace_pv(&next, "grow_volume").await?);
        }
        if node_step {
            c = self
                .replace_claim_status(
                    &core::mark_node_pending(&c, filesystem, Timestamp::now()),
                    "mark_node_pending",
                )
                .await?;
            done.claims.push(c.clone());
            self.metrics.expansions.with_label_values(&["node_pending"]).inc();
            let note = if filesystem {
                format!(
                    "volume {} grown to {human}; the node must resize the file system",
                    pv.name_any()
                )
            } else {
                format!(
                    "volume {} grown to {human}; the node must refresh the device",
                    pv.name_any()
                )
            };
            self.event(key, &c, false, core::REASON_FS_RESIZE_REQUIRED, note, false);
        } else {
            c = self
                .replace_claim_status(&core::mark_finished(&c, size), "mark_finished")
                .await?;
            done.claims.push(c.clone());
            self.metrics.expansions.with_label_values(&["finished"]).inc();
            let note = format!("volume {} expanded to {human}", pv.name_any());
            self.event(key, &c, false, core::REASON_RESIZE_SUCCESSFUL, note, false);
        }
        self.metrics
            .expansion_seconds
            .with_label_values(&["controller"])
            .observe(started.elapsed().as_secs_f64());
        attempt.succeeded();
        Ok(())
    }
}

/// Whether the volume's image lives in one node's own store (node affinity on the driver's
/// topology key), where only that node can grow it.
fn node_local(pv: &PersistentVolume) -> bool {
    stowage_common::store::pv::affinity_value(pv, stowage_loopdriver::TOPOLOGY_KEY).is_some()
}

/// The events gate's subject of a claim expand reports on.
pub(crate) fn subject(key: &str) -> Subject {
    Subject::new("claim", key)
}
