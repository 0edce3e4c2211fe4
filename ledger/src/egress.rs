//! Egress policies defined through the admin API (those of the config live in the config):
//! one hash under the registry's tag, read by every node once a second.

use std::collections::BTreeMap;

use redis::AsyncCommands;
use serde::{Deserialize, Serialize};

use crate::{Ledger, Result, from_json, to_json};

#[derive(Serialize, Deserialize)]
struct Stored {
    allow: Vec<String>,
}

impl Ledger {
    /// Every API-defined policy: name → its rules as written.
    pub async fn egress_policies(&self) -> Result<BTreeMap<String, Vec<String>>> {
        let all: BTreeMap<String, String> = self.conn().hgetall(self.keys.egress()).await?;
        all.into_iter().map(|(name, j)| Ok((name, from_json::<Stored>("egress policy", &j)?.allow))).collect()
    }

    /// Defines (or redefines) an API policy.
    pub async fn set_egress_policy(&self, name: &str, allow: &[String]) -> Result<()> {
        let json = to_json("egress policy", &Stored { allow: allow.to_vec() })?;
        let _: () = self.conn().hset(self.keys.egress(), name, json).await?;
        Ok(())
    }

    /// Removes an API policy; false if there was none of that name.
    pub async fn delete_egress_policy(&self, name: &str) -> Result<bool> {
        let removed: u64 = self.conn().hdel(self.keys.egress(), name).await?;
        Ok(removed > 0)
    }
}
