//! The agent's replies: whole frames written to the host's channel (stdout, or the newest
//! socket connection), one writer at a time.

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use agent_proto::{ErrorInfo, Kind};

use crate::basics::{lock, log};

/// The encoded bytes of one frame, built without copying the payload twice.
pub fn frame_bytes(kind: Kind, id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&(5 + payload.len() as u32).to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The agent's stdout: whole frames, one writer at a time.
pub struct Out {
    w: Mutex<Box<dyn Write + Send>>,
    /// Set after the first failed write, so a vanished host is logged once.
    broken: AtomicBool,
}

impl Out {
    /// Replies go to `w`.
    pub fn new(w: Box<dyn Write + Send>) -> Out {
        Out { w: Mutex::new(w), broken: AtomicBool::new(false) }
    }

    /// Replies go to `w` from now on (a new channel to the host took over).
    pub fn replace(&self, w: Box<dyn Write + Send>) {
        *lock(&self.w) = w;
        self.broken.store(false, Ordering::Relaxed);
    }

    /// Sends one frame.
    pub fn send(&self, kind: Kind, id: u32, payload: &[u8]) {
        let bytes = frame_bytes(kind, id, payload);
        let mut w = lock(&self.w);
        self.write(&mut **w, &bytes);
    }

    /// Sends an `Error` frame, the final frame of request `id`.
    pub fn send_error(&self, id: u32, err: &ErrorInfo) {
        self.send(Kind::Error, id, &err.encode());
    }

    /// Sends a frame of a request unless its final frame went out already (`closed`). The flag
    /// is read under the writer lock, so no frame can follow the final one.
    pub fn send_open(&self, closed: &AtomicBool, kind: Kind, id: u32, payload: &[u8]) -> bool {
        let bytes = frame_bytes(kind, id, payload);
        let mut w = lock(&self.w);
        if closed.load(Ordering::Relaxed) {
            return false;
        }
        self.write(&mut **w, &bytes);
        true
    }

    /// Sends the final frame of a request and marks it `closed` (see `send_open`).
    pub fn send_last(&self, closed: &AtomicBool, kind: Kind, id: u32, payload: &[u8]) {
        let bytes = frame_bytes(kind, id, payload);
        let mut w = lock(&self.w);
        if !closed.swap(true, Ordering::Relaxed) {
            self.write(&mut **w, &bytes);
        }
    }

    fn write(&self, w: &mut dyn Write, bytes: &[u8]) {
        if let Err(e) = w.write_all(bytes).and_then(|()| w.flush())
            && !self.broken.swap(true, Ordering::Relaxed)
        {
            log(&format!("cannot write to stdout ({e}); dropping replies"));
        }
    }
}

/// Where a test's `Out` writes: keeps every byte, read back as frames.
#[cfg(test)]
#[derive(Clone, Default)]
pub struct Sink(std::sync::Arc<Mutex<Vec<u8>>>);

#[cfg(test)]
impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        lock(&self.0).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
impl Sink {
    /// The frames sent so far.
    pub fn frames(&self) -> Vec<agent_proto::Frame> {
        let mut buf = lock(&self.0).clone();
        std::iter::from_fn(|| agent_proto::Frame::decode(&mut buf).expect("whole frames")).collect()
    }
}

#[cfg(test)]
mod tests {
    use agent_proto::Frame;

    use super::*;

    #[test]
    fn frame_bytes_match_the_codec() {
        let payload = vec![1u8, 2, 3, 250];
        let want = Frame::new(Kind::Stdout, 77, payload.clone()).encode();
        assert_eq!(frame_bytes(Kind::Stdout, 77, &payload), want);
        let mut buf = want;
        assert_eq!(Frame::decode(&mut buf).unwrap().unwrap().payload, payload);
    }

    #[test]
    fn nothing_follows_the_last_frame() {
        let sink = Sink::default();
        let out = Out::new(Box::new(sink.clone()));
        let closed = AtomicBool::new(false);
        assert!(out.send_open(&closed, Kind::Stdout, 1, b"a"));
        out.send_last(&closed, Kind::Exit, 1, b"x");
        assert!(!out.send_open(&closed, Kind::Stdout, 1, b"b"));
        out.send_last(&closed, Kind::Error, 1, b"y");
        let kinds: Vec<Kind> = sink.frames().into_iter().map(|f| f.kind).collect();
        assert_eq!(kinds, [Kind::Stdout, Kind::Exit]);
    }
}
