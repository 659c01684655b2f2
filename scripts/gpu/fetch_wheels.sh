#!/usr/bin/env bash
# Python 3.12 x86-64 wheels of what dfm needs and the GPU image lacks, into .whl/ (git-ignored through
# .git/info/exclude), for a device run that names .whl in `carry` (see scripts/gpu/lease.sh).
# Run here, before asking for the machine. Versions: the ones CI tests with. Not imageio-ffmpeg (68 MB:
# over the 64 MiB a call may carry; the GPU tests and benchmarks write no video).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
packages=(
    megatron-core==0.16.1 megatron-energon==7.4.1 webdataset==1.0.2 braceexpand==0.1.7
    hydra-core==1.3.8 omegaconf==2.3.1 diffusers==0.42.1
    multi-storage-client==1.3.1 mfusepy==3.1.1 filetype rapidyaml s3fs==2026.9.0
    # What these import that the image (torch, numpy, transformers and their dependencies) lacks, from
    # a Python 3.12 resolve of the set (pip install --dry-run --report) less transformers' closure,
    # kept to the modules `import dfm.training.pretrain, dfm.convert, diffusers, megatron.energon`
    # loads (python -X importtime): not s3fs's aiobotocore / botocore / aiohttp chain (imported on
    # first s3:// use only; botocore alone is 13 MB).
    requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 pillow==13.0.0 importlib_metadata==10.2.0 zipp==4.1.2
    jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    attrs==26.1.0 python-dateutil==2.9.0.post0 six==1.17.0 opentelemetry-api==1.45.2 xattr==1.3.0 cffi==2.1.1
    pycparser==3.12 wcmatch==10.2.1 bracex==3.2.3 lark==1.3.1 prettytable==3.18.0 wcwidth==0.9.4 psutil==7.2.2
    deprecation==2.1.0 lazy-importer==0.1.0
    # the GPU tests
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
)
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
for pkg in "${packages[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$pkg" || echo "fetch_wheels: no wheel for $pkg" >&2
done
# antlr4's runtime 4.9.3 (what omegaconf pins) is a source distribution: build its wheel here (pure Python).
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
