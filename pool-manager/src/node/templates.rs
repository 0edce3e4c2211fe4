//! The templates a node serves (configured, private, made from images) and the snapshots
//! that make private ones.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use config::Template;

use super::Node;
use crate::sandbox::Sandbox;
use crate::sync::lock;

impl Node {
    /// A configured, private or image template by name.
    pub fn template(&self, name: &str) -> Option<Arc<Template>> {
        if wire::images::is_image_template(name) {
            return lock(&self.from_images).1.get(name).cloned();
        }
        self.templates.get(name).cloned().or_else(|| lock(&self.private).get(name).cloned())
    }

    /// Every template this node serves now: configured ones, private ones, then those made
    /// from images.
    pub fn template_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.templates.keys().cloned().collect();
        names.sort();
        for mut more in [
            lock(&self.private).keys().cloned().collect::<Vec<_>>(),
            lock(&self.from_images).1.keys().cloned().collect(),
        ] {
            more.sort();
            names.extend(more);
        }
        names
    }

    /// Reloads the templates made from images when the ledger's version of them moved (one
    /// small read otherwise; every pool tick).
    pub async fn refresh_image_templates(&self) -> Result<(), ledger::LedgerError> {
        let seen = lock(&self.from_images).0;
        if self.ledger.image_templates_version().await? == seen && seen != 0 {
            return Ok(());
        }
        let (version, list) = self.ledger.image_templates().await?;
        self.images.set_owners(list.iter().filter_map(|t| Some((t.image.clone(), t.owner.clone()?))));
        let map: HashMap<String, Arc<Template>> = list
            .into_iter()
            .filter_map(|t| {
                let base = self.templates.get(&t.base)?;
                Some((t.name.clone(), Arc::new(Template::from_image(base, &t))))
            })
            .collect();
        let deleted: Vec<String> = {
            let mut current = lock(&self.from_images);
            let gone = current.1.keys().filter(|n| !map.contains_key(*n)).cloned().collect();
            *current = (version, map);
            gone
        };
        // A deleted template's idle sandboxes go (its sessions run on), and requests waiting
        // for it hear so now rather than at their deadline.
        for name in deleted {
            let retired = self.ledger.shrink(&self.id, &name, 100_000).await?;
            let (_, told) = self.ledger.set_unhealthy(&self.id, &name, "the template was deleted", None, 1_000).await?;
            tracing::info!(template = %name, retired, told, "template made from an image deleted");
        }
        Ok(())
    }

    /// Reloads the private templates of this node from the ledger. A snapshot's base is a
    /// configured template or one made from an image (loaded first: `refresh_image_templates`);
    /// a snapshot whose base is gone is not served.
    pub async fn refresh_private_templates(&self) -> Result<(), ledger::LedgerError> {
        let list = self.ledger.private_templates(&self.id).await?;
        let map: HashMap<String, Arc<Template>> = list
            .into_iter()
            .filter_map(|p| {
                let base = self.template(&p.base)?;
                let t = Template { name: p.name.clone(), image: p.image, warm: 0, ..(*base).clone() };
                Some((p.name, Arc::new(t)))
            })
            .collect();
        *lock(&self.private) = map;
        Ok(())
    }

    /// Snapshots a sandbox's filesystem into a private template of `tenant`, named
    /// `<node>.<id>` (`id`: 16 hex digits, else a random one).
    pub async fn snapshot(
        &self,
        sb: &Sandbox,
        tenant: &str,
        id: Option<&str>,
    ) -> anyhow::Result<ledger::PrivateTemplate> {
        let hex = match id {
            Some(h) if h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()) => h.to_ascii_lowercase(),
            _ => format!("{:016x}", rand::random::<u64>()),
        };
        let written = self.engine.written_bytes(&sb.container).await?;
        // A snapshot of a snapshot derives from the same configured template.
        let base = self.ledger.private_template(&sb.template.name).await?.map(|p| p.base);
        let t = ledger::PrivateTemplate {
            name: wire::ids::make(&self.id, &u64::from_str_radix(&hex, 16)?.to_be_bytes()),
            tenant: tenant.to_string(),
            base: base.unwrap_or_else(|| sb.template.name.clone()),
            image: format!("{}:{hex}", self.engine.snapshot_repo()),
            created_ms: self.ledger.now_ms().await?,
            size_mb: written.div_ceil(1 << 20),
        };
        // The template is recorded before its image exists: the pruner keeps every image a
        // template names, so it can never take an image committed a moment before its
        // template was recorded (the next create of it then failed to start).
        self.ledger.put_private_template(&self.id, &t).await?;
        if let Err(e) = self.engine.commit(&sb.container, &hex, &serde_json::to_string(&t)?).await {
            self.ledger.delete_private_template(&t.name).await?;
            return Err(e);
        }
        self.refresh_private_templates().await?;
        Ok(t)
    }

    /// Removes the snapshot images of private templates deleted on purpose (a positive
    /// record, `ptpl-gone`) that no container uses any more. An image whose template the
    /// ledger has no record of at all (Redis lost it) gets its record back from the image's
    /// label: nothing a tenant owns is deleted because the ledger forgot it.
    pub async fn prune_snapshots(&self) -> anyhow::Result<usize> {
        let live: HashSet<String> =
            self.ledger.private_templates(&self.id).await?.into_iter().map(|p| p.image).collect();
        let mut deleted = self.ledger.deleted_private_templates(&self.id).await?;
        let (mut removed, mut restored) = (0, 0);
        for image in self.engine.snapshot_images().await? {
            if live.contains(&image.reference) {
                continue;
            }
            let record = image.record.as_deref().and_then(|r| serde_json::from_str::<ledger::PrivateTemplate>(r).ok());
            let Some(record) = record else {
                // An image from before records were labelled: kept, as it cannot be told apart.
                continue;
            };
            if deleted.remove(&record.name) {
                if self.engine.remove_image(&image.reference).await? {
                    removed += 1;
                    self.ledger.forget_deleted_private_template(&self.id, &record.name).await?;
                }
            } else {
                tracing::warn!(template = %record.name, tenant = %record.tenant, "restored a private template the ledger had no record of, from its image's label");
                self.ledger.put_private_template(&self.id, &record).await?;
                restored += 1;
            }
        }
        // Deletion records whose image is already gone.
        for name in deleted {
            self.ledger.forget_deleted_private_template(&self.id, &name).await?;
        }
        if restored > 0 {
            self.refresh_private_templates().await?;
        }
        Ok(removed)
    }
}
