#!/usr/bin/env bash
# dev/test/test_flags_doc.sh [--write]: doc/flags.md is what the programs' flag tables say (TRAINER_FLAGS in
# llmc/train_settings.h, MOE_FLAGS in train_moe.cu, GENERATE_FLAGS in generate.cu, printed by --help-markdown). Without
# arguments it regenerates the page and compares: any difference is printed and fails; the usage texts (-h) must also
# name every flag of the page. --write rewrites doc/flags.md after a change to a table. Needs build/train_moe_fp32 and
# build/generate_fp32 (make test builds them).
#   dev/test/test_flags_doc.sh            check
#   dev/test/test_flags_doc.sh --write    regenerate doc/flags.md
set -u
cd "$(dirname "$0")/../.."
TRAIN=build/train_moe_fp32
GEN=build/generate_fp32
PAGE=doc/flags.md
passed=0
failed=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for program in "$TRAIN" "$GEN"; do [ -x "$program" ] || { echo "$program: not built (make $program)"; exit 2; }; done
{
    echo "# The programs' flags"
    echo
    echo "Generated from the flag tables of \`llmc/train_settings.h\` (\`TRAINER_FLAGS\`), \`train_moe.cu\` (\`MOE_FLAGS\`) and"
    echo "\`generate.cu\` (\`GENERATE_FLAGS\`) by \`dev/test/test_flags_doc.sh --write\`; a test keeps it current. What the"
    echo "flags do: \`doc/training.md\`, \`doc/inference.md\`. A \`USE_CUDNN=1\` build adds \`-cd\` (cuDNN's attention backward: 1"
    echo "deterministic, 0 with float atomics)."
    echo
    "$TRAIN" --help-markdown
    echo
    "$GEN" --help-markdown
} >"$work/flags.md" || { echo "--help-markdown failed"; exit 1; }
if [ "${1:-}" = --write ]; then
    cp "$work/flags.md" "$PAGE" && echo "wrote $PAGE"
    exit
fi
if diff -u "$PAGE" "$work/flags.md" >"$work/diff"; then
    passed=$((passed + 1))
else
    failed=$((failed + 1))
    echo "FAIL: $PAGE differs from the flag tables (dev/test/test_flags_doc.sh --write regenerates it):"
    cat "$work/diff"
fi
# the page and the usage texts come from the same tables: every flag the page names, one of the -h texts names
{ "$TRAIN" -h; "$GEN" -h; } 2>"$work/usage.txt"
rows=$(grep -c '^| `-' "$work/flags.md")
missing=$(grep -o '^| `-[a-z]*`' "$work/flags.md" | tr -d '|` ' | while read -r f; do
    grep -qE "^  $f( |$)" "$work/usage.txt" || echo "$f"; done)
if [ "$rows" -gt 60 ] && [ -z "$missing" ]; then passed=$((passed + 1)); else
    failed=$((failed + 1))
    echo "FAIL: $rows flags on the page (expected more than 60), missing from -h: $missing"
fi
echo "flags_doc: $passed passed, $failed failed"
[ $failed -eq 0 ]
