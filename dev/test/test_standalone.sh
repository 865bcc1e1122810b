#!/usr/bin/env bash
# dev/test/test_standalone.sh: the repository stands alone. In every file git tracks (or would track):
#   - no absolute path into a machine's own directories (a home, a checkout, a shared folder: the top-level
#     directories named in ABSOLUTE below); system paths (the interpreter, the null device, the temporary
#     directory) stay allowed;
#   - no reference to a specification outside the repository (the shared folder or its architecture file, named
#     in OUTSIDE below): doc/ is the spec;
#   - every page of doc/ that a file mentions exists;
#   - the text speaks of the project, not of its history: no file names a tracker entry ("issue" and a number).
# The scanner first checks itself on planted lines (each bad one must be found, no good one may be), so that a
# broken pattern cannot pass; every planted path is put together at run time, so that this file itself holds none
# and is scanned like the rest.
# Run from anywhere: dev/test/test_standalone.sh
set -u
cd "$(dirname "$0")/../.."
passed=0
failed=0
pass() { passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

ABSOLUTE='(^|[^A-Za-z0-9_.~-])/(work|home|root|Users|mnt|media|srv|scratch|shared|nfs|data|workspace)/'
OUTSIDE='(^|[^A-Za-z0-9_./-])(shared/[A-Za-z]|ARCHITECTURE\.md)'
HISTORY='(^|[^A-Za-z0-9_])[Ii][Ss][Ss][Uu][Ee][Ss]?[ #-]*[0-9]+([^A-Za-z0-9_]|$)'

# the scanner on planted lines: each must be found, and system paths must not be
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
s=/
spec=ARCHITECTURE
printf '%s\n' "see ${s}work${s}shared${s}spec.md" "x = \"${s}home${s}dev${s}x\"" "cd ${s}root${s}switch.cu" > "$work/bad_abs"
printf '%s\n' "the formats: shared${s}${spec}.md" "${spec}.md, \"MoE semantics\"" > "$work/bad_outside"
printf '%s\n' "${s}usr${s}bin${s}python3 x.py > ${s}dev${s}null" "mktemp ${s}tmp${s}x.XXXX" "build${s}work${s}x and data${s}x" \
    > "$work/good"
if [ "$(grep -cE "$ABSOLUTE" "$work/bad_abs")" = 3 ]; then pass; else fail "the absolute-path pattern misses planted paths"; fi
if [ "$(grep -cE "$OUTSIDE" "$work/bad_outside")" = 2 ]; then pass; else fail "the outside-spec pattern misses planted references"; fi
if ! grep -qE "$ABSOLUTE|$OUTSIDE" "$work/good"; then pass; else fail "the patterns flag system or relative paths"; fi
word=ssue
printf '%s\n' "see I${word} 15 for why" "i${word} #3" "i${word}s 25 and 26" > "$work/bad_history"
printf '%s\n' "a t${word} 3" "i${word}d 3 warps" "the i${word} of a load" > "$work/good_history"
if [ "$(grep -cE "$HISTORY" "$work/bad_history")" = 3 ] && ! grep -qE "$HISTORY" "$work/good_history"; then pass; else
    fail "the history pattern misses a planted mention or flags a planted good line"; fi

mapfile -t files < <(git ls-files --cached --others --exclude-standard | while read -r f; do
    [ -f "$f" ] && printf '%s\n' "$f"; done)
if [ "${#files[@]}" -gt 0 ]; then pass; else fail "git lists no files"; fi

hits=$(grep -nIE "$ABSOLUTE" "${files[@]}" 2>/dev/null)
if [ -z "$hits" ]; then pass; else fail "absolute paths into a machine's directories:"$'\n'"$hits"; fi
hits=$(grep -nIE "$OUTSIDE" "${files[@]}" 2>/dev/null)
if [ -z "$hits" ]; then pass; else fail "references to a specification outside the repository (doc/ is the spec):"$'\n'"$hits"; fi

hits=$(grep -nIE "$HISTORY" "${files[@]}" 2>/dev/null)
if [ -z "$hits" ]; then pass; else
    fail "text that names a tracker entry (say what the code does and why instead):"$'\n'"$hits"; fi

missing=""
for doc in $(grep -ohIE 'doc/[A-Za-z0-9_-]+\.md' "${files[@]}" 2>/dev/null | sort -u); do
    [ -f "$doc" ] || missing="$missing $doc"
done
if [ -z "$missing" ]; then pass; else fail "mentioned but missing:$missing"; fi
for doc in doc/formats.md doc/moe.md; do
    if [ -s "$doc" ]; then pass; else fail "$doc is missing"; fi
done

echo "standalone: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
