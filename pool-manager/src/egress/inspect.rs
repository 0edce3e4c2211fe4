//! What a connection says it is for, read from the first bytes its client sends: the SNI of a
//! TLS ClientHello, or the `Host` (and an absolute-form target's host) of an HTTP request
//! head. The proxy checks that name against the rule that admitted the connection, so a
//! connection admitted for `allowed.test` cannot ask the server behind it for `other.test`
//! (virtual hosts, CDNs). Pure: bytes in, a verdict out.

/// How much of a first flight is read before giving up on it (a ClientHello is one TLS record
/// of at most 16 KiB plus its header; an HTTP head the proxy's own bound).
pub const MAX_FIRST: usize = 5 + (1 << 14);
const MAX_HTTP_HEAD: usize = 16 * 1024;
const TLS_HANDSHAKE: u8 = 0x16;
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;

/// What the first bytes of a connection are.
#[derive(Debug, PartialEq, Eq)]
pub enum First {
    /// Not enough bytes yet to tell.
    NeedMore,
    /// A TLS ClientHello, with the host name it asks for (`None`: no SNI).
    Tls(Option<String>),
    /// An HTTP request head of `end` bytes, with the names it presents (lowercase, no port).
    Http {
        /// The hosts an absolute-form target and any `Host` header name.
        names: Vec<String>,
        /// Where the head ends in the bytes read (after its empty line).
        end: usize,
    },
    /// Another protocol: nothing to check.
    Other,
    /// Reads as TLS or HTTP but not as one the proxy can check: refused.
    Unreadable(&'static str),
}

/// Classifies the first bytes a client sent.
pub fn classify(buf: &[u8]) -> First {
    match buf.first() {
        None => First::NeedMore,
        Some(&TLS_HANDSHAKE) => tls(buf),
        Some(_) => http(buf),
    }
}

fn tls(buf: &[u8]) -> First {
    if buf.len() < 5 {
        return First::NeedMore;
    }
    let len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
    if len > MAX_FIRST - 5 {
        return First::Unreadable("a TLS record longer than TLS allows");
    }
    if buf.len() < 5 + len {
        return First::NeedMore;
    }
    match client_hello_sni(&buf[5..5 + len]) {
        Ok(sni) => First::Tls(sni),
        Err(why) => First::Unreadable(why),
    }
}

/// A cursor over a handshake message; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("a truncated ClientHello");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<usize, &'static str> {
        Ok(usize::from(self.take(1)?[0]))
    }
    fn u16(&mut self) -> Result<usize, &'static str> {
        let b = self.take(2)?;
        Ok(usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
    fn vec8(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u16()?;
        self.take(n)
    }
}

/// The `server_name` of the ClientHello in a TLS record's body (RFC 8446 4.1.2, RFC 6066 3).
/// The whole ClientHello must be in this one record.
fn client_hello_sni(record: &[u8]) -> Result<Option<String>, &'static str> {
    let mut r = Reader(record);
    if r.u8()? != usize::from(CLIENT_HELLO) {
        return Err("a TLS handshake that does not start with a ClientHello");
    }
    let len = r.take(3)?;
    let len = (usize::from(len[0]) << 16) | (usize::from(len[1]) << 8) | usize::from(len[2]);
    if len > r.0.len() {
        return Err("a ClientHello split over TLS records");
    }
    let mut r = Reader(&r.0[..len]);
    r.take(2 + 32)?; // legacy_version, random
    r.vec8()?; // legacy_session_id
    r.vec16()?; // cipher_suites
    r.vec8()?; // legacy_compression_methods
    if r.0.is_empty() {
        return Ok(None); // no extensions
    }
    let mut exts = Reader(r.vec16()?);
    let mut sni = None;
    let mut seen = false;
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec16()?;
        if kind != usize::from(EXT_SERVER_NAME) {
            continue;
        }
        if seen {
            return Err("a ClientHello with two server_name extensions");
        }
        seen = true;
        let mut list = Reader(Reader(data).vec16()?);
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type != 0 {
                continue;
            }
            if sni.is_some() {
                return Err("a ClientHello naming two hosts");
            }
            let name = std::str::from_utf8(name).map_err(|_| "an SNI that is not a host name")?;
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
                return Err("an SNI that is not a host name");
            }
            sni = Some(name.trim_end_matches('.').to_ascii_lowercase());
        }
    }
    Ok(sni)
}

