//! A closure pulled from a daemon with its NARs on the way ([`DaemonConnection::closure_fetching`]).
//! Nix's `copyPaths` (`src/libstore/store-api.cc`) first finds the whole closure
//! (`computeFSClosure`, one QueryPathInfo per path), then asks for one NAR at a time. Here the
//! closure is found in one round trip from a daemon that offers sluice's QueryClosureInfos,
//! else one level of references per round trip, and the NARs of the paths found
//! are asked for right behind the next level's queries, so that they stream back while that
//! level is looked for: the NARs start coming after the first level's round trip,
//! not after the last one's, and the closure is known while the last of them still come.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use sluice_nix::wire::features::{QUERY_PATH_INFOS, SLUICE_QUERY_CLOSURE};
use sluice_nix::wire::ops::{write_request, NarFromPath, QueryClosureInfos, QueryPathInfo, QueryPathInfos};

use super::pace::Pace;
use super::{DaemonConnection, RemoteError, PIPELINE_BYTES};

/// What [`DaemonConnection::closure_fetching`] found: the info of each path of the closure,
/// and the first path of it the daemon did not know, if any (the search stopped there).
pub(super) struct FoundClosure {
    pub(super) infos: BTreeMap<StorePath, ValidPathInfo>,
    pub(super) not_valid: Option<StorePath>,
}

/// Picks, among infos just found, the paths whose NARs to fetch, in the order to ask for them.
pub(super) type ChooseNars<'a> = &'a mut dyn FnMut(&[ValidPathInfo]) -> Vec<StorePath>;

/// Takes each NAR fetched, whole, as soon as it has arrived.
pub(super) type TakeNar<'a> = &'a mut dyn FnMut(StorePath, Vec<u8>);

/// Requests written in one round: queries of paths and NARs asked for, in that order.
#[derive(Default)]
struct Round {
    queried: Vec<StorePath>,
    /// Whether the queries were one QueryClosureInfos: the answer holds the closure of the
    /// paths queried.
    closure: bool,
    nars: Vec<(StorePath, u64)>,
    /// Bytes of the NAR requests, which the daemon may not have read when the next round is
    /// written (it reads each after the NAR before it has gone out).
    nar_bytes: usize,
    /// When the queries were written.
    sent: Option<Instant>,
    /// Bytes of the NARs asked for in the round before, which come before the answers.
    ahead: u64,
}

/// The NARs a [`DaemonConnection::closure_fetching`] had still to read, or to ask for, when
/// it had found the closure: [`DaemonConnection::fetch_rest`] reads them.
pub(super) struct RestOfNars {
    in_flight: Round,
    wanted: VecDeque<(StorePath, u64)>,
}

