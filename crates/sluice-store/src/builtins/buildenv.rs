//! `builtin:buildenv`: a user environment (profile) of symlinks into the packages it is made
//! of, as Nix 2.8/2.26 `src/libstore/builtins/buildenv.cc` makes it. The derivation's
//! `derivations` attribute lists, per package, `active priority count path…`; `manifest` is
//! the path `manifest.nix` links to. Packages are linked in order of priority (lower first,
//! then by path), then those listed in their `nix-support/propagated-user-env-packages`, at
//! priorities from 1000 on. Where two packages have a directory of the same name, the
//! environment gets a directory of links to both (a link made earlier is expanded); where they
//! have another file of the same name, the lower priority number wins, and equal priorities
//! are an error, in Nix's words.
//!
//! The tree is built in memory (directories and symlinks only) and serialised straight into
//! the NAR. The packages are read through a [`View`] of the store in which only the inputs'
//! closure exists, as in Nix's sandbox: a link out of it is dangling.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use sluice_nix::nar::writer::NarWriter;
use sluice_nix::nar::NarVisitor;
use sluice_nix::store_path::StorePath;

use super::view::{is_absent, libc_enotdir, View};
use super::{BuiltinDerivation, BuiltinError, Context, Spool};

/// A node of the environment being built.
enum Node {
    Dir(BTreeMap<Vec<u8>, Node>),
    /// A symlink to a path in a package.
    Link(PathBuf),
}

/// Priority of the first package propagated by another (Nix's `priorityCounter`).
const PROPAGATED_PRIORITY: i64 = 1000;

/// Builds the environment of `drv` (output `out`, inputs `visible`) into `spool` as a NAR.
pub(super) fn build(
    cx: &mut Context<'_>,
    drv: &BuiltinDerivation,
    visible: &BTreeSet<StorePath>,
    out: &StorePath,
    spool: &mut Spool,
) -> Result<(), BuiltinError> {
    let packages = packages(drv.attr("derivations")?)?;
    let manifest = drv.attr("manifest")?.to_owned();
    let view = View::new(cx.store, visible);
    let mut env = Env {
        view,
        root: BTreeMap::new(),
        priorities: BTreeMap::new(),
        out: PathBuf::from(cx.store.store_dir().display_path(out)),
        warn: cx.warn,
    };
    env.build_profile(packages)?;
    env.root.insert(b"manifest.nix".to_vec(), Node::Link(PathBuf::from(manifest)));
    let root = Node::Dir(std::mem::take(&mut env.root));
    let failed = |e: io::Error| BuiltinError::Failed(format!("writing the NAR of the user environment: {e}"));
    let mut nar = NarWriter::new(spool).map_err(failed)?;
    write_nar(&mut nar, &root).map_err(failed)
}

/// A package of the environment.
struct Package {
    path: String,
    active: bool,
    priority: i64,
}

/// The packages of the `derivations` attribute: `active priority count path…` per package.
fn packages(list: &str) -> Result<Vec<Package>, BuiltinError> {
    let mut tokens = list.split([' ', '\t', '\n', '\r']).filter(|t| !t.is_empty());
    let mut next = |what: &str| tokens.next().ok_or_else(|| BuiltinError::Failed(format!("attribute 'derivations': {what} missing")));
    let number = |t: &str, what: &str| {
        t.parse::<i64>().map_err(|_| BuiltinError::Failed(format!("attribute 'derivations': {what} {t:?} is not a number")))
    };
    let mut packages = Vec::new();
    while let Ok(active) = next("") {
        let active = active != "false";
        let priority = number(next("priority")?, "priority")?;
        let outputs = number(next("output count")?, "output count")?;
        for _ in 0..outputs {
            packages.push(Package { path: next("output path")?.to_owned(), active, priority });
        }
    }
    Ok(packages)
}

/// The environment being built.
struct Env<'a, 'w> {
    view: View<'a>,
    root: BTreeMap<Vec<u8>, Node>,
    /// The priority of each link made, by its path in the environment.
    priorities: BTreeMap<Vec<Vec<u8>>, i64>,
    /// The output path, for messages.
    out: PathBuf,
    warn: &'w mut dyn FnMut(&str),
}

