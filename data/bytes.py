#!/usr/bin/env python3
"""data/bytes.py: turns text files into byte-level training data for the trainers: every byte is a token
(0..255) and 256 is the end-of-text token between documents, so the vocabulary is 257. Small CPU runs use
it (the quick start); real runs use the GPT-2 tokenizer.

    python3 data/bytes.py --out-dir data/bytes FILE [FILE ...] [--val-fraction 0.1]

writes OUT_DIR/train.bin and OUT_DIR/val.bin (data shards: 256 int32 header [20240520, 1, ntok], then
ntok uint16 tokens) and OUT_DIR/tokenizer.bin (header [20240328, 2, 257, 256], then per token a length
byte and its bytes). Each file is one document; the last --val-fraction of every document goes to val.
"""
import argparse
import os
import struct
import sys
from array import array

EOT = 256


def write_shard(path, tokens):
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<256i", *header))
        data = array("H", tokens)
        if sys.byteorder != "little":
            data.byteswap()
        f.write(data.tobytes())
    os.replace(path + ".tmp", path)


def write_tokenizer(path):
    header = [0] * 256
    header[0], header[1], header[2], header[3] = 20240328, 2, 257, EOT
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<256i", *header))
        for b in range(256):
            f.write(bytes([1, b]))
        eot = b"<|endoftext|>"
        f.write(bytes([len(eot)]) + eot)
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args()
    if not 0.0 < args.val_fraction < 1.0:
        sys.exit("bytes.py: --val-fraction %g: expected a value between 0 and 1" % args.val_fraction)
    train, val = [], []
    for path in args.files:
        try:
            data = open(path, "rb").read()
        except OSError as e:
            sys.exit("bytes.py: cannot read %s: %s" % (path, e.strerror))
        if not data:
            sys.exit("bytes.py: %s is empty" % path)
        cut = int(len(data) * (1.0 - args.val_fraction))
        train += [EOT] + list(data[:cut])
        val += [EOT] + list(data[cut:])
    os.makedirs(args.out_dir, exist_ok=True)
    write_shard(os.path.join(args.out_dir, "train.bin"), train)
    write_shard(os.path.join(args.out_dir, "val.bin"), val)
    write_tokenizer(os.path.join(args.out_dir, "tokenizer.bin"))
    print("bytes.py: %d train and %d val tokens from %d files in %s" % (len(train), len(val), len(args.files),
                                                                         args.out_dir))


if __name__ == "__main__":
    main()
