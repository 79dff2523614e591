#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, downloaded here into .whl/ (git-ignored), so that a device
# call can carry them (carry: [".whl"]) and scripts/gpu_check.sh installs them there with no
# network: the server's stack (pinned to versions that ran the gpu tests together on the GPU
# machines' Python 3.12), pytest-xdist for `-n 16`, and py-spy, whose static binary is also
# unpacked as .whl/py-spy (export INFER_PY_SPY=$PWD/.whl/py-spy for the bench's profiles).
#
#   bash scripts/gpu_wheels.sh          # from the repository root; ~20 MB, seconds
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
    fastapi==0.124.4 starlette==0.50.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types
    typing_inspection typing_extensions==4.16.0 uvicorn httptools llguidance openai==1.109.1
    jiter distro sniffio jsonschema jsonschema_specifications referencing rpds_py
    gguf==0.19.0 pytest-xdist execnet py-spy
)
mkdir -p .whl
# (pip's own notes about the local index's folders filtered out, its exit status kept)
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl "${WHEELS[@]}" \
    2> >(grep -v "^WARNING: Location" >&2); then
    echo "gpu_wheels.sh: pip could not download every wheel (see above)" >&2
    exit 1
fi
spy=$(compgen -G ".whl/py_spy-*.whl" | sort | tail -1) || {
    echo "gpu_wheels.sh: no py-spy wheel in .whl/" >&2
    exit 1
}
python3 - "$spy" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/py-spy") or n.endswith("/py-spy"))
    with open(".whl/py-spy", "wb") as f:
        f.write(z.read(name))
os.chmod(".whl/py-spy", 0o755)
EOF
ls .whl | wc -l | xargs echo "wheels in .whl/:"
du -sh .whl
