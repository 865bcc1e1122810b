#!/usr/bin/python3
"""dev/test/test_data.py: tests the dataset preparation scripts (data/tinyshakespeare.py, tinystories.py,
fineweb.py, instructions.py and data/data_common.py) on small inputs made here and served by a local HTTP server: the shard
and tokenizer file formats, token counts computed independently from the inputs, the text decoded back from
the shards, resumed downloads, the fallback to the King James Bible with the network cut off (through a
proxy that refuses connections), and one-line errors for bad input.

    /usr/bin/python3 dev/test/test_data.py

Needs python3-numpy, python3-tqdm, bible-kjv (apt) and pyarrow (pip). Ends with "test_data: N passed,
N failed"; exits 1 if anything failed.
"""
import http.server
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA = os.path.join(ROOT, "data")
sys.path.insert(0, DATA)
import data_common  # noqa: E402 (after the path is set)

passed = 0
failed = 0
server_url = None  # the local HTTP server's address, set by main()


def check(condition, what):
    global passed, failed
    if condition:
        passed += 1
    else:
        failed += 1
        print("FAIL: %s" % what)


# ----------------------------------------------------------------------------------------------------------
# readers written from the format description, independent of data_common's writers

def read_shard(path):
    """(version, tokens) of a shard; checks the header against the file size."""
    with open(path, "rb") as f:
        blob = f.read()
    header = struct.unpack("<256i", blob[:1024])
    assert header[0] == 20240520, "%s: magic %d" % (path, header[0])
    width = {1: 2, 2: 4}[header[1]]
    assert len(blob) == 1024 + width * header[2], "%s: %d bytes for %d tokens" % (path, len(blob), header[2])
    tokens = np.frombuffer(blob[1024:], dtype="<u2" if width == 2 else "<u4")
    return header[1], tokens


def read_tokenizer(path):
    """(V, EOT, [token bytes]) of a tokenizer file."""
    with open(path, "rb") as f:
        blob = f.read()
    header = struct.unpack("<256i", blob[:1024])
    assert header[0] == 20240328 and header[1] == 2, "%s: header %r" % (path, header[:2])
    tokens, pos = [], 1024
    for _ in range(header[2]):
        n = blob[pos]
        tokens.append(blob[pos + 1:pos + 1 + n])
        pos += 1 + n
    assert pos == len(blob), "%s: %d trailing bytes" % (path, len(blob) - pos)
    return header[2], header[3], tokens


def byte_documents(tokens):
    """Byte-level tokens (EOT = 256) back to the list of documents' bytes; the stream must start with EOT."""
    assert len(tokens) and tokens[0] == 256, "the stream does not start with EOT"
    cuts = list(np.flatnonzero(tokens == 256)) + [len(tokens)]
    return [bytes(tokens[a + 1:b].astype(np.uint8)) for a, b in zip(cuts[:-1], cuts[1:])]


# ----------------------------------------------------------------------------------------------------------
# a local HTTP server with Range support, and a way to cut one response short

class Files:
    content = {}  # url path -> bytes
    cut_next = {}  # url path -> bytes to send before hanging up, once (Content-Length still says all)
    ranges = []  # the Range headers received, in order


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = Files.content.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        Files.ranges.append(rng)
        if rng:
            start = int(rng.split("=")[1].rstrip("-"))
            if start >= len(body):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", "bytes %d-%d/%d" % (start, len(body) - 1, len(body)))
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        cut = Files.cut_next.pop(self.path, None)
        self.wfile.write(body[start:] if cut is None else body[start:start + cut])
        self.close_connection = True

    def log_message(self, *args):
        pass


def start_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return "http://127.0.0.1:%d" % server.server_address[1]


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(offline):
    """The scripts' environment: proxies cleared so that 127.0.0.1 is reached directly, or (offline) every
    request sent to a proxy port where nothing listens, which is what no network looks like to them."""
    proxies = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
    env = {k: v for k, v in os.environ.items() if k.lower() not in proxies}
    if offline:
        dead = "http://127.0.0.1:%d" % closed_port()
        env.update(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead)
        # an empty tiktoken cache: the GPT-2 BPE files must be fetched, and cannot be
        env["TIKTOKEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiktoken_cache_")
    return env


def one_error_line(stderr, prog, phrase):
    """stderr ends with one line from prog that says phrase, and no traceback: progress bars may come before."""
    lines = stderr.strip().replace("\r", "\n").splitlines()
    ours = [line for line in lines if line.startswith(prog + ":")]
    return len(ours) == 1 and lines[-1] == ours[0] and phrase in ours[0] and "Traceback" not in stderr