impl DaemonConnection {
    /// The closure of `roots` (one level of references per round trip, as
    /// [`query_path_infos`](Self::query_path_infos) asks), where `choose` is given each level's
    /// infos as they are found and picks the paths whose NARs to fetch; those NARs are asked
    /// for (NarFromPath) right after the next level's queries, before the NARs asked for
    /// earlier are read, and each is given to `take` once it has arrived, its registered size
    /// and no more. Returns once the closure is
    /// found, with the NARs still to come, which [`fetch_rest`](Self::fetch_rest) must read
    /// before anything else is sent. A round asks for about the NARs that come in one round
    /// trip (`remote/pace.rs`), so that the next level's answers are not held up behind them;
    /// the rest wait for later rounds. At most 1.5 × [`PIPELINE_BYTES`] of requests are ever
    /// unread by the daemon (well within a socket's or a pipe's buffer), so that a write never
    /// waits for a daemon that waits for its replies to be read: what does not fit waits for
    /// the next round. After an error the rest of the replies are unread: drop the connection.
    pub(super) fn closure_fetching(
        &mut self,
        roots: &[StorePath],
        choose: ChooseNars<'_>,
        take: TakeNar<'_>,
    ) -> Result<(FoundClosure, RestOfNars), RemoteError> {
        let mut found = FoundClosure { infos: BTreeMap::new(), not_valid: None };
        let mut seen: BTreeSet<StorePath> = roots.iter().cloned().collect();
        let mut frontier: VecDeque<StorePath> = seen.iter().cloned().collect();
        let mut wanted: VecDeque<(StorePath, u64)> = VecDeque::new();
        let mut in_flight = Round::default();
        let mut pace = Pace::default();
        loop {
            let (answers, below) = self.read_answers(&in_flight)?;
            if let Some(sent) = in_flight.sent {
                pace.answered(sent.elapsed(), in_flight.ahead);
            }
            let mut infos = Vec::with_capacity(answers.len() + below.len());
            for (path, info) in in_flight.queried.iter().zip(answers) {
                match info {
                    Some(info) => infos.push(info),
                    None if found.not_valid.is_none() => found.not_valid = Some(path.clone()),
                    None => {}
                }
            }
            seen.extend(below.iter().map(|i| i.path.clone()));
            infos.extend(below);
            if found.not_valid.is_some() {
                (frontier, wanted, infos) = Default::default();
            }
            for info in &infos {
                frontier.extend(info.references.iter().filter(|r| seen.insert((*r).clone())).cloned());
            }
            // The next queries go out before the NARs are chosen, which may take a while.
            let first = found.infos.is_empty() && in_flight.queried.is_empty();
            let (queried, closure, query_bytes) = self.write_queries(&mut frontier, first)?;
            let sent = Some(Instant::now());
            if !infos.is_empty() {
                let sizes: BTreeMap<&StorePath, u64> = infos.iter().map(|i| (&i.path, i.nar_size)).collect();
                wanted.extend(choose(&infos).into_iter().filter_map(|p| Some((p.clone(), *sizes.get(&p)?))));
            }
            found.infos.extend(infos.into_iter().map(|i| (i.path.clone(), i)));
            if queried.is_empty() {
                return Ok((found, RestOfNars { in_flight: Round { queried, closure, sent, ..in_flight }, wanted }));
            }
            let budget = pace.budget();
            let (nars, nar_bytes) = self.write_nars(&mut wanted, in_flight.nar_bytes + query_bytes, budget)?;
            tracing::debug!(
                "{}: asked for {} paths' infos and {} NARs ({} bytes, {budget} allowed); {} NARs wait",
                self.daemon,
                queried.len(),
                nars.len(),
                nars.iter().map(|(_, size)| size).sum::<u64>(),
                wanted.len()
            );
            let ahead = in_flight.nars.iter().map(|(_, size)| size).sum();
            self.read_nars(in_flight.nars, take)?;
            in_flight = Round { queried, closure, nars, nar_bytes, sent, ahead };
        }
    }

    /// Asks for and reads the NARs a [`closure_fetching`](Self::closure_fetching) left, giving
    /// each to `take` as it arrives.
    pub(super) fn fetch_rest(&mut self, rest: RestOfNars, take: TakeNar<'_>) -> Result<(), RemoteError> {
        let RestOfNars { mut in_flight, mut wanted } = rest;
        while !in_flight.nars.is_empty() || !wanted.is_empty() {
            let (nars, nar_bytes) = self.write_nars(&mut wanted, in_flight.nar_bytes, u64::MAX)?;
            self.read_nars(in_flight.nars, take)?;
            in_flight = Round { nars, nar_bytes, ..Round::default() };
        }
        Ok(())
    }

    /// Reads the NARs of `nars`, asked for in this order, giving each to `take`.
    fn read_nars(&mut self, nars: Vec<(StorePath, u64)>, take: TakeNar<'_>) -> Result<(), RemoteError> {
        for (path, size) in nars {
            self.finish_stderr("NarFromPath")?;
            take(path, self.read_nar(size)?);
        }
        Ok(())
    }

