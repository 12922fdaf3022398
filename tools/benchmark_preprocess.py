"""End-to-end speed of tools/preprocess_data.py against the tokenizer's own batch encoding.

Builds a JSONL corpus of Shakespeare paragraphs (shuffled, grouped into documents of a few
KB, repeated up to --size-mb), then times, on the same texts:
  raw: `tokenizers` GPT-2 BPE `encode_batch` and `encode_batch_fast` over all texts already in
       memory, its Rust thread pool on --workers cores (RAYON_NUM_THREADS); each timed both to
       the Encoding objects and to the ids as Python lists (what a caller needs; serial);
  tool: `python tools/preprocess_data.py --workers N --append-eod` as a subprocess, start-up,
       JSON parsing and writing the .bin/.idx included.
Both are reported in MB/s of text (UTF-8 bytes of the "text" fields) and tokens/s (eod
tokens excluded); the ratio is raw time / tool time. Each is run --repeats times,
interleaved, and the best is kept, because other processes may share the machine. The peak
RSS is the largest of any one tool process (parent or worker) over the runs.

Example:
    python tools/benchmark_preprocess.py --assets assets --size-mb 25 --workers 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from megalite.data.indexed_dataset import IndexedDataset

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preprocess_data.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default="assets", help="folder filled by scripts/get_assets.sh")
    p.add_argument("--size-mb", type=float, default=25.0, help="JSONL size to build")
    p.add_argument("--doc-kb", type=float, default=4.0, help="mean document size")
    p.add_argument("--workers", type=int, default=2, help="cores for both: tool workers and Rust threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--work-dir", help="where the corpus and outputs go (default: a temporary folder)")
    return p.parse_args(argv)


def build_texts(assets: str, size_mb: float, doc_kb: float, seed: int) -> list[str]:
    """Documents of about doc_kb KB made of shuffled paragraphs, until the JSONL reaches size_mb."""
    paragraphs = []
    for path in sorted(glob.glob(os.path.join(assets, "shakespeare", "*.txt"))):
        with open(path, encoding="utf-8") as f:
            paragraphs += [p.strip() for p in f.read().split("\n\n") if p.strip()]
    if not paragraphs:
        sys.exit(f"no Shakespeare text under {assets}/shakespeare: run scripts/get_assets.sh")
    rng = random.Random(seed)
    texts, size, target = [], 0, size_mb * 1e6
    while size < target:
        rng.shuffle(paragraphs)
        doc, doc_size = [], 0
        for paragraph in paragraphs:
            doc.append(paragraph)
            doc_size += len(paragraph) + 2
            if doc_size >= rng.uniform(0.5, 1.5) * doc_kb * 1000:
                texts.append("\n\n".join(doc))
                size += len(json.dumps({"text": texts[-1]})) + 1
                doc, doc_size = [], 0
                if size >= target:
                    break
    return texts


def time_raw(texts: list[str], vocab: str, merges: str) -> tuple[dict[str, float], int]:
    """Seconds of each raw variant, and the token count. encode_batch_fast skips character
    offsets (megalite's tokenizer uses it); each is timed to its Encoding objects and to the
    ids as lists. The tokenizer is built outside the timing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    seconds = {}
    for method in ("encode_batch", "encode_batch_fast"):
        start = time.perf_counter()
        encodings = getattr(tokenizer, method)(texts, add_special_tokens=False)
        seconds[f"raw {method} -> Encodings"] = time.perf_counter() - start
        ids = [e.ids for e in encodings]
        seconds[f"raw {method} -> ids lists"] = time.perf_counter() - start
        del encodings
    return seconds, sum(map(len, ids))


# Runs the tool and reports its wall time and the peak RSS of its processes. A small launcher
# process stands in between because a forked child's peak RSS starts at its parent's: timed
# from here, after the raw run's gigabyte of Encodings, the tool would seem that large.
_LAUNCHER = """import resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
sys.exit(done.stderr) if done.returncode else print(time.perf_counter() - start, \
resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def time_tool(corpus: str, prefix: str, assets: str, workers: int) -> tuple[float, float, int, int]:
    """Seconds (start-up included), peak RSS in MiB of any one tool process, tokens and documents of one run."""
    command = [sys.executable, TOOL, "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
               "GPT2BPETokenizer", "--vocab-file", os.path.join(assets, "gpt2", "vocab.json"), "--merge-file",
               os.path.join(assets, "gpt2", "merges.txt"), "--workers", str(workers), "--append-eod"]
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *command], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    seconds, peak_kib = done.stdout.split()
    dataset = IndexedDataset(f"{prefix}_text_document")
    return float(seconds), int(peak_kib) / 1024, dataset.num_tokens, len(dataset)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # read when the Rust pool starts: before the first batch
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-preprocess-")
    os.makedirs(work, exist_ok=True)
    texts = build_texts(args.assets, args.size_mb, args.doc_kb, args.seed)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"corpus: {corpus}, {os.path.getsize(corpus) / 1e6:.1f} MB JSONL, {len(texts):,} documents, "
          f"{text_mb:.1f} MB of text; {args.workers} cores, best of {args.repeats}")
    vocab, merges = (os.path.join(args.assets, "gpt2", name) for name in ("vocab.json", "merges.txt"))
    best: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        raw, raw_tokens = time_raw(texts, vocab, merges)
        tool_seconds, peak, tool_tokens, documents = time_tool(corpus, os.path.join(work, "bench"), args.assets,
                                                               args.workers)
        for name, seconds in {**raw, "preprocess_data.py": tool_seconds}.items():
            best.setdefault(name, []).append(seconds)
        print("  " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in {**raw, "tool": tool_seconds}.items()),
              flush=True)
    if tool_tokens - documents != raw_tokens:
        sys.exit(f"token counts differ: tool {tool_tokens - documents:,} (without eod) vs raw {raw_tokens:,}")
    best = {name: min(times) for name, times in best.items()}
    for name, seconds in best.items():
        print(f"{name:>36}: {seconds:6.2f} s  {text_mb / seconds:6.2f} MB/s  {raw_tokens / seconds:12,.0f} tokens/s")
    tool = best.pop("preprocess_data.py")
    fastest = min(best, key=best.get)
    print(f"{'ratio tool / raw':>36}: {best['raw encode_batch -> ids lists'] / tool:.1%} "
          "against encode_batch -> ids lists, "
          f"{best[fastest] / tool:.1%} against the fastest raw variant ({fastest})")
    print(f"{'peak RSS of one tool process':>36}: {peak:.0f} MiB")


if __name__ == "__main__":
    main()
