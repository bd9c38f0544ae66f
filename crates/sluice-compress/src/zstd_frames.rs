//! zstd as independent frames: the encoder Nix writes with (`ZstdMultiFrameCompressionSink`
//! in Nix's `src/libutil/compression.cc`: a frame per 16 MiB of input, each pledged at its
//! exact size so that its header carries its content size), and a decoder that decodes such
//! frames on several cores at once, in order, with bounded memory.
//!
//! Decoding. The caller's thread reads the input one whole frame at a time (its end is found
//! from its block headers, `ZSTD_findFrameCompressedSize`) and decodes the frame it must
//! return next itself; while it does, the following frames go to the helper threads, as many
//! as are free. The helpers (the cores but one) are started once and live for the process,
//! fed through one channel and shared by every reader: at most that many frames are decoded
//! by helpers at once, whatever the number of NARs being read. Buffers are reused: every
//! reader takes the buffers it decodes into and gathers input into from a pool of the process
//! and gives them back, so a frame costs no fresh 16 MiB allocation whose pages the kernel must
//! fault in and zero (jemalloc returns each freed allocation above 8 MiB to the kernel at
//! once; a reader per NAR with buffers of its own made a verify of 16 NARs of 64 MiB fault in
//! 1.26 GiB). Memory is therefore bounded by (helper threads) × ([`MAX_FRAME`] of output + its
//! compressed bytes) over the process, plus, per reader, the frame being returned and the frame
//! being gathered, plus, while any reader lives, the pool's [`POOLED`] buffers of each kind of
//! at most [`POOLED_CAPACITY`] bytes (emptied when the last reader ends). A frame without a
//! content size in its header, or with one above [`MAX_FRAME`] (one stream, as `zstd` and Nix
//! before 2.35 write it), ends the frame-wise decoding: the rest of the input goes through the
//! streaming decoder as before.

use std::collections::VecDeque;
use std::io::{self, Cursor, Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, PoisonError};

/// Uncompressed bytes per frame the encoder writes (Nix's `bytesPerFrame`).
pub(crate) const FRAME_SIZE: usize = 16 * 1024 * 1024;

/// Largest content size (bytes) of a frame decoded whole; larger frames are streamed.
pub(super) const MAX_FRAME: u64 = 64 * 1024 * 1024;

/// Bytes asked of the input per read while a frame is gathered.
const READ_CHUNK: usize = 256 * 1024;

/// Unused buffers of each kind (output, input) the pool keeps at most: a reader uses up to
/// three of each at once (the frame returned, the frame it decodes, a frame at a helper),
/// enough for two readers and their helper frames.
const POOLED: usize = 8;

/// Capacity (bytes) of the largest buffer the pool keeps: a frame of Nix's size, with room.
const POOLED_CAPACITY: usize = 2 * FRAME_SIZE;

/// The helper threads: where their jobs go, and how many there are.
struct Helpers {
    jobs: mpsc::Sender<Job>,
    threads: usize,
    /// Helpers decoding a frame now.
    busy: AtomicUsize,
}

/// The process's helper threads (the cores but the one a reader runs on), started on first
/// use; `None` if none could be started (every frame is then decoded by its reader).
fn helpers() -> Option<&'static Helpers> {
    static HELPERS: OnceLock<Option<Helpers>> = OnceLock::new();
    HELPERS
        .get_or_init(|| {
            let wanted = crate::cores().saturating_sub(1);
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let mut threads = 0;
            for i in 0..wanted {
                let rx = rx.clone();
                if std::thread::Builder::new().name(format!("zstd-frames-{i}")).spawn(move || helper(&rx)).is_ok() {
                    threads += 1;
                }
            }
            (threads > 0).then_some(Helpers { jobs: tx, threads, busy: AtomicUsize::new(0) })
        })
        .as_ref()
}

/// A helper thread: decodes the frames sent to it, one at a time, with one decompression
/// context it keeps.
fn helper(jobs: &Mutex<mpsc::Receiver<Job>>) {
    let mut dctx = Dctx::default();
    loop {
        let job = jobs.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(Job { frame, mut out, reply, slot }) = job else { return };
        let result = dctx.decode(&frame, &mut out);
        drop(slot);
        let _ = reply.send(Decoded { frame, out, result });
    }
}

