#!/usr/bin/python3
"""data/instructions.py: turns a JSONL file of {"prompt": ..., "response": ...} pairs into shards with loss masks
for instruction fine-tuning. Each example becomes the end-of-text token, the prompt's tokens and the response's
tokens, and the data ends with one more end-of-text token. The loss mask (PATH.mask beside each shard; doc/formats.md,
"Loss mask") counts the response's tokens as targets, and the end-of-text token after each response, so that the
model learns to stop; the prompt's tokens and the end-of-text token before them are not targets.

    /usr/bin/python3 data/instructions.py FILE.jsonl --out-dir DIR [--tokenizer gpt2|bytes] [--val-fraction 0.1]
    /usr/bin/python3 data/instructions.py --write-sample data/instructions_sample.jsonl

The first writes DIR/train.bin and DIR/val.bin with their .mask files (the last --val-fraction of the examples, at
least one, go to val) and DIR/TOKENIZER_tokenizer.bin. The second writes the project's sample: 256 short instructions
(arithmetic, reversing, counting, capitals) drawn from a fixed seed, the file the project ships.
"""
import json
import os
import random
import struct
import sys

import numpy as np

from data_common import (HEADER_INTS, ArgumentParser, fail, load_tokenizer, tokenizer_file_path, write_shard,
                         write_tokenizer_file)

MASK_MAGIC = 20261206
MASK_VERSION = 1
SAMPLE_EXAMPLES = 256
SAMPLE_SEED = 20261206


def read_examples(path):
    """The (prompt, response) pairs of a JSONL file, refused with one line naming the file and line when malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    except UnicodeDecodeError as e:
        fail("%s is not UTF-8 text (byte %d)" % (path, e.start))
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            fail("%s: line %d is not JSON (%s)" % (path, number, e.msg))
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
            fail('%s: line %d: expected an object with the strings "prompt" and "response"' % (path, number))
        if not record["response"]:
            fail("%s: line %d: an empty response (nothing to learn from)" % (path, number))
        examples.append((record["prompt"], record["response"]))
    if not examples:
        fail("%s: no examples (an empty file)" % path)
    return examples


def encode_examples(examples, tokenizer):
    """The tokens and the loss mask of the examples, in order, then a final end-of-text token. (ntok,) each."""
    tokens, mask = [], []
    for prompt, response in examples:
        prompt_ids = tokenizer.encode(prompt)
        response_ids = tokenizer.encode(response)
        tokens += [np.array([tokenizer.eot]), prompt_ids, response_ids]
        # this example's end-of-text token ends the previous response: a target, except before the first example
        mask += [np.array([len(mask) > 0]), np.zeros(len(prompt_ids), bool), np.ones(len(response_ids), bool)]
    tokens.append(np.array([tokenizer.eot]))
    mask.append(np.array([True]))
    return np.concatenate(tokens).astype(np.uint32), np.concatenate(mask).astype(np.uint8)


def write_mask(path, flags):
    """The loss mask of the shard at path (doc/formats.md), written whole under a temporary name, then renamed."""
    header = [0] * HEADER_INTS
    header[0], header[1], header[2] = MASK_MAGIC, MASK_VERSION, len(flags)
    with open(path + ".mask.tmp", "wb") as f:
        f.write(struct.pack("<%di" % HEADER_INTS, *header))
        f.write(np.asarray(flags, dtype=np.uint8).tobytes())
    os.replace(path + ".mask.tmp", path + ".mask")


def sample_examples():
    """The project's sample instructions, from a fixed seed: the same file on every machine."""
    rng = random.Random(SAMPLE_SEED)
    words = ["apple", "river", "stone", "cloud", "garden", "silver", "window", "forest", "candle", "harbor", "meadow",
             "lantern", "thunder", "pepper", "violet", "marble"]
    capitals = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Egypt", "Cairo"),
                ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Chile", "Santiago"),
                ("Canada", "Ottawa")]
    examples = []
    for _ in range(SAMPLE_EXAMPLES):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            examples.append(("What is %d plus %d?" % (a, b), "%d plus %d is %d." % (a, b, a + b)))
        elif kind == 1:
            word = rng.choice(words)
            examples.append(("Spell '%s' backwards." % word, "'%s' backwards is '%s'." % (word, word[::-1])))
        elif kind == 2:
            word = rng.choice(words)
            examples.append(("How many letters are in '%s'?" % word, "'%s' has %d letters." % (word, len(word))))
        else:
            country, capital = rng.choice(capitals)
            examples.append(("What is the capital of %s?" % country, "The capital of %s is %s." % (country, capital)))
    return examples


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", nargs="?", help="the examples, one JSON object per line")
    parser.add_argument("--out-dir", help="where the shards, masks and tokenizer file go")
    parser.add_argument("--tokenizer", choices=["gpt2", "bytes"], default="gpt2",
                        help="gpt2: tiktoken's GPT-2 BPE (V=50257); bytes: one token per byte plus EOT (V=257)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--write-sample", metavar="PATH", help="write the project's sample JSONL file and stop")
    args = parser.parse_args()
    if args.write_sample:
        with open(args.write_sample + ".tmp", "w", encoding="utf-8") as f:
            for prompt, response in sample_examples():
                f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
        os.replace(args.write_sample + ".tmp", args.write_sample)
        print("instructions.py: %d examples in %s" % (SAMPLE_EXAMPLES, args.write_sample))
        return
    if not args.jsonl or not args.out_dir:
        fail("expected FILE.jsonl and --out-dir DIR (or --write-sample PATH)")
    if not 0.0 < args.val_fraction < 1.0:
        fail("--val-fraction %g: expected a value between 0 and 1" % args.val_fraction)
    examples = read_examples(args.jsonl)
    if len(examples) < 2:
        fail("%s: %d example; expected at least 2 (one for train, one for val)" % (args.jsonl, len(examples)))
    tokenizer = load_tokenizer(args.tokenizer)
    val_count = max(1, int(len(examples) * args.val_fraction))
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    for split, part in (("train", examples[:-val_count]), ("val", examples[-val_count:])):
        tokens, mask = encode_examples(part, tokenizer)
        path = os.path.join(args.out_dir, "%s.bin" % split)
        write_shard(path, [tokens], tokenizer.vocab_size)
        write_mask(path, mask)
        written.append("%s %d examples, %d tokens, %d targets" % (split, len(part), len(tokens), int(mask.sum())))
    write_tokenizer_file(tokenizer_file_path(args.out_dir, tokenizer), tokenizer)
    print("instructions.py: %s (%s tokenizer, V=%d) in %s" % ("; ".join(written), tokenizer.name,
                                                              tokenizer.vocab_size, args.out_dir))


if __name__ == "__main__":
    sys.exit(main())