def run(script, args, offline=False):
    cmd = [sys.executable, os.path.join(DATA, script)] + args
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=environment(offline))
    return result.returncode, result.stdout, result.stderr


# ----------------------------------------------------------------------------------------------------------
# the tests

def test_shard_versions(tmp):
    path = os.path.join(tmp, "small.bin")
    ntok = data_common.write_shard(path, [np.array([0, 5, 256], dtype=np.uint32), np.array([1], dtype=np.uint32)], 257)
    version, tokens = read_shard(path)
    check(ntok == 4 and version == 1 and list(tokens) == [0, 5, 256, 1], "V=257: version 1, uint16 tokens as written")
    big = np.array([69999, 3, 65536], dtype=np.uint32)
    data_common.write_shard(path, [big], 70000)
    version, tokens = read_shard(path)
    check(version == 2 and list(tokens) == list(big), "V=70000: version 2, uint32 tokens as written")
    data_common.write_shard(path, [np.array([50256], dtype=np.uint32)], 50257)
    check(read_shard(path)[0] == 1, "V=50257 (GPT-2): version 1")
    try:
        data_common.write_shard(path, [np.array([257], dtype=np.uint32)], 257)
        check(False, "token 257 with V=257 is refused")
    except SystemExit as e:
        check(e.code not in (0, None) and "out of range" in str(e), "token 257 with V=257: one line, non-zero exit")


class FakeEncoding:
    """The part of a tiktoken Encoding that the GPT-2 tokenizer wrapper uses: 4 tokens, the last one EOT."""
    n_vocab = 4
    eot_token = 3
    pieces = [b"a", b" the", "\u00e9".encode("utf-8"), b"<|endoftext|>"]

    def decode_single_token_bytes(self, i):
        return self.pieces[i]


def test_tokenizer_files(tmp):
    ours = os.path.join(tmp, "ours.bin")
    data_common.write_tokenizer_file(ours, data_common.ByteTokenizer())
    subprocess.run([sys.executable, os.path.join(DATA, "bytes.py"), "--out-dir", tmp, "/etc/hostname"],
                   check=True, capture_output=True)
    with open(ours, "rb") as a, open(os.path.join(tmp, "tokenizer.bin"), "rb") as b:
        check(a.read() == b.read(), "byte tokenizer file is byte-for-byte the one data/bytes.py writes")
    path = os.path.join(tmp, "fake.bin")
    data_common.write_tokenizer_file(path, data_common.Gpt2Tokenizer(FakeEncoding()))
    vocab, eot, tokens = read_tokenizer(path)
    check((vocab, eot, tokens) == (4, 3, FakeEncoding.pieces), "GPT-2 style tokenizer file: V, EOT and every token")


SHAKESPEARE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
               "First Citizen:\nYou are all resolved rather to die than to famish?\n\n\n\nAll:\nResolved. resolved.\n"
               "Ros\u00e9 \u2014 caf\u00e9.\n") * 40


def test_tinyshakespeare(tmp):
    Files.content["/input.txt"] = SHAKESPEARE.encode("utf-8")
    rc, out, err = run("tinyshakespeare.py", ["--tokenizer", "bytes", "--data-dir", tmp,
                                              "--url", server_url + "/input.txt",
                                              "--val-tokens", "1000", "--workers", "2"])
    check(rc == 0, "tinyshakespeare.py runs (rc %d: %s)" % (rc, err.strip()[-300:]))
    if rc != 0:
        return
    out_dir = os.path.join(tmp, "tinyshakespeare")
    _, val = read_shard(os.path.join(out_dir, "tinyshakespeare_bytes_val.bin"))
    _, train = read_shard(os.path.join(out_dir, "tinyshakespeare_bytes_train.bin"))
    source = SHAKESPEARE.encode("utf-8")
    sections = source.count(b"\n\n") + 1  # every blank-line separated section is a document with its EOT
    check(len(val) == 1000, "val holds exactly --val-tokens tokens (%d)" % len(val))
    check(len(val) + len(train) == len(source) + sections,
          "tokens = bytes + one EOT per section (%d, expected %d)" % (len(val) + len(train), len(source) + sections))
    documents = byte_documents(np.concatenate([val, train]))
    check(b"".join(documents) == source and len(documents) == sections, "the shards decode back to the source text")
    check(os.path.exists(os.path.join(out_dir, "bytes_tokenizer.bin")), "bytes_tokenizer.bin written")
    check(str(len(val) + len(train)) in out.replace(",", "") and out_dir in out, "prints where and how many tokens")

    Files.content["/latin1.txt"] = "caf\u00e9\n".encode("latin-1") * 1000
    rc, out, err = run("tinyshakespeare.py", ["--tokenizer", "bytes", "--data-dir", os.path.join(tmp, "latin1"),
                                              "--url", server_url + "/latin1.txt", "--workers", "2"])
    check(rc == 1 and one_error_line(err, "tinyshakespeare.py", "not UTF-8"),
          "a text that is not UTF-8: one line, exit 1 (rc %d: %s)" % (rc, err.strip()[-200:]))


