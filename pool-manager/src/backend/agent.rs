//! A sandbox's calls over its agent's channel.

use agent_proto::{ExecSpec, ReadSpec, WriteSpec, codes};
use axum::body::Body;
use futures::future::BoxFuture;
use http_util::ApiError;

use super::{Backend, Exec, FILE_TIMEOUT, Ran, not_a_dir};
use crate::channel::{AgentConn, AgentError};

/// Extra time past a command's own timeout before the call itself gives up (agent wedged).
const EXEC_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) struct AgentBackend {
    /// The sandbox's id, for errors.
    pub id: String,
    pub conn: AgentConn,
}

impl AgentBackend {
    fn error(&self, e: AgentError) -> ApiError {
        crate::errors::agent(&self.id, e)
    }
}

impl Backend for AgentBackend {
    fn exec(&self, call: Exec) -> BoxFuture<'_, Result<Ran, ApiError>> {
        Box::pin(async move {
            let started = std::time::Instant::now();
            let spec = ExecSpec {
                fence: call.fence,
                has_stdin: call.stdin.is_some(),
                argv: call.argv,
                env: call.env,
                cwd: call.cwd,
                timeout_ms: call.timeout.as_millis() as u64,
                max_output: call.max_output,
                pty_rows: 0,
                pty_cols: 0,
            };
            match self.conn.exec(spec, call.stdin, call.timeout + EXEC_GRACE).await {
                Ok(out) => Ok(Ran {
                    exit_code: out.exit.exit_code,
                    stdout: out.stdout,
                    stderr: out.stderr,
                    duration_ms: Some(out.exit.duration_us as f64 / 1000.0),
                    timed_out: out.exit.timed_out,
                    stdout_truncated: out.exit.stdout_truncated,
                    stderr_truncated: out.exit.stderr_truncated,
                }),
                Err(AgentError::Remote(info))
                    if info.code == codes::NOT_FOUND || info.code == codes::PERMISSION_DENIED =>
                {
                    // Like a shell: a command that cannot be found or run is an exit status.
                    let code = if info.code == codes::NOT_FOUND { 127 } else { 126 };
                    Ok(Ran {
                        exit_code: code,
                        stderr: format!("{}\n", info.message).into_bytes(),
                        duration_ms: Some(started.elapsed().as_secs_f64() * 1000.0),
                        ..Default::default()
                    })
                }
                Err(e) => Err(self.error(e)),
            }
        })
    }

    /// Streamed: the agent sends as fast as the client takes it (a read with credit), never
    /// more than `max_bytes` (a directory is sized before its first byte: over the limit is
    /// 413 with nothing sent).
    fn read(&self, fence: u64, path: String, max_bytes: u64, _: u64) -> BoxFuture<'_, Result<Body, ApiError>> {
        Box::pin(async move {
            use futures::StreamExt as _;
            let mut stream = self
                .conn
                .read_stream(ReadSpec { fence, path, max_bytes, ..Default::default() })
                .await
                .map_err(|e| self.error(e))?;
            // The first chunk (or the refusal) before the status goes out.
            let first = match tokio::time::timeout(FILE_TIMEOUT, stream.next()).await {
                Err(_) => return Err(self.error(AgentError::Timeout)),
                Ok(Some(Err(e))) => return Err(self.error(e)),
                Ok(first) => first,
            };
            let rest = futures::stream::unfold(stream, |mut stream| async move {
                let next = match tokio::time::timeout(FILE_TIMEOUT, stream.next()).await {
                    Ok(next) => next?,
                    Err(_) => Err(AgentError::Timeout),
                };
                // An error now can only break the answer off: the client sees it cut short.
                Some((next.map_err(std::io::Error::other), stream))
            });
            let first = futures::stream::iter(first.map(|r| r.map_err(std::io::Error::other)));
            Ok(Body::from_stream(first.chain(rest)))
        })
    }

    /// The agent's listing (version 4), or an older agent's tar of the directory.
    fn list<'a>(
        &'a self,
        fence: u64,
        path: &'a str,
        max_bytes: u64,
    ) -> BoxFuture<'a, Result<agent_proto::Listing, ApiError>> {
        Box::pin(async move {
            let list = self.conn.version() >= 4;
            let spec = ReadSpec { fence, path: path.to_string(), max_bytes, list, credit: 0 };
            let bytes = self.conn.read_file(spec, FILE_TIMEOUT).await.map_err(|e| self.error(e))?;
            if list {
                agent_proto::Listing::decode(&bytes)
                    .map_err(|e| ApiError::bad_gateway(format!("sandbox {} answered badly", self.id), e.to_string()))
            } else {
                crate::listing::from_tar(&bytes, false).map_err(|e| not_a_dir(path, e))
            }
        })
    }

    /// Written as the body arrives: never held whole here.
    fn write(&self, fence: u64, path: String, body: Body, max_bytes: u64) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let spec = WriteSpec { fence, path, mode: 0o644 };
            let write = self.conn.write_stream(spec, body.into_data_stream(), max_bytes);
            tokio::time::timeout(FILE_TIMEOUT, write)
                .await
                .unwrap_or(Err(AgentError::Timeout))
                .map(|_| ())
                .map_err(|e| self.error(e))
        })
    }
}
