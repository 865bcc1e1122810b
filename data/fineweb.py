#!/usr/bin/python3
"""data/fineweb.py: downloads FineWeb-Edu's 10B-token sample (web pages that a classifier rated educational;
14 parquet files, ~28 GB) and tokenizes it, on every core, into shards of 100 M tokens: the pretraining data
of scripts/run_gpt2_124M.sh and scripts/run_moe_8x124M.sh.

    /usr/bin/python3 data/fineweb.py [--tokenizer gpt2|bytes] [--data-dir DIR] [--files 14] [--shard-size 100000000]

downloads (resumably: rerun after an interruption) DIR/fineweb_edu_10B/download/000_00000.parquet ... and
writes DIR/fineweb_edu_10B/fineweb_edu_10B_TOK_val_000000.bin (the first --shard-size tokens),
..._TOK_train_000001.bin, ... and TOK_tokenizer.bin, TOK being gpt2 or bytes (DIR defaults to data/).
Every page is a document, preceded by EOT. --files N takes only the first N parquet files (a smaller run).
Without network the King James Bible goes to DIR/fallback_kjv/ instead (see data_common.py); without the
GPT-2 BPE files the byte tokenizer is used. Reading parquet needs pyarrow (pip install "pyarrow<18": later
versions need NumPy 2, Debian 12 has 1.24).
"""
import os

import data_common as dc

NAME = "fineweb_edu_10B"
BASE_URL = "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/"
PARQUET_FILES = ["%03d_00000.parquet" % i for i in range(14)]


def pages(parquet_paths):
    """Yields the text column of the parquet files in order, a record batch at a time (files are ~2 GB)."""
    import pyarrow.parquet as pq
    for path in parquet_paths:
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
                yield from batch.column(0).to_pylist()
        except Exception as e:  # pyarrow's errors (ArrowInvalid, ...) derive from Exception only
            raise dc.BadInput("%s: cannot read its text column (%s); delete it and rerun to download it again"
                              % (path, dc.short_reason(e)))


def main():
    parser = dc.ArgumentParser(prog="fineweb.py", description=__doc__.splitlines()[0])
    dc.add_common_arguments(parser)
    parser.add_argument("--base-url", default=BASE_URL, help="the folder the parquet files are downloaded from")
    parser.add_argument("--files", type=int, default=len(PARQUET_FILES),
                        help="how many of the %d parquet files to use (default: all)" % len(PARQUET_FILES))
    parser.add_argument("--shard-size", type=int, default=10**8, help="tokens per shard (default 100 M)")
    args = parser.parse_args()
    dc.check_workers(args.workers)
    if not 1 <= args.files <= len(PARQUET_FILES):
        dc.fail("--files %d: expected 1 to %d" % (args.files, len(PARQUET_FILES)))
    if args.shard_size < 1:
        dc.fail("--shard-size %d: expected at least 1" % args.shard_size)
    try:
        import pyarrow.parquet  # noqa: F401 (checked before hours of downloading, used in pages())
    except ImportError as e:
        dc.fail("%s: FineWeb-Edu comes as parquet: pip install \"pyarrow<18\"" % e)

    tokenizer = dc.load_tokenizer(args.tokenizer)
    out_dir = os.path.join(args.data_dir, NAME)
    download_dir = os.path.join(out_dir, "download")
    names = PARQUET_FILES[:args.files]
    parquet_paths = [os.path.join(download_dir, name) for name in names]
    base_url = args.base_url if args.base_url.endswith("/") else args.base_url + "/"
    unavailable = dc.download_all([(base_url + name, path) for name, path in zip(names, parquet_paths)])
    if unavailable:
        dc.prepare_fallback(args.data_dir, tokenizer, args.workers, unavailable)
        return

    prefix = os.path.join(out_dir, "%s_%s" % (NAME, tokenizer.name))
    dc.remove_old_shards(out_dir, prefix)
    writer = dc.ShardWriter(prefix, args.shard_size, tokenizer.vocab_size)
    # tqdm over tokens rather than pages: the total is unknown, a token rate says how far along it is
    with dc.tqdm(unit="tok", unit_scale=True, desc="tokenizing") as bar:
        try:
            for tokens in dc.tokenize_documents(pages(parquet_paths), tokenizer, args.workers):
                writer.add(tokens)
                bar.update(len(tokens))
        except dc.BadInput as e:
            dc.fail(str(e))
    writer.flush()
    if len(writer.written) < 2:
        dc.fail("only %d tokens: fewer than one val shard (--shard-size %d) plus a train shard"
                % (writer.written[0][1] if writer.written else 0, args.shard_size))
    dc.write_tokenizer_file(dc.tokenizer_file_path(out_dir, tokenizer), tokenizer)
    dc.report(out_dir, writer.written, tokenizer)


if __name__ == "__main__":
    main()
