//! One vocabulary for failures, shared by every controller and the agent.
//!
//! Each crate has one error type; it implements [`MetricLabel`], and the value goes into the
//! `error` label of that crate's error counters. Successes and failures of an operation are the
//! `result` label (`success` | `error`) everywhere. Values are snake_case and stable: dashboards
//! and alerts filter on them. An API failure maps by its HTTP status ([`api_label`]) so that a
//! 409 reads `conflict` in the binder, in attach/detach and in protection alike.

/// A stable, low-cardinality name for a failure, used as a metric label value.
pub trait MetricLabel {
    fn metric_label(&self) -> &'static str;
}

/// The `result` label of an operation counter.
pub const SUCCESS: &str = "success";
/// The `result` label of an operation counter.
pub const ERROR: &str = "error";
/// The `error` label of a work task that died (a panic) without reporting its outcome; every
/// controller retries its work with backoff.
pub const PANIC: &str = "panic";

/// The label of an API error: the status class the apiserver answered, or `transport` when no
/// answer came (connection refused, timeout, TLS, a body that did not decode).
pub fn api_label(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) => match s.code {
            400 => "bad_request",
            401 | 403 => "forbidden",
            404 => "not_found",
            409 => "conflict",
            410 => "expired",
            422 => "invalid",
            429 => "throttled",
            500..=599 => "server_error",
            _ => "api",
        },
        _ => "transport",
    }
}

impl MetricLabel for kube::Error {
    fn metric_label(&self) -> &'static str {
        api_label(self)
    }
}

/// Whether the apiserver answered with `code`.
pub fn code_is(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// A resourceVersion conflict: someone wrote first. Expected under concurrency; retried quietly.
pub fn is_conflict(e: &kube::Error) -> bool {
    code_is(e, 409)
}

pub fn is_not_found(e: &kube::Error) -> bool {
    code_is(e, 404)
}

/// An apiserver answer with status `code`, as tests of every crate's error labels need one.
pub fn api_error(code: u16) -> kube::Error {
    kube::Error::Api(
        kube::core::Status::failure("refused", "Test")
            .with_code(code)
            .boxed(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> kube::Error {
        api_error(code)
    }

    #[test]
    fn api_errors_are_labelled_by_status_class() {
        let cases = [
            (409, "conflict"),
            (404, "not_found"),
            (403, "forbidden"),
            (422, "invalid"),
            (429, "throttled"),
            (503, "server_error"),
            (418, "api"),
        ];
        for (code, label) in cases {
            assert_eq!(api(code).metric_label(), label, "{code}");
        }
        assert!(is_conflict(&api(409)) && !is_conflict(&api(404)));
        assert!(is_not_found(&api(404)));
    }
}
