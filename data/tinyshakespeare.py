#!/usr/bin/python3
"""data/tinyshakespeare.py: downloads TinyShakespeare (1 MB of Shakespeare's plays, from char-rnn) and
tokenizes it into one val and one train shard for the trainers.

    /usr/bin/python3 data/tinyshakespeare.py [--tokenizer gpt2|bytes] [--data-dir DIR] [--val-tokens 32768]

writes DIR/tinyshakespeare/tinyshakespeare_TOK_val.bin (the first --val-tokens tokens), ..._TOK_train.bin (the
rest) and TOK_tokenizer.bin, TOK being gpt2 or bytes (DIR defaults to data/). Every blank-line separated
section (a speech) is a document, preceded by EOT. Without network the King James Bible goes to
DIR/fallback_kjv/ instead (see data_common.py); without the GPT-2 BPE files the byte tokenizer is used.
Then, e.g.: ./train_gpt -i "data/tinyshakespeare/*_gpt2_train.bin" -j "data/tinyshakespeare/*_gpt2_val.bin"
-tf data/tinyshakespeare/gpt2_tokenizer.bin
"""
import os

import data_common as dc  # first: it says in one line what to install when numpy or tqdm is missing
import numpy as np

NAME = "tinyshakespeare"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def sections(text):
    """The text cut at blank lines, each piece keeping its separator so that no byte is lost."""
    pieces = text.split("\n\n")
    return [piece + "\n\n" for piece in pieces[:-1]] + [pieces[-1]]


def main():
    parser = dc.ArgumentParser(prog="tinyshakespeare.py", description=__doc__.splitlines()[0])
    dc.add_common_arguments(parser)
    parser.add_argument("--url", default=URL, help="where to download input.txt from")
    parser.add_argument("--val-tokens", type=int, default=32768, help="tokens at the start that go to val")
    args = parser.parse_args()
    dc.check_workers(args.workers)
    if args.val_tokens < 1:
        dc.fail("--val-tokens %d: expected at least 1" % args.val_tokens)

    tokenizer = dc.load_tokenizer(args.tokenizer)
    out_dir = os.path.join(args.data_dir, NAME)
    raw_path = os.path.join(out_dir, "input.txt")
    unavailable = dc.download_all([(args.url, raw_path)])
    if unavailable:
        dc.prepare_fallback(args.data_dir, tokenizer, args.workers, unavailable)
        return

    try:
        with open(raw_path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        dc.fail("%s is not UTF-8 text (%s); delete it and rerun, or point --url at a text file" % (raw_path, e.reason))
    tokens = np.concatenate(list(dc.tokenize_documents(sections(text), tokenizer, args.workers)))
    if len(tokens) <= args.val_tokens:
        dc.fail("%s has only %d tokens: not more than --val-tokens %d" % (raw_path, len(tokens), args.val_tokens))
    prefix = os.path.join(out_dir, "%s_%s" % (NAME, tokenizer.name))
    written = []
    for split, part in (("val", tokens[:args.val_tokens]), ("train", tokens[args.val_tokens:])):
        path = "%s_%s.bin" % (prefix, split)
        written.append((path, dc.write_shard(path, [part], tokenizer.vocab_size)))
    dc.write_tokenizer_file(dc.tokenizer_file_path(out_dir, tokenizer), tokenizer)
    dc.report(out_dir, written, tokenizer)


if __name__ == "__main__":
    main()
