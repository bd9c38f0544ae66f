//! Reference cycles among the paths of a closure. A store's references cannot form a cycle
//! (other than a path referring to itself), but narinfos are claims: a cache can list paths
//! that refer to each other, and the paths waiting for their references to be added first
//! would then wait for ever. The copies find such cycles once the closure is known and fail
//! their paths with Nix's words (`topoSortPaths`, `src/libstore/store-api.cc`: "cycle detected
//! in the references of '…' from '…'").

use std::collections::HashMap;

use sluice_nix::store_path::{StoreDir, StorePath};

/// A set of two or more paths each of which reaches every other through references, with one
/// of its references named as Nix names it: `path` is referred to by `parent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cycle {
    /// The paths of the cycle, sorted.
    pub members: Vec<StorePath>,
    /// The first member.
    pub path: StorePath,
    /// The first member that refers to `path`.
    pub parent: StorePath,
}

impl Cycle {
    /// Nix's message for it.
    pub fn message(&self, store_dir: &StoreDir) -> String {
        format!(
            "cycle detected in the references of '{}' from '{}'",
            store_dir.display_path(&self.path),
            store_dir.display_path(&self.parent)
        )
    }
}

/// The cycles of the graph given as each path with its references (the strongly connected
/// components of more than one path, by Tarjan's algorithm without recursion, so that a
/// closure's depth does not bound it). References to paths not given, and of a path to itself,
/// are left out. Linear in paths and references.
pub(crate) fn reference_cycles<'a, R>(graph: impl IntoIterator<Item = (&'a StorePath, R)>) -> Vec<Cycle>
where
    R: IntoIterator<Item = &'a StorePath>,
{
    let graph: Vec<(&StorePath, R)> = graph.into_iter().collect();
    let index: HashMap<&StorePath, usize> = graph.iter().enumerate().map(|(i, (p, _))| (*p, i)).collect();
    let paths: Vec<&StorePath> = graph.iter().map(|(p, _)| *p).collect();
    let edges: Vec<Vec<usize>> = graph
        .into_iter()
        .enumerate()
        .map(|(i, (_, refs))| refs.into_iter().filter_map(|r| index.get(r).copied()).filter(|&j| j != i).collect())
        .collect();
    let mut tarjan = Tarjan {
        order: vec![None; paths.len()],
        low: vec![0; paths.len()],
        on_stack: vec![false; paths.len()],
        stack: Vec::new(),
        next: 0,
    };
    let mut cycles = Vec::new();
    for root in 0..paths.len() {
        if tarjan.order[root].is_some() {
            continue;
        }
        tarjan.visit(root);
        let mut calls = vec![(root, 0usize)];
        while let Some((v, i)) = calls.last_mut() {
            let v = *v;
            if let Some(&w) = edges[v].get(*i) {
                *i += 1;
                match tarjan.order[w] {
                    None => {
                        tarjan.visit(w);
                        calls.push((w, 0));
                    }
                    Some(order) if tarjan.on_stack[w] => tarjan.low[v] = tarjan.low[v].min(order),
                    Some(_) => {}
                }
                continue;
            }
            calls.pop();
            if let Some(&(u, _)) = calls.last() {
                tarjan.low[u] = tarjan.low[u].min(tarjan.low[v]);
            }
            if Some(tarjan.low[v]) != tarjan.order[v] {
                continue;
            }
            let component = tarjan.pop_component(v);
            cycles.extend(cycle(&paths, &edges, component));
        }
    }
    cycles.sort_by(|a, b| a.path.cmp(&b.path));
    cycles
}

/// The state of Tarjan's algorithm: each node's visiting order and lowest order reachable.
struct Tarjan {
    order: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
}

