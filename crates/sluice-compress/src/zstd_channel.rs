//! zstd over a connection between two sluice ends (the worker protocol's `sluice-zstd`
//! feature, negotiated in the handshake): once switched on, each direction is one zstd stream
//! whose every `write` is compressed and flushed (`ZSTD_e_flush`), so that the far end can
//! decode all that was written, whatever it waits for next, and a reader that decodes what has
//! arrived. Nix has no such feature: a real Nix end never offers it, and the connection stays
//! plain (Nix's `compress` store setting is ssh's `-C`, the whole channel compressed by ssh).
//!
//! The switch is shared ([`Switch`]) so that a connection whose reader and writer are already
//! owned by other layers (the daemon's, which couple its two directions) turns both on right
//! after the greeting.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use zstd::stream::raw::{Decoder, Encoder, InBuffer, Operation, OutBuffer};

/// The zstd level of a channel: cheap enough for a link of hundreds of MB/s on one core.
const LEVEL: i32 = 1;

/// Bytes of compressed input read, or compressed output written, per system call.
const CHUNK: usize = 64 << 10;

/// Whether a connection's [`ZstdChannelReader`] and [`ZstdChannelWriter`] are on: off (plain
/// bytes) until [`Switch::on`].
#[derive(Debug, Clone, Default)]
pub struct Switch(Arc<AtomicBool>);

impl Switch {
    /// A switch that is on from the start.
    pub fn on_now() -> Switch {
        let switch = Switch::default();
        switch.on();
        switch
    }

    /// Turns the channel's compression on, for every byte written or read from now on.
    pub fn on(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_on(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

fn zstd_err(what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} the connection's zstd stream: {e}"))
}

/// Writes to `inner`, compressed once its switch is on (see the module doc).
pub struct ZstdChannelWriter<W> {
    inner: W,
    switch: Switch,
    encoder: Option<Encoder<'static>>,
    out: Vec<u8>,
}

impl<W: Write> ZstdChannelWriter<W> {
    /// A writer to `inner`, plain until `switch` is on.
    pub fn new(inner: W, switch: Switch) -> Self {
        ZstdChannelWriter { inner, switch, encoder: None, out: vec![0; CHUNK] }
    }

    /// What it writes to.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Compresses all of `data` and what zstd holds back, and writes it out.
    fn compress(&mut self, data: &[u8]) -> io::Result<()> {
        let encoder = match &mut self.encoder {
            Some(encoder) => encoder,
            None => self.encoder.insert(Encoder::new(LEVEL).map_err(|e| zstd_err("starting", e))?),
        };
        let mut input = InBuffer::around(data);
        loop {
            let mut output = OutBuffer::around(&mut self.out[..]);
            let remaining = match input.pos() < data.len() {
                true => encoder.run(&mut input, &mut output).map(|_| 1),
                false => encoder.flush(&mut output),
            }
            .map_err(|e| zstd_err("writing", e))?;
            let n = output.pos();
            self.inner.write_all(&self.out[..n])?;
            if input.pos() == data.len() && remaining == 0 {
                return Ok(());
            }
        }
    }
}

impl<W: Write> Write for ZstdChannelWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.switch.is_on() {
            return self.inner.write(buf);
        }
        self.compress(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Reads from `inner`, decoding zstd once its switch is on (see the module doc). The end of
/// `inner` is the end of the stream (the far end never ends its frame).
pub struct ZstdChannelReader<R> {
    inner: R,
    switch: Switch,
    decoder: Option<Decoder<'static>>,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl<R: Read> ZstdChannelReader<R> {
    /// A reader of `inner`, plain until `switch` is on.
    pub fn new(inner: R, switch: Switch) -> Self {
        ZstdChannelReader { inner, switch, decoder: None, buf: vec![0; CHUNK], pos: 0, end: 0 }
    }
}

impl<R: Read> Read for ZstdChannelReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if !self.switch.is_on() || out.is_empty() {
            return self.inner.read(out);
        }
        let decoder = match &mut self.decoder {
            Some(decoder) => decoder,
            None => self.decoder.insert(Decoder::new().map_err(|e| zstd_err("starting", e))?),
        };
        loop {
            // What zstd holds decoded comes out first: with all the input consumed, a read of
            // more would wait for bytes the far end may never send before its answer.
            let mut input = InBuffer::around(&self.buf[self.pos..self.end]);
            let mut output = OutBuffer::around(&mut *out);
            decoder.run(&mut input, &mut output).map_err(|e| zstd_err("reading", e))?;
            self.pos += input.pos();
            if output.pos() > 0 {
                return Ok(output.pos());
            }
            if self.pos == self.end {
                let n = self.inner.read(&mut self.buf)?;
                if n == 0 {
                    return Ok(0);
                }
                (self.pos, self.end) = (0, n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every write is decodable on its own as soon as it is written; bytes written before the
    /// switch are plain.
    #[test]
    fn each_write_is_decodable_at_once_and_the_switch_starts_compression() {
        let switch = Switch::default();
        let mut w = ZstdChannelWriter::new(Vec::new(), switch.clone());
        w.write_all(b"hello ").unwrap();
        switch.on();
        let data: Vec<u8> = (0..200_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        w.write_all(&data).unwrap();
        let first = w.inner.len();
        w.write_all(b"tail").unwrap();
        let wire = w.inner.clone();
        assert_eq!(&wire[..6], b"hello ");
        assert!(first - 6 < data.len() / 4, "{} bytes for {}", first - 6, data.len());
        // Only what the first two writes produced: the reader gets all of the data.
        let rswitch = Switch::default();
        let mut r = ZstdChannelReader::new(&wire[..first], rswitch.clone());
        let mut plain = [0u8; 6];
        r.read_exact(&mut plain).unwrap();
        rswitch.on();
        let mut back = vec![0u8; data.len()];
        r.read_exact(&mut back).unwrap();
        assert_eq!(back, data);
        let mut r = ZstdChannelReader::new(&wire[6..], Switch::on_now());
        let mut all = Vec::new();
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all.len(), data.len() + 4);
        assert_eq!(&all[data.len()..], b"tail");
    }

    /// A write decoded into more than the reader's buffer holds is read whole from what has
    /// arrived, without waiting for more input (which a peer waiting for its answer never
    /// sends): the input below ends where the write's bytes end, and reading past them fails.
    #[test]
    fn decoded_bytes_zstd_holds_are_read_before_more_input() {
        let mut w = ZstdChannelWriter::new(Vec::new(), Switch::on_now());
        let data = vec![7u8; 1 << 20];
        w.write_all(&data).unwrap();
        let mut wire = std::io::Cursor::new(w.inner).chain(FailingRead);
        let mut r = ZstdChannelReader::new(&mut wire, Switch::on_now());
        let mut back = vec![0u8; data.len()];
        for chunk in back.chunks_mut(4096) {
            r.read_exact(chunk).unwrap();
        }
        assert_eq!(back, data);
    }

    /// Input that must not be read: a read waiting for the far end.
    struct FailingRead;

    impl Read for FailingRead {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::Error::other("read past what the far end sent"))
        }
    }
}