fn http(buf: &[u8]) -> First {
    // Servers skip empty lines before a request line (RFC 9112 2.2).
    let start = buf.iter().position(|b| *b != b'\r' && *b != b'\n').unwrap_or(buf.len());
    let rest = &buf[start..];
    let token_len = rest.iter().position(|b| *b == b' ').unwrap_or(rest.len());
    let token = &rest[..token_len];
    if token.len() > 20 || !token.iter().all(u8::is_ascii_uppercase) {
        return First::Other;
    }
    if token_len == rest.len() {
        return First::NeedMore; // a method, or its beginning, without its space yet
    }
    let Some(end) = head_end(buf, start) else {
        return if buf.len() > MAX_HTTP_HEAD { First::Unreadable("an HTTP head too long") } else { First::NeedMore };
    };
    let line = buf[start..end].split(|b| *b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let version = line.rsplit(|b| *b == b' ').next().unwrap_or_default();
    // HTTP/1 only: an HTTP/2 preface (`PRI * HTTP/2.0`, h2c with prior knowledge) carries
    // its authority in compressed frames, like the Host inside TLS: not checked, not touched.
    if line.split(|b| *b == b' ').count() != 3 || !version.starts_with(b"HTTP/1.") {
        return First::Other;
    }
    match head_names(&buf[start..end]) {
        Ok(names) => First::Http { names, end },
        Err(why) => First::Unreadable(why),
    }
}

/// The names an HTTP request head presents: the host of an absolute-form target, and every
/// `Host` header's (lowercase, without port or trailing dot).
pub fn head_names(head: &[u8]) -> Result<Vec<String>, &'static str> {
    let text = std::str::from_utf8(head).map_err(|_| "an HTTP head that is not UTF-8")?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).skip_while(|l| l.is_empty());
    let line = lines.next().unwrap_or("");
    let target = line.split(' ').nth(1).unwrap_or("");
    let mut names = Vec::new();
    let lower = target.to_ascii_lowercase();
    if let Some(rest) = lower.strip_prefix("http://").or_else(|| lower.strip_prefix("https://")) {
        let auth = rest.split(['/', '?', '#']).next().unwrap_or("");
        names.push(host_of(auth.rsplit_once('@').map_or(auth, |(_, h)| h)));
    }
    for l in lines.filter(|l| !l.is_empty()) {
        if l.starts_with([' ', '\t']) {
            return Err("an HTTP head with folded header lines");
        }
        let Some((name, value)) = l.split_once(':') else {
            return Err("an HTTP header line without a colon");
        };
        if name.trim().eq_ignore_ascii_case("host") {
            names.push(host_of(value.trim()));
        }
    }
    Ok(names)
}

/// Where the head that starts at `start` ends (after its empty line), if it is complete.
fn head_end(buf: &[u8], start: usize) -> Option<usize> {
    let mut i = start;
    while let Some(n) = buf[i..].iter().position(|b| *b == b'\n') {
        let nl = i + n;
        match buf.get(nl + 1) {
            Some(b'\n') => return Some(nl + 2),
            Some(b'\r') if buf.get(nl + 2) == Some(&b'\n') => return Some(nl + 3),
            _ => i = nl + 1,
        }
    }
    None
}

/// The host of a `Host` value or an authority: lowercase, without its port or a trailing dot.
fn host_of(v: &str) -> String {
    let v = v.to_ascii_lowercase();
    if v.starts_with('[') {
        return v; // an IPv6 literal: never a name a rule admits
    }
    let host = match v.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => v.as_str(),
    };
    host.trim_end_matches('.').to_string()
}

/// An HTTP request head rewritten to end its connection after this request: its
/// `Connection`, `Keep-Alive` and `Proxy-*` headers replaced by `connection: close`, so a
/// later request on the connection (which is not read) cannot present another host. A request
/// to upgrade (WebSocket) keeps asking for it: `connection: upgrade, close` (a server that
/// declines the upgrade closes).
pub fn close_after(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).skip_while(|l| l.is_empty());
    let mut out = String::with_capacity(head.len() + 20);
    out.push_str(lines.next().unwrap_or(""));
    out.push_str("\r\n");
    let mut upgrade = false;
    for l in lines.filter(|l| !l.is_empty()) {
        let lower = l.to_ascii_lowercase();
        if lower.starts_with("proxy-") || lower.starts_with("connection:") || lower.starts_with("keep-alive:") {
            continue;
        }
        upgrade |= lower.starts_with("upgrade:");
        out.push_str(l);
        out.push_str("\r\n");
    }
    out.push_str(if upgrade { "connection: upgrade, close\r\n\r\n" } else { "connection: close\r\n\r\n" });
    out.into_bytes()
}

