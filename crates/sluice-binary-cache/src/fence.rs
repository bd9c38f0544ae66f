//! Pushes and collections of one cache kept apart, so that a cache is consistent at every
//! moment while `sluice copy` pushes into it and `sluice store gc` collects it (sluice's own:
//! Nix has no collection of a binary cache). The danger: a push skips a path P the cache holds,
//! a collection that found P unreferenced deletes it, and the push then publishes a narinfo
//! referring to P. Two kinds of small files in the cache say who is at work, and each side
//! writes its own before it reads the other's (the two orders cannot both miss the other):
//!
//! - a push writes `sluice/push/<id>` (the hash parts of the closure it pushes) after finding
//!   what the cache holds and before it uploads anything, and deletes it once its last
//!   narinfo was answered ([`BinaryCache::begin_push`], [`BinaryCache::end_push`]);
//! - a collection writes `sluice/gc/<id>.running` before it reads the push files, and deletes
//!   nothing that the closures they name hold (nor, while one exists, any NAR file); it
//!   writes it again at least every [`GC_TTL`]/4 while it deletes, and at its end writes
//!   `sluice/gc/<id>.done` before deleting its `.running` ([`Collection`]).
//!
//! A push lists `sluice/gc/` before it looks at what the cache holds and again after writing
//! its file. A collection whose `.running` it then sees (younger than [`GC_TTL`]) may have
//! missed its file: it waits for that collection to end, then looks again. If the listing changed in between, a
//! collection began or ended meanwhile and may have deleted what the push found: the push
//! looks again. A collection that wrote its `.running` after the push's file was written sees
//! that file, and keeps the push's closure. So a narinfo the push publishes refers only to
//! paths that no collection deletes while the push's file exists, and once it is gone, the
//! narinfo itself names them to every later collection.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use sluice_nix::store_path::StorePath;

use crate::objects::Object;
use crate::{BinaryCache, CacheError};

/// Where pushes in progress write their files.
pub const PUSHES: &str = "sluice/push/";
/// Where collections write theirs.
pub const COLLECTIONS: &str = "sluice/gc/";
/// A collection's `.running` file not written for this long is a collection that was killed.
pub const GC_TTL: Duration = Duration::from_secs(600);
/// A push's file older than this is a push that was killed (and is deleted by a collection).
pub const PUSH_TTL: Duration = Duration::from_secs(86_400);
/// How often a push waiting for a collection lists `sluice/gc/` again.
const WAIT_POLL: Duration = Duration::from_millis(200);

/// A name no other writer picks: the time in nanoseconds and the process id.
fn unique_id() -> String {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{nanos:x}-{}", std::process::id())
}

/// Whether `object` is written less than `ttl` ago (by the cache's clock, as far as this host's
/// agrees with it).
fn is_fresh(object: &Object, ttl: Duration) -> bool {
    object.modified.elapsed().map_or(true, |age| age < ttl)
}

/// What `sluice/gc/` holds: each file's name and when it was written.
type GcState = BTreeSet<(String, SystemTime)>;

/// Whether a collection is at work: a `.running` file younger than [`GC_TTL`].
fn is_collected(state: &GcState) -> bool {
    state.iter().any(|(name, modified)| name.ends_with(".running") && modified.elapsed().map_or(true, |age| age < GC_TTL))
}

impl BinaryCache {
    async fn gc_state(&self) -> Result<GcState, CacheError> {
        Ok(self.list_under(COLLECTIONS).await?.into_iter().map(|o| (o.name, o.modified)).collect())
    }

