//! The apiserver's own count of write requests (`apiserver_request_total`), scraped through the
//! admin client so every write of every client is counted, whoever sent it.

use std::collections::BTreeMap;

use anyhow::{Context, anyhow};
use kube::Client;

const WRITE_VERBS: &[&str] = &["POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"];

/// Write requests so far, keyed `resource[/subresource] VERB code`.
#[derive(Debug, Clone, Default)]
pub struct Writes(pub BTreeMap<String, f64>);

impl Writes {
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
        let mut out = BTreeMap::new();
        for (labels, v) in m.samples.get("apiserver_request_total").into_iter().flatten() {
            let get = |k: &str| labels.get(k).map(String::as_str).unwrap_or("");
            if !WRITE_VERBS.contains(&get("verb")) {
                continue;
            }
            let resource = match get("subresource") {
                "" => get("resource").to_string(),
                sub => format!("{}/{sub}", get("resource")),
            };
            *out.entry(format!("{resource} {} {}", get("verb"), get("code")))
                .or_insert(0.0) += v;
        }
        Ok(Self(out))
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Writes) -> Writes {
        Writes(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), v - before.0.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect(),
        )
    }

    /// All writes except kube-apiserver's own background ones: it renews its identity Lease and
    /// reconciles the `kubernetes` Service endpoints every few seconds, which would charge the
    /// slower implementation for time rather than work (neither controller writes these).
    pub fn controller_writes(&self) -> f64 {
        const BACKGROUND: &[&str] = &["leases ", "endpoints ", "endpointslices "];
        self.0
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
        self.0
            .iter()
            .filter(|(k, _)| k.rsplit(' ').next() == Some(code))
            .map(|(_, v)| v)
            .sum::<f64>()
            + 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::Writes;

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
        let w = Writes::from_text(text).unwrap();
        assert_eq!(w.controller_writes(), 13.0);
        assert_eq!(w.conflicts(), 1.0);
        assert_eq!(w.throttled(), 4.0);
        assert_eq!(w.0["persistentvolumes/status PUT 200"], 3.0);
        let later = Writes(w.0.iter().map(|(k, v)| (k.clone(), v + 2.0)).collect());
        assert_eq!(later.since(&w).controller_writes(), 8.0);
    }
}