/// A helper's slot, taken before a job is sent and released when the job is decoded.
struct HelperSlot(&'static Helpers);

impl HelperSlot {
    fn try_take() -> Option<HelperSlot> {
        let helpers = helpers()?;
        helpers.busy.fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| (busy < helpers.threads).then_some(busy + 1)).ok()?;
        Some(HelperSlot(helpers))
    }

    /// Sends `frame` to the helpers, to be decoded into `out`; the answer comes on the
    /// returned receiver.
    fn send(self, frame: Frame, out: Vec<u8>) -> mpsc::Receiver<Decoded> {
        let (reply, rx) = mpsc::sync_channel(1);
        let helpers = self.0;
        // The helpers never stop while the process runs, so the send cannot fail; if it did,
        // the dropped reply says so to the reader.
        let _ = helpers.jobs.send(Job { frame, out, reply, slot: self });
        rx
    }
}

impl Drop for HelperSlot {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A frame for a helper: decode `frame` into `out`, answer on `reply`.
struct Job {
    frame: Frame,
    out: Vec<u8>,
    reply: mpsc::SyncSender<Decoded>,
    slot: HelperSlot,
}

/// A helper's answer: the frame's buffers back, `out` holding its content if `result` is `Ok`.
struct Decoded {
    frame: Frame,
    out: Vec<u8>,
    result: io::Result<()>,
}

/// The content size of the frame `head` starts if [`FrameDecoder`] decodes it whole: a
/// frame (not a skippable one) whose header holds a content size of at most [`MAX_FRAME`].
pub(super) fn whole_frame_size(head: &[u8]) -> Option<usize> {
    match zstd::zstd_safe::get_frame_content_size(head) {
        Ok(Some(n)) if n <= MAX_FRAME && !super::skippable_frame(head) => Some(n as usize),
        _ => None,
    }
}

/// One frame, compressed: `len` bytes of `bytes` from `start` (the rest is input around it or
/// spare room of a reused buffer), and its content size in bytes.
struct Frame {
    bytes: Vec<u8>,
    start: usize,
    len: usize,
    content_size: usize,
}

/// A zstd decompression context, made on first use and kept.
#[derive(Default)]
struct Dctx(Option<zstd::bulk::Decompressor<'static>>);

impl Dctx {
    /// Decodes `frame` into `out` (cleared first; its capacity is reused). Fails unless the
    /// output is exactly the header's content size (zstd checks it, and `out` has no room for
    /// more).
    fn decode(&mut self, frame: &Frame, out: &mut Vec<u8>) -> io::Result<()> {
        let dctx = match &mut self.0 {
            Some(d) => d,
            None => self.0.insert(zstd::bulk::Decompressor::new()?),
        };
        out.clear();
        out.reserve_exact(frame.content_size);
        dctx.decompress_to_buffer(&frame.bytes[frame.start..frame.start + frame.len], out)?;
        match out.len() == frame.content_size {
            true => Ok(()),
            false => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("corrupt zstd frame: {} bytes of content where its header says {}", out.len(), frame.content_size),
            )),
        }
    }
}

/// A frame in order: to be decoded by the reader, or being decoded by a helper.
enum Slot {
    Here(Frame),
    Helper(mpsc::Receiver<Decoded>),
}

/// Decodes a zstd input frame by frame on several cores (see the module documentation).
pub(super) struct FrameDecoder<'a> {
    input: Box<dyn Read + Send + 'a>,
    /// Input read past the last frame taken: `pending[start..filled]` (before it, frames taken
    /// already; after it, room, initialised once). Taking a frame moves `start` past it, so
    /// that a frame costs the copy of itself or of what follows it, whichever is shorter, not
    /// of the whole rest of the buffer: the buffer is compacted only when it needs room, then
    /// holding the start of one frame, at most once per frame.
    pending: Vec<u8>,
    start: usize,
    filled: usize,
    input_done: bool,
    /// Frames taken from the input, in order, not returned yet.
    slots: VecDeque<Slot>,
    /// The decoded frame being returned, and how much of it was.
    out: Vec<u8>,
    out_pos: usize,
    /// The context of the frames this thread decodes.
    dctx: Dctx,
    /// The streaming decoder of the rest of the input, once a frame is not decoded whole.
    rest: Option<Box<dyn Read + Send + 'a>>,
}

