"""dev/test/write_references.py LIST: writes the PyTorch references that LIST names, one a line, each line a
script and its flags as on its own command line:
    train_moe.py --write-reference build/ref/moe_k1_cf0.5_fp32 --B 3 ... --dtype float32
`make test` writes the references of dev/test/tests.txt this way (the Makefile's ref_command makes the lines). Run
one by one, each reference spent most of its 1.4 s importing torch; here torch is imported once, and each reference
is written by a process forked from this one, so that it starts from the state a fresh process has (torch's global
generator and settings untouched) and writes the same bytes as `/usr/bin/python3 LINE` would.
Stops at the first line that fails, with its exit status, after the script's own message.
    /usr/bin/python3 dev/test/write_references.py build/table_references.txt
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import train_gpt  # noqa: E402  (after the path; these import torch and read its thread settings)
import train_moe  # noqa: E402

SCRIPTS = {"train_gpt.py": train_gpt.main, "train_moe.py": train_moe.main}


def run(words):
    """The child's part: the script's main on the line's flags; returns the exit status."""
    sys.argv = words
    try:
        SCRIPTS[words[0]](words[1:])
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: write_references.py LIST")
    path = sys.argv[1]
    try:
        with open(path) as f:
            lines = [line.split() for line in f]
    except OSError as e:
        sys.exit(f"{path}: cannot read the list of references ({e.strerror})")
    for number, words in enumerate(lines, 1):
        if not words:
            continue
        if words[0] not in SCRIPTS:
            sys.exit(f"{path}:{number}: '{words[0]}': expected one of {', '.join(SCRIPTS)}")
        print(" ".join(words), flush=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = run(words)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status != 0:
            sys.exit(f"{path}:{number}: {words[0]} ... {words[2] if len(words) > 2 else ''} failed (exit status "
                     f"{status})")


if __name__ == "__main__":
    main()
