//! `sluice nar`: `dump` a path as a NAR, `restore` a NAR into a directory, `ls` a NAR file.