impl Tarjan {
    fn visit(&mut self, v: usize) {
        self.order[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
    }

    /// The component whose root is `v`: the stack down to it.
    fn pop_component(&mut self, v: usize) -> Vec<usize> {
        let mut component = Vec::new();
        while let Some(w) = self.stack.pop() {
            self.on_stack[w] = false;
            component.push(w);
            if w == v {
                break;
            }
        }
        component
    }
}

/// The [`Cycle`] of a component; `None` for a component of one node, which no member refers
/// to (`edges` hold no reference of a path to itself).
fn cycle(paths: &[&StorePath], edges: &[Vec<usize>], component: Vec<usize>) -> Option<Cycle> {
    let first = *component.iter().min_by_key(|&&i| paths[i])?;
    let parent = component.iter().filter(|&&i| edges[i].contains(&first)).min_by_key(|&&i| paths[i])?;
    let mut members: Vec<StorePath> = component.iter().map(|&i| paths[i].clone()).collect();
    members.sort();
    Some(Cycle { members, path: paths[first].clone(), parent: paths[*parent].clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store path whose hash part is `c` 32 times, named `c`.
    fn path(c: char) -> StorePath {
        StoreDir::default().parse_path(&format!("/nix/store/{}-{c}", c.to_string().repeat(32))).unwrap()
    }

    fn cycles_of(edges: &[(char, &str)]) -> Vec<Vec<char>> {
        let graph: Vec<(StorePath, Vec<StorePath>)> = edges.iter().map(|(p, refs)| (path(*p), refs.chars().map(path).collect())).collect();
        let cycles = reference_cycles(graph.iter().map(|(p, refs)| (p, refs.iter())));
        cycles.into_iter().map(|c| c.members.iter().map(|m| m.name().chars().next().unwrap()).collect()).collect()
    }

    /// Self-references, references out of the graph and diamonds are not cycles; each cycle is
    /// found once, with the paths it holds and no path merely hanging off it.
    #[test]
    fn finds_each_cycle_with_its_members() {
        assert_eq!(cycles_of(&[('a', "abx"), ('b', "c"), ('c', ""), ('d', "bc")]), Vec::<Vec<char>>::new());
        assert_eq!(
            cycles_of(&[('a', "b"), ('b', "c"), ('c', "a"), ('d', "a"), ('h', "i"), ('i', "h"), ('j', "j")]),
            vec![vec!['a', 'b', 'c'], vec!['h', 'i']]
        );
        // Two cycles joined by a path are two components.
        assert_eq!(cycles_of(&[('a', "b"), ('b', "ac"), ('c', "d"), ('d', "c")]), vec![vec!['a', 'b'], vec!['c', 'd']]);
    }

    /// A chain deeper than any thread's stack would allow a recursive walk, closed into a cycle.
    #[test]
    fn a_long_chain_closed_into_a_cycle_is_one_cycle() {
        let n = 200_000;
        let dir = StoreDir::default();
        let paths: Vec<StorePath> =
            (0..n).map(|i| dir.parse_path(&format!("/nix/store/{}-p{i}", sluice_nix::base32::encode(&sha_of(i)))).unwrap()).collect();
        let graph = (0..n).map(|i| (&paths[i], std::iter::once(&paths[(i + 1) % n])));
        let cycles = reference_cycles(graph);
        assert_eq!(cycles.len(), 1);
        assert_eq!(cycles[0].members.len(), n);
        let parent_of_first = paths.iter().position(|p| *p == cycles[0].path).map(|i| &paths[(i + n - 1) % n]);
        assert_eq!(Some(&cycles[0].parent), parent_of_first);
    }

    /// 20 bytes that differ for each `i`.
    fn sha_of(i: usize) -> [u8; 20] {
        let mut bytes = [0u8; 20];
        bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
        bytes
    }

    #[test]
    fn the_message_is_nix_s() {
        let cycles = {
            let (a, b) = (path('a'), path('b'));
            let graph = [(a.clone(), vec![b.clone()]), (b.clone(), vec![a.clone()])];
            reference_cycles(graph.iter().map(|(p, r)| (p, r.iter())))
        };
        let dir = StoreDir::default();
        assert_eq!(
            cycles[0].message(&dir),
            format!("cycle detected in the references of '/nix/store/{}-a' from '/nix/store/{}-b'", "a".repeat(32), "b".repeat(32))
        );
    }
}
