#!/bin/bash
# fetch-kernel.sh CACHE LABEL SUITE SPEC MODULE...
# A Debian kernel for the VM matrix (`cargo xtask vm-test`), through a private apt
# configuration under CACHE/apt (the system's sources and lists are not touched):
#   SPEC = linux-image-amd64      the kernel the suite's metapackage points at
#        = an anchored regex      the highest version of the matching package names
# Leaves CACHE/kernels/LABEL/{vmlinuz,config,package,modules.dep,mod/...}: the image and the
# named modules with their dependencies (from the package's modules.dep), decompressed.
# Cached: a second call with the same resolved package does nothing.
set -euo pipefail
CACHE=$1 LABEL=$2 SUITE=$3 SPEC=$4; shift 4
MODS=("$@")
DIR=$CACHE/kernels/$LABEL
mkdir -p "$DIR"
. "$(dirname "$0")/apt-private.sh"
apt_private "$CACHE" "$SUITE"
idx=$IDX
packages() { /usr/lib/apt/apt-helper cat-file "$idx"; }
if [ "$SPEC" = linux-image-amd64 ]; then
  pv=$(packages | awk '/^Package: /{p=$2} /^Version: /{v=$2} /^Depends: /{ if (p=="linux-image-amd64") { match($0, /linux-image-[^ ,]+/); print substr($0, RSTART, RLENGTH), v } }' | sort -V -k2 | tail -1)
else
  pv=$(packages | RE="^($SPEC)\$" awk '/^Package: /{p=$2} /^Version: /{ if (p ~ ENVIRON["RE"]) print p, $2 }' | sort -V -k2 | tail -1)
fi
[ -n "$pv" ] || { echo "fetch-kernel: $LABEL: nothing matches $SPEC in $SUITE" >&2; exit 1; }
read -r pkg ver <<<"$pv"
key="$pkg $ver ${MODS[*]}"
if [ -s "$DIR/vmlinuz" ] && [ "$(cat "$DIR/key" 2>/dev/null)" = "$key" ]; then exit 0; fi
echo "fetch-kernel: $LABEL: downloading $pkg $ver" >&2
rm -rf "$DIR" && mkdir -p "$DIR"
(cd "$CACHE/debs" && rm -f ./*.deb && apt-get "${APT[@]}" download "$pkg=$ver" >"$CACHE/apt-download.log" 2>&1) || { cat "$CACHE/apt-download.log" >&2; exit 1; }
deb=$(ls "$CACHE"/debs/*.deb | head -1)
list=$(dpkg-deb --fsys-tarfile "$deb" | tar -t)
if ! grep -qE '^\./(boot/vmlinuz-|usr/lib/modules/[^/]+/vmlinuz$)' <<<"$list"; then
  # 7.x packaging: the image and modules are in linux-binary-<abi>
  bin=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | grep -oE 'linux-binary-[^ ]+' | head -1 || true)
  modpkg=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | grep -oE 'linux-modules-[^ ]+' | head -1 || true)
  [ -n "$bin" ] || { echo "fetch-kernel: $LABEL: no vmlinuz in $deb" >&2; exit 1; }
  rm -f "$deb"
  (cd "$CACHE/debs" && apt-get "${APT[@]}" download "$bin=$ver" >"$CACHE/apt-download.log" 2>&1) || { cat "$CACHE/apt-download.log" >&2; exit 1; }
  deb=$(ls "$CACHE"/debs/*.deb | head -1)
  list=$(dpkg-deb --fsys-tarfile "$deb" | tar -t)
fi
img=$(grep -m1 -E '^\./(boot/vmlinuz-[^/]+|usr/lib/modules/[^/]+/vmlinuz)$' <<<"$list")
cfg=$(grep -m1 -E '^\./boot/config-' <<<"$list" || true)
T=$(mktemp -d "$CACHE/x.XXXXXX")
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$T" "$img" ${cfg:+"$cfg"}
# The modules: in the image's package, or (7.x) in linux-modules-<abi>.
mdeb=$deb
if ! grep -qE '^\./(usr/)?lib/modules/[^/]+/kernel/' <<<"$list" && [ -n "${modpkg:-}" ]; then
  (cd "$CACHE/debs" && apt-get "${APT[@]}" download "$modpkg=$ver" >"$CACHE/apt-download.log" 2>&1) || { cat "$CACHE/apt-download.log" >&2; exit 1; }
  mdeb=$(ls "$CACHE"/debs/"${modpkg}"_*.deb | head -1)
  list=$(dpkg-deb --fsys-tarfile "$mdeb" | tar -t)
fi
mdir=$(grep -m1 -oE '^\./(usr/)?lib/modules/[^/]+/kernel/' <<<"$list" || true)
mdir=${mdir%kernel/}
if [ -n "$mdir" ]; then
  dpkg-deb --fsys-tarfile "$mdeb" | tar -x -C "$T" "${mdir}kernel"
  dpkg-deb --fsys-tarfile "$mdeb" | tar -x -C "$T" --wildcards "${mdir}modules.*" 2>/dev/null || true
fi
mv "$T/$img" "$DIR/vmlinuz"
[ -n "$cfg" ] && mv "$T/$cfg" "$DIR/config"
: > "$DIR/modules.order"
dep=""
if [ -n "$mdir" ]; then
  # Debian's packages do not ship modules.dep (depmod writes it at install): made here.
  mdir=${mdir%/}; abi=$(basename "$mdir"); rel=${mdir#./}; prefix=${rel%lib/modules/*}; base=$T/${prefix%/}
  depmod -b "$base" "$abi"
  dep=$mdir/modules.dep
fi
if [ -n "$dep" ]; then
  cp "$T/$dep" "$DIR/modules.dep"
  # Each wanted module after its dependencies (modules.dep lists a module's deps; the last
  # must load first), each once. A module built into this kernel is not in modules.dep.
  declare -A seen=()
  order=()
  visit() {
    local m=$1 line d
    [ -n "${seen[$m]:-}" ] && return; seen[$m]=1
    line=$(grep -m1 -E "^$m:" "$DIR/modules.dep" || true)
    for d in $(echo "${line#*:}" | tr ' ' '\n' | tac); do visit "$d"; done
    order+=("$m")
  }
  for name in "${MODS[@]}"; do
    path=$(grep -m1 -oE "^[^:]*/${name//_/[_-]}\.ko(\.xz|\.zst|\.gz)?:" "$DIR/modules.dep" | tr -d : || true)
    [ -n "$path" ] && visit "$path"
  done
  if [ ${#order[@]} -gt 0 ]; then
    mkdir -p "$DIR/mod"
    for m in "${order[@]}"; do
      out=$DIR/mod/$(basename "$m"); cp "$T/$mdir/$m" "$out"
      case $out in
        *.xz) xz -d -f "$out"; out=${out%.xz} ;;
        *.zst) zstd -q -d --rm -f "$out"; out=${out%.zst} ;;
        *.gz) gzip -d -f "$out"; out=${out%.gz} ;;
      esac
      basename "$out" >> "$DIR/modules.order"
    done
  fi
fi
rm -rf "$T" "$deb" "$mdeb"
echo "$pkg $ver" > "$DIR/package"
echo "$key" > "$DIR/key"
