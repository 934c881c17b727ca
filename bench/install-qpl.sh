#!/usr/bin/env bash
# Installs Intel QPL 1.9.0 (software path; IAA too where the machine has it)
# for tern's run-time QPL codec: `bench/install-qpl.sh [PREFIX]`, PREFIX
# /opt/qpl by default. Idempotent: a second run with the same prefix only
# prints how tern finds the library.
#
# Where QPL comes from: Debian's `libqpl-dev` 1.9.0-1 (sid), fetched from
# Debian's archive and checked against a pinned sha256. It carries QPL's
# headers and its static library, built by Debian from the 1.9.0 release.
# Debian's shared `libqpl1` needs glibc 2.38, newer than bookworm's 2.36,
# and the source tarball was not reachable from the development machines,
# so this script links that static library into `libqpl.so.1` here. The one
# glibc 2.38 dependency of that code, the C23 names `__isoc23_strtol` and
# `__isoc23_strtoll` (which differ from strtol/strtoll only in accepting a
# `0b` prefix), is supplied by a two-line shim with hidden visibility, so
# it binds inside libqpl only and never interposes on the process's libc.
#
# tern does not link QPL: it dlopens `libqpl.so`/`libqpl.so.1`, or the file
# named by TERN_QPL_LIB (crates/tern-page/src/codec/qpl.rs).
set -euo pipefail

PREFIX=${1:-/opt/qpl}
VERSION=1.9.0
DEB=libqpl-dev_${VERSION}-1_amd64.deb
DEB_SHA256=8a09b9106ef7aace666528e43de8b2d4da6ed1010b3edd0113dd230200dd1bfd
URL=http://deb.debian.org/debian/pool/main/i/intel-qpl/$DEB
LIB=$PREFIX/lib/libqpl.so.$VERSION
STAMP=$PREFIX/.tern-qpl-$VERSION-$DEB_SHA256

say_how_tern_finds_it() {
    cat <<EOF
QPL $VERSION installed in $PREFIX.
tern loads it at run time; point it there with either
  export TERN_QPL_LIB=$PREFIX/lib/libqpl.so.1
or
  export LD_LIBRARY_PATH=$PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
then check with: tern doctor
Headers: $PREFIX/include/qpl (for bench/qpl/huffman_modes.c).
EOF
}

if [[ -f $STAMP && -f $LIB ]]; then
    say_how_tern_finds_it
    exit 0
fi

if [[ $(uname -m) != x86_64 ]]; then
    echo "install-qpl: QPL is x86_64 only (this is $(uname -m))" >&2
    exit 1
fi

need=()
command -v curl >/dev/null || need+=(curl)
command -v g++ >/dev/null || need+=(g++)
command -v dpkg-deb >/dev/null || need+=(dpkg)
if ((${#need[@]})); then
    apt-get update -qq
    apt-get install -y -qq "${need[@]}"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -sSfL --retry 3 -o "$work/$DEB" "$URL"
echo "$DEB_SHA256  $work/$DEB" | sha256sum -c --quiet -
dpkg-deb -x "$work/$DEB" "$work/root"
archive=$work/root/usr/lib/x86_64-linux-gnu/libqpl.a

cat >"$work/isoc23.c" <<'EOF'
#include <stdlib.h>
__attribute__((visibility("hidden"))) long __isoc23_strtol(const char *s, char **end, int base) {
    return strtol(s, end, base);
}
__attribute__((visibility("hidden"))) long long __isoc23_strtoll(const char *s, char **end, int base) {
    return strtoll(s, end, base);
}
EOF
gcc -O2 -fPIC -c "$work/isoc23.c" -o "$work/isoc23.o"

mkdir -p "$PREFIX/lib" "$PREFIX/include"
g++ -shared -o "$work/libqpl.so.$VERSION" -Wl,-soname,libqpl.so.1 \
    -Wl,--whole-archive "$archive" -Wl,--no-whole-archive "$work/isoc23.o" -ldl -lpthread
install -m 0755 "$work/libqpl.so.$VERSION" "$LIB"
ln -sfn "libqpl.so.$VERSION" "$PREFIX/lib/libqpl.so.1"
ln -sfn libqpl.so.1 "$PREFIX/lib/libqpl.so"
rm -rf "$PREFIX/include/qpl"
cp -r "$work/root/usr/include/qpl" "$PREFIX/include/qpl"
touch "$STAMP"
say_how_tern_finds_it
