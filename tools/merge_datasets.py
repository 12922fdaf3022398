"""Merge Megatron-format indexed datasets (.bin/.idx) into one, as Megatron-LM's tool does.

Preprocessing in parallel shards gives one dataset per shard; training wants one prefix.
The output is byte-identical to writing every document into a single dataset, in order.

Example:
    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab
"""

from __future__ import annotations

import argparse
import os
import sys

from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
    merge_datasets,
)


def input_prefixes(inputs: list[str], output_prefix: str) -> list[str]:
    """Expand directories to their datasets (sorted, as Megatron's tool does); keep prefixes in order.

    A directory's own earlier output is skipped, so re-running a merge never merges itself.
    """
    prefixes = []
    for entry in inputs:
        if os.path.isdir(entry):
            found = sorted(os.path.join(entry, name[: -len(".idx")])
                           for name in os.listdir(entry) if name.endswith(".idx"))
            prefixes += [p for p in found if os.path.abspath(p) != os.path.abspath(output_prefix)]
        else:
            prefixes.append(entry.removesuffix(".idx").removesuffix(".bin"))
    return prefixes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="DIR_OR_PREFIX",
                        help="directories (every *.idx prefix in them, sorted) or dataset prefixes, merged in order")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    args = parser.parse_args(argv)
    prefixes = input_prefixes(args.input, args.output_prefix)
    if not prefixes:
        parser.error(f"no datasets (*.idx) found in {' '.join(args.input)}")
    try:
        merge_datasets(prefixes, args.output_prefix)
    except IndexedDatasetError as error:  # a bad input is the user's to fix: the message, not a traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    merged = IndexedDataset(args.output_prefix)
    print(
        f"merged {len(prefixes)} datasets into {data_file_path(args.output_prefix)} and "
        f"{index_file_path(args.output_prefix)}: {len(merged.document_indices) - 1:,} documents, "
        f"{len(merged):,} sequences, {merged.num_tokens:,} {merged.dtype.__name__} tokens"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
