//! Images on Docker: the registry (resolve, pull, sizes) and snapshots (commit, list,
//! remove).

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use telemetry::names;

use super::*;

impl Dock {
    /// Loads `stub` (unless Docker has it) and creates containers of lazy `image` from it.
    pub async fn use_lazy_stub(&self, image: &str, stub: crate::lazy::Stub) -> anyhow::Result<()> {
        if !self.image_exists(&stub.tag).await? {
            use bollard::query_parameters::ImportImageOptionsBuilder;
            let load = self.docker.import_image(
                ImportImageOptionsBuilder::new().quiet(true).build(),
                bollard::body_full(stub.tar),
                None,
            );
            let outcomes: Vec<_> = timed("load image", futures::TryStreamExt::try_collect(load)).await?;
            if let Some(e) = outcomes.into_iter().find_map(|o| o.error_detail.and_then(|d| d.message)) {
                anyhow::bail!("load the stub image {}: {e}", stub.tag);
            }
        }
        self.lazy.insert(image, &stub.tag);
        Ok(())
    }

    /// Whether the engine holds `image` locally (a 404 is `false`, not an error).
    pub async fn image_exists(&self, image: &str) -> anyhow::Result<bool> {
        Ok(timed_or("inspect image", &format!("inspect image {image}"), self.docker.inspect_image(image), &[404])
            .await?
            .is_ok())
    }

    /// The repository of this deployment's snapshot images (`commit` tags them in it).
    pub fn snapshot_repo(&self) -> String {
        format!("sandpool-snap/{}", self.prefix)
    }

    /// Commits a container's filesystem to a new image `repo:tag` labelled as this
    /// deployment's snapshot. Returns the image reference.
    pub async fn commit(&self, container: &str, tag: &str, record: &str) -> anyhow::Result<String> {
        use bollard::query_parameters::CommitContainerOptionsBuilder;
        let repo = self.snapshot_repo();
        let opts = CommitContainerOptionsBuilder::new().container(container).repo(&repo).tag(tag).pause(true).build();
        let labels = HashMap::from([
            (LABEL_SNAPSHOT.to_string(), "true".to_string()),
            (LABEL_TEMPLATE_RECORD.to_string(), record.to_string()),
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
        ]);
        let config = bollard::models::ContainerConfig { labels: Some(labels), ..Default::default() };
        timed("commit container", self.docker.commit_container(opts, config)).await?;
        Ok(format!("{repo}:{tag}"))
    }

    /// The bytes a container has written (its writable layer: what a commit of it adds).
    pub async fn written_bytes(&self, container: &str) -> anyhow::Result<u64> {
        let opts = bollard::query_parameters::InspectContainerOptions { size: true };
        let c = timed("inspect container", self.docker.inspect_container(container, Some(opts))).await?;
        Ok(c.size_rw.unwrap_or(0).max(0) as u64)
    }

    /// Removes an image. `Ok(false)` while containers still use it.
    pub async fn remove_image(&self, image: &str) -> anyhow::Result<bool> {
        use bollard::query_parameters::RemoveImageOptionsBuilder;
        let opts = RemoveImageOptionsBuilder::new().force(false).build();
        // 404: already gone (removed); 409: still used by a container (not yet).
        let what = format!("remove image {image}");
        let r = timed_or("remove image", &what, self.docker.remove_image(image, Some(opts), None), &[404, 409]).await?;
        Ok(!matches!(r, Err(409)))
    }

    /// This deployment's snapshot images on this node.
    pub async fn snapshot_images(&self) -> anyhow::Result<Vec<SnapshotImage>> {
        use bollard::query_parameters::ListImagesOptionsBuilder;
        let opts = ListImagesOptionsBuilder::new().filters(&self.own(LABEL_SNAPSHOT)).build();
        let list = timed("list images", self.docker.list_images(Some(opts))).await?;
        Ok(list
            .into_iter()
            .flat_map(|i| {
                let record = i.labels.get(LABEL_TEMPLATE_RECORD).cloned();
                i.repo_tags.into_iter().map(move |reference| SnapshotImage { reference, record: record.clone() })
            })
            .collect())
    }

