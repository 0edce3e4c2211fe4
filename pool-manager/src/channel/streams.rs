//! The channel's flow-controlled streams: a streamed read (`ReadStream`) and a streaming
//! exec (`ExecStream` with its `StreamControl`), each on its own route.

use futures::StreamExt as _;

use super::*;

/// Output bytes a streamed read may have in flight (sent by the agent, not yet taken).
const READ_WINDOW: u32 = 1 << 20;

impl AgentConn {
    /// Starts a flow-controlled read (`spec.credit` is set here): the agent stays at most
    /// `READ_WINDOW` bytes ahead of the chunks taken from the `ReadStream`, so a slow client
    /// slows the read and memory stays bounded. Dropping the stream early cancels the read.
    pub async fn read_stream(&self, mut spec: ReadSpec) -> Result<ReadStream, AgentError> {
        spec.credit = READ_WINDOW;
        let route = self.route()?;
        self.send(&self.request(Frame::new(Kind::ReadFile, route.id, spec.encode()))?).await?;
        Ok(ReadStream { route, conn: self.clone(), done: false })
    }

    /// Writes a file from a stream of chunks as they come (any sizes; re-chunked here),
    /// creating parent directories; at most `max_bytes` in all. A stream that fails (its
    /// client went away) or runs over cancels the upload on the agent: its temp file goes and
    /// the target is untouched.
    #[tracing::instrument(name = "agent.write_file", skip_all, fields(otel.kind = "client"))]
    pub async fn write_stream<S, E>(&self, spec: WriteSpec, data: S, max_bytes: u64) -> Result<u64, AgentError>
    where
        S: futures::Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let mut route = self.route()?;
        let id = route.id;
        self.send(&[Frame::new(Kind::WriteFile, id, spec.encode())]).await?;
        let mut cancel = CancelOnDrop { conn: Some(self.clone()), id };
        let mut data = std::pin::pin!(data);
        let mut sent: u64 = 0;
        while let Some(chunk) = data.next().await {
            let chunk = chunk.map_err(|e| AgentError::Upload(e.to_string()))?;
            sent += chunk.len() as u64;
            if sent > max_bytes {
                return Err(AgentError::TooLarge(format!("more than {max_bytes} bytes")));
            }
            for c in chunk.chunks(proto::MAX_CHUNK) {
                self.send(&[Frame::new(Kind::Data, id, c.to_vec())]).await?;
            }
        }
        self.send(&[Frame::new(Kind::End, id, vec![])]).await?;
        cancel.conn = None;
        let f = route.next().await?;
        match f.kind {
            Kind::Done => Ok(proto::Dec::new(&f.payload).u64().unwrap_or(sent)),
            Kind::Error => Err(remote(&f)),
            k => Err(AgentError::Protocol(format!("unexpected {k:?} during write"))),
        }
    }
}

/// A streamed read's chunks, in order (see `AgentConn::read_stream`).
pub struct ReadStream {
    route: Route,
    conn: AgentConn,
    done: bool,
}

impl ReadStream {
    /// The next chunk, `None` after the last; each chunk taken is credited back to the agent.
    /// An error ends the stream (the first one, before any chunk, is the read's refusal).
    pub async fn next(&mut self) -> Option<Result<Bytes, AgentError>> {
        if self.done {
            return None;
        }
        let f = match self.route.next().await {
            Ok(f) => f,
            Err(e) => {
                self.done = true;
                return Some(Err(e));
            }
        };
        match f.kind {
            Kind::Data => {
                let credit = (f.payload.len() as u32).to_le_bytes().to_vec();
                if let Err(e) = self.conn.send(&[Frame::new(Kind::Credit, self.route.id, credit)]).await {
                    self.done = true;
                    return Some(Err(e));
                }
                Some(Ok(Bytes::from(f.payload)))
            }
            Kind::End => {
                self.done = true;
                None
            }
            Kind::Error => {
                self.done = true;
                Some(Err(remote(&f)))
            }
            k => {
                self.done = true;
                Some(Err(AgentError::Protocol(format!("unexpected {k:?} during read"))))
            }
        }
    }
}

impl Drop for ReadStream {
    fn drop(&mut self) {
        if !self.done {
            drop(CancelOnDrop { conn: Some(self.conn.clone()), id: self.route.id });
        }
    }
}

/// A running streaming exec: its reply frames, and a handle to steer it.
pub struct ExecStream {
    route: Route,
    pub control: StreamControl,
}

/// Sends stdin, resizes, signals and output credit to one streaming exec.
#[derive(Clone)]
pub struct StreamControl {
    conn: AgentConn,
    id: u32,
    /// At most `STDIN_WINDOW` stdin frames unacknowledged: more could block the agent's
    /// request loop behind a command that is waiting for output credit.
    window: Arc<tokio::sync::Semaphore>,
}

impl AgentConn {
    /// Starts a command whose output is flow-controlled: the agent sends at most
    /// `STREAM_WINDOW` bytes ahead of the credit returned with `StreamControl::credit`.
    #[tracing::instrument(name = "agent.exec_stream", skip_all, fields(otel.kind = "client"))]
    pub async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream, AgentError> {
        let route = self.route()?;
        let window = Arc::new(tokio::sync::Semaphore::new(proto::STDIN_WINDOW as usize));
        lock(&self.inner.stdin_windows).insert(route.id, window.clone());
        let payload = proto::ExecFlowSpec { credit: STREAM_WINDOW, spec }.encode();
        self.send(&self.request(Frame::new(Kind::ExecFlow, route.id, payload))?).await?;
        let control = StreamControl { conn: self.clone(), id: route.id, window };
        Ok(ExecStream { route, control })
    }
}

impl ExecStream {
    /// The next frame of the command: `Stdout`, `Stderr`, then `Exit` or `Error` last.
    pub async fn next(&mut self) -> Result<Frame, AgentError> {
        self.route.next().await
    }
}

impl StreamControl {
    pub async fn stdin(&self, data: &[u8]) -> Result<(), AgentError> {
        for chunk in data.chunks(proto::MAX_CHUNK) {
            let permit = self.window.acquire().await.map_err(|_| AgentError::Closed)?;
            // Returned by the agent's StdinAck (see `dispatch`), not on drop.
            permit.forget();
            self.conn.send(&[Frame::new(Kind::Stdin, self.id, chunk.to_vec())]).await?;
        }
        Ok(())
    }

    pub async fn stdin_eof(&self) -> Result<(), AgentError> {
        self.conn.send(&[Frame::new(Kind::StdinEof, self.id, vec![])]).await
    }

    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), AgentError> {
        let payload = proto::Enc::default().u16(rows).u16(cols).finish();
        self.conn.send(&[Frame::new(Kind::Resize, self.id, payload)]).await
    }

    pub async fn signal(&self, signal: u32) -> Result<(), AgentError> {
        self.conn.send(&[Frame::new(Kind::Signal, self.id, signal.to_le_bytes().to_vec())]).await
    }

    /// Lets the agent send `bytes` more output.
    pub async fn credit(&self, bytes: u32) -> Result<(), AgentError> {
        self.conn.send(&[Frame::new(Kind::Credit, self.id, bytes.to_le_bytes().to_vec())]).await
    }
}