    /// Those of `paths` the cache holds whole ([`BinaryCache::query_complete_paths`]), found
    /// under the fence of the module documentation, and the name of the push's file to hand
    /// to [`BinaryCache::end_push`] once the last narinfo was answered (`None` for a cache that
    /// cannot be listed, which `sluice store gc` does not collect, and for a bucket whose
    /// listing these credentials may not read, e.g. push keys without `s3:ListBucket`: such a
    /// push goes ahead unfenced, with a warning, as a push of Nix's does).
    pub async fn begin_push(&self, paths: &[StorePath]) -> Result<(BTreeSet<StorePath>, Option<String>), CacheError> {
        if !self.can_list() {
            return Ok((self.query_complete_paths(paths).await?, None));
        }
        // A push writes: a cache that refuses it says so here, about `nix-cache-info`.
        self.init_for_writing().await?;
        let before = match self.gc_state().await {
            Ok(before) => before,
            Err(e) => {
                tracing::warn!("{e}: pushing without the fence against `sluice store gc` (it needs the cache's listing)");
                return Ok((self.query_complete_paths(paths).await?, None));
            }
        };
        let mut complete = self.query_complete_paths(paths).await?;
        let name = format!("{PUSHES}{}", unique_id());
        let text: String = paths.iter().map(|p| format!("{}\n", p.hash_part())).collect();
        self.put_object(&name, text.into_bytes()).await?;
        let mut after = self.gc_state().await?;
        if after != before || is_collected(&after) {
            while is_collected(&after) {
                tokio::time::sleep(WAIT_POLL).await;
                after = self.gc_state().await?;
            }
            complete = self.query_complete_paths(paths).await?;
        }
        Ok((complete, Some(name)))
    }

    /// Deletes the push's file `name` ([`BinaryCache::begin_push`]'s).
    pub async fn end_push(&self, name: &str) -> Result<(), CacheError> {
        self.delete_object(name).await
    }

    /// The pushes in progress, as a collection sees them.
    pub async fn pushes_in_progress(&self) -> Result<Pushes, CacheError> {
        let (fresh, stale): (Vec<Object>, Vec<Object>) = self.list_under(PUSHES).await?.into_iter().partition(|o| is_fresh(o, PUSH_TTL));
        let mut pushes = Pushes { closures: None, killed: stale.into_iter().map(|o| o.name).collect(), requests: 1 + fresh.len() };
        for object in fresh {
            // Gone since the listing: that push ended, and its narinfos are there to see.
            let Some(bytes) = self.get(&object.name).await? else { continue };
            let text = String::from_utf8_lossy(&bytes);
            pushes.closures.get_or_insert_with(BTreeSet::new).extend(text.lines().map(str::to_owned));
        }
        Ok(pushes)
    }
}

/// The pushes in progress in a cache ([`BinaryCache::pushes_in_progress`]).
pub struct Pushes {
    /// The hash parts of their closures (files younger than [`PUSH_TTL`]); `None` when there
    /// is no push in progress.
    pub closures: Option<BTreeSet<String>>,
    /// The files of pushes older than that: pushes that were killed, to delete.
    pub killed: Vec<String>,
    /// Requests made to find this out.
    pub requests: usize,
}

/// A collection at work in a cache: its `.running` file, written again as it goes.
pub struct Collection {
    id: String,
    written: Instant,
}

impl Collection {
    fn running(&self) -> String {
        format!("{COLLECTIONS}{}.running", self.id)
    }

    /// Writes the collection's `.running` file: from now on, a push that begins waits for it.
    pub async fn begin(cache: &BinaryCache) -> Result<Collection, CacheError> {
        let collection = Collection { id: unique_id(), written: Instant::now() };
        cache.put_object(&collection.running(), Vec::new()).await?;
        Ok(collection)
    }

    /// Writes the `.running` file again if a quarter of [`GC_TTL`] went by since it was;
    /// the requests made.
    pub async fn keep_alive(&mut self, cache: &BinaryCache) -> Result<usize, CacheError> {
        if self.written.elapsed() < GC_TTL / 4 {
            return Ok(0);
        }
        self.written = Instant::now();
        cache.put_object(&self.running(), Vec::new()).await?;
        Ok(1)
    }

    /// Ends the collection: its `.done` file written, then its `.running` and every other
    /// collection's `.done` (and `.running` older than [`GC_TTL`]) deleted; the requests made.
    pub async fn end(self, cache: &BinaryCache) -> Result<usize, CacheError> {
        let done = format!("{COLLECTIONS}{}.done", self.id);
        cache.put_object(&done, Vec::new()).await?;
        cache.delete_object(&self.running()).await?;
        let mut requests = 3;
        for object in cache.list_under(COLLECTIONS).await? {
            let finished = object.name.ends_with(".done") && object.name != done;
            if finished || (object.name.ends_with(".running") && !is_fresh(&object, GC_TTL)) {
                cache.delete_object(&object.name).await?;
                requests += 1;
            }
        }
        Ok(requests)
    }
}
