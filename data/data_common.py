#!/usr/bin/python3
"""data/data_common.py: what the dataset preparation scripts (tinyshakespeare.py, tinystories.py, fineweb.py)
share: the tokenizers (GPT-2 through tiktoken, or byte-level), the shard and tokenizer file writers, resumable
downloads, multiprocess tokenization, and the fallback corpus used when the dataset cannot be downloaded.
Not run on its own; the scripts import it. Run with Debian's /usr/bin/python3 (numpy and tqdm from apt,
tiktoken and pyarrow from pip).

File formats (doc/formats.md): a data shard is a 256-int32 little-endian header [20240520, version, ntok]
then ntok tokens, uint16 (version 1) or uint32 (version 2, only for vocabularies over 65535); the tokenizer
file is a 256-int32 header [20240328, 2, V, EOT id] then, per token, one length byte and the token's bytes.
Every document is preceded by the EOT token, as in llm.c, so the model learns where documents start.

Fallback: with no network (or an unreachable dataset host) and nothing downloaded yet, the scripts turn the
King James Bible that Debian's bible-kjv package ships (public domain; read through its `bible` program,
which stores the text compressed) into data/fallback_kjv/, never into the dataset's own directory.
"""
import argparse
import multiprocessing
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request

try:
    import numpy as np
    from tqdm import tqdm
except ImportError as e:
    sys.exit("%s: %s in %s: run with Debian's /usr/bin/python3 after apt-get install python3-numpy python3-tqdm"
             % (os.path.basename(sys.argv[0]), e, sys.executable))

PROG = os.path.basename(sys.argv[0])
DATA_DIR = os.path.dirname(os.path.abspath(__file__))
SHARD_MAGIC = 20240520
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
HEADER_INTS = 256
# Short, so that a machine without network falls back within seconds instead of hanging.
NET_TIMEOUT_S = 10
# the two GPT-2 BPE files (1.5 MB together) may take longer than one connection attempt
BPE_FETCH_TIMEOUT_S = 30
GPT2_EOT_TEXT = b"<|endoftext|>"
FALLBACK_NAME = "fallback_kjv"
FALLBACK_VAL_FRACTION = 0.1


def fail(message):
    sys.exit("%s: %s" % (PROG, message))


class BadInput(Exception):
    """Raised (not sys.exit) inside document generators: they run in the pool's feeder thread, where only an
    Exception reaches the main thread; main turns it into one line and exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option gets one line (not the usage block) and exit status 2."""

    def error(self, message):
        sys.exit("%s: %s (see --help)" % (self.prog, message))


def add_common_arguments(parser):
    parser.add_argument("--tokenizer", choices=["gpt2", "bytes"], default="gpt2",
                        help="gpt2: tiktoken's GPT-2 BPE (V=50257); bytes: one token per byte plus EOT (V=257)")
    parser.add_argument("--data-dir", default=DATA_DIR,
                        help="where the dataset's directory (and fallback_kjv/) go (default: this script's folder)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")


def check_workers(workers):
    if workers < 1:
        fail("--workers %d: expected at least 1" % workers)


def short_reason(error):
    """The first line of the root cause's message, cut short: requests and urllib wrap the socket error that
    says what happened (DNS failure, refused, timed out) in layers of longer messages."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ if error.__cause__ is not None else error.__context__
    if isinstance(error, urllib.error.URLError) and not isinstance(error, urllib.error.HTTPError):
        error = error.reason
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


# ----------------------------------------------------------------------------------------------------------
# tokenizers

class ByteTokenizer:
    """Every UTF-8 byte is a token (0..255); 256 is EOT. The format data/bytes.py writes."""
    name = "bytes"
    vocab_size = 257
    eot = 256

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def token_bytes(self):
        return [bytes([b]) for b in range(256)] + [GPT2_EOT_TEXT]


class Gpt2Tokenizer:
    """tiktoken's GPT-2 encoding: 50256 BPE tokens plus <|endoftext|> (50256) as EOT."""
    name = "gpt2"

    def __init__(self, encoding):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        self.eot = encoding.eot_token

    def encode(self, text):
        # encode_ordinary: a literal "<|endoftext|>" inside a document is text, not a document boundary
        return np.array(self.encoding.encode_ordinary(text), dtype=np.uint32)

    def token_bytes(self):
        return [self.encoding.decode_single_token_bytes(i) for i in range(self.vocab_size)]