/// Buffers for decoded frames, and for gathering input, not in use: every reader takes its
/// buffers from these and gives them back.
static POOL_OUT: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
static POOL_IN: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A buffer from `pool`, or a new empty one.
fn reuse(pool: &Mutex<Vec<Vec<u8>>>) -> Vec<u8> {
    pool.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default()
}

/// A buffer from [`POOL_IN`] that starts with `bytes` (what follows them is room, initialised
/// before and kept so).
fn spare_with(bytes: &[u8]) -> Vec<u8> {
    let mut spare = reuse(&POOL_IN);
    if spare.len() < bytes.len() {
        spare.resize(bytes.len(), 0);
    }
    spare[..bytes.len()].copy_from_slice(bytes);
    spare
}

/// Gives `buf` back to `pool` if it has room for it ([`POOLED`], [`POOLED_CAPACITY`]).
fn give_back(pool: &Mutex<Vec<Vec<u8>>>, buf: Vec<u8>) {
    if buf.capacity() > 0 && buf.capacity() <= POOLED_CAPACITY {
        let mut pool = pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < POOLED {
            pool.push(buf);
        }
    }
}

/// Readers alive: the pools are emptied when the last one ends, so that an idle process
/// holds none of their memory.
static READERS: AtomicUsize = AtomicUsize::new(0);

impl Drop for FrameDecoder<'_> {
    /// Gives the reader's buffers back before it stops counting, so that the reader ending
    /// last empties the pools after every other reader gave its buffers back.
    fn drop(&mut self) {
        give_back(&POOL_OUT, std::mem::take(&mut self.out));
        give_back(&POOL_IN, std::mem::take(&mut self.pending));
        if READERS.fetch_sub(1, Ordering::AcqRel) == 1 {
            for pool in [&POOL_OUT, &POOL_IN] {
                pool.lock().unwrap_or_else(PoisonError::into_inner).clear();
            }
        }
    }
}

impl<'a> FrameDecoder<'a> {
    pub(super) fn new(input: Box<dyn Read + Send + 'a>) -> Self {
        READERS.fetch_add(1, Ordering::AcqRel);
        FrameDecoder {
            input,
            pending: Vec::new(),
            start: 0,
            filled: 0,
            input_done: false,
            slots: VecDeque::new(),
            out: Vec::new(),
            out_pos: 0,
            dctx: Dctx::default(),
            rest: None,
        }
    }

    /// Moves the input not taken yet (`pending[start..filled]`) to the front of `pending`.
    fn compact(&mut self) {
        if self.start > 0 {
            self.pending.copy_within(self.start..self.filled, 0);
            self.filled -= self.start;
            self.start = 0;
        }
    }

