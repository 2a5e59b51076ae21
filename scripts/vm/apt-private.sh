# apt-private.sh (sourced): a private apt configuration under CACHE/apt for one Debian suite,
# for the VM tests' downloads of Debian's kernel packages (fetch-kernel.sh, fault-module.sh).
# The system's sources and lists are not touched. After `apt_private CACHE SUITE`:
#   APT   the apt-get options (`apt-get "${APT[@]}" download PKG=VER`)
#   IDX   the suite's Packages index (`/usr/lib/apt/apt-helper cat-file "$IDX"`)
# The lists are updated when missing, for another mirror, or older than a day.
apt_private() {
  local cache=$1 suite=$2 mirror want sl
  mkdir -p "$cache"/{apt/lists/partial,apt/cache/archives/partial,debs}
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  # One sources.list per suite (the lists of several suites live side by side).
  sl=$cache/apt/sources.$suite.list
  APT=(-o Dir::Etc::SourceList="$sl" -o Dir::Etc::SourceParts=/nonexistent
       -o Dir::State::Lists="$cache/apt/lists" -o Dir::Cache="$cache/apt/cache"
       -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Acquire::Languages=none
       -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
       -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
       -o Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false
       -o APT::Sandbox::User=root)
  want="deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main"
  if [ "$want" != "$(cat "$sl" 2>/dev/null)" ] || ! ls "$cache"/apt/lists/*_dists_"${suite}"_main_binary-amd64_Packages* >/dev/null 2>&1 ||
     [ -n "$(find "$cache/apt/lists" -maxdepth 1 -name "*_dists_${suite}_InRelease" -mmin +1440 2>/dev/null)" ]; then
    echo "$want" > "$sl"
    apt-get "${APT[@]}" update >"$cache/apt-update.$suite.log" 2>&1 || { cat "$cache/apt-update.$suite.log" >&2; return 1; }
  fi
  IDX=$(ls "$cache"/apt/lists/*_dists_"${suite}"_main_binary-amd64_Packages* | head -1)
}
