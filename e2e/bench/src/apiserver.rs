//! The apiserver's own count of requests (`apiserver_request_total`) and the time it spent on
//! them (`apiserver_request_duration_seconds`), scraped through the admin client so every request
//! of every client is counted, whoever sent it. Writes are what the bench reports per object;
//! reads and request time tell two builds with the same writes apart (one waiting longer on the
//! apiserver, or asking it more).

use std::collections::BTreeMap;

use anyhow::{Context, anyhow};
use kube::Client;

const WRITE_VERBS: &[&str] = &["POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"];

/// Requests so far.
#[derive(Debug, Clone, Default)]
pub struct Requests {
    /// Write requests, keyed `resource[/subresource] VERB code`.
    pub writes: BTreeMap<String, f64>,
    /// Every other request (GET, LIST, WATCH), keyed the same way.
    pub reads: BTreeMap<String, f64>,
    /// Seconds the apiserver spent serving requests, keyed `resource[/subresource] VERB`; not
    /// WATCH (a watch's duration is its life, not work) nor CONNECT.
    pub seconds: BTreeMap<String, f64>,
}

impl Requests {
    pub async fn scrape(client: &Client) -> anyhow::Result<Self> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        let text = client
            .request_text(req)
            .await
            .context("GET /metrics of kube-apiserver")?;
        Self::from_text(&text)
    }

    fn from_text(text: &str) -> anyhow::Result<Self> {
        let m = stowage_testkit::scrape::parse(text).map_err(|e| anyhow!("apiserver /metrics: {e}"))?;
        let key = |labels: &BTreeMap<String, String>| {
            let get = |k: &str| labels.get(k).map(String::as_str).unwrap_or("");
            let resource = match get("subresource") {
                "" => get("resource").to_string(),
                sub => format!("{}/{sub}", get("resource")),
            };
            (format!("{resource} {}", get("verb")), get("verb").to_string())
        };
        let mut out = Self::default();
        for (labels, v) in m.samples.get("apiserver_request_total").into_iter().flatten() {
            let (k, verb) = key(labels);
            let code = labels.get("code").map(String::as_str).unwrap_or("");
            let map = match WRITE_VERBS.contains(&verb.as_str()) {
                true => &mut out.writes,
                false => &mut out.reads,
            };
            *map.entry(format!("{k} {code}")).or_insert(0.0) += v;
        }
        for (labels, v) in m
            .samples
            .get("apiserver_request_duration_seconds_sum")
            .into_iter()
            .flatten()
        {
            let (k, verb) = key(labels);
            if verb != "WATCH" && verb != "CONNECT" {
                *out.seconds.entry(k).or_insert(0.0) += v;
            }
        }
        Ok(out)
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Requests) -> Requests {
        fn delta(now: &BTreeMap<String, f64>, then: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect()
        }
        Requests {
            writes: delta(&self.writes, &before.writes),
            reads: delta(&self.reads, &before.reads),
            seconds: delta(&self.seconds, &before.seconds),
        }
    }

    /// All writes except kube-apiserver's own background ones: it renews its identity Lease and
    /// reconciles the `kubernetes` Service endpoints every few seconds, which would charge the
    /// slower implementation for time rather than work (neither controller writes these).
    pub fn controller_writes(&self) -> f64 {
        const BACKGROUND: &[&str] = &["leases ", "endpoints ", "endpointslices "];
        self.writes
            .iter()
            .filter(|(k, _)| !BACKGROUND.iter().any(|b| k.starts_with(b)))
            .map(|(_, v)| v)
            .sum::<f64>()
            + 0.0
    }

    /// Writes the apiserver refused with 409 Conflict (stale resourceVersion).
    pub fn conflicts(&self) -> f64 {
        self.with_code("409")
    }

    /// Writes API Priority and Fairness turned away (429 Too Many Requests).
    pub fn throttled(&self) -> f64 {
        self.with_code("429")
    }

    fn with_code(&self, code: &str) -> f64 {
        // `+ 0.0` turns the empty sum's -0.0 into 0.
        self.writes
            .iter()
            .filter(|(k, _)| k.rsplit(' ').next() == Some(code))
            .map(|(_, v)| v)
            .sum::<f64>()
            + 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::Requests;

    #[test]
    fn counts_write_verbs_by_resource_and_skips_background() {
        let text = "# TYPE apiserver_request_total counter\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"persistentvolumes\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"} 5\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"persistentvolumes\",scope=\"resource\",subresource=\"status\",verb=\"PUT\",version=\"v1\"} 3\n\
apiserver_request_total{code=\"409\",component=\"apiserver\",resource=\"persistentvolumes\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"} 1\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"persistentvolumes\",scope=\"cluster\",subresource=\"\",verb=\"LIST\",version=\"v1\"} 9\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",group=\"coordination.k8s.io\",resource=\"leases\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"} 7\n\
apiserver_request_total{code=\"422\",component=\"apiserver\",resource=\"endpoints\",scope=\"resource\",subresource=\"\",verb=\"POST\",version=\"v1\"} 2\n\
apiserver_request_total{code=\"429\",component=\"apiserver\",resource=\"persistentvolumeclaims\",scope=\"resource\",subresource=\"status\",verb=\"PUT\",version=\"v1\"} 4\n";
        let w = Requests::from_text(text).unwrap();
        assert_eq!(w.controller_writes(), 13.0);
        assert_eq!(w.conflicts(), 1.0);
        assert_eq!(w.throttled(), 4.0);
        assert_eq!(w.writes["persistentvolumes/status PUT 200"], 3.0);
        assert_eq!(w.reads["persistentvolumes LIST 200"], 9.0);
        let later = Requests {
            writes: w.writes.iter().map(|(k, v)| (k.clone(), v + 2.0)).collect(),
            ..w.clone()
        };
        assert_eq!(later.since(&w).controller_writes(), 8.0);
        assert!(later.since(&w).reads.is_empty());
    }

    #[test]
    fn sums_request_seconds_without_watches() {
        let text = "# TYPE apiserver_request_duration_seconds histogram\n\
apiserver_request_duration_seconds_sum{component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"persistentvolumes\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"} 1.5\n\
apiserver_request_duration_seconds_count{component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"persistentvolumes\",scope=\"resource\",subresource=\"\",verb=\"PUT\",version=\"v1\"} 3\n\
apiserver_request_duration_seconds_sum{component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"persistentvolumes\",scope=\"cluster\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 900\n";
        let w = Requests::from_text(text).unwrap();
        assert_eq!(w.seconds.get("persistentvolumes PUT"), Some(&1.5));
        assert_eq!(w.seconds.len(), 1, "{:?}", w.seconds);
    }
}
