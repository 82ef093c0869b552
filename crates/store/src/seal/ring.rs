//! The key ring every sealed or authenticated thing at rest is kept with:
//! stored answers in the database ([`super::Sealer`]) and records in Redis
//! ([`crate::fastpath::EntryKeys`]). One key writes; every key of the ring
//! opens, so keys rotate by putting a new key first and keeping the old
//! ones until what they wrote has expired (`docs/design.md` §5, §17).

/// Keys by id: the current one first, then the previous ones, each id once.
#[derive(Clone)]
pub struct KeyRing<I, K> {
    keys: Vec<(I, K)>,
}

impl<I: PartialEq, K> KeyRing<I, K> {
    /// A ring whose `current` key writes and every key reads; a previous
    /// key with the current one's id (or an earlier one's) is left out.
    pub fn new(current: (I, K), previous: impl IntoIterator<Item = (I, K)>) -> Self {
        let mut keys = vec![current];
        for (id, key) in previous {
            if keys.iter().all(|(known, _)| *known != id) {
                keys.push((id, key));
            }
        }
        KeyRing { keys }
    }

    /// The key that writes, and its id.
    pub fn current(&self) -> (&I, &K) {
        let (id, key) = &self.keys[0];
        (id, key)
    }

    /// The key with `id`, if the ring has it.
    pub fn find<Q>(&self, id: &Q) -> Option<&K>
    where
        I: PartialEq<Q>,
        Q: ?Sized,
    {
        self.keys
            .iter()
            .find(|(known, _)| known == id)
            .map(|(_, k)| k)
    }

    /// The ids, the current one first (never the keys: what logs may show).
    pub fn ids(&self) -> impl Iterator<Item = &I> {
        self.keys.iter().map(|(id, _)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_key_writes_and_every_key_is_found_once() {
        let ring = KeyRing::new(("b", 2), [("a", 1), ("b", 9), ("a", 8)]);
        assert_eq!(ring.current(), (&"b", &2));
        assert_eq!(ring.find(&"a"), Some(&1));
        assert_eq!(
            ring.find(&"b"),
            Some(&2),
            "the current key, not a later twin"
        );
        assert_eq!(ring.find(&"c"), None);
        assert_eq!(ring.ids().copied().collect::<Vec<_>>(), ["b", "a"]);
    }
}
