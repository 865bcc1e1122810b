#!/usr/bin/env bash
# cpu/test/check/nvcc_unity.sh PROBE.cu...: writes to stdout one CUDA translation unit that holds the given probes,
# for make check-cuda to pass them through nvcc in one call. Alone, a probe of a few dozen lines costs nvcc about
# 2.3 s, nearly all of it cudafe++, cicc and the host compiler parsing the CUDA headers again (225 probes: 9 CPU
# minutes); together they take about 20 s.
# Each probe is #included (so that nvcc's messages name its own file and line) inside a namespace of its own, with
# main renamed, and the macros it defines are undefined after it. The system headers the probes include, and the
# macros a probe defines before its first #include (OMPI_SKIP_MPICXX), come first, once: a header first included
# inside a namespace would declare its names there. Paths are taken as given, relative to an -I directory.
set -eu
# the hoisted lines, in their first order of appearance
for f in "$@"; do
    awk '/^[[:space:]]*#[[:space:]]*include[[:space:]]*</ { seen_include = 1; print; next }
         /^[[:space:]]*#[[:space:]]*define[[:space:]]/ && !seen_include { print }' "$f"
done | awk '!seen[$0]++'
n=0
for f in "$@"; do
    n=$((n + 1))
    echo "#define main probe_main"
    echo "namespace probe_$n {"
    echo "#include \"$f\""
    echo "}"
    echo "#undef main"
    sed -n 's/^[[:space:]]*#[[:space:]]*define[[:space:]]*\([A-Za-z_][A-Za-z0-9_]*\).*/#undef \1/p' "$f" | sort -u
done
