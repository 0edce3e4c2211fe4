//! Files of docker-exec templates through Docker's archive API (or `cat`/`tee` as the
//! template's user).

use bollard::query_parameters::{DownloadFromContainerOptionsBuilder, UploadToContainerOptionsBuilder};
use bytes::Bytes;
use futures::StreamExt;

use super::*;

impl Dock {
    /// Fetches `path` from the container: a regular file's bytes, or a directory as a tar.
    pub async fn download(&self, container: &str, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
        let opts = DownloadFromContainerOptionsBuilder::new().path(path).build();
        let fetch = async {
            let mut stream = self.docker.download_from_container(container, Some(opts));
            let mut tar_bytes = Vec::new();
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(b) => tar_bytes.extend_from_slice(&b),
                    Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {
                        return Err(FileError::NotFound);
                    }
                    Err(e) => return Err(FileError::Other(e.to_string())),
                }
                if max_bytes > 0 && tar_bytes.len() as u64 > max_bytes + 64 * 1024 {
                    return Err(FileError::TooLarge);
                }
            }
            Ok(tar_bytes)
        };
        let tar_bytes = tokio::time::timeout(FILE_TIMEOUT, fetch)
            .await
            .map_err(|_| FileError::Other(format!("download: docker did not finish within {FILE_TIMEOUT:?}")))??;
        let mut archive = tar::Archive::new(&tar_bytes[..]);
        let mut entries = archive.entries().map_err(|e| FileError::Other(e.to_string()))?;
        let Some(first) = entries.next() else { return Err(FileError::NotFound) };
        let mut first = first.map_err(|e| FileError::Other(e.to_string()))?;
        if first.header().entry_type().is_dir() {
            return Ok(tar_bytes);
        }
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut first, &mut data).map_err(|e| FileError::Other(e.to_string()))?;
        Ok(data)
    }

    /// Writes `data` to `path` in the container, creating parent directories.
    /// Reads a file (a directory as a tar of its contents) as `user`, through `docker exec`: the
    /// archive API (`download`) reads as the daemon, past the user's permissions.
    pub async fn read_as(&self, container: &str, user: &str, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
        const SCRIPT: &str = r#"if [ -d "$1" ]; then cd -- "$1" && exec tar -cf - .; else exec cat -- "$1"; fi"#;
        let out = self.file_exec(container, user, SCRIPT, path, None, max_bytes as usize + 1).await?;
        if out.stdout_truncated {
            return Err(FileError::TooLarge);
        }
        Ok(out.stdout)
    }

    /// Writes a file as `user`, creating its parents, through `docker exec` (see `read_as`).
    pub async fn write_as(&self, container: &str, user: &str, path: &str, data: Bytes) -> Result<(), FileError> {
        const SCRIPT: &str = r#"mkdir -p -- "$(dirname -- "$1")" && exec cat > "$1""#;
        self.file_exec(container, user, SCRIPT, path, Some(data), 64 * 1024).await.map(drop)
    }

    async fn file_exec(
        &self,
        container: &str,
        user: &str,
        script: &str,
        path: &str,
        stdin: Option<Bytes>,
        max_output: usize,
    ) -> Result<DockerExecOutcome, FileError> {
        let argv = ["/bin/sh", "-c", script, "sh", path].map(String::from).to_vec();
        let req = DockerExec {
            argv,
            user: Some(user.into()),
            env: vec![],
            cwd: None,
            stdin,
            timeout: FILE_TIMEOUT,
            max_output,
        };
        let out = self.exec(container, req).await.map_err(|e| FileError::Other(format!("{e:#}")))?;
        if out.exit_code == 0 {
            return Ok(out);
        }
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        Err(if err.contains("No such file") {
            FileError::NotFound
        } else if err.contains("Is a directory") {
            FileError::IsDirectory(err)
        } else {
            FileError::Refused(err)
        })
    }

    /// Writes `data` to `path` in the container as root (mode 0644), making its parent directories.
    pub async fn upload(&self, container: &str, path: &str, data: Bytes) -> Result<(), FileError> {
        let rel = path.trim_start_matches('/');
        let mut builder = tar::Builder::new(Vec::new());
        // Parent directories first: the archive API does not create them.
        let mut parent = String::new();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            parent.push_str(part);
            parent.push('/');
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            builder.append_data(&mut h, &parent, std::io::empty()).map_err(|e| FileError::Other(e.to_string()))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_mtime(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        );
        builder.append_data(&mut h, rel, &data[..]).map_err(|e| FileError::Other(e.to_string()))?;
        let tar_bytes = builder.into_inner().map_err(|e| FileError::Other(e.to_string()))?;
        let opts = UploadToContainerOptionsBuilder::new().path("/").build();
        tokio::time::timeout(
            DOCKER_TIMEOUT,
            self.docker.upload_to_container(container, Some(opts), bollard::body_full(tar_bytes.into())),
        )
        .await
        .map_err(|_| FileError::Other("upload timed out".into()))?
        .map_err(|e| match e {
            bollard::errors::Error::DockerResponseServerError { status_code: 400, message } => {
                FileError::IsDirectory(message)
            }
            e => FileError::Other(e.to_string()),
        })
    }
}