impl Env<'_, '_> {
    /// Nix's `buildProfile`.
    fn build_profile(&mut self, mut packages: Vec<Package>) -> Result<(), BuiltinError> {
        packages.sort_by(|a, b| (a.priority, &a.path).cmp(&(b.priority, &b.path)));
        let (mut done, mut postponed) = (BTreeSet::new(), BTreeSet::new());
        for p in packages.iter().filter(|p| p.active) {
            self.add_package(&p.path, p.priority, &mut done, &mut postponed)?;
        }
        let mut priority = PROPAGATED_PRIORITY;
        while !postponed.is_empty() {
            for p in std::mem::take(&mut postponed) {
                self.add_package(&p, priority, &mut done, &mut postponed)?;
                priority += 1;
            }
        }
        Ok(())
    }

    /// Links the package at `path`, once, and postpones the packages it propagates.
    fn add_package(
        &mut self,
        path: &str,
        priority: i64,
        done: &mut BTreeSet<String>,
        postponed: &mut BTreeSet<String>,
    ) -> Result<(), BuiltinError> {
        if !done.insert(path.to_owned()) {
            return Ok(());
        }
        self.create_links(Path::new(path), priority)?;
        let list = Path::new(path).join("nix-support/propagated-user-env-packages");
        match self.view.resolve(&list).and_then(|p| std::fs::read(self.view.real(&p)?)) {
            Ok(text) => postponed.extend(
                String::from_utf8_lossy(&text).split([' ', '\n']).filter(|p| !p.is_empty() && !done.contains(*p)).map(str::to_owned),
            ),
            Err(e) if is_absent(&e) => {}
            Err(e) => return Err(BuiltinError::Failed(format!("reading '{}': {e}", list.display()))),
        }
        Ok(())
    }

    /// Nix's `createLinks`: links the entries of the package directory `src_dir` into the
    /// environment's root, at `priority`. The walk keeps its own stack of steps, not the
    /// thread's, so that packages as deep as the store accepts cannot overflow a worker's stack.
    fn create_links(&mut self, src_dir: &Path, priority: i64) -> Result<(), BuiltinError> {
        let mut steps = vec![Step::Dir { src: src_dir.to_owned(), dst: Vec::new(), priority }];
        while let Some(step) = steps.pop() {
            match step {
                Step::Dir { src, dst, priority } => self.dir_links(&src, &dst, priority, &mut steps)?,
                Step::Entry { src, dst, priority } => self.link_entry(&src, dst, priority, &mut steps)?,
            }
        }
        Ok(())
    }

    /// One directory of [`Env::create_links`]: its entries, to link into `dst` (components),
    /// pushed onto `steps` so that they are linked in order.
    fn dir_links(&mut self, src_dir: &Path, dst: &[Vec<u8>], priority: i64, steps: &mut Vec<Step>) -> Result<(), BuiltinError> {
        let failed = |what: &str, p: &Path, e: io::Error| BuiltinError::Failed(format!("{what} '{}': {e}", p.display()));
        let entries = match self.view.read_dir(src_dir) {
            Ok(entries) => entries,
            Err(e) if e.raw_os_error() == Some(libc_enotdir()) => {
                (self.warn)(&format!("not including '{}' in the user environment because it's not a directory", src_dir.display()));
                return Ok(());
            }
            Err(e) => return Err(failed("opening directory", src_dir, e)),
        };
        for name in entries.into_iter().filter(|n| !n.starts_with(b".")).rev() {
            let src = src_dir.join(OsStr::from_bytes(&name));
            let mut entry_dst = dst.to_vec();
            entry_dst.push(name);
            steps.push(Step::Entry { src, dst: entry_dst, priority });
        }
        Ok(())
    }