def test_resumed_download(tmp):
    body = "".join("line %d of a long text\n" % i for i in range(20000)).encode("utf-8")
    Files.content["/big.txt"] = body
    Files.cut_next["/big.txt"] = 200000
    Files.ranges.clear()
    args = ["--tokenizer", "bytes", "--data-dir", tmp, "--url", server_url + "/big.txt", "--val-tokens", "1000",
            "--workers", "2"]
    rc, out, err = run("tinyshakespeare.py", args)
    part = os.path.join(tmp, "tinyshakespeare", "input.txt.part")
    check(rc == 1 and one_error_line(err, "tinyshakespeare.py", "rerun"),
          "a download cut short fails with one line saying to rerun (rc %d: %s)" % (rc, err.strip()[-200:]))
    check(os.path.exists(part) and os.path.getsize(part) == 200000, "the partial download is kept in input.txt.part")
    rc, out, err = run("tinyshakespeare.py", args)
    check(rc == 0, "the rerun succeeds (rc %d: %s)" % (rc, err.strip()[-300:]))
    check(Files.ranges == [None, "bytes=200000-"], "the rerun asks only for the rest (Range headers %r)" % Files.ranges)
    with open(os.path.join(tmp, "tinyshakespeare", "input.txt"), "rb") as f:
        check(f.read() == body, "the resumed file is the served file")


STORY_FILES = [
    [{"story": "  Once upon a time there was a cat.\n", "summary": "cat"},
     {"story": "Tom ate a pie. \u00c9l\u00e8ve!"}],
    [{"story": "Lily saw a bird.\n\nIt flew away."}, {"story": "The end."}, {"story": "\u6708 moon"}],
    [{"story": "Ben had a red ball."}],
]


def test_tinystories(tmp):
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for i, stories in enumerate(STORY_FILES):
            blob = json.dumps(stories).encode("utf-8")
            info = tarfile.TarInfo("data%02d.json" % i)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    Files.content["/stories.tar.gz"] = archive.getvalue()
    rc, out, err = run("tinystories.py", ["--tokenizer", "bytes", "--data-dir", tmp,
                                          "--url", server_url + "/stories.tar.gz",
                                          "--workers", "2"])
    check(rc == 0, "tinystories.py runs (rc %d: %s)" % (rc, err.strip()[-300:]))
    if rc != 0:
        return
    out_dir = os.path.join(tmp, "tinystories")
    for split, files in (("val", STORY_FILES[:1]), ("train", STORY_FILES[1:])):
        _, tokens = read_shard(os.path.join(out_dir, "tinystories_bytes_%s.bin" % split))
        expected = [s["story"].strip().encode("utf-8") for stories in files for s in stories]
        check(len(tokens) == sum(len(e) + 1 for e in expected), "%s: one EOT plus the UTF-8 bytes per story" % split)
        check(byte_documents(tokens) == expected, "%s: the stories decode back, in order" % split)

    bad_dir = os.path.join(tmp, "bad")
    os.makedirs(os.path.join(bad_dir, "tinystories", "TinyStories_all_data"))
    for i, text in enumerate(['[{"story": "fine"}]', '{"not": "a list"}']):
        with open(os.path.join(bad_dir, "tinystories", "TinyStories_all_data", "data%02d.json" % i), "w") as f:
            f.write(text)
    with open(os.path.join(bad_dir, "tinystories", "TinyStories_all_data.tar.gz"), "wb") as f:
        f.write(b"already downloaded")  # present: no download; the unpacked folder is used as it is
    rc, out, err = run("tinystories.py", ["--tokenizer", "bytes", "--data-dir", bad_dir, "--workers", "2"])
    check(rc == 1 and one_error_line(err, "tinystories.py", "not a TinyStories JSON file"),
          "a malformed JSON file: one line, exit 1 (rc %d: %s)" % (rc, err.strip()[-300:]))


