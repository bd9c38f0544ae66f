//! The connection limit, and shedding idle connections when it is reached, as nginx does
//! when its connections run out (`ngx_drain_connections`): a connection accepted while every
//! slot is taken has the oldest idle one (no request in progress, [`Activity::sheddable_since`])
//! closed gracefully ([`Activity::shed`]) and takes its slot once it has closed. A connection
//! with a request in progress is never shed. HTTP/1.1 connections and HTTP/2 ones whose
//! client answers the GOAWAY's PING close at once; others within their closing grace
//! ([`crate::conn`]), so another idle one is shed each [`SHED_RETRY`] while none has freed a
//! slot. No limit per peer: behind a load balancer every client is the same peer.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::progress::Activity;

/// Time a connection waiting for a slot gives the one shed for it before shedding another.
pub(crate) const SHED_RETRY: Duration = Duration::from_millis(500);

/// The slots of `max_connections` connections, and the activity of those being served.
pub(crate) struct Slots {
    permits: Arc<Semaphore>,
    served: Mutex<Served>,
}

#[derive(Default)]
struct Served {
    next: u64,
    activities: HashMap<u64, Arc<Activity>>,
}

impl Slots {
    pub fn new(max_connections: usize) -> Arc<Self> {
        Arc::new(Slots { permits: Arc::new(Semaphore::new(max_connections)), served: Mutex::default() })
    }

    fn served(&self) -> std::sync::MutexGuard<'_, Served> {
        self.served.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection just accepted, idle connections shed for it while none is
    /// free (see the module doc).
    pub async fn take(self: &Arc<Self>) -> io::Result<Slot> {
        loop {
            if let Ok(permit) = self.permits.clone().try_acquire_owned() {
                return Ok(self.slot(permit));
            }
            self.shed_oldest_idle();
            tokio::select! {
                permit = self.permits.clone().acquire_owned() => return Ok(self.slot(permit.map_err(io::Error::other)?)),
                () = tokio::time::sleep(SHED_RETRY) => {}
            }
        }
    }

    fn slot(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        let mut served = self.served();
        served.next += 1;
        Slot { slots: self.clone(), id: served.next, _permit: permit }
    }

    fn shed_oldest_idle(&self) {
        let served = self.served();
        let oldest = served.activities.values().filter_map(|a| Some((a.sheddable_since()?, a))).min_by_key(|(since, _)| *since);
        if let Some((_, activity)) = oldest {
            activity.shed();
        }
    }
}

/// A connection's slot, freed when it is dropped.
pub struct Slot {
    slots: Arc<Slots>,
    id: u64,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// Makes the connection sheddable by what `activity` says of it.
    pub fn serves(&self, activity: Arc<Activity>) {
        self.slots.served().activities.insert(self.id, activity);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.served().activities.remove(&self.id);
    }
}
