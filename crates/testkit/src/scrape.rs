//! Scraping and strictly parsing the Prometheus text exposition of a running binary.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A plain HTTP/1.0 GET; returns status code and body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {head:?}")))?;
    Ok((code, body.to_string()))
}

/// One sample: label set and value.
pub type Sample = (BTreeMap<String, String>, f64);

/// Parsed exposition: family name → samples (histogram/summary series keep their suffixes).
#[derive(Debug, Default)]
pub struct Metrics {
    pub types: BTreeMap<String, String>,
    pub samples: BTreeMap<String, Vec<Sample>>,
}

impl Metrics {
    /// The single value of an unlabelled series (or the first series of a family).
    pub fn value(&self, name: &str) -> Option<f64> {
        self.samples.get(name).and_then(|v| v.first()).map(|(_, v)| *v)
    }

    /// Sum over every series of `name`.
    pub fn sum(&self, name: &str) -> f64 {
        self.sum_where(name, &[])
    }

    /// Sum over the series of `name` that carry every one of `labels`.
    pub fn sum_where(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let matches = |l: &BTreeMap<String, String>| {
            labels
                .iter()
                .all(|(k, v)| l.get(*k).is_some_and(|have| have == v))
        };
        self.samples
            .get(name)
            .map(|v| v.iter().filter(|(l, _)| matches(l)).map(|(_, x)| x).sum())
            .unwrap_or(0.0)
    }
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// Parses text format 0.0.4 strictly: every line must be a comment, HELP/TYPE or a valid sample,
/// and every sample must belong to a family with a TYPE line.
pub fn parse(text: &str) -> Result<Metrics, String> {
    let mut m = Metrics::default();
    for (i, line) in text.lines().enumerate() {
        let err = |what: &str| format!("line {}: {what}: {line:?}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let mut parts = rest.trim_start().splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("TYPE"), Some(name), Some(ty)) => {
                    if !valid_name(name) {
                        return Err(err("bad metric name"));
                    }
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty) {
                        return Err(err("unknown type"));
                    }
                    m.types.insert(name.to_string(), ty.to_string());
                }
                (Some("HELP"), Some(name), _) if !valid_name(name) => return Err(err("bad metric name")),
                _ => {}
            }
            continue;
        }
        let (series, rest) = match line.find('{') {
            Some(_) => {
                let close = line.rfind('}').ok_or_else(|| err("unclosed label set"))?;
                (&line[..close + 1], &line[close + 1..])
            }
            None => line.split_once(' ').ok_or_else(|| err("no value"))?,
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, parse_labels(l.trim_end_matches('}')).map_err(|e| err(&e))?),
            None => (series, BTreeMap::new()),
        };
        if !valid_name(name) {
            return Err(err("bad metric name"));
        }
        let value = rest
            .split_whitespace()
            .next()
            .and_then(parse_value)
            .ok_or_else(|| err("bad value"))?;
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| m.types.contains_key(*f)))
            .unwrap_or(name);
        if !m.types.contains_key(family) {
            return Err(err("sample without a TYPE line"));
        }
        m.samples
            .entry(name.to_string())
            .or_default()
            .push((labels, value));
    }
    Ok(m)
}

fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"").ok_or("label without =\"")?;
        let k = k.trim().trim_start_matches(',').trim();
        if !valid_name(k) {
            return Err(format!("bad label name {k:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("dangling escape".into()),
                },
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end.ok_or("unterminated label value")?;
        out.insert(k.to_string(), value);
        rest = after[end + 1..].trim_start_matches(',').trim();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_labels_histograms_and_rejects_garbage() {
        let text = "# HELP a_total x\n# TYPE a_total counter\na_total{k=\"v\",q=\"a\\\"b\"} 3\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n";
        let m = super::parse(text).unwrap();
        assert_eq!(m.value("a_total"), Some(3.0));
        assert_eq!(m.samples["a_total"][0].0["q"], "a\"b");
        assert_eq!(m.value("h_count"), Some(1.0));
        assert_eq!(m.sum_where("a_total", &[("k", "v")]), 3.0);
        assert_eq!(m.sum_where("a_total", &[("k", "w")]), 0.0);
        assert!(super::parse("no_type 1\n").is_err());
        assert!(super::parse("# TYPE x gauge\nx{a=1} 2\n").is_err());
        assert!(super::parse("# TYPE x gauge\nx one\n").is_err());
    }
}