def make_tokenizer(name):
    """The tokenizer by name, with no fallback: used in worker processes, after load_tokenizer succeeded."""
    if name == "bytes":
        return ByteTokenizer()
    import tiktoken
    return Gpt2Tokenizer(tiktoken.get_encoding("gpt2"))


def load_tokenizer(name):
    """The requested tokenizer; GPT-2 falls back to bytes, saying why, when tiktoken or its BPE files are missing."""
    if name == "bytes":
        return ByteTokenizer()
    try:
        import tiktoken
    except ImportError:
        print("%s: tiktoken is not installed (pip install tiktoken); using the byte-level tokenizer instead" % PROG)
        return ByteTokenizer()
    # tiktoken downloads the BPE files on first use (then caches them) through requests without a timeout:
    # run it in a daemon thread so that a network that drops packets costs BPE_FETCH_TIMEOUT_S, not minutes.
    result = {}

    def fetch():
        try:
            result["encoding"] = tiktoken.get_encoding("gpt2")
        except Exception as e:  # requests' connection errors, tiktoken's hash mismatch: all mean "no BPE files"
            result["error"] = e

    fetcher = threading.Thread(target=fetch, daemon=True)
    fetcher.start()
    fetcher.join(BPE_FETCH_TIMEOUT_S)
    if "encoding" in result:
        return Gpt2Tokenizer(result["encoding"])
    reason = short_reason(result["error"]) if "error" in result else "timed out after %d s" % BPE_FETCH_TIMEOUT_S
    print("%s: cannot fetch the GPT-2 tokenizer files (%s); using the byte-level tokenizer instead "
          "(outputs are named 'bytes', not 'gpt2')" % (PROG, reason))
    return ByteTokenizer()


_worker_tokenizer = None


def _init_worker(tokenizer_name):
    global _worker_tokenizer
    _worker_tokenizer = make_tokenizer(tokenizer_name)


def _encode_document(text):
    body = _worker_tokenizer.encode(text)
    out = np.empty(len(body) + 1, dtype=np.uint32)
    out[0] = _worker_tokenizer.eot
    out[1:] = body
    return out


def tokenize_documents(texts, tokenizer, workers):
    """Yields, in order, one uint32 array per document: EOT followed by the document's tokens."""
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer.name,)) as pool:
        # chunks of 64 documents amortise the inter-process traffic without holding up the ordered output
        for tokens in pool.imap(_encode_document, texts, chunksize=64):
            yield tokens


# ----------------------------------------------------------------------------------------------------------
# output files

def shard_dtype_and_version(vocab_size):
    if vocab_size > 65535:
        return np.uint32, 2
    return np.uint16, 1


