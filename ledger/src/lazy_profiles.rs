//! Lazy images' access profiles (issue 32): the chunks of an image's blob that its first
//! session on some node read, so that any node's prefetch of the image fetches them before a
//! sandbox asks. One string per image (its manifest digest), a JSON array of chunk indexes,
//! bounded in length and kept [`LAZY_PROFILE_TTL_S`]: a profile is a hint, and an image nobody
//! starts for a week needs none.

use redis::AsyncCommands;

use crate::{Ledger, Result, from_json, to_json};

/// The most chunk indexes a stored profile holds (longer ones are cut): 1 GiB at 1 MiB chunks.
pub const MAX_LAZY_PROFILE_CHUNKS: usize = 1024;
/// How long a profile is kept after it was last written: a week.
pub const LAZY_PROFILE_TTL_S: u64 = 7 * 24 * 3600;

impl Ledger {
    /// Stores the access profile of the lazy image with manifest digest `digest` (replacing
    /// any earlier one: a later first session's reads are as good, and keep it fresh).
    pub async fn put_lazy_profile(&self, digest: &str, chunks: &[u64]) -> Result<()> {
        let chunks = &chunks[..chunks.len().min(MAX_LAZY_PROFILE_CHUNKS)];
        let json = to_json("lazy profile", &chunks)?;
        let _: () = self.conn().set_ex(self.keys.lazy_profile(digest), json, LAZY_PROFILE_TTL_S).await?;
        Ok(())
    }

    /// The access profile of the lazy image with manifest digest `digest`, if one is stored.
    pub async fn lazy_profile(&self, digest: &str) -> Result<Option<Vec<u64>>> {
        let json: Option<String> = self.conn().get(self.keys.lazy_profile(digest)).await?;
        let Some(json) = json else { return Ok(None) };
        let mut chunks: Vec<u64> = from_json("lazy profile", &json)?;
        chunks.truncate(MAX_LAZY_PROFILE_CHUNKS);
        Ok(Some(chunks))
    }
}