    // ---------- images of the corpus ----------

    /// `reference` pinned to the digest its registry has for it now (`repository@sha256:...`),
    /// asked of the registry through Docker (its credentials, its TLS and mirror settings).
    pub async fn resolve(&self, reference: &str, auth: Option<&config::RegistryAuth>) -> Result<String, RegistryError> {
        let call = self.docker.inspect_registry_image(reference, credentials(auth));
        match tokio::time::timeout(DOCKER_TIMEOUT, call).await {
            Ok(Ok(d)) => {
                let digest =
                    d.descriptor.digest.ok_or_else(|| RegistryError::Failed("the registry named no digest".into()))?;
                Ok(format!("{}@{digest}", wire::images::repository_of(reference)))
            }
            Ok(Err(bollard::errors::Error::DockerResponseServerError { status_code: 404 | 401 | 403, message })) => {
                Err(RegistryError::NotFound(message))
            }
            // A registry that wants credentials this caller's scope does not hold: to it, the
            // image is not there (Docker answers 500 with the registry's words).
            Ok(Err(bollard::errors::Error::DockerResponseServerError { message, .. }))
                if refused_credentials(&message) =>
            {
                Err(RegistryError::NotFound(message))
            }
            Ok(Err(bollard::errors::Error::DockerResponseServerError { message, .. })) => {
                Err(RegistryError::Failed(message))
            }
            Ok(Err(e)) => Err(RegistryError::Failed(e.to_string())),
            Err(_) => Err(RegistryError::Failed(format!("docker did not answer within {DOCKER_TIMEOUT:?}"))),
        }
    }

    /// Pulls `reference` (a `repository@sha256:...`), within `timeout`. The error is the
    /// registry's (or Docker's) own words.
    pub async fn pull(
        &self,
        reference: &str,
        auth: Option<&config::RegistryAuth>,
        timeout: Duration,
    ) -> Result<(), String> {
        use bollard::query_parameters::CreateImageOptionsBuilder;
        let opts = CreateImageOptionsBuilder::new().from_image(reference).build();
        let started = std::time::Instant::now();
        let mut stream = self.docker.create_image(Some(opts), None, credentials(auth));
        let drain = async {
            while let Some(item) = stream.next().await {
                match item {
                    Ok(info) => {
                        if let Some(e) = info.error_detail.and_then(|d| d.message) {
                            return Err(e);
                        }
                    }
                    Err(bollard::errors::Error::DockerResponseServerError { message, .. }) => return Err(message),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        };
        let r = match tokio::time::timeout(timeout, drain).await {
            Ok(r) => r,
            Err(_) => Err(format!("the pull did not finish within {timeout:?}")),
        };
        metrics::histogram!(names::DOCKER_DURATION, "op" => "pull image").record(started.elapsed().as_secs_f64());
        if r.is_err() {
            metrics::counter!(names::DOCKER_ERRORS, "op" => "pull image").increment(1);
        }
        r
    }

    /// The size of each image named by a `repository@digest` reference (Docker's `Size`: its
    /// layers, shared ones included).
    pub async fn digest_image_sizes(&self) -> anyhow::Result<HashMap<String, u64>> {
        use bollard::query_parameters::ListImagesOptionsBuilder;
        let list = timed("list images", self.docker.list_images(Some(ListImagesOptionsBuilder::new().build()))).await?;
        Ok(list
            .into_iter()
            .flat_map(|i| {
                let size = i.size.max(0) as u64;
                i.repo_digests.into_iter().map(move |d| (d, size))
            })
            .collect())
    }
}

fn credentials(auth: Option<&config::RegistryAuth>) -> Option<bollard::auth::DockerCredentials> {
    auth.map(|a| bollard::auth::DockerCredentials {
        username: Some(a.username.clone()),
        password: Some(a.password.clone()),
        ..Default::default()
    })
}

/// Whether Docker's error says the registry refused the credentials given (or their absence).
fn refused_credentials(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    ["no basic auth credentials", "unauthorized", "authentication required", "denied: requested access"]
        .iter()
        .any(|s| m.contains(s))
}
