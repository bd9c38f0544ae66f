//! Shell completions and man pages come from the same
//! clap definitions as `--help`, so every command and option appears in each.

use crate::common::*;

/// Every subcommand, as `sluice --help` lists it.
const COMMANDS: [&str; 10] = ["copy", "missing", "path-info", "nar", "daemon", "serve", "store", "key", "completions", "man"];

#[test]
fn completions_name_every_command_and_option() {
    let tmp = tempfile::tempdir().unwrap();
    let help = sluice(tmp.path(), &["--help"]);
    check(&help, "sluice --help");
    for c in COMMANDS {
        assert!(String::from_utf8_lossy(&help.stdout).contains(&format!("  {c} ")), "--help lists {c}");
    }
    for shell in ["bash", "zsh", "fish"] {
        let o = sluice(tmp.path(), &["completions", shell]);
        check(&o, shell);
        let script = String::from_utf8_lossy(&o.stdout);
        for word in COMMANDS.iter().chain(&["--as-nix", "--no-check-sigs", "--listen"]) {
            assert!(script.contains(word.trim_start_matches('-')), "{shell} completions lack {word}");
        }
    }
    let bad = sluice(tmp.path(), &["completions", "tcsh"]);
    assert_eq!(bad.status.code(), Some(1), "an unknown shell is a usage error");
}

#[test]
fn man_pages_for_every_command_with_options_and_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("man1");
    let o = sluice(tmp.path(), &["man", dir.to_str().unwrap()]);
    check(&o, "sluice man");
    let mut written: Vec<String> = String::from_utf8_lossy(&o.stdout).lines().map(|l| l.rsplit('/').next().unwrap().to_owned()).collect();
    written.sort();
    let mut want: Vec<String> = [
        "sluice",
        "sluice-copy",
        "sluice-missing",
        "sluice-path-info",
        "sluice-nar",
        "sluice-nar-dump",
        "sluice-nar-restore",
        "sluice-nar-ls",
        "sluice-nar-cat",
        "sluice-daemon",
        "sluice-legacy-serve",
        "sluice-serve",
        "sluice-store",
        "sluice-store-verify",
        "sluice-store-sign",
        "sluice-store-gc",
        "sluice-key",
        "sluice-key-generate",
        "sluice-completions",
        "sluice-man",
    ]
    .iter()
    .map(|n| format!("{n}.1"))
    .collect();
    want.sort();
    assert_eq!(written, want);
    let page = std::fs::read_to_string(dir.join("sluice-path-info.1")).unwrap();
    assert!(page.starts_with(".ie") || page.contains(".TH sluice\\-path\\-info"), "{page}");
    assert!(page.contains("\\-\\-as\\-nix") && page.contains("2.26"), "the option and its default: {page}");
    let page = std::fs::read_to_string(dir.join("sluice-copy.1")).unwrap();
    assert!(page.contains("\\-\\-jobs") && page.contains("256"), "{page}");
    // The help's code spans are bold, not Markdown backticks.
    assert!(page.contains("(like \\fBnix copy\\fR)"), "{page}");
    for name in &written {
        let page = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(!page.contains('`'), "{name}: {}", page.lines().find(|l| l.contains('`')).unwrap_or_default());
    }
}

/// Every option and argument of every command says what it is in `--help`, and a command does
/// not offer flags it ignores: `path-info` and `serve` substitute nothing, so they take no
/// `--substituters`, `--trusted-public-keys` or `--no-check-sigs` (`copy`, `missing`,
/// `daemon` and `store verify` do).
#[test]
fn help_describes_every_argument_and_offers_no_idle_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let commands: [&[&str]; 16] = [
        &["copy"],
        &["missing"],
        &["path-info"],
        &["nar", "dump"],
        &["nar", "restore"],
        &["nar", "ls"],
        &["nar", "cat"],
        &["daemon"],
        &["legacy-serve"],
        &["serve"],
        &["store", "verify"],
        &["store", "sign"],
        &["store", "gc"],
        &["key", "generate"],
        &["completions"],
        &["man"],
    ];
    let substituting = ["--substituters", "--trusted-public-keys", "--no-check-sigs"];
    for command in commands {
        let o = sluice(tmp.path(), &[command, &["--help"]].concat());
        check(&o, &format!("{command:?} --help"));
        let text = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = text.lines().collect();
        let mut items = 0;
        for (i, line) in lines.iter().enumerate() {
            let body = line.trim_start();
            let indent = line.len() - body.len();
            if (indent == 2 || indent == 6) && (body.starts_with('-') || body.starts_with('<')) {
                items += 1;
                let next = lines.get(i + 1).map_or("", |l| l.trim());
                assert!(!next.is_empty() && !next.starts_with('['), "{command:?}: {body:?} has no description:\n{text}");
            }
        }
        assert!(items >= 2, "{command:?}: {text}");
        let offered =
            substituting.iter().filter(|f| lines.iter().any(|l| l.trim() == **f || l.trim().starts_with(&format!("{f} <")))).count();
        // `store verify` repairs a local store by substituting, and checks signatures.
        let expected = if matches!(command, ["copy"] | ["missing"] | ["daemon"] | ["store", "verify"]) { substituting.len() } else { 0 };
        assert_eq!(offered, expected, "{command:?}:\n{text}");
    }
}

/// A usage error (an unknown flag, a missing argument, a bad value) exits with 1, as Nix 2.8's
/// and 2.26's do; `--help` and `--version` with 0.
#[test]
fn usage_errors_exit_1_as_nix() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    for (ours, theirs) in [
        (&["copy", "--bogus", "/nix/store/x"][..], &["copy", "--bogus", "/nix/store/x"][..]),
        (&["path-info"], &["path-info", "--store"]),
        (&["copy", "--jobs", "zero", "/nix/store/x"], &["copy", "--max-jobs", "zero", "/nix/store/x"]),
    ] {
        let own = sluice(t, ours);
        assert_eq!(own.status.code(), Some(1), "sluice {ours:?}: {}", stderr(&own));
        assert!(stderr(&own).starts_with("error: "), "{}", stderr(&own));
        for real in [nix(t, "nix", theirs), nix_modern(t, &[&["nix"][..], theirs].concat())] {
            assert_eq!(real.status.code(), Some(1), "nix {theirs:?}: {}", stderr(&real));
        }
    }
    for ok in [&["--help"][..], &["--version"], &["copy", "--help"]] {
        assert_eq!(sluice(t, ok).status.code(), Some(0), "{ok:?}");
    }
}