def write_shard(path, token_arrays, vocab_size):
    """Writes the token arrays as one shard, streaming (the header's count is filled in last); returns ntok.
    The file appears under its name only once complete, so an interrupted run never leaves a short shard."""
    dtype, version = shard_dtype_and_version(vocab_size)
    ntok = 0
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(bytes(4 * HEADER_INTS))
        for tokens in token_arrays:
            if len(tokens) and int(tokens.max()) >= vocab_size:
                fail("token %d out of range for vocabulary %d in %s" % (int(tokens.max()), vocab_size, path))
            f.write(np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
            ntok += len(tokens)
        header = [0] * HEADER_INTS
        header[0], header[1], header[2] = SHARD_MAGIC, version, ntok
        f.seek(0)
        f.write(struct.pack("<%di" % HEADER_INTS, *header))
    os.replace(tmp, path)
    return ntok


class ShardWriter:
    """Cuts a token stream into shards of exactly shard_size tokens (the last may be shorter): shard 0 is
    PREFIX_val_000000.bin, the rest PREFIX_train_%06d.bin, as llm.c's FineWeb shards. Returns (path, ntok)s."""

    def __init__(self, prefix, shard_size, vocab_size):
        self.prefix = prefix
        self.shard_size = shard_size
        self.vocab_size = vocab_size
        self.buffer = np.empty(shard_size, dtype=np.uint32)
        self.filled = 0
        self.written = []

    def add(self, tokens):
        while len(tokens):
            take = min(len(tokens), self.shard_size - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_size:
                self.flush()

    def flush(self):
        if self.filled == 0:
            return
        index = len(self.written)
        split = "val" if index == 0 else "train"
        path = "%s_%s_%06d.bin" % (self.prefix, split, index)
        write_shard(path, [self.buffer[:self.filled]], self.vocab_size)
        self.written.append((path, self.filled))
        self.filled = 0


def remove_old_shards(out_dir, prefix):
    """A rerun with another shard size would otherwise leave stale shards that the trainers' globs pick up."""
    base = os.path.basename(prefix) + "_"
    for name in os.listdir(out_dir):
        if name.startswith(base) and name.endswith(".bin"):
            os.remove(os.path.join(out_dir, name))


def write_tokenizer_file(path, tokenizer):
    header = [0] * HEADER_INTS
    header[0], header[1], header[2], header[3] = TOKENIZER_MAGIC, TOKENIZER_VERSION, tokenizer.vocab_size, tokenizer.eot
    tokens = tokenizer.token_bytes()
    if len(tokens) != tokenizer.vocab_size:
        fail("tokenizer %s has %d tokens, expected %d" % (tokenizer.name, len(tokens), tokenizer.vocab_size))
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<%di" % HEADER_INTS, *header))
        for i, token in enumerate(tokens):
            if not 0 < len(token) <= 255:
                fail("token %d of %s is %d bytes long: the format allows 1..255" % (i, tokenizer.name, len(token)))
            f.write(bytes([len(token)]) + token)
    os.replace(path + ".tmp", path)


def tokenizer_file_path(out_dir, tokenizer):
    """TinyShakespeare's gpt2_tokenizer.bin (data/tinyshakespeare/) is the trainers' default -tf file."""
    return os.path.join(out_dir, "%s_tokenizer.bin" % tokenizer.name)


def report(out_dir, written, tokenizer):
    """written: (path, ntok) pairs. One line per file, then the total, so a user sees where everything went."""
    for path, ntok in written:
        print("  %-60s %15s tokens" % (path, format(ntok, ",")))
    total = sum(ntok for _, ntok in written)
    print("%s: %s tokens (%s tokenizer, V=%d) in %d shards under %s; tokenizer file %s" % (
        PROG, format(total, ","), tokenizer.name, tokenizer.vocab_size, len(written), out_dir,
        tokenizer_file_path(out_dir, tokenizer)))


# ----------------------------------------------------------------------------------------------------------
# downloads

class NetworkUnavailable(Exception):
    """The server could not be reached at all (no network, DNS failure, refused, HTTP error before any data)."""


def download(url, path):
    """Downloads url to path unless path exists. Bytes arrive in path.part, which a rerun continues with an
    HTTP Range request; the complete file is renamed to path, so path existing means complete."""
    if os.path.exists(path):
        return
    part = path + ".part"
    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"Range": "bytes=%d-" % have} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=NET_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left past what we have: the previous run got it all
            os.replace(part, path)
            return
        raise NetworkUnavailable("%s: HTTP %d %s" % (url, e.code, e.reason))
    except (urllib.error.URLError, OSError) as e:
        raise NetworkUnavailable("%s: %s" % (url, short_reason(e)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # only now: no empty dataset dir on fallback
    with response:
        if have and response.status != 206:  # the server ignored the range: start over
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        try:
            with open(part, "ab" if have else "wb") as f, \
                    tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=os.path.basename(path)) as bar:
                while True:
                    chunk = response.read(1 << 20)
                    if not chunk:
                        break
                    f.write(chunk)
                    bar.update(len(chunk))
        except OSError as e:
            fail("download of %s interrupted (%s); rerun to resume from the %s bytes in %s"
                 % (url, short_reason(e), format(os.path.getsize(part), ","), part))
    got = os.path.getsize(part)
    if total is not None and got != total:
        fail("download of %s stopped at %s of %s bytes; rerun to resume from %s"
             % (url, format(got, ","), format(total, ","), part))
    os.replace(part, path)


def download_all(urls_and_paths):
    """Downloads every (url, path); returns None when all are here. When the first server cannot be reached
    and no file of the set is present yet, returns why, having downloaded nothing: the caller falls back. Once
    something of the set is here, an unreachable server is an error to retry, not a reason to switch corpus."""
    for url, path in urls_and_paths:
        try:
            download(url, path)
        except NetworkUnavailable as e:
            started = any(os.path.exists(p) or os.path.exists(p + ".part") for _, p in urls_and_paths)
            if not started:
                return "cannot download %s" % e
            fail("cannot download %s; rerun to resume where it stopped" % e)
    return None


# ----------------------------------------------------------------------------------------------------------
# the fallback corpus

def kjv_books():
    """The 66 books of the King James Bible, one text per book: chapters separated by a blank line, one verse
    per line, verse references removed. `bible -f` prints 'Ge1:1 In the beginning ...', one verse a line."""
    bible = shutil.which("bible") or "/usr/bin/bible"
    if not os.path.exists(bible):
        fail("no fallback corpus either: the `bible` program is missing (apt-get install bible-kjv)")
    result = subprocess.run([bible, "-f", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL, capture_output=True)
    if result.returncode != 0:
        fail("%s failed (exit status %d): %s" % (bible, result.returncode, result.stderr.decode(errors="replace")))
    verse = re.compile(r"^([0-9]?[A-Za-z]+)([0-9]+):[0-9]+ (.*)$")
    books = []  # [book, chapter, [chapter texts]]
    for line in result.stdout.decode("ascii").splitlines():
        m = verse.match(line)
        if not m:
            fail("unexpected line from %s: %r" % (bible, line[:80]))
        book, chapter, text = m.group(1), m.group(2), m.group(3)
        if not books or books[-1][0] != book:
            books.append([book, None, []])
        if books[-1][1] != chapter:
            books[-1][1] = chapter
            books[-1][2].append([])
        books[-1][2][-1].append(text)
    return ["\n\n".join("\n".join(verses) for verses in chapters) + "\n" for _, _, chapters in books]


def split_document(text, val_fraction):
    """(train part, val part) of one document, cut at the line boundary nearest to 1 - val_fraction."""
    cut = text.rfind("\n", 0, int(len(text) * (1.0 - val_fraction))) + 1
    return text[:cut], text[cut:]


def prepare_fallback(data_dir, tokenizer, workers, reason):
    """Writes the fallback corpus to DATA_DIR/fallback_kjv/, saying why (reason) in one line: every book a
    document, its last 10% (at a verse boundary) to val, the rest to train."""
    out_dir = os.path.join(data_dir, FALLBACK_NAME)
    print("%s: %s; falling back to the King James Bible (Debian package bible-kjv), written to %s, "
          "not under the dataset's name" % (PROG, reason, out_dir))
    books = kjv_books()
    halves = [split_document(book, FALLBACK_VAL_FRACTION) for book in books]
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, "%s_%s" % (FALLBACK_NAME, tokenizer.name))
    written = []
    for split, index in (("val", 1), ("train", 0)):
        path = "%s_%s.bin" % (prefix, split)
        texts = [pair[index] for pair in halves]
        written.append((path, write_shard(path, tokenize_documents(texts, tokenizer, workers), tokenizer.vocab_size)))
    write_tokenizer_file(tokenizer_file_path(out_dir, tokenizer), tokenizer)
    report(out_dir, written, tokenizer)