def test_fineweb(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pages = [["Photosynthesis turns light into sugar. " * (i % 7 + 1) + "\u00b5m %d" % i for i in range(40)],
             ["Rivers carve valleys over millions of years. %d" % i for i in range(30)]]
    for i, texts in enumerate(pages):
        sink = io.BytesIO()
        pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), sink, row_group_size=16)
        Files.content["/fw/%03d_00000.parquet" % i] = sink.getvalue()
    shard = 1500
    rc, out, err = run("fineweb.py", ["--tokenizer", "bytes", "--data-dir", tmp, "--base-url", server_url + "/fw",
                                      "--files", "2", "--shard-size", str(shard), "--workers", "2"])
    check(rc == 0, "fineweb.py runs (rc %d: %s)" % (rc, err.strip()[-300:]))
    if rc != 0:
        return
    out_dir = os.path.join(tmp, "fineweb_edu_10B")
    expected = [t.encode("utf-8") for texts in pages for t in texts]
    total = sum(len(e) + 1 for e in expected)
    nshards = (total + shard - 1) // shard
    names = ["fineweb_edu_10B_bytes_%s_%06d.bin" % ("val" if i == 0 else "train", i) for i in range(nshards)]
    present = sorted(n for n in os.listdir(out_dir) if n.endswith(".bin") and "tokenizer" not in n)
    check(present == sorted(names), "shards val_000000, train_000001.. (%r)" % present)
    if present != sorted(names):
        return
    shards = [read_shard(os.path.join(out_dir, n))[1] for n in names]
    check(all(len(s) == shard for s in shards[:-1]) and 0 < len(shards[-1]) <= shard,
          "every shard but the last holds exactly --shard-size tokens")
    check(byte_documents(np.concatenate(shards)) == expected, "the shards decode back to the pages, in order")


def test_fallback(tmp):
    rc, out, err = run("tinyshakespeare.py", ["--data-dir", tmp, "--workers", "2"], offline=True)
    check(rc == 0, "offline, tinyshakespeare.py falls back and succeeds (rc %d: %s)" % (rc, err.strip()[-300:]))
    check("byte-level tokenizer" in out, "offline, the missing GPT-2 BPE files are reported and bytes used")
    check("King James" in out and "fallback_kjv" in out, "offline, the fallback corpus is named in the output")
    check(not os.path.exists(os.path.join(tmp, "tinyshakespeare")), "nothing is written under the dataset's name")
    if rc != 0:
        return
    out_dir = os.path.join(tmp, "fallback_kjv")
    _, val = read_shard(os.path.join(out_dir, "fallback_kjv_bytes_val.bin"))
    _, train = read_shard(os.path.join(out_dir, "fallback_kjv_bytes_train.bin"))
    train_books, val_books = byte_documents(train), byte_documents(val)
    # the KJV has 66 books and 31,102 verses: every book is a document in both splits, a verse is a line
    check(len(train_books) == 66 and len(val_books) == 66, "66 books in train and in val")
    verses = sum(1 for book in train_books + val_books for line in book.split(b"\n") if line)
    check(verses == 31102, "31,102 verses (%d)" % verses)
    check(train_books[0].startswith(b"In the beginning God created the heaven and the earth.\n"), "Genesis 1:1 first")
    check(val_books[-1].rstrip(b"\n").endswith(b"The grace of our Lord Jesus Christ be with you all. Amen."),
          "Revelation 22:21 last")
    check(len(val) < len(train) / 4, "val is the smaller part (%d of %d)" % (len(val), len(train) + len(val)))


def test_no_fallback_once_started(tmp):
    download_dir = os.path.join(tmp, "fineweb_edu_10B", "download")
    os.makedirs(download_dir)
    with open(os.path.join(download_dir, "000_00000.parquet.part"), "wb") as f:
        f.write(b"PAR1 half a file")
    rc, out, err = run("fineweb.py", ["--tokenizer", "bytes", "--data-dir", tmp, "--workers", "2"], offline=True)
    check(rc == 1 and one_error_line(err, "fineweb.py", "resume"),
          "offline with a partial download: one line saying to rerun, exit 1 (rc %d: %s)" % (rc, err.strip()[-200:]))
    check(not os.path.exists(os.path.join(tmp, "fallback_kjv")), "offline with a partial download: no fallback")


