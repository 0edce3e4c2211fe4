//! Docker as the node's `Runtime`: each call is the `Dock` method of the same name (the
//! inherent methods stay, for the node's start-up work that only Docker has: networks, the
//! disk bound probe).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use bytes::Bytes;
use config::Template;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::{Dock, DockerExec, DockerExecOutcome};
use crate::agent_bin::AgentFiles;
use crate::channel::Link;
use crate::runtime::{Call, ContainerEvent, CpuUse, FileCall, RegistryError, Runtime, SandboxContainer, SnapshotImage};

impl Runtime for Dock {
    fn create<'a>(
        &'a self,
        sandbox: &'a str,
        template: &'a Template,
        agent: Option<&'a AgentFiles>,
    ) -> Call<'a, String> {
        Box::pin(Dock::create(self, sandbox, template, agent))
    }

    fn start<'a>(&'a self, container: &'a str) -> Call<'a, ()> {
        Box::pin(Dock::start(self, container))
    }

    fn attach<'a>(&'a self, container: &'a str) -> Call<'a, Link> {
        Box::pin(Dock::attach(self, container))
    }

    fn direct_channel(&self, template: &Template) -> bool {
        super::direct_channel(template)
    }

    fn remove<'a>(&'a self, container: &'a str) -> Call<'a, ()> {
        Box::pin(Dock::remove(self, container))
    }

    fn list(&self) -> Call<'_, Vec<SandboxContainer>> {
        Box::pin(Dock::list(self))
    }

    fn events(&self) -> BoxStream<'static, anyhow::Result<ContainerEvent>> {
        Box::pin(Dock::container_events(self))
    }

    fn set_paused<'a>(&'a self, container: &'a str, pause: bool) -> Call<'a, ()> {
        Box::pin(Dock::set_paused(self, container, pause))
    }

    fn cpu_use<'a>(&'a self, container: &'a str) -> Call<'a, CpuUse> {
        Box::pin(Dock::cpu_use(self, container))
    }

    fn container_ip<'a>(&'a self, container: &'a str, network: &'a str) -> Call<'a, Ipv4Addr> {
        Box::pin(Dock::container_ip(self, container, network))
    }

    fn exec<'a>(&'a self, container: &'a str, req: DockerExec) -> Call<'a, DockerExecOutcome> {
        Box::pin(Dock::exec(self, container, req))
    }

    fn download<'a>(&'a self, container: &'a str, path: &'a str, max_bytes: u64) -> FileCall<'a, Vec<u8>> {
        Box::pin(Dock::download(self, container, path, max_bytes))
    }

    fn read_as<'a>(
        &'a self,
        container: &'a str,
        user: &'a str,
        path: &'a str,
        max_bytes: u64,
    ) -> FileCall<'a, Vec<u8>> {
        Box::pin(Dock::read_as(self, container, user, path, max_bytes))
    }

    fn upload<'a>(&'a self, container: &'a str, path: &'a str, data: Bytes) -> FileCall<'a, ()> {
        Box::pin(Dock::upload(self, container, path, data))
    }

    fn write_as<'a>(&'a self, container: &'a str, user: &'a str, path: &'a str, data: Bytes) -> FileCall<'a, ()> {
        Box::pin(Dock::write_as(self, container, user, path, data))
    }

    fn snapshot_repo(&self) -> String {
        Dock::snapshot_repo(self)
    }

    fn written_bytes<'a>(&'a self, container: &'a str) -> Call<'a, u64> {
        Box::pin(Dock::written_bytes(self, container))
    }

    fn commit<'a>(&'a self, container: &'a str, tag: &'a str, record: &'a str) -> Call<'a, String> {
        Box::pin(Dock::commit(self, container, tag, record))
    }

    fn snapshot_images(&self) -> Call<'_, Vec<SnapshotImage>> {
        Box::pin(Dock::snapshot_images(self))
    }

    fn remove_image<'a>(&'a self, image: &'a str) -> Call<'a, bool> {
        Box::pin(Dock::remove_image(self, image))
    }

    fn image_exists<'a>(&'a self, image: &'a str) -> Call<'a, bool> {
        Box::pin(Dock::image_exists(self, image))
    }

    fn use_lazy_stub<'a>(&'a self, image: &'a str, stub: crate::lazy::Stub) -> Call<'a, ()> {
        Box::pin(Dock::use_lazy_stub(self, image, stub))
    }

    fn resolve<'a>(
        &'a self,
        reference: &'a str,
        auth: Option<&'a config::RegistryAuth>,
    ) -> BoxFuture<'a, Result<String, RegistryError>> {
        Box::pin(Dock::resolve(self, reference, auth))
    }

    fn pull<'a>(
        &'a self,
        reference: &'a str,
        auth: Option<&'a config::RegistryAuth>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(Dock::pull(self, reference, auth, timeout))
    }

    fn digest_image_sizes(&self) -> Call<'_, HashMap<String, u64>> {
        Box::pin(Dock::digest_image_sizes(self))
    }
}
