"""Hugging Face tokenizer directories, Kimi's tiktoken ones included, loaded without running remote code.

Kimi K2 and Moonlight publish their tokenizer as `tiktoken.model` (one `<base64 token bytes> <rank>` line per BPE
token, the rank being its id), `tokenizer_config.json` (`added_tokens_decoder`: the special tokens, numbered after
the ranks; `bos_token` / `eos_token` name two of them) and `tokenization_kimi.py`, the remote code transformers
needs to read them. megalite never runs remote code: it builds the same tokenizer as a `tokenizers` fast
tokenizer, with transformers' tiktoken converter (merges from the ranks, byte-level, `ignore_merges` as tiktoken)
and the facts of the remote code: its pre-tokenisation pattern `KIMI_PATTERN` (Han runs split from other
letters) and its special tokens, `NUM_RESERVED_SPECIAL` ids after the last rank, each named by
`added_tokens_decoder` or `<|reserved_token_{id}|>`. Special tokens written in the text encode as their ids, as
the remote code's `encode` does (`allowed_special="all"`).

The ids equal `tiktoken.Encoding(pat_str=KIMI_PATTERN, ...).encode(text, allowed_special="all")` on the whole
text (tests/test_tiktoken_tokenizer.py). The remote code also cuts a text every 400,000 characters and after
25,000 consecutive (non-)whitespace characters before encoding (a guard against a tiktoken stack overflow); a
token that straddles such a cut is split there, and megalite does not cut.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from megalite.errors import InvalidInput, MissingInput

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TIKTOKEN_CLASS = "TikTokenTokenizer"  # tokenizer_config.json's tokenizer_class for Kimi's remote code
NUM_RESERVED_SPECIAL = 256  # ids after the ranks the remote code reserves for special tokens
_DEFAULT_ROLES = {"bos_token": "[BOS]", "eos_token": "[EOS]"}  # the remote code's defaults

# tokenization_kimi.py's pat_str: runs of Han characters; words of other letters (cased, with English
# contractions); one to three digits; punctuation runs; newlines; other whitespace. `&&` intersects classes.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def is_tiktoken_directory(directory: Path) -> bool:
    """Whether `directory` holds a tiktoken tokenizer rather than a tokenizer.json one: Kimi's tokenizer_class,
    or a tiktoken.model with no tokenizer.json beside it."""
    if (directory / RANKS_FILE).is_file() and not (directory / "tokenizer.json").is_file():
        return True
    return tokenizer_config(directory).get("tokenizer_class") == TIKTOKEN_CLASS


def load_pretrained_tokenizer(directory: str | Path):
    """`AutoTokenizer.from_pretrained(directory)` from local files, except that a tiktoken directory (Kimi K2,
    Moonlight) loads as the equivalent `PreTrainedTokenizerFast` instead of through its remote code."""
    import transformers  # slow to import, and only loading needs it

    directory = Path(directory)
    if is_tiktoken_directory(directory):
        return tiktoken_tokenizer(directory)
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tiktoken_tokenizer(directory: Path):
    """The `PreTrainedTokenizerFast` of Kimi's tiktoken directory (see the module doc)."""
    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    config = tokenizer_config(directory)
    named = config.get("tokenizer_class")
    if named not in (None, TIKTOKEN_CLASS):
        raise InvalidInput(f"{directory / CONFIG_FILE}: tokenizer_class {named!r} with a {RANKS_FILE}: megalite "
                           f"reads Kimi's tiktoken tokenizer ({TIKTOKEN_CLASS}: Kimi K2, Moonlight) only; save this "
                           "one as a tokenizer.json with save_pretrained where its own code runs")
    ranks = read_ranks(directory / RANKS_FILE)
    special = special_tokens(config, len(ranks), directory / CONFIG_FILE)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_: str) -> dict[bytes, int]:
            return ranks  # read above: tiktoken's own loader caches files by path under /tmp, stale once edited

    backend = _Converter(pattern=KIMI_PATTERN, extra_special_tokens=list(special)).converted()
    moved = {name: backend.token_to_id(name) for name, i in special.items() if backend.token_to_id(name) != i}
    if moved:  # a special token that is also a BPE token's text would keep that token's id
        raise InvalidInput(f"{directory / CONFIG_FILE}: special tokens {sorted(moved)} are also BPE tokens of "
                           f"{directory / RANKS_FILE}; rename them in added_tokens_decoder")
    roles = {role: _token_name(config, role, special, directory / CONFIG_FILE)
             for role in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                                **{role: name for role, name in roles.items() if name is not None})


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model's token bytes -> rank; every rank from 0 to the count - 1 once, as ids must be."""
    if not path.is_file():
        raise MissingInput(f"{path} does not exist: a tiktoken tokenizer directory holds its BPE ranks there "
                           "(Kimi K2's and Moonlight's tokenizer folders have it)")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise InvalidInput(f"{path}:{number}: {line[:80]!r} is not '<base64 token bytes> <rank>', so this is not "
                               "a tiktoken BPE file; give the tiktoken.model the model was published with") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise InvalidInput(f"{path}: its {len(ranks)} ranks are not 0..{len(ranks) - 1} each once (a repeated token "
                           "or rank, or a gap), so they cannot be token ids; give the file as published")
    return ranks


def special_tokens(config: dict, first_id: int, source: Path) -> dict[str, int]:
    """Name -> id of the special tokens after the `first_id` BPE ranks: NUM_RESERVED_SPECIAL of them (more if
    added_tokens_decoder numbers one further), named by added_tokens_decoder or `<|reserved_token_{id}|>`."""
    named: dict[int, str] = {}
    for key, token in config.get("added_tokens_decoder", {}).items():
        content = token.get("content") if isinstance(token, dict) else token
        if not key.isdigit() or int(key) < first_id or not isinstance(content, str):
            raise InvalidInput(f"{source}: added_tokens_decoder[{key!r}] must be a special token's id at or after "
                               f"{first_id} (the BPE ranks' count) with a 'content' string; it is {token!r}")
        named[int(key)] = content
    last = max([first_id + NUM_RESERVED_SPECIAL - 1, *named])
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first_id, last + 1)}


def tokenizer_config(directory: Path) -> dict:
    """tokenizer_config.json's settings ({} without the file)."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidInput(f"{path} is not JSON ({error}); give the tokenizer_config.json the model was "
                           "published with") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{path} holds a {type(config).__name__}, not an object of tokenizer settings")
    return config


def _token_name(config: dict, role: str, special: dict[str, int], source: Path) -> str | None:
    """The special token tokenizer_config.json gives `role` (a name or an AddedToken-like object), else the remote
    code's default ([BOS], [EOS]; none for the others); it must be one of the special tokens."""
    token = config.get(role, _DEFAULT_ROLES.get(role))
    name = token.get("content") if isinstance(token, dict) else token
    if name is not None and name not in special:
        raise InvalidInput(f"{source}: {role} {name!r} is not among the special tokens added_tokens_decoder "
                           "names; name one of them")
    return name
