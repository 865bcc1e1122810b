#!/usr/bin/env python3
"""data/bytes.py: turns any text files into byte-level training data for the trainers: every byte is a token
(0..255) and 256 is the end-of-text token before each document, so the vocabulary is 257. For small CPU runs
on text at hand; the dataset scripts (tinyshakespeare.py, ...) take --tokenizer bytes for the same format.

    /usr/bin/python3 data/bytes.py --out-dir DIR FILE [FILE ...] [--val-fraction 0.1]

writes DIR/train.bin, DIR/val.bin (data shards) and DIR/tokenizer.bin (formats: data/data_common.py). Each
file is one document; the last --val-fraction of every document goes to val.
"""
import os

import numpy as np

from data_common import ArgumentParser, ByteTokenizer, fail, write_shard, write_tokenizer_file


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args()
    if not 0.0 < args.val_fraction < 1.0:
        fail("--val-fraction %g: expected a value between 0 and 1" % args.val_fraction)
    tokenizer = ByteTokenizer()
    train, val = [], []
    for path in args.files:
        try:
            data = np.fromfile(path, dtype=np.uint8)
        except OSError as e:
            fail("cannot read %s: %s" % (path, e.strerror))
        if data.size == 0:
            fail("%s is empty" % path)
        cut = int(data.size * (1.0 - args.val_fraction))
        eot = np.array([tokenizer.eot], dtype=np.uint16)
        train += [eot, data[:cut].astype(np.uint16)]
        val += [eot, data[cut:].astype(np.uint16)]
    os.makedirs(args.out_dir, exist_ok=True)
    ntrain = write_shard(os.path.join(args.out_dir, "train.bin"), train, tokenizer.vocab_size)
    nval = write_shard(os.path.join(args.out_dir, "val.bin"), val, tokenizer.vocab_size)
    write_tokenizer_file(os.path.join(args.out_dir, "tokenizer.bin"), tokenizer)
    print("bytes.py: %d train and %d val tokens from %d files in %s" % (ntrain, nval, len(args.files), args.out_dir))


if __name__ == "__main__":
    main()
