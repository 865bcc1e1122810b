#!/usr/bin/python3
"""data/tinystories.py: downloads TinyStories (short stories written by GPT-3.5/4 with a small vocabulary,
1.5 GB compressed, ~0.9 billion GPT-2 tokens) and tokenizes it into one val and one train shard.

    /usr/bin/python3 data/tinystories.py [--tokenizer gpt2|bytes] [--data-dir DIR] [--workers N]

downloads (resumably) DIR/tinystories/TinyStories_all_data.tar.gz, unpacks its 50 JSON files into
DIR/tinystories/TinyStories_all_data/, and writes tinystories_TOK_val.bin (every story of the first JSON
file, ~19 M GPT-2 tokens), tinystories_TOK_train.bin (the other 49) and TOK_tokenizer.bin, TOK being gpt2 or
bytes (DIR defaults to data/). Every story is a document, preceded by EOT. Without network the King James
Bible goes to DIR/fallback_kjv/ instead (see data_common.py); without the GPT-2 BPE files the byte
tokenizer is used.
"""
import json
import os
import tarfile

import data_common as dc

NAME = "tinystories"
URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"


def unpack(archive, dest):
    """Extracts the archive's JSON files into dest. They land in dest.tmp first, renamed when all are there,
    so dest existing means complete. Only the base names of regular .json members are used: a member named
    ../x cannot write outside dest."""
    if os.path.isdir(dest):
        return
    tmp = dest + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    print("%s: unpacking %s" % (dc.PROG, archive))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if not (member.isfile() and member.name.endswith(".json")):
                    continue
                target = os.path.join(tmp, os.path.basename(member.name))
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    dst.write(src.read())
    except (tarfile.TarError, OSError, EOFError) as e:
        dc.fail("cannot unpack %s (%s); delete it and rerun to download it again" % (archive, dc.short_reason(e)))
    os.replace(tmp, dest)


def stories(json_paths):
    """Yields the stories of the files in order, stripped of surrounding whitespace."""
    for path in json_paths:
        try:
            with open(path, encoding="utf-8") as f:
                items = json.load(f)
            texts = [item["story"].strip() for item in items]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise dc.BadInput("%s: not a TinyStories JSON file (a list of objects with a \"story\"): %s" % (path, e))
        yield from texts


def main():
    parser = dc.ArgumentParser(prog="tinystories.py", description=__doc__.splitlines()[0])
    dc.add_common_arguments(parser)
    parser.add_argument("--url", default=URL, help="where to download TinyStories_all_data.tar.gz from")
    args = parser.parse_args()
    dc.check_workers(args.workers)

    tokenizer = dc.load_tokenizer(args.tokenizer)
    out_dir = os.path.join(args.data_dir, NAME)
    archive = os.path.join(out_dir, "TinyStories_all_data.tar.gz")
    unavailable = dc.download_all([(args.url, archive)])
    if unavailable:
        dc.prepare_fallback(args.data_dir, tokenizer, args.workers, unavailable)
        return
    json_dir = os.path.join(out_dir, "TinyStories_all_data")
    unpack(archive, json_dir)
    json_paths = sorted(os.path.join(json_dir, name) for name in os.listdir(json_dir))
    if len(json_paths) < 2:
        dc.fail("%s holds %d JSON files: need at least 2 (one for val, the rest for train)"
                % (json_dir, len(json_paths)))

    prefix = os.path.join(out_dir, "%s_%s" % (NAME, tokenizer.name))
    written = []
    for split, paths in (("val", json_paths[:1]), ("train", json_paths[1:])):
        path = "%s_%s.bin" % (prefix, split)
        print("%s: tokenizing %s (%d JSON files)" % (dc.PROG, split, len(paths)))
        tokens = dc.tokenize_documents(stories(paths), tokenizer, args.workers)
        try:
            written.append((path, dc.write_shard(path, tokens, tokenizer.vocab_size)))
        except dc.BadInput as e:
            dc.fail(str(e))
    dc.write_tokenizer_file(dc.tokenizer_file_path(out_dir, tokenizer), tokenizer)
    dc.report(out_dir, written, tokenizer)


if __name__ == "__main__":
    main()
