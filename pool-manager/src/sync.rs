//! The crate's one locking rule, in a room of its own so every file can use it without
//! depending on the node.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering the guard if a thread panicked while holding it. The node's and its
/// pools' mutexes guard maps, a queue and the token bucket, each changed in steps that leave
/// them consistent, so the data is still good after such a panic; skipping it instead would
/// lose a sandbox or misreport the counts.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_poisoned_lock_keeps_its_data() {
        let m = Arc::new(Mutex::new(HashMap::from([("a".to_string(), 1)])));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            g.insert("b".to_string(), 2);
            panic!("poison the lock");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        lock(&m).insert("c".to_string(), 3);
        let mut keys: Vec<String> = lock(&m).keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["a", "b", "c"]);
    }
}