    /// Reads more input into `pending` (compacted first when it lacks room), growing it
    /// (geometrically, within its capacity first: a reused buffer seldom grows) when it has less
    /// than [`READ_CHUNK`] of room; false
    /// at the input's end. While its capacity has room, it does not grow past it: a frame's
    /// buffer is reserved for the whole frame ([`FrameDecoder::next_frame`]), and grown to
    /// twice that for the last pieces of a frame read in short pieces, the pool would not keep
    /// it.
    fn fill(&mut self) -> io::Result<bool> {
        if self.input_done {
            return Ok(false);
        }
        if self.pending.len() - self.filled < READ_CHUNK {
            self.compact();
        }
        if self.pending.len() - self.filled < READ_CHUNK {
            let capacity = self.pending.capacity();
            let len = match self.filled < capacity {
                true => (self.filled + READ_CHUNK).min(capacity).max((2 * self.pending.len()).min(capacity)),
                false => self.filled + READ_CHUNK,
            };
            self.pending.resize(len, 0);
        }
        let n = loop {
            match self.input.read(&mut self.pending[self.filled..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other?,
            }
        };
        self.filled += n;
        self.input_done = n == 0;
        Ok(!self.input_done)
    }

    /// The next frame to decode whole; `None` at the end of the input, or when the next frame
    /// is to be streamed (then `rest` is set).
    fn next_frame(&mut self) -> io::Result<Option<Frame>> {
        if self.rest.is_some() {
            return Ok(None);
        }
        // A frame header is at most 18 bytes.
        while self.filled - self.start < 18 && self.fill()? {}
        let head = &self.pending[self.start..self.filled];
        if head.is_empty() {
            return Ok(None);
        }
        let Some(content_size) = whole_frame_size(head) else {
            let head = Cursor::new(head.to_vec());
            let rest = head.chain(std::mem::replace(&mut self.input, Box::new(io::empty())));
            self.rest = Some(Box::new(super::zstd_stream::StreamDecoder::new(io::BufReader::new(rest))));
            return Ok(None);
        };
        let bound = zstd::zstd_safe::compress_bound(content_size) + 1024;
        loop {
            if let Ok(len) = zstd::zstd_safe::find_frame_compressed_size(&self.pending[self.start..self.filled]) {
                return Ok(Some(self.take_frame(len, content_size)));
            }
            if self.filled - self.start > bound {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("corrupt zstd frame: no end within {bound} bytes for {content_size} bytes of content"),
                ));
            }
            // Room for the whole frame at once: a buffer grown step by step is reallocated, and
            // each large buffer given back to the allocator is returned to the kernel at once
            // (jemalloc's arena for allocations above 8 MiB), to be faulted in again.
            if self.pending.capacity() - self.start < bound {
                self.compact();
                self.pending.reserve_exact(bound.saturating_sub(self.pending.len()));
            }
            if !self.fill()? {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the zstd data ends inside a frame"));
            }
        }
    }

    /// Takes the frame of `len` bytes at `pending[start..]`: copied out into a spare buffer when
    /// more input follows it than it has bytes, else the whole buffer becomes the frame's and
    /// what follows it is copied to a spare buffer, which becomes `pending`.
    fn take_frame(&mut self, len: usize, content_size: usize) -> Frame {
        let (start, after) = (self.start, self.filled - self.start - len);
        if after > len {
            self.start += len;
            return Frame { bytes: spare_with(&self.pending[start..start + len]), start: 0, len, content_size };
        }
        let spare = spare_with(&self.pending[start + len..self.filled]);
        (self.start, self.filled) = (0, after);
        Frame { bytes: std::mem::replace(&mut self.pending, spare), start, len, content_size }
    }

    /// Takes frames from the input while helpers are free to decode them ahead, and always
    /// one for this thread when none is taken.
    fn top_up(&mut self) -> io::Result<()> {
        loop {
            let helper = match self.slots.is_empty() {
                true => None,
                false => match HelperSlot::try_take() {
                    Some(slot) => Some(slot),
                    None => return Ok(()),
                },
            };
            let Some(frame) = self.next_frame()? else { return Ok(()) };
            self.slots.push_back(match helper {
                None => Slot::Here(frame),
                Some(helper) => Slot::Helper(helper.send(frame, reuse(&POOL_OUT))),
            });
        }
    }

    /// The next frame decoded into `out`; false when no frame is left to decode whole.
    fn next_decoded(&mut self) -> io::Result<bool> {
        give_back(&POOL_OUT, std::mem::take(&mut self.out));
        self.out_pos = 0;
        self.top_up()?;
        let decoded = match self.slots.pop_front() {
            Some(Slot::Here(frame)) => {
                let mut out = reuse(&POOL_OUT);
                let result = self.dctx.decode(&frame, &mut out);
                Decoded { frame, out, result }
            }
            Some(Slot::Helper(rx)) => rx.recv().map_err(|_| io::Error::other("a zstd decoding thread stopped"))?,
            None => return Ok(false),
        };
        let Decoded { frame, out, result } = decoded;
        give_back(&POOL_IN, frame.bytes);
        match result {
            Ok(()) => {
                self.out = out;
                Ok(true)
            }
            Err(e) => {
                give_back(&POOL_OUT, out);
                Err(e)
            }
        }
    }
}

impl Read for FrameDecoder<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let left = &self.out[self.out_pos..];
            if !left.is_empty() || buf.is_empty() {
                let n = left.len().min(buf.len());
                buf[..n].copy_from_slice(&left[..n]);
                self.out_pos += n;
                return Ok(n);
            }
            if !self.next_decoded()? {
                return self.rest.as_mut().map_or(Ok(0), |rest| rest.read(buf));
            }
        }
    }
}