    /// Sends the queries of the paths at the front of `frontier`, up to half of
    /// [`PIPELINE_BYTES`]: for the `first` (the roots), one QueryClosureInfos with its
    /// feature; else one QueryPathInfos with its feature, else one QueryPathInfo each. The
    /// paths queried, whether their closure was asked for, and the bytes sent.
    fn write_queries(&mut self, frontier: &mut VecDeque<StorePath>, first: bool) -> Result<(Vec<StorePath>, bool, usize), RemoteError> {
        let io = self.io_err("QueryPathInfo");
        let (mut queried, mut batch) = (Vec::new(), Vec::new());
        // Each path's QueryPathInfo measures its share of a QueryPathInfos too.
        while let Some(path) = frontier.front() {
            if batch.len() >= PIPELINE_BYTES / 2 {
                break;
            }
            write_request(&mut batch, &self.store_dir, self.version, &QueryPathInfo { path: path.clone() }).map_err(&io)?;
            queried.extend(frontier.pop_front());
        }
        let paths = || queried.iter().cloned().collect();
        let closure = first && self.features.contains(SLUICE_QUERY_CLOSURE) && !queried.is_empty();
        if closure {
            batch.clear();
            write_request(&mut batch, &self.store_dir, self.version, &QueryClosureInfos { paths: paths() }).map_err(&io)?;
        } else if self.features.contains(QUERY_PATH_INFOS) && !queried.is_empty() {
            batch.clear();
            write_request(&mut batch, &self.store_dir, self.version, &QueryPathInfos { paths: paths() }).map_err(&io)?;
        }
        self.write_batch(&batch, "QueryPathInfo")?;
        Ok((queried, closure, batch.len()))
    }

    /// Sends the requests of the NARs at the front of `wanted` while the requests the daemon
    /// may not have read (`unread` bytes before these) stay under [`PIPELINE_BYTES`] and the
    /// NARs asked for under `budget` bytes (the first always goes). The NARs asked for, and
    /// the bytes sent.
    fn write_nars(
        &mut self,
        wanted: &mut VecDeque<(StorePath, u64)>,
        unread: usize,
        budget: u64,
    ) -> Result<(Vec<(StorePath, u64)>, usize), RemoteError> {
        let io = self.io_err("NarFromPath");
        let (mut nars, mut batch, mut asked) = (Vec::new(), Vec::new(), 0u64);
        while let Some((path, size)) = wanted.front() {
            if unread + batch.len() >= PIPELINE_BYTES || (asked > 0 && asked.saturating_add(*size) > budget) {
                break;
            }
            asked = asked.saturating_add((*size).max(1));
            write_request(&mut batch, &self.store_dir, self.version, &NarFromPath { path: path.clone() }).map_err(&io)?;
            nars.extend(wanted.pop_front());
        }
        self.write_batch(&batch, "NarFromPath")?;
        Ok((nars, batch.len()))
    }

    /// Writes and flushes `batch`, if it is not empty.
    fn write_batch(&mut self, batch: &[u8], what: &'static str) -> Result<(), RemoteError> {
        if batch.is_empty() {
            return Ok(());
        }
        std::io::Write::write_all(&mut self.w, batch).and_then(|()| std::io::Write::flush(&mut self.w)).map_err(self.io_err(what))
    }

    /// Reads the answers to the queries of `round` (one QueryClosureInfos, one QueryPathInfos
    /// with the feature, else one QueryPathInfo each): the info of each path queried, in
    /// order, and those of the rest of their closure that came with them.
    fn read_answers(&mut self, round: &Round) -> Result<(Vec<Option<ValidPathInfo>>, Vec<ValidPathInfo>), RemoteError> {
        let queried = &round.queried;
        if queried.is_empty() {
            return Ok(Default::default());
        }
        if round.closure {
            self.finish_stderr("QueryClosureInfos")?;
            return self.read_closure_infos(queried);
        }
        if self.features.contains(QUERY_PATH_INFOS) {
            self.finish_stderr("QueryPathInfos")?;
            return Ok((self.read_path_infos(queried)?, Vec::new()));
        }
        let mut answers = Vec::with_capacity(queried.len());
        for path in queried {
            self.finish_stderr("QueryPathInfo")?;
            answers.push(self.read_path_info(path)?);
        }
        Ok((answers, Vec::new()))
    }
}
