//! A docker-exec template's sandbox: its calls are the runtime's own exec and file calls,
//! as the template's user.

use std::sync::Arc;

use axum::body::Body;
use config::User;
use futures::future::BoxFuture;
use http_util::ApiError;
use wire::ErrorCode;

use super::{Backend, Exec, Ran, not_a_dir};
use crate::runtime::{DockerExec, FileError, Runtime};

pub(crate) struct EngineBackend {
    /// The sandbox's id, for errors.
    pub id: String,
    pub container: String,
    pub user: User,
    pub engine: Arc<dyn Runtime>,
}

impl EngineBackend {
    /// A file: by the archive API for a root template, else as its user.
    async fn read_bytes(&self, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
        match self.user {
            User::Root => self.engine.download(&self.container, path, max_bytes).await,
            user => self.engine.read_as(&self.container, &user.spec(), path, max_bytes).await,
        }
    }
}

impl Backend for EngineBackend {
    fn exec(&self, call: Exec) -> BoxFuture<'_, Result<Ran, ApiError>> {
        Box::pin(async move {
            let req = DockerExec {
                argv: call.argv,
                user: match self.user {
                    User::Root => None,
                    user => Some(user.spec()),
                },
                env: call.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                cwd: (!call.cwd.is_empty()).then_some(call.cwd),
                stdin: call.stdin,
                timeout: call.timeout,
                max_output: call.max_output as usize,
            };
            let out =
                self.engine.exec(&self.container, req).await.map_err(|e| {
                    ApiError::bad_gateway(format!("sandbox {}: exec failed", self.id), format!("{e:#}"))
                })?;
            Ok(Ran {
                exit_code: out.exit_code,
                stdout: out.stdout,
                stderr: out.stderr,
                duration_ms: None,
                timed_out: out.timed_out,
                stdout_truncated: out.stdout_truncated,
                stderr_truncated: out.stderr_truncated,
            })
        })
    }

    /// Collected before the answer, so bounded by `collect_limit` (the body limit) too.
    fn read(&self, _: u64, path: String, max_bytes: u64, collect_limit: u64) -> BoxFuture<'_, Result<Body, ApiError>> {
        Box::pin(async move {
            let data = self
                .read_bytes(&path, max_bytes.min(collect_limit))
                .await
                .map_err(|e| crate::errors::file(&path, e))?;
            Ok(Body::from(data))
        })
    }

    /// From the directory's tar.
    fn list<'a>(
        &'a self,
        _: u64,
        path: &'a str,
        max_bytes: u64,
    ) -> BoxFuture<'a, Result<agent_proto::Listing, ApiError>> {
        Box::pin(async move {
            let tar = self.read_bytes(path, max_bytes).await.map_err(|e| crate::errors::file(path, e))?;
            // Docker's archive puts the directory's own name first; `tar -C dir .` does not.
            let prefixed = self.user == User::Root;
            crate::listing::from_tar(&tar, prefixed).map_err(|e| not_a_dir(path, e))
        })
    }

    fn write(&self, _: u64, path: String, body: Body, max_bytes: u64) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let body = axum::body::to_bytes(body, max_bytes as usize).await.map_err(|_| {
                ApiError::new(ErrorCode::PayloadTooLarge, format!("the body is over {max_bytes} bytes"))
            })?;
            match self.user {
                User::Root => self.engine.upload(&self.container, &path, body).await,
                user => self.engine.write_as(&self.container, &user.spec(), &path, body).await,
            }
            .map_err(|e| crate::errors::file(&path, e))
        })
    }
}
