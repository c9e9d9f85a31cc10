#!/usr/bin/env bash
# The two images the Containerfile starts from, made locally where no registry is reachable (`make test-image`):
#   BASE      a Debian bookworm root with python3.11, made by debootstrap from the Debian mirror;
#   UV_IMAGE  uv's binary alone at /uv, as Astral's ghcr.io/astral-sh/uv image holds it, from the project's own uv.
# Each is made only when missing. The root's tarball stays in WORK: a removed base image comes back in seconds.
# Usage: image/local-base.sh BASE UV_IMAGE UV_BINARY WORK   (BUILDAH: the buildah command, its storage flags)
set -euo pipefail
base=$1 uv_image=$2 uv_binary=$3 work=$4
read -r -a buildah <<< "${BUILDAH:-buildah}"
exists() { "${buildah[@]}" inspect --type image "$1" >/dev/null 2>&1; }

if ! exists "$base"; then
  if [ ! -f "$work/rootfs.tar" ]; then
    rm -rf "$work/rootfs" && mkdir -p "$work"
    echo "debootstrap: Debian bookworm with python3 into $work/rootfs (about 4 minutes on two cores)"
    debootstrap --variant=minbase --include=python3,ca-certificates bookworm "$work/rootfs" \
      "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
      || { tail -n 20 "$work/debootstrap.log"; exit 1; }
    # What no container reads: downloaded packages, package lists, documentation (100 of the root's 267 MB).
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
      "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/*
    tar -C "$work/rootfs" -cf "$work/rootfs.tar.partial" . && mv "$work/rootfs.tar.partial" "$work/rootfs.tar"
    rm -rf "$work/rootfs"
  fi
  container=$("${buildah[@]}" from scratch)
  "${buildah[@]}" add "$container" "$work/rootfs.tar" / > /dev/null
  "${buildah[@]}" config --env LANG=C.UTF-8 --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$container"
  "${buildah[@]}" commit -q --rm "$container" "$base" > /dev/null
  echo "made $base"
fi

if ! exists "$uv_image"; then
  container=$("${buildah[@]}" from scratch)
  "${buildah[@]}" copy "$container" "$(readlink -f "$uv_binary")" /uv > /dev/null
  "${buildah[@]}" commit -q --rm "$container" "$uv_image" > /dev/null
  echo "made $uv_image"
fi
