//! A relay in front of a gRPC server on a unix socket that drops the `:authority` a client sends
//! when it is not a valid authority.
//!
//! The kubelet's plugin watcher dials registration sockets by path, and grpc-go then sends that
//! path as `:authority`; the HTTP/2 server under tonic (h2) rejects such a request as malformed
//! (RST_STREAM PROTOCOL_ERROR), so registration never happens. The relay decodes each request's
//! header block (HPACK), leaves out an `:authority` that is not one, re-encodes the block with its
//! own encoder, and passes every other frame and the whole server side through untouched.

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// The client connection preface of HTTP/2.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;

/// Is `value` a plain `host[:port]` (a name, an IPv4 or a bracketed IPv6 address)? A path is not,
/// nor the percent-encoded path grpc-go sends (`%2Fvar%2Flib%2F…`).
pub fn valid_authority(value: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(value) else {
        return false;
    };
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && !p.contains(']') => (h, Some(p)),
        _ => (s, None),
    };
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        !v6.is_empty() && v6.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    host_ok && port.is_none_or(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

/// Rewrites the header block fragments of client→server frames.
pub struct Rewriter {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// (stream id, flags of the HEADERS frame, block so far) while CONTINUATIONs follow.
    pending: Option<(u32, u8, Vec<u8>)>,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self {
            decoder: Decoder::new(),
            encoder: Encoder::new(),
            pending: None,
        }
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&len.to_be_bytes()[1..]);
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

impl Rewriter {
    /// One client frame in (header and payload), the frames to send on out.
    pub fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Result<Vec<u8>, String> {
        match kind {
            HEADERS => {
                let mut p = payload;
                let mut pad = 0usize;
                if flags & FLAG_PADDED != 0 {
                    pad = *p.first().ok_or("HEADERS frame without its pad length")? as usize;
                    p = &p[1..];
                }
                if flags & FLAG_PRIORITY != 0 {
                    p = p.get(5..).ok_or("HEADERS frame shorter than its priority")?;
                }
                let block = p
                    .get(..p.len().saturating_sub(pad))
                    .ok_or("bad padding")?
                    .to_vec();
                // Priority and padding are dropped: both are optional and change nothing here.
                let keep = flags & FLAG_END_STREAM;
                if flags & FLAG_END_HEADERS != 0 {
                    self.rewrite(stream, keep, &block)
                } else {
                    self.pending = Some((stream, keep, block));
                    Ok(vec![])
                }
            }
            CONTINUATION => {
                let (s, keep, mut block) = self.pending.take().ok_or("CONTINUATION without HEADERS")?;
                if s != stream {
                    return Err("CONTINUATION of another stream".into());
                }
                block.extend_from_slice(payload);
                if flags & FLAG_END_HEADERS != 0 {
                    self.rewrite(stream, keep, &block)
                } else {
                    self.pending = Some((s, keep, block));
                    Ok(vec![])
                }
            }
            _ => Ok(frame(kind, flags, stream, payload)),
        }
    }

    fn rewrite(&mut self, stream: u32, flags: u8, block: &[u8]) -> Result<Vec<u8>, String> {
        let headers = self.decoder.decode(block).map_err(|e| format!("HPACK: {e:?}"))?;
        let kept: Vec<(&[u8], &[u8])> = headers
            .iter()
            .filter(|(n, v)| n.as_slice() != b":authority" || valid_authority(v))
            .map(|(n, v)| (n.as_slice(), v.as_slice()))
            .collect();
        let out = self.encoder.encode(kept);
        // One frame: a header block the size of a gRPC request fits the default 16 KiB.
        Ok(frame(HEADERS, flags | FLAG_END_HEADERS, stream, &out))
    }
}

/// Relays one client connection to `server`, fixing its requests' header blocks.
pub async fn relay(client: UnixStream, server: &std::path::Path) -> std::io::Result<()> {
    let upstream = UnixStream::connect(server).await?;
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let down = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut ur, &mut cw).await;
        let _ = cw.shutdown().await;
    });
    let up = async {
        let mut preface = [0u8; PREFACE.len()];
        cr.read_exact(&mut preface).await?;
        if preface != PREFACE {
            return Err(std::io::Error::other("not an HTTP/2 client"));
        }
        uw.write_all(&preface).await?;
        let mut rw = Rewriter::default();
        loop {
            let mut head = [0u8; 9];
            if cr.read_exact(&mut head).await.is_err() {
                break;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            cr.read_exact(&mut payload).await?;
            let out = rw
                .frame(head[3], head[4], stream, &payload)
                .map_err(std::io::Error::other)?;
            uw.write_all(&out).await?;
        }
        let _ = uw.shutdown().await;
        Ok::<(), std::io::Error>(())
    };
    let r = up.await;
    let _ = down.await;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_not_an_authority() {
        assert!(valid_authority(b"localhost"));
        assert!(valid_authority(b"127.0.0.1:8080"));
        assert!(valid_authority(b"[::1]:443"));
        assert!(!valid_authority(b"/var/lib/kubelet/plugins_registry/x-reg.sock"));
        // What grpc-go sends for a unix socket dialled by path.
        assert!(!valid_authority(
            b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock"
        ));
        assert!(!valid_authority(b""));
        assert!(!valid_authority(b"host:"));
    }

    #[test]
    fn the_authority_path_is_dropped_and_the_rest_kept_across_continuations() {
        let mut client = Encoder::new();
        let block = client.encode(vec![
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", b"/k/plugins_registry/loop.stowage.dev-reg.sock"),
            (b"content-type", b"application/grpc"),
        ]);
        let (a, b) = block.split_at(block.len() / 2);
        let mut rw = Rewriter::default();
        assert!(rw.frame(HEADERS, FLAG_END_STREAM, 1, a).unwrap().is_empty());
        let out = rw.frame(CONTINUATION, FLAG_END_HEADERS, 1, b).unwrap();
        assert_eq!(out[3], HEADERS);
        assert_eq!(out[4], FLAG_END_STREAM | FLAG_END_HEADERS);
        let mut server = Decoder::new();
        let headers = server.decode(&out[9..]).unwrap();
        assert!(headers.iter().all(|(n, _)| n != b":authority"));
        assert_eq!(headers.len(), 4);
        // Data frames pass through as they were.
        assert_eq!(rw.frame(0x0, 0x1, 1, b"abc").unwrap(), frame(0x0, 0x1, 1, b"abc"));
        // A valid authority is kept.
        let block = client.encode(vec![(&b":authority"[..], &b"localhost"[..])]);
        let out = rw.frame(HEADERS, FLAG_END_HEADERS, 3, &block).unwrap();
        assert_eq!(server.decode(&out[9..]).unwrap()[0].1, b"localhost");
    }
}
