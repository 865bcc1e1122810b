#!/usr/bin/env bash
# cpu/test/check/unity.sh PROBE.cu...: writes to stdout one CUDA program that holds the given probes, with a main
# that runs the one its first argument names (`probes race_nosync.bug`, the rest of the arguments passed on). It is
# what run_probes.sh builds with cpu/cucc --check and what make check-cuda passes through nvcc, each in one call.
# Alone, a probe of a few dozen lines costs nvcc about 2.3 s, nearly all of it cudafe++, cicc and the host compiler
# parsing the CUDA headers again (225 probes: 9 CPU minutes), and cpu/cucc --check about 0.26 s (a minute); together
# they take about 20 s and 8 s.
# Each probe is #included (so that messages name its own file and line) inside a namespace of its own, with main
# renamed, and the macros it defines are undefined after it. The system headers the probes include, and the macros a
# probe defines before its first #include (OMPI_SKIP_MPICXX), come first, once: a header first included inside a
# namespace would declare its names there. Paths are taken as given, relative to an -I directory.
set -eu
# the hoisted lines, in their first order of appearance
for f in "$@"; do
    awk '/^[[:space:]]*#[[:space:]]*include[[:space:]]*</ { seen_include = 1; print; next }
         /^[[:space:]]*#[[:space:]]*define[[:space:]]/ && !seen_include { print }' "$f"
done | awk '!seen[$0]++'
echo "#include <cstdio>"
echo "#include <cstring>"
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
# a probe's main takes no arguments or (argc, argv); it gets argv from its own name on
echo "static int run_probe(int (*probe)(), int, char**) { return probe(); }"
echo "static int run_probe(int (*probe)(int, char**), int argc, char** argv) { return probe(argc, argv); }"
echo "int main(int argc, char** argv) {"
echo "    if (argc < 2) { fprintf(stderr, \"usage: %s PROBE [ARG...]\\n\", argv[0]); return 2; }"
n=0
for f in "$@"; do
    n=$((n + 1))
    name=$(basename "$f" .cu)
    echo "    if (strcmp(argv[1], \"$name\") == 0) return run_probe(probe_$n::probe_main, argc - 1, argv + 1);"
done
echo "    fprintf(stderr, \"%s: no probe named %s\\n\", argv[0], argv[1]);"
echo "    return 2;"
echo "}"