def read_mask(path):
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack("<%di" % data_common.HEADER_INTS, data[:4 * data_common.HEADER_INTS])
    return header[:3], list(data[4 * data_common.HEADER_INTS:])


def test_instructions(tmp):
    """data/instructions.py: the shipped sample is the script's own, and a small JSONL's shards and masks are the
    examples' UTF-8 bytes after end-of-text tokens, with exactly the responses and the end-of-text tokens after them
    counting as targets (worked out here from the examples)."""
    sample = os.path.join(tmp, "sample.jsonl")
    rc, out, err = run("instructions.py", ["--write-sample", sample])
    with open(sample, "rb") as a, open(os.path.join(DATA, "instructions_sample.jsonl"), "rb") as b:
        check(rc == 0 and a.read() == b.read(), "instructions.py --write-sample writes the shipped sample")
    examples = [("Say hi.", "Hi!"), ("Caf\u00e9?", "Oui \u2014 caf\u00e9."), ("2+2", "4")]
    jsonl = os.path.join(tmp, "small.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in examples))
    out_dir = os.path.join(tmp, "out")
    rc, out, err = run("instructions.py", [jsonl, "--out-dir", out_dir, "--tokenizer", "bytes", "--val-fraction", "0.34"])
    check(rc == 0, "instructions.py on 3 examples (rc %d: %s)" % (rc, err.strip()[-200:]))
    for split, part in (("train", examples[:2]), ("val", examples[2:])):
        tokens, flags = [], []
        for i, (prompt, response) in enumerate(part):
            p, r = list(prompt.encode("utf-8")), list(response.encode("utf-8"))
            tokens += [256] + p + r
            flags += [1 if i > 0 else 0] + [0] * len(p) + [1] * len(r)
        tokens.append(256)
        flags.append(1)
        path = os.path.join(out_dir, split + ".bin")
        version, got_tokens = read_shard(path)
        header, got_flags = read_mask(path + ".mask")
        check(version == 1 and list(got_tokens) == tokens, "instructions.py %s shard: the examples' bytes" % split)
        check(header == (20261206, 1, len(tokens)) and got_flags == flags,
              "instructions.py %s mask: the responses and their end-of-text tokens count" % split)
    bad = (("{\"prompt\": \"x\"}\n", "line 1: expected an object"), ("{\"prompt\": \"x\", \"response\": \"y\"}\nnot json\n",
           "line 2 is not JSON"), ("", "no examples (an empty file)"))
    for text, phrase in bad:
        with open(jsonl, "w", encoding="utf-8") as f:
            f.write(text)
        rc, out, err = run("instructions.py", [jsonl, "--out-dir", os.path.join(tmp, "bad"), "--tokenizer", "bytes"])
        check(rc != 0 and one_error_line(err, "instructions.py", phrase) and not os.path.exists(os.path.join(tmp, "bad")),
              "instructions.py refuses '%s' in one line (rc %d, %r)" % (phrase, rc, err.strip()[-200:]))


def test_bad_arguments(tmp):
    for script, args, what in (("tinyshakespeare.py", ["--tokenizer", "llama"], "unknown tokenizer"),
                               ("tinyshakespeare.py", ["--val-tokens", "0"], "--val-tokens 0"),
                               ("fineweb.py", ["--files", "15"], "--files 15"),
                               ("fineweb.py", ["--shard-size", "0"], "--shard-size 0"),
                               ("tinystories.py", ["--workers", "0"], "--workers 0")):
        rc, out, err = run(script, args + ["--data-dir", tmp], offline=True)
        check(rc != 0 and len(err.strip().splitlines()) == 1 and not out,
              "%s %s: one line, non-zero exit (rc %d, %r)" % (script, what, rc, err.strip()[-200:]))
    check(os.listdir(tmp) == [], "bad arguments write nothing")


def main():
    global server_url
    server_url = start_server()
    tests = [test_shard_versions, test_tokenizer_files, test_tinyshakespeare, test_resumed_download, test_tinystories,
             test_fineweb, test_fallback, test_no_fallback_once_started, test_instructions, test_bad_arguments]
    for test in tests:
        with tempfile.TemporaryDirectory(prefix="test_data_") as tmp:
            try:
                test(tmp)
            except Exception as e:  # a test that crashes is one failure, and the others still run
                check(False, "%s raised %s: %s" % (test.__name__, type(e).__name__, e))
    print("test_data: %d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
