//! The byte stream a channel runs over. The channel frames it (`agent_proto::Frame`); it does
//! not care what carries the bytes: the agent's own Unix socket (the direct channel), or a
//! runtime's attach to the agent's stdio (`Runtime::attach`).

use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

/// A plain byte stream to a sandbox's agent, as its two halves.
pub struct Link {
    /// Over the agent's own socket, not the runtime's attach stream.
    pub direct: bool,
    /// What the agent writes: frames, nothing else (its log goes elsewhere).
    pub reader: Pin<Box<dyn AsyncRead + Send>>,
    /// What the agent reads.
    pub writer: Pin<Box<dyn AsyncWrite + Send>>,
}

impl Link {
    /// The direct channel to a sandbox's agent: its Unix socket in `dir`, or `None` when it
    /// does not answer within `wait` (an agent too old to serve one, or a runtime whose
    /// sockets the host cannot reach).
    pub async fn connect_socket(dir: &Path, wait: Duration) -> Option<Link> {
        let path = dir.join(crate::agent_bin::SOCKET_NAME);
        let deadline = tokio::time::Instant::now() + wait;
        let stream = loop {
            match tokio::net::UnixStream::connect(&path).await {
                Ok(s) => break s,
                Err(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(5)).await,
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "no direct channel; the attach stream serves");
                    return None;
                }
            }
        };
        // Only root in the sandbox (the agent, PID 1) can have made a socket there.
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == 0 => {}
            other => {
                tracing::warn!(path = %path.display(), peer = ?other, "the socket is not the agent's; not using it");
                return None;
            }
        }
        let (read, write) = stream.into_split();
        Some(Link { direct: true, reader: Box::pin(read), writer: Box::pin(write) })
    }
}
