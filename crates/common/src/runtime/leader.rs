//! Leader election on a `coordination.k8s.io/v1` Lease with client-go's semantics (lease duration,
//! renew deadline, retry period), so a stowage replica and an upstream one read the same record the
//! same way.
//!
//! Why not a crate: the one leader-election crate built on kube 5 (kube-lease-manager) lets a standby
//! sleep until the holder's lease *expires*, so a released lease is not taken over early, and it has
//! no renew deadline, so a leader cut off from the apiserver never steps down. Both are safety
//! properties we test, so the small loop lives here, with its decision as a pure function.
//!
//! Expiry is judged, as in client-go, on this process's monotonic clock from the moment the record
//! was last seen to change — never by comparing another machine's `renewTime` with our wall clock.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

/// Timings, with upstream's defaults.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl Timings {
    /// client-go's rule: lease duration > renew deadline > retry period (with jitter), or a
    /// standby could take over while the leader still believes it leads.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "--leader-elect-lease-duration ({:?}) must be greater than --leader-elect-renew-deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        if self.renew_deadline <= self.retry_period.mul_f64(1.2) {
            return Err(format!(
                "--leader-elect-renew-deadline ({:?}) must be greater than 1.2 × --leader-elect-retry-period ({:?})",
                self.renew_deadline, self.retry_period
            ));
        }
        if self.retry_period.is_zero() {
            return Err("--leader-elect-retry-period must be positive".into());
        }
        Ok(())
    }
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// The part of the Lease the election reads and writes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    pub holder: String,
    pub lease_duration_seconds: i32,
    pub acquire_time: Option<Timestamp>,
    pub renew_time: Option<Timestamp>,
    pub transitions: i32,
}

impl Record {
    fn from_spec(spec: &LeaseSpec) -> Self {
        Self {
            holder: spec.holder_identity.clone().unwrap_or_default(),
            lease_duration_seconds: spec.lease_duration_seconds.unwrap_or(0),
            acquire_time: spec.acquire_time.as_ref().map(|t| t.0),
            renew_time: spec.renew_time.as_ref().map(|t| t.0),
            transitions: spec.lease_transitions.unwrap_or(0),
        }
    }

    fn write_into(&self, spec: &mut LeaseSpec) {
        spec.holder_identity = (!self.holder.is_empty()).then(|| self.holder.clone());
        spec.lease_duration_seconds = Some(self.lease_duration_seconds);
        spec.acquire_time = self.acquire_time.map(MicroTime);
        spec.renew_time = self.renew_time.map(MicroTime);
        spec.lease_transitions = Some(self.transitions);
    }
}

/// What the candidate knows of the record: its content and when (on our clock) it last changed.
#[derive(Debug, Clone)]
pub struct Observed {
    pub record: Record,
    pub at: Instant,
}

/// The outcome of one look at the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Write this record (create when there is no lease yet, else update).
    Write(Record),
    /// Someone else holds an unexpired lease.
    HeldByOther { holder: String },
}

/// One step of client-go's tryAcquireOrRenew, without I/O.
pub fn decide(
    current: Option<&Record>,
    observed: Option<&Observed>,
    me: &str,
    timings: &Timings,
    now: Instant,
    wall_now: Timestamp,
) -> Decision {
    let lease_secs = i32::try_from(timings.lease_duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let Some(current) = current else {
        return Decision::Write(Record {
            holder: me.to_string(),
            lease_duration_seconds: lease_secs,
            acquire_time: Some(wall_now),
            renew_time: Some(wall_now),
            transitions: 0,
        });
    };
    // A record we have not seen before counts as freshly renewed from now on.
    let seen_at = match observed {
        Some(o) if o.record == *current => o.at,
        _ => now,
    };
    let held_for = Duration::from_secs(u64::try_from(current.lease_duration_seconds.max(0)).unwrap_or(0));
    if !current.holder.is_empty() && current.holder != me && seen_at + held_for > now {
        return Decision::HeldByOther {
            holder: current.holder.clone(),
        };
    }
    let mine = current.holder == me;
    Decision::Write(Record {
        holder: me.to_string(),
        lease_duration_seconds: lease_secs,
        acquire_time: if mine {
            current.acquire_time
        } else {
            Some(wall_now)
        },
        renew_time: Some(wall_now),
        transitions: if mine {
            current.transitions
        } else {
            current.transitions.saturating_add(1)
        },
    })
}

/// The record that hands the lease back: empty holder and a one-second duration, as client-go
/// writes on release, so standbys take over at their next retry instead of waiting for expiry.
pub fn released(current: &Record, wall_now: Timestamp) -> Record {
    Record {
        holder: String::new(),
        lease_duration_seconds: 1,
        acquire_time: Some(wall_now),
        renew_time: Some(wall_now),
        transitions: current.transitions,
    }
}

/// A candidate for one Lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timings: Timings,
    observed: Option<Observed>,
    /// The lease object as last read or written, for resourceVersion preconditions.
    lease: Option<Lease>,
}

