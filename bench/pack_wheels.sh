#!/usr/bin/env bash
# Builds the git-ignored .whl/ that bench/gpu_suite.sh unpacks on a GPU machine with no package index: the packages
# its Python (3.12, torch 2.11 cu130) lacks, downloaded for that platform, unpacked, and xz-compressed so that each
# tarball fits one 64 MiB carry.
#
#   site.tar.xz   av 18.1.0 (MP4), fa3-fwd 0.0.3 (FlashAttention-3), diffusers 0.42.1 (the baseline)   ~36 MB
#   fa4-a.tar.xz  flash-attn-4's CuTe DSL compiler library alone                                      ~50 MB
#   fa4-b.tar.xz  flash-attn-4 and the rest of its dependencies                                       ~23 MB
#   pytest + deps as wheels (step gputest)
#
#   bash bench/pack_wheels.sh            # into .whl/ (WHL=DIR for another place)
set -euo pipefail
WHL=${WHL:-.whl}
mkdir -p "$WHL"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

download() {  # dir packages...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$tmp/$dir" "$@"
}
unpack() {  # dir -> $tmp/$dir.site (wheels are zips; .so made executable as pip would)
  mkdir -p "$tmp/$1.site"
  for w in "$tmp/$1"/*.whl; do python3 -m zipfile -e "$w" "$tmp/$1.site"; done
  find "$tmp/$1.site" -name "*.so*" -exec chmod 755 {} +
}
pack() {  # source dir, tarball
  tar -C "$1" -cf - . | xz -9 -T0 > "$2.tmp" && mv "$2.tmp" "$2"
  echo "$2: $(stat -c %s "$2") B"
}

download site av==18.1.0 fa3-fwd==0.0.3 diffusers==0.42.1
unpack site
pack "$tmp/site.site" "$WHL/site.tar.xz"

download fa4 flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
    torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.2 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1
unpack fa4
rm -rf "$tmp/fa4.site/nvidia_cutlass_dsl/cu13/lib/stubs"  # aarch64 / QNX stubs
lib=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs
mkdir -p "$tmp/fa4-a/$lib"
mv "$tmp/fa4.site/$lib"/_cutlass_ir.cu13.*.so "$tmp/fa4-a/$lib/"
pack "$tmp/fa4-a" "$WHL/fa4-a.tar.xz"
pack "$tmp/fa4.site" "$WHL/fa4-b.tar.xz"

python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHL" pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
    packaging==26.4
