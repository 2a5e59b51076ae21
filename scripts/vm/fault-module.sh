#!/bin/bash
# fault-module.sh CACHE LABEL SUITE
# nantrace_fault.ko (scripts/vm/fault-module/: the VM cluster's test faults, printed by the
# kernel) for the kernel fetch-kernel.sh left in CACHE/kernels/LABEL. Debian's
# linux-headers-<abi>-<flavour>, linux-headers-<abi>-common and linux-kbuild-<x.y> of that
# kernel package's own version, downloaded through the same private apt configuration
# (apt-private.sh: the system's sources are not touched), extracted with dpkg -x under
# CACHE/fault-module/headers/<version>; then `make -C <headers> M=<a copy of the source>
# modules` with the compiler the headers name (CC in .kernelvariables: gcc-12 for bookworm's
# 6.1, the kernel's own CONFIG_CC_VERSION_TEXT). Leaves CACHE/fault-module/LABEL/nantrace_fault.ko;
# cached under the kernel package, its version and the module source's hash. Exits non-zero,
# saying why, when it cannot build: the cluster's fault tests have no other way to a real
# kernel fault (never a switch that trusts user-space records).
set -euo pipefail
CACHE=$1 LABEL=$2 SUITE=$3
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/fault-module
KDIR=$CACHE/kernels/$LABEL
OUT=$CACHE/fault-module/$LABEL
die() { echo "fault-module: $LABEL: $*" >&2; exit 1; }
[ -s "$KDIR/package" ] || die "no $KDIR/package (fetch-kernel.sh first)"
read -r pkg ver < "$KDIR/package"
# linux-image-<abi>-<flavour>: abi 6.1.0-50, flavour amd64 (or cloud-amd64, rt-amd64, ...).
rest=${pkg#linux-image-}
abi=$(grep -oE '^[0-9]+\.[0-9]+\.[0-9]+-[0-9]+' <<<"$rest") || die "cannot read the ABI from $pkg"
flavour=${rest#"$abi"-}
flavour=${flavour%-unsigned}
kbuild=linux-kbuild-$(cut -d. -f1,2 <<<"$abi")
hdr=linux-headers-$abi-$flavour
src_hash=$(cat "$SRC"/nantrace_fault.c "$SRC"/Kbuild | sha256sum | cut -c1-16)
key="$pkg $ver $src_hash"
if [ -s "$OUT/nantrace_fault.ko" ] && [ "$(cat "$OUT/key" 2>/dev/null)" = "$key" ]; then
  echo "$OUT/nantrace_fault.ko"; exit 0
fi
t0=$(date +%s.%N)
H=$CACHE/fault-module/headers/$ver
if [ ! -f "$H/.done" ] || [ ! -d "$H/usr/src/$hdr" ]; then
  echo "fault-module: $LABEL: downloading $hdr, linux-headers-$abi-common, $kbuild $ver" >&2
  . "$HERE/apt-private.sh"
  apt_private "$CACHE" "$SUITE" || die "apt update failed (private configuration under $CACHE/apt)"
  D=$CACHE/fault-module/debs
  rm -rf "$D" "$CACHE/fault-module/headers" && mkdir -p "$D" "$H"
  (cd "$D" && apt-get "${APT[@]}" download "$hdr=$ver" "linux-headers-$abi-common=$ver" "$kbuild=$ver" \
     >"$CACHE/fault-module/apt-download.log" 2>&1) ||
    { cat "$CACHE/fault-module/apt-download.log" >&2; die "cannot download the headers of $pkg $ver"; }
  for d in "$D"/*.deb; do dpkg -x "$d" "$H"; done
  rm -rf "$D"
  # The flavour's Makefile includes the common one by its absolute path under /usr/src:
  # pointed at the copy here (the other links in the packages are relative).
  sed -i "s|^include /usr/src/|include $H/usr/src/|" "$H/usr/src/$hdr/Makefile"
  touch "$H/.done"
fi
cc=$(sed -n 's/^CC = .*\$(CROSS_COMPILE)\([^ ]*\)$/\1/p' "$H/usr/src/$hdr/.kernelvariables" 2>/dev/null || true)
cc=${cc:-gcc}
command -v "$cc" >/dev/null || die "no $cc on this machine (the compiler the kernel was built with; apt-get install $cc make)"
want=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\(.*\)"$/\1/p' "$H/usr/src/$hdr/.config")
have=$("$cc" --version | head -1)
[ "$want" = "$have" ] || echo "fault-module: $LABEL: warning: the kernel was built with \"$want\", this machine has \"$have\"" >&2
B=$CACHE/fault-module/build.$LABEL
rm -rf "$B" && mkdir -p "$B" "$OUT"
cp "$SRC"/nantrace_fault.c "$SRC"/Kbuild "$B"/
make -C "$H/usr/src/$hdr" M="$B" modules >"$OUT/build.log" 2>&1 ||
  { cat "$OUT/build.log" >&2; die "make -C $H/usr/src/$hdr M=$B modules failed"; }
vermagic=$(modinfo -F vermagic "$B/nantrace_fault.ko" 2>/dev/null || true)
case $vermagic in "$abi-$flavour "*) ;; *) die "built for \"$vermagic\", not $abi-$flavour" ;; esac
cp "$B/nantrace_fault.ko" "$OUT/nantrace_fault.ko"
rm -rf "$B"
echo "$key" > "$OUT/key"
echo "fault-module: $LABEL: built nantrace_fault.ko for $pkg $ver in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}') s" >&2
echo "$OUT/nantrace_fault.ko"
