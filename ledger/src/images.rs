//! Templates made from images (one hash every node and gateway reads, with a version that moves
//! on every change so nodes reload only then), and the images each node holds (placement
//! prefers a node that holds a template's image; eviction only ever removes these).
//!
//! The template changes are `MULTI` pipelines, not scripts: each is two commands on two keys
//! of one slot (`{global}`) that decide nothing from what they read (a write and an
//! unconditional version bump; a read of both), so a transaction already makes them atomic,
//! and a script would add a Lua file and a round of `EVALSHA` loading for nothing. A change
//! that must read before it writes is a script (`script.rs`).

use std::collections::HashMap;

use redis::AsyncCommands;
use wire::images::ImageTemplate;

use crate::{Ledger, Result, from_json, to_json};

impl Ledger {
    /// Records a template made from an image. `false`: one of that name exists (kept as is).
    pub async fn put_image_template(&self, t: &ImageTemplate) -> Result<bool> {
        let (k, v) = (self.keys.image_templates(), self.keys.image_templates_version());
        let json = to_json("image template", t)?;
        // Both keys share the `{global}` tag: one transaction.
        let (added, _): (bool, i64) =
            redis::pipe().atomic().hset_nx(&k, &t.name, json).incr(&v, 1).query_async(&mut self.conn()).await?;
        Ok(added)
    }

    /// The template made from an image named `name` (`<namespace>/<name>`), if there is one.
    pub async fn image_template(&self, name: &str) -> Result<Option<ImageTemplate>> {
        let v: Option<String> = self.conn().hget(self.keys.image_templates(), name).await?;
        v.map(|j| from_json("image template", &j)).transpose()
    }

    /// Every template made from an image, with the version they were read at.
    pub async fn image_templates(&self) -> Result<(u64, Vec<ImageTemplate>)> {
        let (k, v) = (self.keys.image_templates(), self.keys.image_templates_version());
        let (all, version): (HashMap<String, String>, Option<u64>) =
            redis::pipe().atomic().hgetall(&k).get(&v).query_async(&mut self.conn()).await?;
        let list = all.values().map(|j| from_json("image template", j)).collect::<Result<_>>()?;
        Ok((version.unwrap_or(0), list))
    }

    /// The version of the templates made from images (moves on every change).
    pub async fn image_templates_version(&self) -> Result<u64> {
        let v: Option<u64> = self.conn().get(self.keys.image_templates_version()).await?;
        Ok(v.unwrap_or(0))
    }

    /// Forgets a template made from an image; the record it had, if any.
    pub async fn delete_image_template(&self, name: &str) -> Result<Option<ImageTemplate>> {
        let (k, v) = (self.keys.image_templates(), self.keys.image_templates_version());
        let Some(t) = self.image_template(name).await? else { return Ok(None) };
        let (n, _): (i64, i64) =
            redis::pipe().atomic().hdel(&k, name).incr(&v, 1).query_async(&mut self.conn()).await?;
        Ok((n > 0).then_some(t))
    }

    /// The node holds `image` now.
    pub async fn node_holds(&self, node: &str, image: &str) -> Result<()> {
        let _: i64 = self.conn().sadd(self.keys.node(node).imgs(), image).await?;
        Ok(())
    }

    /// The node no longer holds `image`.
    pub async fn node_dropped(&self, node: &str, image: &str) -> Result<()> {
        let _: i64 = self.conn().srem(self.keys.node(node).imgs(), image).await?;
        Ok(())
    }

    /// The images a node holds (`repository@digest`).
    pub async fn node_images(&self, node: &str) -> Result<Vec<String>> {
        let mut v: Vec<String> = self.conn().smembers(self.keys.node(node).imgs()).await?;
        v.sort();
        Ok(v)
    }

    /// For each of `nodes`, whether it holds `image` (one round trip).
    pub async fn holding(&self, nodes: &[String], image: &str) -> Result<Vec<bool>> {
        let mut pipe = redis::pipe();
        for n in nodes {
            pipe.sismember(self.keys.node(n).imgs(), image);
        }
        Ok(pipe.query_async(&mut self.conn()).await?)
    }
}
