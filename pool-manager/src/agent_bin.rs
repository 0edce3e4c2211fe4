//! TEMPORARY placeholder (lead): replaced by the real embedded agent binary.
use std::path::{Path, PathBuf};
pub fn install(dir: &Path) -> std::io::Result<PathBuf> {
    Ok(dir.join("sandpool-agent"))
}