impl Elector {
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str, timings: Timings) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            timings,
            observed: None,
            lease: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// One tryAcquireOrRenew round trip. `Ok(true)` when we hold the lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let lease = self.api.get_opt(&self.name).await?;
        // A lease without a spec reads as free.
        let current = lease
            .as_ref()
            .map(|l| l.spec.as_ref().map(Record::from_spec).unwrap_or_default());
        let now = Instant::now();
        let decision = decide(
            current.as_ref(),
            self.observed.as_ref(),
            &self.identity,
            &self.timings,
            now,
            Timestamp::now(),
        );
        if let Some(cur) = &current
            && self.observed.as_ref().is_none_or(|o| o.record != *cur)
        {
            self.observed = Some(Observed {
                record: cur.clone(),
                at: now,
            });
        }
        self.lease = lease;
        let Decision::Write(record) = decision else {
            return Ok(false);
        };
        self.write(record).await
    }

    /// Writes `record` with the last-read resourceVersion as precondition; a conflict means
    /// someone else wrote first, which is a plain "not acquired".
    async fn write(&mut self, record: Record) -> Result<bool, kube::Error> {
        let result = match self.lease.clone() {
            None => {
                let mut spec = LeaseSpec::default();
                record.write_into(&mut spec);
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                record.write_into(lease.spec.get_or_insert_with(Default::default));
                self.api.replace(&self.name, &PostParams::default(), &lease).await
            }
        };
        match result {
            Ok(written) => {
                self.observed = Some(Observed {
                    record,
                    at: Instant::now(),
                });
                self.lease = Some(written);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Blocks until this candidate holds the lease, retrying every retry period (with jitter).
    pub async fn acquire(&mut self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    tracing::info!(lease = %self.name, identity = %self.identity, "acquired leadership");
                    return;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, lease = %self.name, "cannot read or write the lease"),
            }
            tokio::time::sleep(jittered(self.timings.retry_period)).await;
        }
    }

    /// Renews every retry period; returns when renewal has failed for a whole renew deadline
    /// (or the lease was taken), i.e. when leadership is lost.
    pub async fn hold(&mut self) {
        let mut last_renewed = Instant::now();
        loop {
            tokio::time::sleep(self.timings.retry_period).await;
            // An apiserver that never answers must not keep us leading past the deadline.
            let deadline = last_renewed + self.timings.renew_deadline;
            let attempt = match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::error!(lease = %self.name, "renewal did not answer within the renew deadline");
                    return;
                }
            };
            match attempt {
                Ok(true) => last_renewed = Instant::now(),
                Ok(false) => {
                    if self
                        .observed
                        .as_ref()
                        .is_some_and(|o| o.record.holder != self.identity)
                    {
                        tracing::error!(lease = %self.name, "lease taken by another candidate");
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, lease = %self.name, "cannot renew the lease"),
            }
            if last_renewed.elapsed() > self.timings.renew_deadline {
                tracing::error!(lease = %self.name, "could not renew within the renew deadline");
                return;
            }
        }
    }

    /// Hands the lease back if we hold it (on shutdown), so a standby takes over at once.
    pub async fn release(&mut self) {
        let Some(lease) = self.lease.clone() else { return };
        let current = lease.spec.as_ref().map(Record::from_spec).unwrap_or_default();
        if current.holder != self.identity {
            return;
        }
        match self.write(released(&current, Timestamp::now())).await {
            Ok(true) => tracing::info!(lease = %self.name, "released leadership"),
            Ok(false) => tracing::warn!(lease = %self.name, "lease changed under us; not released"),
            Err(e) => tracing::warn!(error = %e, lease = %self.name, "cannot release the lease"),
        }
    }
}