    /// One entry of [`Env::create_links`]: `src` into `dst`.
    fn link_entry(&mut self, src: &Path, dst: Vec<Vec<u8>>, priority: i64, steps: &mut Vec<Step>) -> Result<(), BuiltinError> {
        let src_is_dir = match self.view.stat_is_dir(src) {
            Ok(d) => d,
            Err(e) if is_absent(&e) => {
                let msg = format!("skipping dangling symlink '{}'", self.shown(&dst).display());
                (self.warn)(&msg);
                return Ok(());
            }
            Err(e) => return Err(BuiltinError::Failed(format!("getting status of '{}': {e}", src.display()))),
        };
        const SKIPPED: [&str; 7] =
            ["/propagated-build-inputs", "/nix-support", "/perllocal.pod", "/info/dir", "/log", "/manifest.nix", "/manifest.json"];
        if SKIPPED.iter().any(|s| src.as_os_str().as_bytes().ends_with(s.as_bytes())) {
            return Ok(());
        }
        let existing = match self.node(&dst) {
            Some(Node::Dir(_)) => Some(None),
            Some(Node::Link(target)) => Some(Some(target.clone())),
            None => None,
        };
        match (src_is_dir, existing) {
            (true, Some(None)) => {
                steps.push(Step::Dir { src: src.to_owned(), dst, priority });
                return Ok(());
            }
            (true, Some(Some(link))) => {
                let target =
                    self.view.resolve(&link).map_err(|e| BuiltinError::Failed(format!("getting status of '{}': {e}", link.display())))?;
                if !self.view.stat_is_dir(&target).unwrap_or(false) {
                    return Err(BuiltinError::Failed(format!(
                        "collision between '{}' and non-directory '{}'",
                        src.display(),
                        target.display()
                    )));
                }
                self.set(&dst, Node::Dir(BTreeMap::new()));
                let previous = self.priorities.get(dst.as_slice()).copied().unwrap_or(0);
                // The link's target first, then `src`, as Nix's recursion does.
                steps.push(Step::Dir { src: src.to_owned(), dst: dst.clone(), priority });
                steps.push(Step::Dir { src: target, dst, priority: previous });
                return Ok(());
            }
            (false, Some(Some(link))) => {
                let previous = self.priorities.get(dst.as_slice()).copied().unwrap_or(0);
                if previous == priority {
                    return Err(BuiltinError::Failed(format!(
                        "packages '{}' and '{}' have the same priority {priority}; use 'nix-env --set-flag priority NUMBER INSTALLED_PKGNAME' to change the priority of one of the conflicting packages (0 being the highest priority)",
                        src.display(),
                        link.display()
                    )));
                }
                if previous < priority {
                    return Ok(());
                }
            }
            (false, Some(None)) => {
                return Err(BuiltinError::Failed(format!(
                    "collision between non-directory '{}' and directory '{}'",
                    src.display(),
                    self.shown(&dst).display()
                )));
            }
            (_, None) => {}
        }
        self.set(&dst, Node::Link(src.to_owned()));
        self.priorities.insert(dst, priority);
        Ok(())
    }

    /// The environment's node at `path`, if any.
    fn node(&self, path: &[Vec<u8>]) -> Option<&Node> {
        let (last, parents) = path.split_last()?;
        let mut dir = &self.root;
        for c in parents {
            match dir.get(c)? {
                Node::Dir(d) => dir = d,
                Node::Link(_) => return None,
            }
        }
        dir.get(last)
    }

    /// Puts `node` at `path`, whose parents are directories of the environment.
    fn set(&mut self, path: &[Vec<u8>], node: Node) {
        let Some((last, parents)) = path.split_last() else { return };
        let mut dir = &mut self.root;
        for c in parents {
            match dir.get_mut(c) {
                Some(Node::Dir(d)) => dir = d,
                _ => return,
            }
        }
        dir.insert(last.clone(), node);
    }

    /// The full path of `path` in the output, for messages.
    fn shown(&self, path: &[Vec<u8>]) -> PathBuf {
        path.iter().fold(self.out.clone(), |p, c| p.join(OsStr::from_bytes(c)))
    }
}

/// A step of [`Env::create_links`]'s walk.
enum Step {
    /// Link the entries of the directory `src` into `dst`.
    Dir { src: PathBuf, dst: Vec<Vec<u8>>, priority: i64 },
    /// Link `src` at `dst`.
    Entry { src: PathBuf, dst: Vec<Vec<u8>>, priority: i64 },
}

/// Writes the environment `root` into the NAR, with a stack of its own.
fn write_nar(nar: &mut NarWriter<&mut Spool>, root: &Node) -> io::Result<()> {
    let mut path: Vec<Vec<u8>> = Vec::new();
    let entries = match root {
        Node::Link(target) => return nar.symlink(&path, target.as_os_str().as_bytes()),
        Node::Dir(entries) => entries,
    };
    nar.directory_start(&path)?;
    let mut open = vec![entries.iter()];
    while let Some(dir) = open.last_mut() {
        match dir.next() {
            Some((name, Node::Link(target))) => {
                path.push(name.clone());
                nar.symlink(&path, target.as_os_str().as_bytes())?;
                path.pop();
            }
            Some((name, Node::Dir(entries))) => {
                path.push(name.clone());
                nar.directory_start(&path)?;
                open.push(entries.iter());
            }
            None => {
                open.pop();
                nar.directory_end(&path)?;
                path.pop();
            }
        }
    }
    Ok(())
}
