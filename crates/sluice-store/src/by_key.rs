//! A value ordered by a key alone, for priority queues (`BinaryHeap`) of things that are not
//! themselves ordered.

/// `value` with the ordering of `key`.
pub(crate) struct ByKey<K, V> {
    pub key: K,
    pub value: V,
}

impl<K: Ord, V> PartialEq for ByKey<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl<K: Ord, V> Eq for ByKey<K, V> {}

impl<K: Ord, V> PartialOrd for ByKey<K, V> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<K: Ord, V> Ord for ByKey<K, V> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}