/// Writes zstd as independent frames of [`FRAME_SIZE`] input bytes, each with its content
/// size, on up to 4 cores per frame when parallel (Nix's `ZstdMultiFrameCompressionSink`).
/// Its compression context comes from, and goes back to, `KEPT_COMPRESSORS`.
pub struct FrameEncoder<W: Write> {
    out: W,
    frame: Vec<u8>,
    compressor: zstd::bulk::Compressor<'static>,
    /// The level and the workers per frame the context was set up for.
    setup: (i32, u32),
    wrote_frame: bool,
}

/// Compression contexts kept when their encoder finishes, for the next encoder of the same
/// level and workers: making a context (and its tables) per NAR was 2.6 % of the CPU of a push
/// of many small paths (`ZSTD_createCCtx`, perf). At most [`KEEP_COMPRESSORS`] are kept, a few
/// MiB at level 3.
static KEPT_COMPRESSORS: Mutex<Vec<((i32, u32), zstd::bulk::Compressor<'static>)>> = Mutex::new(Vec::new());

/// How many compression contexts [`KEPT_COMPRESSORS`] holds at most: a push compresses at most
/// 4 NARs per core at once (`BinaryCache::parallelism`).
const KEEP_COMPRESSORS: usize = 16;

impl<W: Write> FrameEncoder<W> {
    /// `level`: zstd's compression level; `threads`: workers per frame (Nix caps them at 4).
    pub(super) fn new(out: W, level: i32, threads: u32) -> io::Result<Self> {
        let setup = (level, if threads > 1 { threads.min(4) } else { 0 });
        let kept = {
            let mut kept = KEPT_COMPRESSORS.lock().unwrap_or_else(PoisonError::into_inner);
            kept.iter().position(|(s, _)| *s == setup).map(|i| kept.swap_remove(i).1)
        };
        let compressor = match kept {
            Some(c) => c,
            None => {
                let mut c = zstd::bulk::Compressor::new(level)?;
                if setup.1 > 0 {
                    c.set_parameter(zstd::zstd_safe::CParameter::NbWorkers(setup.1))?;
                }
                c
            }
        };
        Ok(FrameEncoder { out, frame: Vec::new(), compressor, setup, wrote_frame: false })
    }

    fn emit_frame(&mut self) -> io::Result<()> {
        let packed = self.compressor.compress(&self.frame)?;
        self.out.write_all(&packed)?;
        self.frame.clear();
        self.wrote_frame = true;
        Ok(())
    }

    /// Writes the last frame (an empty one if nothing was written: a zstd stream has at least
    /// one frame) and returns the writer underneath.
    pub fn finish(mut self) -> io::Result<W> {
        if !self.frame.is_empty() || !self.wrote_frame {
            self.emit_frame()?;
        }
        let mut kept = KEPT_COMPRESSORS.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < KEEP_COMPRESSORS {
            kept.push((self.setup, self.compressor));
        }
        Ok(self.out)
    }
}

impl<W: Write> Write for FrameEncoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(FRAME_SIZE - self.frame.len());
        self.frame.extend_from_slice(&buf[..n]);
        if self.frame.len() == FRAME_SIZE {
            self.emit_frame()?;
        }
        Ok(n)
    }

    /// Frames are written whole: flushes only the writer underneath.
    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Compressible data that is not all alike, `len` bytes.
    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7 + i / 4099) % 251) as u8).collect()
    }

    fn encode(input: &[u8], threads: u32) -> Vec<u8> {
        let mut e = FrameEncoder::new(Vec::new(), 3, threads).unwrap();
        e.write_all(input).unwrap();
        e.finish().unwrap()
    }

    /// Held by each test that makes readers (here and in the crate's), so that the pools'
    /// tests see only their own.
    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        static SERIAL: Mutex<()> = Mutex::new(());
        SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The capacities of the buffers `pool` holds.
    fn pooled(pool: &Mutex<Vec<Vec<u8>>>) -> Vec<usize> {
        pool.lock().unwrap().iter().map(Vec::capacity).collect()
    }

    fn decode(packed: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        FrameDecoder::new(Box::new(packed)).read_to_end(&mut out)?;
        Ok(out)
    }

    /// The encoder cuts a frame per 16 MiB, each with its content size; the decoder gives
    /// the input back, as the streaming decoder does.
    #[test]
    fn frames_round_trip() {
        let _serial = serial();
        let input = data(2 * FRAME_SIZE + 12345);
        let packed = encode(&input, 2);
        let first = zstd::zstd_safe::find_frame_compressed_size(&packed).unwrap();
        assert_eq!(zstd::zstd_safe::get_frame_content_size(&packed).unwrap(), Some(FRAME_SIZE as u64));
        let second = zstd::zstd_safe::find_frame_compressed_size(&packed[first..]).unwrap();
        let third = &packed[first + second..];
        assert_eq!(zstd::zstd_safe::get_frame_content_size(third).unwrap(), Some(12345));
        assert_eq!(zstd::zstd_safe::find_frame_compressed_size(third).unwrap(), third.len());
        assert_eq!(decode(&packed).unwrap(), input);
        assert_eq!(zstd::stream::decode_all(&packed[..]).unwrap(), input);
    }

    /// Readers on several threads at once share the process's helpers (a reader that finds
    /// none free decodes its frames itself) and reuse their buffers from frame to frame, the
    /// last frame being shorter than the buffer it reuses: each gets its own input back.
    #[test]
    fn concurrent_readers_share_helpers_and_reuse_buffers() {
        let _serial = serial();
        let inputs: Vec<Vec<u8>> = (0..4).map(|i| data(3 * FRAME_SIZE + 1000 * i)).collect();
        let packed: Vec<Vec<u8>> = inputs.iter().map(|input| encode(input, 1)).collect();
        std::thread::scope(|s| {
            let readers: Vec<_> = packed.iter().map(|p| s.spawn(move || decode(p).unwrap())).collect();
            for (reader, input) in readers.into_iter().zip(&inputs) {
                assert!(reader.join().unwrap() == *input);
            }
        });
    }

    /// A reader gives its buffers back to the process's pools for the next reader while any
    /// reader lives (a reader per NAR with buffers of its own faulted in fresh 16 MiB buffers
    /// for each), and the last reader to end empties them.
    #[test]
    fn readers_reuse_the_pools_buffers_and_the_last_empties_them() {
        let _serial = serial();
        let input = data(3 * FRAME_SIZE);
        let packed = encode(&input, 1);
        let alive = FrameDecoder::new(Box::new(&b""[..]));
        assert_eq!(decode(&packed).unwrap(), input);
        let (out, gathered) = (pooled(&POOL_OUT), pooled(&POOL_IN));
        assert!(!out.is_empty() && out.iter().all(|&c| c >= FRAME_SIZE), "{out:?}");
        assert!(!gathered.is_empty() && gathered.iter().all(|&c| c <= POOLED_CAPACITY), "{gathered:?}");
        assert_eq!(decode(&packed).unwrap(), input);
        assert!(pooled(&POOL_OUT).len() <= POOLED);
        drop(alive);
        assert_eq!((pooled(&POOL_OUT), pooled(&POOL_IN)), (vec![], vec![]));
    }

    /// A reader that ends counts as alive until its buffers are back in the pools, so that the
    /// reader ending last empties the pools after them. Before, it stopped counting first: a
    /// reader ending meanwhile, last, emptied the pools, then the first gave its buffers back,
    /// held with no reader alive. Here the first one's giving back waits on the pool's lock.
    #[test]
    fn an_ending_reader_counts_until_its_buffers_are_back() {
        let _serial = serial();
        let packed = zstd::bulk::compress(&data(4096), 1).unwrap();
        let mut ending = FrameDecoder::new(Box::new(&packed[..]));
        ending.read_exact(&mut [0u8]).unwrap();
        let last = FrameDecoder::new(Box::new(&b""[..]));
        let counted = std::thread::scope(|s| {
            let pool = POOL_OUT.lock().unwrap();
            let dropping = s.spawn(move || drop(ending));
            std::thread::sleep(std::time::Duration::from_millis(200));
            let counted = READERS.load(Ordering::Acquire);
            drop(pool);
            dropping.join().unwrap();
            counted
        });
        assert_eq!(counted, 2, "a reader stopped counting before its buffers were back");
        assert_eq!(pooled(&POOL_OUT).len(), 1);
        drop(last);
        assert_eq!((pooled(&POOL_OUT), pooled(&POOL_IN), READERS.load(Ordering::Acquire)), (vec![], vec![], 0));
    }

    /// A frame that hardly compresses, read in short pieces (as from a pipe or an HTTP body),
    /// is gathered within the buffer sized for it, which goes back to the pool for the next
    /// frame: before, the last pieces grew it to twice its size, past what the pool keeps, and
    /// every such frame's buffer was a fresh allocation.
    #[test]
    fn a_frame_read_in_short_pieces_is_gathered_in_a_buffer_the_pool_keeps() {
        struct Short<'a>(&'a [u8]);
        impl Read for Short<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = buf.len().min(16 * 1024).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let _serial = serial();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let input: Vec<u8> = (0..2 * FRAME_SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let packed = encode(&input, 1);
        let alive = FrameDecoder::new(Box::new(&b""[..]));
        let mut out = Vec::new();
        FrameDecoder::new(Box::new(Short(&packed))).read_to_end(&mut out).unwrap();
        assert!(out == input);
        let gathered = pooled(&POOL_IN);
        assert!(gathered.iter().any(|&c| c >= FRAME_SIZE), "{gathered:?}");
        drop(alive);
    }

    /// A hostile cache's NAR as frames of at most 64 compressed bytes each decodes in time
    /// linear in its size: taking a frame copied all the input read after it to the front of the
    /// buffer, up to 256 KiB per frame.
    #[test]
    fn tiny_frames_decode_in_linear_time() {
        let _serial = serial();
        let nar = sluice_nix::nar::writer::regular_file_nar(&data(4 << 20), false);
        let mut c = zstd::bulk::Compressor::new(1).unwrap();
        let frames: Vec<Vec<u8>> = nar.chunks(48).map(|chunk| c.compress(chunk).unwrap()).collect();
        assert!(frames.iter().all(|f| f.len() <= 64), "{:?}", frames.iter().map(Vec::len).max());
        let packed = frames.concat();
        let started = std::time::Instant::now();
        let mut out = Vec::new();
        crate::Compression::Zstd.decoder(&packed[..]).unwrap().read_to_end(&mut out).unwrap();
        let took = started.elapsed();
        assert!(out == nar, "{} bytes decoded of {}", out.len(), nar.len());
        // 1.3 s in a debug build on a loaded machine; 38 s before.
        assert!(took < std::time::Duration::from_secs(12), "{} frames took {took:?}", frames.len());
    }

    /// Nothing written is one empty frame.
    #[test]
    fn empty_input_is_one_empty_frame() {
        let _serial = serial();
        let packed = encode(b"", 1);
        assert_eq!(zstd::zstd_safe::get_frame_content_size(&packed).unwrap(), Some(0));
        assert_eq!(decode(&packed).unwrap(), b"");
    }

    /// Frames without a content size (a stream, as `zstd` writes it) after whole frames are
    /// streamed; skippable frames are skipped.
    #[test]
    fn streamed_frames_follow_whole_ones() {
        let _serial = serial();
        let (a, b) = (data(100_000), data(300_000));
        let mut packed = encode(&a, 1);
        packed.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
        let mut stream = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        stream.write_all(&b).unwrap();
        packed.extend(stream.finish().unwrap());
        assert_eq!(decode(&packed).unwrap(), [a, b].concat());
    }

    /// A frame cut short, or with a wrong checksum, fails; nothing is made up.
    #[test]
    fn damaged_frames_fail() {
        let _serial = serial();
        let input = data(FRAME_SIZE + 1000);
        let packed = {
            let mut c = zstd::bulk::Compressor::new(3).unwrap();
            c.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true)).unwrap();
            [c.compress(&input[..FRAME_SIZE]).unwrap(), c.compress(&input[FRAME_SIZE..]).unwrap()].concat()
        };
        assert_eq!(decode(&packed).unwrap(), input);
        let cut = decode(&packed[..packed.len() - 3]).unwrap_err();
        assert_eq!(cut.kind(), io::ErrorKind::UnexpectedEof, "{cut}");
        let mut flipped = packed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(decode(&flipped).is_err());
    }
}