/// A ClientHello in a TLS record, naming `sni` (if any): what a client sends first. For tests
/// (the proxy's and the end-to-end ones).
pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(name) = sni {
        let mut entry = vec![0u8];
        entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
        entry.extend_from_slice(name.as_bytes());
        let mut list = (entry.len() as u16).to_be_bytes().to_vec();
        list.extend_from_slice(&entry);
        exts.extend_from_slice(&EXT_SERVER_NAME.to_be_bytes());
        exts.extend_from_slice(&(list.len() as u16).to_be_bytes());
        exts.extend_from_slice(&list);
    }
    // supported_versions: TLS 1.3 (an extension the parser skips).
    exts.extend_from_slice(&[0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
    let mut hello = vec![0x03, 0x03];
    hello.extend_from_slice(&[0x2a; 32]);
    hello.push(0); // no session id
    hello.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // TLS_AES_128_GCM_SHA256
    hello.extend_from_slice(&[0x01, 0x00]); // null compression
    hello.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    hello.extend_from_slice(&exts);
    let mut hs = vec![CLIENT_HELLO];
    hs.extend_from_slice(&(hello.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&hello);
    let mut record = vec![TLS_HANDSHAKE, 0x03, 0x01];
    record.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    record.extend_from_slice(&hs);
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sni_of_a_client_hello_is_read_whole_or_not_at_all() {
        let hello = client_hello(Some("Other.Test."));
        assert_eq!(classify(&hello), First::Tls(Some("other.test".into())));
        for cut in [1, 4, 5, hello.len() - 1] {
            assert_eq!(classify(&hello[..cut]), First::NeedMore, "{cut} bytes");
        }
        assert_eq!(classify(&client_hello(None)), First::Tls(None));
        // A record that says it holds more of the ClientHello than it does.
        let mut split = hello.clone();
        split[8] = 0x40;
        assert!(matches!(classify(&split), First::Unreadable(_)), "{:?}", classify(&split));
        // Another handshake message, and garbage lengths inside.
        let mut not_hello = hello.clone();
        not_hello[5] = 2;
        assert!(matches!(classify(&not_hello), First::Unreadable(_)));
        let mut bad_ext = hello.clone();
        let n = bad_ext.len();
        bad_ext[n - 8] = 0xff;
        assert!(matches!(classify(&bad_ext), First::Unreadable(_)), "{:?}", classify(&bad_ext));
    }

    #[test]
    fn an_http_head_presents_its_host_and_absolute_target() {
        let head = b"GET /x HTTP/1.1\r\nHost: Task.Test:8080\r\nAccept: */*\r\n\r\nbody";
        assert_eq!(classify(head), First::Http { names: vec!["task.test".into()], end: head.len() - 4 });
        let abs = b"\r\nGET http://a.test:1/p HTTP/1.1\nhost: b.test\n\n";
        assert_eq!(classify(abs), First::Http { names: vec!["a.test".into(), "b.test".into()], end: abs.len() });
        assert_eq!(classify(b"GET / HTTP/1.0\r\n\r\n"), First::Http { names: vec![], end: 18 });
        assert_eq!(classify(b"GE"), First::NeedMore);
        assert_eq!(classify(b"GET / HTTP/1.1\r\nHost: a"), First::NeedMore);
        assert_eq!(classify(b"SSH-2.0-OpenSSH\r\n"), First::Other);
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), First::Other, "h2c: not checked, not touched");
        assert_eq!(classify(b"*1\r\n$4\r\nPING\r\n"), First::Other);
        assert_eq!(classify(b"\x00\x00\x00\x08"), First::Other);
        assert!(matches!(classify(b"GET / HTTP/1.1\r\nHost: a\r\n b\r\n\r\n"), First::Unreadable(_)));
        let spaced = b"GET / HTTP/1.1\r\nHost : a.test\r\n\r\n";
        assert_eq!(classify(spaced), First::Http { names: vec!["a.test".into()], end: spaced.len() });
        assert_eq!(
            head_names(b"get http://a.test/ HTTP/1.1\r\nHOST: b.test\r\n\r\n"),
            Ok(vec!["a.test".into(), "b.test".into()])
        );
    }

    #[test]
    fn a_checked_request_ends_its_connection() {
        let head = b"GET / HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive\r\nProxy-Authorization: x\r\n\r\n";
        assert_eq!(close_after(head), b"GET / HTTP/1.1\r\nHost: a.test\r\nconnection: close\r\n\r\n");
        let ws = b"GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
        assert_eq!(
            close_after(ws),
            b"GET /ws HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\nconnection: upgrade, close\r\n\r\n"
        );
    }
}