/// client-go's JitterFactor of 1.2: wait between 1x and 2.2x the period.
fn jittered(period: Duration) -> Duration {
    period.mul_f64(1.0 + 1.2 * rand::random::<f64>())
}

/// Runs the election forever, publishing whether we lead on `leading`. Returns on `shutdown`,
/// after releasing the lease if we held it.
pub async fn run(mut elector: Elector, leading: watch::Sender<bool>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = elector.acquire() => {}
        }
        let _ = leading.send(true);
        let lost = tokio::select! {
            _ = &mut shutdown => false,
            _ = elector.hold() => true,
        };
        let _ = leading.send(false);
        if !lost {
            break;
        }
        tracing::warn!("leadership lost; controllers stopped, standing again as a candidate");
    }
    let _ = leading.send(false);
    elector.release().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Timings {
        Timings::default()
    }

    fn rec(holder: &str, transitions: i32) -> Record {
        Record {
            holder: holder.into(),
            lease_duration_seconds: 15,
            acquire_time: Some(Timestamp::UNIX_EPOCH),
            renew_time: Some(Timestamp::UNIX_EPOCH),
            transitions,
        }
    }

    #[test]
    fn timings_must_nest() {
        assert!(Timings::default().validate().is_ok());
        let bad = Timings {
            renew_deadline: Duration::from_secs(20),
            ..Timings::default()
        };
        assert!(bad.validate().unwrap_err().contains("lease-duration"));
        let bad = Timings {
            retry_period: Duration::from_secs(9),
            ..Timings::default()
        };
        assert!(bad.validate().unwrap_err().contains("retry-period"));
    }

    #[test]
    fn no_lease_creates_one_held_by_me() {
        let now = Instant::now();
        let d = decide(None, None, "a", &t(), now, Timestamp::UNIX_EPOCH);
        assert_eq!(
            d,
            Decision::Write(Record {
                holder: "a".into(),
                transitions: 0,
                ..rec("a", 0)
            })
        );
    }

    #[test]
    fn unexpired_lease_of_another_is_respected_until_it_stops_changing_for_a_duration() {
        let now = Instant::now();
        let r = rec("b", 3);
        let seen = Observed {
            record: r.clone(),
            at: now,
        };
        assert_eq!(
            decide(
                Some(&r),
                Some(&seen),
                "a",
                &t(),
                now + Duration::from_secs(14),
                Timestamp::UNIX_EPOCH
            ),
            Decision::HeldByOther { holder: "b".into() }
        );
        let Decision::Write(w) = decide(
            Some(&r),
            Some(&seen),
            "a",
            &t(),
            now + Duration::from_secs(16),
            Timestamp::UNIX_EPOCH,
        ) else {
            panic!("expired lease must be taken")
        };
        assert_eq!((w.holder.as_str(), w.transitions), ("a", 4));
    }

    #[test]
    fn a_changed_record_restarts_the_expiry_clock() {
        let now = Instant::now();
        let old = Observed {
            record: rec("b", 3),
            at: now,
        };
        let mut renewed = rec("b", 3);
        renewed.renew_time = Some(Timestamp::from_second(10).unwrap());
        let later = now + Duration::from_secs(30);
        assert_eq!(
            decide(
                Some(&renewed),
                Some(&old),
                "a",
                &t(),
                later,
                Timestamp::UNIX_EPOCH
            ),
            Decision::HeldByOther { holder: "b".into() }
        );
    }

    #[test]
    fn released_lease_is_taken_at_once() {
        let now = Instant::now();
        let r = released(&rec("b", 3), Timestamp::UNIX_EPOCH);
        let seen = Observed {
            record: r.clone(),
            at: now,
        };
        let Decision::Write(w) = decide(Some(&r), Some(&seen), "a", &t(), now, Timestamp::UNIX_EPOCH) else {
            panic!("released lease must be taken")
        };
        assert_eq!((w.holder.as_str(), w.transitions), ("a", 4));
    }

    #[test]
    fn renewal_keeps_acquire_time_and_transitions() {
        let now = Instant::now();
        let r = rec("a", 7);
        let wall = Timestamp::from_second(99).unwrap();
        let Decision::Write(w) = decide(Some(&r), None, "a", &t(), now, wall) else {
            panic!()
        };
        assert_eq!(w.acquire_time, r.acquire_time);
        assert_eq!(w.renew_time, Some(wall));
        assert_eq!(w.transitions, 7);
    }
}
